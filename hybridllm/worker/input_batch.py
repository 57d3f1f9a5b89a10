"""A worker's per-request state between steps, and the flattened inputs of each step."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridllm.engine.scheduler_output import SchedulerOutput
from hybridllm.layers.attention_metadata import AttentionMetadata
from hybridllm.sample import SamplingMetadata
from hybridllm.sampling_params import SamplingParams
from hybridllm.worker.intermediate_tensors import IntermediateTensors

logger = logging.getLogger(__name__)

# (first position, query length, context length after the step) of one sequence in a step
Span = tuple[int, int, int]


@dataclass
class CachedRequestState:
    """What a worker remembers about a running request between steps."""

    req_id: str
    token_ids: list[int]  # prompt + output, as known to the scheduler
    num_prompt_tokens: int
    block_ids: tuple[list[int], ...]  # one block table per KV cache group
    sampling_params: SamplingParams
    num_computed_tokens: int
    # drafts this step verifies after token_ids (speculative decoding); set every step
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(frozen=True)
class SampleRow:
    """A row of the step's hidden states that samples: its request, and how many of the
    request's drafts come before it (0: the row of its last known token)."""

    row: int
    state: CachedRequestState
    num_drafts_before: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        """The request's output as this row sees it: with the drafts before the row."""
        out = self.state.output_token_ids
        return (
            out + self.state.spec_token_ids[: self.num_drafts_before]
            if self.num_drafts_before
            else out
        )


@dataclass(frozen=True)
class PromptLogprobRows:
    """The rows of one request's prompt chunk whose logits score the prompt's next tokens."""

    req_id: str
    num_logprobs: int  # the request's prompt_logprobs
    first_row: int  # row of the chunk's first token in the step's hidden states
    next_token_ids: list[int]  # the prompt tokens those rows predict, one per row
    starts_prompt: bool  # the chunk begins the prompt: its first token has no logprob


@dataclass
class StepInputs:
    """One step's flattened batch on the device, in the runner's row order, and the host-side
    facts the last stage needs after the forward."""

    input_ids: torch.Tensor | None  # [num_tokens] int64; None past the first stage
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    spans: list[Span]
    requests: list[CachedRequestState] = field(default_factory=list)  # one per span, if any

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def sampling_rows(self) -> list[SampleRow]:
        """The rows that sample a token: the last row of each sequence whose context reaches
        all its request's known tokens; a verify step's rows past them follow its drafts."""
        rows = []
        starts = self.attn_metadata.query_start_loc_cpu
        for i, (state, (_, _, context)) in enumerate(zip(self.requests, self.spans)):
            num_drafts_before = context - len(state.token_ids)
            if num_drafts_before >= 0:
                rows.append(SampleRow(starts[i + 1] - 1, state, num_drafts_before))
        return rows

    def prompt_logprob_rows(self) -> list[PromptLogprobRows]:
        """For each request that asked for prompt logprobs and computes prompt tokens this step:
        position p predicts prompt token p + 1, and the last prompt position predicts output."""
        result = []
        for i, (state, (start, length, _)) in enumerate(zip(self.requests, self.spans)):
            k = state.sampling_params.prompt_logprobs
            if k is None or start >= state.num_prompt_tokens:
                continue
            end = min(start + length, state.num_prompt_tokens - 1)
            result.append(
                PromptLogprobRows(
                    req_id=state.req_id,
                    num_logprobs=k,
                    first_row=self.attn_metadata.query_start_loc_cpu[i],
                    next_token_ids=state.token_ids[start + 1 : end + 1],
                    starts_prompt=start == 0,
                )
            )
        return result


