"""Building blocks of the paged KV cache: the block, its content hash, and the LRU free queue."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple


class BlockHash(NamedTuple):
    """Identity of a FULL block's content: a chained hash plus the block's own token ids.

    Keeping the token ids makes a dict lookup compare them on a hash match, so two
    blocks only collide if their parents' 64-bit chained hashes collide too.
    """

    hash_value: int
    token_ids: tuple[int, ...]


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given the hash of the block before it (None for the first)."""
    tokens = tuple(token_ids)
    parent_value = None if parent is None else parent.hash_value
    # Python hashes ints and tuples of ints deterministically (no PYTHONHASHSEED salt).
    return BlockHash(hash((parent_value, tokens)), tokens)


def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int
) -> None:
    """Append the hashes of full blocks of `token_ids` not hashed yet (O(new blocks))."""
    num_full_blocks = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else None
    for i in range(len(block_hashes), num_full_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        block_hashes.append(parent)


class KVCacheBlock:
    """One block of `block_size` KV slots: who uses it and what it holds.

    `prev_free`/`next_free` link it into the FreeBlockQueue while `ref_cnt` is 0.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set while registered in the prefix cache
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={cached})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks, least recently freed first.

    Allocation pops from the front (evicting the oldest cached content); freeing
    appends at the back; a prefix-cache hit unlinks a block from anywhere in O(1).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # Sentinels keep every unlink/append free of head/tail special cases.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free KV cache blocks left to pop")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids in eviction order (O(n); tests and debugging only)."""
        ids = []
        block = self._head.next_free
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids
