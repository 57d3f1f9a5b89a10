"""Block manager of a sliding-window KV cache group: drops blocks that fall out of the window."""

from __future__ import annotations

from collections.abc import Sequence

from hybridllm.engine.block_manager import BlockManager
from hybridllm.engine.kv_cache_utils import BlockHash, KVCacheBlock
from hybridllm.engine.request import Request


class SlidingWindowBlockManager(BlockManager):
    """A `BlockManager` whose requests hold only the blocks their future queries can read.

    A query at position p reads keys at positions (p - window, p]. Before a step that computes
    from position p, every block whose tokens all sit below p - window + 1 goes back to the pool
    and its place in the request's block table is taken by the null block (block 0, reserved,
    never written), so block tables stay indexed by position and the attention kernels, which
    mask keys outside the window, never read it.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        sliding_window: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"a sliding-window group needs >= 2 blocks, got {num_blocks}")
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.sliding_window = sliding_window
        # the free queue starts in id order: this is block 0
        self.null_block = self.block_pool.get_new_blocks(1)[0]
        self.num_usable_blocks = num_blocks - 1

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block a query at position `num_computed_tokens` (or later) reads."""
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Free the request's blocks that no query from `num_computed_tokens` on can read,
        oldest first into the free queue (they are evicted first)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        null = self.null_block
        freed = []
        for i in range(min(self.first_needed_block(num_computed_tokens), len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break  # everything before it went already
            freed.append(blocks[i])
            blocks[i] = null
        if freed:
            self.block_pool.free_blocks(reversed(freed))

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[int] | None:
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        self.remove_skipped_blocks(request, num_computed)
        return super().allocate_slots(request, num_new_tokens, new_computed_blocks)

    # ----- prefix cache -----
    def hit_lengths(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """[len(hashes) + 1] flags: entry m says a hit of the first m blocks is usable here,
        i.e. the blocks a query at position m * block_size reads are all cached."""
        valid = [True]
        run = 0  # cached blocks ending at the current one
        for m, block_hash in enumerate(hashes, start=1):
            run = run + 1 if self.block_pool.get_cached_block(block_hash) is not None else 0
            valid.append(run >= m - self.first_needed_block(m * self.block_size))
        return valid

    def hit_blocks(self, hashes: Sequence[BlockHash], num_blocks: int) -> list[KVCacheBlock]:
        """The block table of a hit of `num_blocks` blocks (`hit_lengths` said usable): the null
        block where the window no longer reaches, the cached blocks after."""
        first = self.first_needed_block(num_blocks * self.block_size)
        table = [self.null_block] * first
        for block_hash in hashes[first:num_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                raise ValueError("hit_blocks: a block of the hit is not cached")
            table.append(block)
        return table

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """The longest usable hit within `hashes` (this group alone)."""
        valid = self.hit_lengths(hashes)
        best = max(m for m, ok in enumerate(valid) if ok)
        return self.hit_blocks(hashes, best)