class InputBatch:
    """The requests a worker runs, kept from step to step, and the inputs of each step. Every
    pipeline stage keeps the same state; only the first embeds token ids."""

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        with_input_ids: bool,
        eos_token_ids: set[int],
        vocab_size: int,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.with_input_ids = with_input_ids
        self.eos_token_ids = eos_token_ids  # masked under min_tokens
        self.vocab_size = vocab_size
        self.requests: dict[str, CachedRequestState] = {}

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Drop finished requests, add new ones, and extend the cached ones."""
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                block_ids=tuple(list(ids) for ids in new.block_ids),
                sampling_params=new.sampling_params,
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            for table, new_ids in zip(state.block_ids, cached.new_block_ids):
                table.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            state.spec_token_ids = spec_tokens.get(cached.req_id, [])

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        """The scheduled requests' tokens as one batch (call `update` first; the step must
        schedule some tokens)."""
        scheduled = scheduler_output.num_scheduled_tokens
        verifying = scheduler_output.scheduled_spec_decode_tokens
        # Decodes (query length 1) first: the attention layer batches them in one kernel.
        decodes: list[tuple[CachedRequestState, Span]] = []
        prefills: list[tuple[CachedRequestState, Span]] = []
        for req_id, length in scheduled.items():
            state = self.requests[req_id]
            start = state.num_computed_tokens
            if req_id in verifying:
                # A verify step: one decode row per token (the last known one, then each
                # draft), each reading the context up to its own position; causal by length.
                decodes.extend((state, (start + j, 1, start + j + 1)) for j in range(length))
            else:
                (decodes if length == 1 else prefills).append(
                    (state, (start, length, start + length))
                )
        pairs = decodes + prefills
        requests = [state for state, _ in pairs]
        spans = [span for _, span in pairs]
        input_ids = None
        if self.with_input_ids:
            input_ids = np.concatenate(
                [
                    np.asarray(_span_tokens(state, start, length))
                    for state, (start, length, _) in pairs
                ]
            )
        num_groups = len(requests[0].block_ids)
        block_tables = [[state.block_ids[g] for state in requests] for g in range(num_groups)]
        return step_inputs(
            spans, block_tables, len(decodes), self.block_size, self.device, input_ids, requests
        )

    def sampling_metadata(self, rows: list[SampleRow]) -> SamplingMetadata:
        """The sampler's view of `rows`, from their requests' parameters and tokens."""
        return SamplingMetadata.build(
            [row.state.sampling_params for row in rows],
            [row.state.token_ids[: row.state.num_prompt_tokens] for row in rows],
            [row.output_token_ids for row in rows],
            self.device,
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
        )

    def drop_unsamplable(self, rows: list[SampleRow], failed: dict[str, str]) -> list[SampleRow]:
        """Try each request's sampling metadata alone; the ones that fail go to `failed` (the
        scheduler finishes them with that error) and their rows leave the rows kept."""
        kept = []
        for row in rows:
            req_id = row.state.req_id
            if req_id in failed:
                continue
            try:
                self.sampling_metadata([row])
            except Exception as exc:
                logger.warning("request %s cannot be sampled: %s", req_id, exc)
                failed[req_id] = f"its sampling parameters failed: {exc}"
                continue
            kept.append(row)
        # a request whose later row failed loses its earlier rows too
        return [row for row in kept if row.state.req_id not in failed]


def _span_tokens(state: CachedRequestState, start: int, length: int) -> list[int]:
    """The tokens at positions [start, start + length): known ones, then drafts."""
    ids = state.token_ids[start : start + length]
    missing = length - len(ids)
    if missing:
        first = max(start - len(state.token_ids), 0)
        ids = ids + state.spec_token_ids[first : first + missing]
    return ids


def step_inputs(
    spans: list[Span],
    block_tables: Sequence[Sequence[Sequence[int]]],
    num_decodes: int,
    block_size: int,
    device: torch.device,
    input_ids: np.ndarray | None = None,
    requests: Sequence[CachedRequestState] = (),
) -> StepInputs:
    """Positions, token ids (when given, one per position) and attention metadata of the
    sequences `spans` describe, each reading and writing the blocks of its row of each KV cache
    group's `block_tables[group]`."""
    positions = np.concatenate([np.arange(start, start + length) for start, length, _ in spans])
    attn_metadata = attention_metadata(
        spans, block_tables, num_decodes, positions, block_size, device
    )
    ids = None
    if input_ids is not None:
        ids = torch.from_numpy(input_ids.astype(np.int64)).to(device)
    return StepInputs(
        input_ids=ids,
        positions=torch.from_numpy(positions.astype(np.int64)).to(device),
        attn_metadata=attn_metadata,
        spans=spans,
        requests=list(requests),
    )


