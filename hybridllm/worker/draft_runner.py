"""Speculative decoding's draft model: its own weights and paged KV cache, greedy drafts."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridllm.config import EngineConfig
from hybridllm.engine.block_pool import BlockPool
from hybridllm.engine.kv_cache_utils import BlockHash, KVCacheBlock, extend_block_hashes
from hybridllm.platforms import platform_for_device
from hybridllm.worker.input_batch import Span, step_inputs
from hybridllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# A catch-up this short runs as decode rows, one per token (the layout of a verify step);
# longer ones as prefill chunks.
_MAX_CATCH_UP_ROWS = 8


@dataclass
class DraftSequence:
    """One request as the draft model holds it."""

    token_ids: list[int] = field(default_factory=list)  # tokens whose KV is written, in order
    num_known: int = 0  # how many of them were the request's own (the rest: its drafts)
    blocks: list[KVCacheBlock] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of its known full blocks
    num_cached: int = 0  # leading blocks registered in the prefix cache
    last_used: int = 0  # the propose call that last drafted for it (eviction order)

    @property
    def block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]


@dataclass
class _Feed:
    """Tokens to run through the draft for one sequence, from position `start`."""

    seq: DraftSequence
    start: int
    token_ids: list[int]  # the last one's greedy next token is a draft


class DraftModelRunner:
    """Runs the draft model in the engine's process on the CPU (one worker, every layer).

    Each request's draft KV is kept between steps: a step feeds only what the draft has not
    seen (the target's kept tokens past the draft's own accepted guesses; the prompt the first
    time, less the full blocks the draft's prefix cache still holds), then decodes k - 1 more
    tokens greedily. The KV holds `max_seqs` full contexts in a `BlockPool` like the target's;
    when it runs short the least recently drafted sequences are dropped (they catch up again
    when they next draft).
    """

    def __init__(
        self,
        config: EngineConfig,
        num_speculative_tokens: int,
        max_seqs: int,
        vocab_size: int | None = None,
    ):
        placement = config.plan.workers()[0]
        platform = platform_for_device(placement.device)
        self.runner = ModelRunner(config, platform, config.plan.stage_of(0))
        self.runner.load_model()
        self.device = self.runner.device
        # drafts are token ids the target knows: a draft's larger (padded) vocabulary is cut
        self.vocab_size = vocab_size or config.model_config.vocab_size
        self.block_size = config.cache_config.block_size
        self.num_groups = len(self.runner.kv_cache_groups)
        self.max_tokens_per_forward = config.scheduler_config.max_num_batched_tokens
        max_len = config.scheduler_config.max_model_len + num_speculative_tokens
        self.num_blocks = num_blocks = max_seqs * -(-max_len // self.block_size)
        self.runner.initialize_kv_cache(num_blocks)
        self.pool = BlockPool(num_blocks)
        self.seqs: dict[str, DraftSequence] = {}
        self.num_calls = 0
        self.num_tokens_run = 0  # through the draft model, all calls together
        logger.info(
            "draft model %s: KV cache of %d blocks (%.0f MiB) for %d sequences",
            config.model_config.model,
            num_blocks,
            num_blocks * self.runner.kv_cache_bytes_per_block() / 2**20,
            max_seqs,
        )

    # ---- sequences ----------------------------------------------------------------------------

    def retain(self, req_ids: set[str]) -> None:
        """Forget every sequence but those of `req_ids` (finished or preempted requests)."""
        for req_id in [r for r in self.seqs if r not in req_ids]:
            self._free(req_id)

    def _free(self, req_id: str) -> None:
        # the tail first into the free queue: it is the first evicted, the shared prefix last
        self.pool.free_blocks(reversed(self.seqs.pop(req_id).blocks))

    def _sequence(self, req_id: str, token_ids: list[int]) -> DraftSequence:
        """The draft's sequence of `req_id`: the one it holds if `token_ids` extend its known
        tokens, else a new one on the prefix cache's blocks of `token_ids`' full blocks (all
        but the one of the last token, which the first forward writes)."""
        seq = self.seqs.get(req_id)
        if seq is not None and seq.token_ids[: seq.num_known] == token_ids[: seq.num_known]:
            return seq
        if seq is not None:  # a new request under a finished one's id
            self._free(req_id)
        seq = self.seqs[req_id] = DraftSequence()
        extend_block_hashes(seq.block_hashes, token_ids, self.block_size)
        for block_hash in seq.block_hashes[: (len(token_ids) - 1) // self.block_size]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            seq.blocks.append(block)
        self.pool.touch(seq.blocks)
        seq.num_cached = len(seq.blocks)
        seq.num_known = seq.num_cached * self.block_size
        seq.token_ids = token_ids[: seq.num_known]
        return seq

    def _reserve(self, seq: DraftSequence, num_blocks: int, keep: set[str]) -> bool:
        """Give `seq` at least `num_blocks` blocks, dropping the least recently drafted
        sequences not in `keep` if the pool runs short; False if it cannot."""
        missing = num_blocks - len(seq.blocks)
        if missing > self.pool.num_free_blocks:
            idle = sorted((s.last_used, r) for r, s in self.seqs.items() if r not in keep)
            for _, victim in idle:
                self._free(victim)
                if missing <= self.pool.num_free_blocks:
                    break
        if missing > self.pool.num_free_blocks:
            return False
        if missing > 0:
            seq.blocks.extend(self.pool.get_new_blocks(missing))
        return True

    def _cache_full_blocks(self, seq: DraftSequence) -> None:
        """Register the sequence's full blocks of known tokens but the last token's block
        (positions a later step may write again never enter the shared cache)."""
        extend_block_hashes(seq.block_hashes, seq.token_ids[: seq.num_known], self.block_size)
        end = (seq.num_known - 1) // self.block_size
        for i in range(seq.num_cached, end):
            self.pool.cache_block(seq.blocks[i], seq.block_hashes[i])
        seq.num_cached = max(seq.num_cached, end)

    # ---- drafting -----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, batch: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """Up to k greedy drafts after `token_ids` for each (req_id, token_ids, k) of `batch`
        (empty where the KV cache has no room for the request)."""
        self.num_calls += 1
        keep = {req_id for req_id, _, _ in batch}
        feeds: list[_Feed | None] = []
        for req_id, token_ids, k in batch:
            seq = self._sequence(req_id, token_ids)
            seq.last_used = self.num_calls
            if not self._reserve(seq, -(-(len(token_ids) + k - 1) // self.block_size), keep):
                feeds.append(None)
                continue
            start = _common_prefix(seq, token_ids)
            feeds.append(_Feed(seq, start, token_ids[start:]))
            seq.token_ids, seq.num_known = list(token_ids), len(token_ids)
        live = [i for i, feed in enumerate(feeds) if feed is not None]
        drafts: list[list[int]] = [[] for _ in batch]
        for i, token in zip(live, self._run([feeds[i] for i in live]), strict=True):
            drafts[i].append(token)
            self._cache_full_blocks(feeds[i].seq)
        for j in range(1, max((k for _, _, k in batch), default=0)):
            step = [i for i in live if batch[i][2] > j]
            if not step:
                break
            decode = []
            for i in step:
                seq = feeds[i].seq
                decode.append(_Feed(seq, len(seq.token_ids), [drafts[i][-1]]))
                seq.token_ids.append(drafts[i][-1])
            for i, token in zip(step, self._run(decode), strict=True):
                drafts[i].append(token)
        return drafts

    def _run(self, feeds: list[_Feed]) -> list[int]:
        """Feed each sequence its tokens (in forwards of at most max_num_batched_tokens); the
        greedy token after each feed, in order."""
        pieces = []  # (feed index, start, tokens, last piece of the feed)
        for i, feed in enumerate(feeds):
            n, chunk = len(feed.token_ids), self.max_tokens_per_forward
            for offset in range(0, n, chunk):
                tokens = feed.token_ids[offset : offset + chunk]
                pieces.append((i, feed.start + offset, tokens, offset + chunk >= n))
        result: dict[int, int] = {}
        forward: list = []
        size = 0
        for piece in pieces:
            if forward and size + len(piece[2]) > self.max_tokens_per_forward:
                result.update(self._forward(forward, feeds))
                forward, size = [], 0
            forward.append(piece)
            size += len(piece[2])
        if forward:
            result.update(self._forward(forward, feeds))
        return [result[i] for i in range(len(feeds))]

    def _forward(self, pieces: list, feeds: list[_Feed]) -> dict[int, int]:
        """One forward over `pieces` (each a run of one sequence's tokens); the greedy token
        after the last piece of each feed. Short runs go as one decode row per token."""
        decode_rows, prefills = [], []  # (feed index, span, tokens, samples)
        for i, start, tokens, last in pieces:
            if len(tokens) <= _MAX_CATCH_UP_ROWS:
                for j, token in enumerate(tokens):
                    samples = last and j == len(tokens) - 1
                    decode_rows.append((i, (start + j, 1, start + j + 1), [token], samples))
            else:
                prefills.append((i, (start, len(tokens), start + len(tokens)), tokens, last))
        rows = decode_rows + prefills
        spans: list[Span] = [span for _, span, _, _ in rows]
        ids = np.fromiter((t for _, _, tokens, _ in rows for t in tokens), dtype=np.int64)
        tables = [feeds[i].seq.block_ids for i, _, _, _ in rows]
        inputs = step_inputs(
            spans, [tables] * self.num_groups, len(decode_rows), self.block_size, self.device, ids
        )
        hidden = self.runner._forward(inputs, self.runner.kv_caches, {})  # [tokens, hidden]
        self.num_tokens_run += len(ids)
        ends = inputs.attn_metadata.query_start_loc_cpu
        sampling = [(i, ends[r + 1] - 1) for r, (i, _, _, samples) in enumerate(rows) if samples]
        if not sampling:
            return {}
        index = torch.tensor([row for _, row in sampling], dtype=torch.int64, device=self.device)
        logits = self.runner.model.compute_logits(hidden.index_select(0, index))  # [n, vocab]
        tokens = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
        return {i: token for (i, _), token in zip(sampling, tokens, strict=True)}

    def shutdown(self) -> None:
        self.runner.kv_caches = []
        self.runner.model = None
        self.seqs.clear()


def _common_prefix(seq: DraftSequence, token_ids: list[int]) -> int:
    """How many leading tokens of `token_ids` (which extend the sequence's known tokens) the
    draft's KV already holds, at most all but the last (whose row gives the first draft)."""
    n = seq.num_known
    limit = min(len(seq.token_ids), len(token_ids))
    while n < limit and seq.token_ids[n] == token_ids[n]:
        n += 1
    return min(n, len(token_ids) - 1)
