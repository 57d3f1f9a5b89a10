"""State slots of linear-attention layers: one per running request, whatever its length."""

from __future__ import annotations

from hybridllm.engine.block_manager import BlockManager


class StateSlotManager(BlockManager):
    """A `BlockManager` whose requests each hold exactly one block: the index of the state slot
    (the conv and recurrent state of every linear-attention layer) the request reads and writes
    in place. Taken at the request's first step, freed when it finishes or is preempted (a
    preempted request recomputes from its first token, so its state needs no copy).

    A state summarises a whole prefix and is overwritten every step, so it cannot be shared
    between requests: prefix caching is off here.
    """

    def __init__(self, num_slots: int, block_size: int) -> None:
        super().__init__(num_slots, block_size, enable_prefix_caching=False)

    @property
    def capacity_tokens(self) -> int:
        raise ValueError("a state slot holds any number of tokens")

    def num_blocks_for(self, num_tokens: int) -> int:
        return 1 if num_tokens > 0 else 0