def attention_metadata(
    spans: list[Span],
    block_tables: Sequence[Sequence[Sequence[int]]],
    num_decodes: int,
    positions: np.ndarray,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Slot mapping, query starts, context lengths and block tables (padded with block 0 and
    cut to the blocks the longest context reaches) for tokens at `positions` [num_tokens], one
    metadata per KV cache group (`block_tables[group][seq]`), the rest in `other_groups`."""
    query_lens = [length for _, length, _ in spans]
    seq_lens = [context for _, _, context in spans]
    query_start_loc = np.zeros(len(spans) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    max_blocks = max(-(-context // block_size) for context in seq_lens)
    seq_of_token = np.repeat(np.arange(len(spans)), query_lens)
    block_of_token = positions // block_size
    offsets = positions % block_size
    query_start_loc_t = torch.from_numpy(query_start_loc.astype(np.int32)).to(device)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    groups = []
    for group_tables in block_tables:
        table = np.zeros((len(spans), max_blocks), dtype=np.int32)  # [num_seqs, max_blocks]
        for i, ids in enumerate(group_tables):
            used = min(len(ids), max_blocks)
            table[i, :used] = ids[:used]
        # slot of each token = block_table[seq][pos // block_size] * block_size + pos % block_size
        blocks = table[seq_of_token, block_of_token].astype(np.int64)
        slots = blocks * block_size + offsets
        groups.append(
            AttentionMetadata(
                num_decodes=num_decodes,
                num_decode_tokens=num_decodes,
                slot_mapping=torch.from_numpy(slots).to(device),
                query_start_loc=query_start_loc_t,
                seq_lens=seq_lens_t,
                block_tables=torch.from_numpy(table).to(device),
                query_start_loc_cpu=query_start_loc.tolist(),
                seq_lens_cpu=seq_lens,
                max_seq_len=max(seq_lens),
                block_size=block_size,
            )
        )
    groups[0].other_groups = tuple(groups[1:])
    return groups[0]


def profile_block_tables(spans: list[Span], block_size: int) -> tuple[list[list[int]], int]:
    """Block tables of a profiling step's sequences, and the blocks they use together.

    Each sequence gets blocks for the tokens it writes (+1: a chunk may straddle a block
    boundary); a longer context (a chunk's cached prefix) maps onto the same blocks again, so its
    reads cost what real ones do without a max_model_len cache.
    """
    tables, first = [], 0
    for _, length, context in spans:
        own = -(-length // block_size) + 1
        tables.append([first + j % own for j in range(-(-context // block_size))])
        first += own
    return tables, first


def rows_on_device(rows: list[int], device: torch.device) -> torch.Tensor:
    """`rows` as an int64 tensor [len(rows)] on `device`."""
    tensor = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        # pinned + non_blocking: a pageable copy would wait for the queued forward pass
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def previous_stage_inputs(
    intermediate: IntermediateTensors | None, num_tokens: int, pp_rank: int, device: torch.device
) -> dict[str, torch.Tensor | None]:
    """The model's keyword arguments that continue a step from stage `pp_rank - 1`'s
    activations (hidden states and residual, [num_tokens, hidden] each), on `device`."""
    if intermediate is None:
        raise ValueError(
            f"pipeline stage {pp_rank} needs the activations of stage {pp_rank - 1}, got none"
        )
    if intermediate.num_tokens != num_tokens:
        raise ValueError(
            f"pipeline stage {pp_rank} got activations for "
            f"{intermediate.num_tokens} tokens but this step computes {num_tokens}"
        )
    local = intermediate.to(device)
    return {"hidden_states": local.hidden_states, "residual": local.residual}
