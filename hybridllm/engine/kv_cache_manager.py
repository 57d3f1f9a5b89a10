"""The scheduler's KV cache: one block manager per KV cache group, allocated together."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hybridllm.engine.block_manager import BlockManager
from hybridllm.engine.kv_cache_groups import KVCacheGroupSpec
from hybridllm.engine.kv_cache_utils import KVCacheBlock
from hybridllm.engine.request import Request
from hybridllm.engine.sliding_block_manager import SlidingWindowBlockManager
from hybridllm.engine.state_slot_manager import StateSlotManager

logger = logging.getLogger(__name__)

FULL_ATTENTION = (KVCacheGroupSpec(None, ()),)

# one block table (or list of blocks) per group
GroupBlockIds = tuple[list[int], ...]
GroupBlocks = list[list[KVCacheBlock]]


class KVCacheManager:
    """Gives a request blocks in every group at once, or in none.

    A model without sliding layers has one full-attention group and this is its `BlockManager`
    with block ids wrapped in a 1-tuple. Prefix hits are the longest block-aligned prefix that
    every group can serve: a full group needs all of its blocks, a sliding one the blocks of the
    last `window` tokens before the hit point. A model with linear-attention layers (a state
    group) caches no prefixes: a state slot cannot be shared.
    """

    def __init__(
        self,
        groups: Sequence[KVCacheGroupSpec],
        num_blocks: Sequence[int],
        block_size: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        if len(groups) != len(num_blocks):
            raise ValueError(f"{len(groups)} KV cache groups but {len(num_blocks)} block counts")
        self.groups = tuple(groups)
        self.block_size = block_size
        if enable_prefix_caching and any(spec.is_state for spec in self.groups):
            logger.info(
                "prefix caching is off: the model's linear-attention layers keep one state per "
                "request, which cannot be shared"
            )
            enable_prefix_caching = False
        self.enable_prefix_caching = enable_prefix_caching
        self.managers: list[BlockManager] = [
            self._manager(spec, n, enable_prefix_caching)
            for spec, n in zip(self.groups, num_blocks)
        ]
        self._sliding = [m for m in self.managers if isinstance(m, SlidingWindowBlockManager)]
        self._full = [m for m, spec in zip(self.managers, self.groups) if spec.is_full]
        # one group: every call goes straight to its manager (the common, per-step path)
        self._single = self.managers[0] if len(self.managers) == 1 else None

    def _manager(
        self, spec: KVCacheGroupSpec, num_blocks: int, prefix_caching: bool
    ) -> BlockManager:
        if spec.is_state:
            return StateSlotManager(num_blocks, self.block_size)
        if spec.sliding_window is not None:
            return SlidingWindowBlockManager(
                num_blocks, self.block_size, spec.sliding_window, prefix_caching
            )
        return BlockManager(num_blocks, self.block_size, prefix_caching)

    # ----- stats -----
    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def num_blocks(self) -> int:
        """Usable blocks over every group (a sliding group's null block excluded)."""
        return sum(getattr(m, "num_usable_blocks", m.num_blocks) for m in self.managers)

    @property
    def num_free_blocks(self) -> int:
        return sum(m.num_free_blocks for m in self.managers)

    @property
    def usage(self) -> float:
        """The fullest group's fraction of blocks in use."""
        return max(m.usage for m in self.managers)

    @property
    def capacity_tokens(self) -> int | None:
        """Tokens one request can reach before the full groups run out (None: no full group)."""
        if not self._full:
            return None
        return min(m.capacity_tokens for m in self._full)

    def blocks_short(self, num_tokens: int, chunk: int) -> str | None:
        """Why a request of `num_tokens` tokens computed in chunks of `chunk` can never fit
        the cache, or None."""
        for spec, manager in zip(self.groups, self.managers):
            need = spec.blocks_per_request(self.block_size, chunk, num_tokens)
            have = getattr(manager, "num_usable_blocks", manager.num_blocks)
            if need > have:
                if spec.is_state:
                    return "the linear-attention state cache has no slot"
                kind = "" if spec.sliding_window is None else f" (window {spec.sliding_window})"
                return (
                    f"prompt has {num_tokens} tokens and needs {need} KV cache blocks, but the "
                    f"whole cache{kind} has {have} blocks of {self.block_size} tokens"
                )
        return None

    def get_block_ids(self, request_id: str) -> GroupBlockIds:
        if self._single is not None:
            return (self._single.get_block_ids(request_id),)
        return tuple(m.get_block_ids(request_id) for m in self.managers)

    # ----- prefix cache -----
    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Each group's blocks of the longest prefix every group has cached, and its tokens."""
        if self._single is not None:
            blocks, num_hit = self._single.get_computed_blocks(request)
            return [blocks], num_hit
        empty: GroupBlocks = [[] for _ in self.managers]
        if (
            not self.enable_prefix_caching
            or request.sampling_params.prompt_logprobs is not None
            or request.request_id in self.managers[0].req_to_blocks
        ):
            return empty, 0
        hashes = request.update_block_hashes(self.block_size)
        hashes = hashes[: (request.num_tokens - 1) // self.block_size]
        full_hits = [m.cached_prefix(hashes) for m in self._full]
        limit = min((len(h) for h in full_hits), default=len(hashes))
        valid = [True] * (limit + 1)
        for manager in self._sliding:
            for m, ok in enumerate(manager.hit_lengths(hashes[:limit])):
                valid[m] = valid[m] and ok
        num_hit = max(m for m, ok in enumerate(valid) if ok)
        if num_hit == 0:
            return empty, 0
        blocks = [
            m.hit_blocks(hashes, num_hit)
            if isinstance(m, SlidingWindowBlockManager)
            else m.cached_prefix(hashes[:num_hit])
            for m in self.managers
        ]
        return blocks, num_hit * self.block_size

    def cache_computed_blocks(self, request: Request) -> None:
        if self._single is not None:
            self._single.cache_computed_blocks(request)
            return
        for manager in self.managers:
            manager.cache_computed_blocks(request)

    def reset_prefix_cache(self) -> bool:
        for manager in self.managers:
            manager.reset_prefix_cache()
        return True

    # ----- allocation -----
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks | None = None,
    ) -> GroupBlockIds | None:
        """Room for `num_new_tokens` more tokens in every group: the ids of each group's new
        blocks, or None, allocating nothing, when a group is short."""
        if self._single is not None:
            hits = new_computed_blocks[0] if new_computed_blocks else ()
            ids = self._single.allocate_slots(request, num_new_tokens, hits)
            return None if ids is None else (ids,)
        hits = new_computed_blocks or [()] * len(self.managers)
        num_computed = request.num_computed_tokens + len(hits[0]) * self.block_size
        for manager in self._sliding:
            # blocks this request no longer reads go back first: they may serve this step
            manager.remove_skipped_blocks(request, num_computed)
        if not all(
            m.can_allocate_slots(request, num_new_tokens, h) for m, h in zip(self.managers, hits)
        ):
            return None
        return tuple(
            m.allocate_slots(request, num_new_tokens, h) for m, h in zip(self.managers, hits)
        )

    def free(self, request: Request) -> None:
        if self._single is not None:
            self._single.free(request)
            return
        for manager in self.managers:
            manager.free(request)
