"""Paged KV cache manager: per-request block tables over a shared pool, with prefix caching."""

from __future__ import annotations

from collections.abc import Sequence

from hybridllm.engine.block_pool import BlockPool
from hybridllm.engine.kv_cache_utils import BlockHash, KVCacheBlock
from hybridllm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Gives each request the blocks its tokens need, sharing full blocks with equal prefixes.

    Usage per request: `get_computed_blocks` (prefix hits, new requests only), then
    `can_allocate_slots`/`allocate_slots` each step, `cache_computed_blocks` once the
    step's tokens are in the cache, and `free` when it finishes or is preempted.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in (or came from) the cache.
        self._num_cached_blocks: dict[str, int] = {}
        # A block that stands in a block table for one the request no longer holds (a sliding
        # window's, see sliding_block_manager.py): never freed, cached or touched. None: none.
        self.null_block: KVCacheBlock | None = None

    # ----- stats -----
    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # ----- prefix cache -----
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a request with no blocks yet: (blocks, num cached tokens).

        The last token is never a hit (it must be computed to produce logits), and a
        request that wants prompt logprobs gets no hits (its whole prompt must run).
        Takes no reference: pass the blocks to `allocate_slots` in the same step.
        """
        if (
            not self.enable_prefix_caching
            or request.sampling_params.prompt_logprobs is not None
            or request.request_id in self.req_to_blocks
        ):
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.update_block_hashes(self.block_size)
        computed = self.cached_prefix(hashes[:max_hit_blocks])
        return computed, len(computed) * self.block_size

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of `hashes` whose blocks are all cached."""
        computed: list[KVCacheBlock] = []
        for block_hash in hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now computed (O(new full blocks))."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = request.update_block_hashes(self.block_size)
        for i in range(start, num_full):
            if blocks[i] is not self.null_block:
                self.block_pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content (e.g. between benchmark runs). Always succeeds."""
        # Blocks in use lose their hashes too; they stay counted in _num_cached_blocks,
        # so they are not re-registered and simply stop being shared.
        self.block_pool.reset_prefix_cache()
        return True

    # ----- allocation -----
    def _num_blocks_to_allocate(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        num_held = len(self.req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        return max(0, self.num_blocks_for(num_computed + num_new_tokens) - num_held)

    def can_allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> bool:
        num_needed = self._num_blocks_to_allocate(request, num_new_tokens, new_computed_blocks)
        # Hit blocks sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return num_needed <= self.num_free_blocks - num_free_hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_blocks` are prefix hits from `get_computed_blocks` (new requests).
        Returns the ids of newly allocated blocks (hits excluded), or None, allocating
        nothing, when the pool is short.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if new_computed_blocks and request.request_id in self.req_to_blocks:
            raise ValueError(
                f"request {request.request_id!r} already has blocks: prefix hits are for new requests"
            )
        if not self.can_allocate_slots(request, num_new_tokens, new_computed_blocks):
            return None
        num_needed = self._num_blocks_to_allocate(request, num_new_tokens, new_computed_blocks)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self._touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self._num_cached_blocks[request.request_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        req_blocks.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def _touch(self, hits: Sequence[KVCacheBlock]) -> None:
        null = self.null_block
        self.block_pool.touch(hits if null is None else [b for b in hits if b is not null])

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so its tail is evicted before its prefix."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        null = self.null_block
        self.block_pool.free_blocks(
            reversed(blocks) if null is None else (b for b in reversed(blocks) if b is not null)
        )
