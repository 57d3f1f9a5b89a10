"""Pool of KV cache blocks: ref counts, the LRU free queue, and the hash -> block prefix cache."""

from __future__ import annotations

from collections.abc import Iterable

from hybridllm.engine.kv_cache_utils import BlockHash, FreeBlockQueue, KVCacheBlock


class BlockPool:
    """Owns every block; hands them out, takes them back, and remembers their content.

    A block with ref_cnt 0 sits in the free queue but keeps its hash, so a later
    request with the same prefix can still hit it until allocation evicts it.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # At most one block per content hash: a duplicate computed later stays unregistered.
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` least recently freed blocks, evicting their cached content."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} KV cache blocks: only {self.num_free_blocks} are free"
            )
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each; blocks reaching 0 join the free queue in this order."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a computed full block under its content hash (no-op if already known)."""
        if block.block_hash is not None or block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use keep their data, they just stop being shared."""
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None
