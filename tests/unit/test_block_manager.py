"""Paged KV block manager: allocation, ref counts, prefix caching, LRU eviction, no leaks."""

import random

import pytest

from hybridllm.engine.block_manager import BlockManager
from hybridllm.engine.request import Request
from hybridllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id, prompt, **params) -> Request:
    return Request(request_id, prompt, SamplingParams(**params), eos_token_id=None)


def admit(manager: BlockManager, request: Request) -> list[int]:
    """Schedule a new request's whole prompt and mark it computed, as a step would."""
    hits, num_hit = manager.get_computed_blocks(request)
    new_ids = manager.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new_ids is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_computed_blocks(request)
    return manager.get_block_ids(request.request_id)


def assert_all_free(manager: BlockManager) -> None:
    assert manager.num_free_blocks == manager.num_blocks
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)
    assert manager.req_to_blocks == {}
    assert manager.usage == 0.0


def test_allocate_grows_block_table_and_counts_refs():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    request = make_request("a", range(10))
    assert manager.allocate_slots(request, 10) == [0, 1, 2]
    request.num_computed_tokens = 10
    assert manager.allocate_slots(request, 2) == []  # slots 10, 11 fit in block 2
    request.num_computed_tokens = 12
    assert manager.allocate_slots(request, 1) == [3]
    assert manager.num_free_blocks == 4 and manager.usage == pytest.approx(0.5)
    assert all(manager.block_pool.blocks[i].ref_cnt == 1 for i in range(4))
    manager.free(request)
    assert_all_free(manager)


def test_allocation_failure_allocates_nothing():
    manager = BlockManager(num_blocks=3, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    small, big = make_request("small", range(4)), make_request("big", range(12))
    assert manager.allocate_slots(small, 4) == [0]
    assert not manager.can_allocate_slots(big, 12)
    assert manager.allocate_slots(big, 12) is None
    assert manager.num_free_blocks == 2 and "big" not in manager.req_to_blocks
    assert manager.allocate_slots(big, 8) == [1, 2]  # a smaller chunk fits
    manager.free(small)
    manager.free(big)
    assert_all_free(manager)


def test_prefix_hit_shares_full_blocks():
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    first = make_request("a", prompt)
    first_ids = admit(manager, first)
    second = make_request("b", prompt + [7, 8])
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 8 and [b.block_id for b in hits] == first_ids[:2]
    new_ids = manager.allocate_slots(second, second.num_tokens - num_hit, hits)
    second_ids = manager.get_block_ids("b")
    assert second_ids[:2] == first_ids[:2] and second_ids[2:] == new_ids
    # The partial third block is never shared: each request writes its own.
    assert second_ids[2] != first_ids[2]
    assert [manager.block_pool.blocks[i].ref_cnt for i in first_ids] == [2, 2, 1]
    manager.free(first)
    assert [manager.block_pool.blocks[i].ref_cnt for i in first_ids[:2]] == [1, 1]
    manager.free(second)
    assert_all_free(manager)


def test_hit_leaves_last_token_to_compute():
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    prompt = list(range(8))  # exactly two full blocks
    admit(manager, make_request("a", prompt))
    _, num_hit = manager.get_computed_blocks(make_request("b", prompt))
    assert num_hit == 4  # (8 - 1) // 4 blocks: the last block holds the last prompt token
    _, num_hit = manager.get_computed_blocks(make_request("c", prompt + [99]))
    assert num_hit == 8


def test_hits_need_same_prefix_and_stop_at_first_miss():
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(manager, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block after a different first block: no hit (hashes are chained).
    _, num_hit = manager.get_computed_blocks(make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert num_hit == 0
    _, num_hit = manager.get_computed_blocks(make_request("c", [1, 2, 3, 4, 0, 6, 7, 8, 9]))
    assert num_hit == 4


def test_no_hits_without_prefix_caching_or_with_prompt_logprobs():
    prompt = list(range(12))
    for enable, params in ((False, {}), (True, {"prompt_logprobs": 0})):
        manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE, enable_prefix_caching=enable)
        admit(manager, make_request("a", prompt))
        assert manager.get_computed_blocks(make_request("b", prompt, **params)) == ([], 0)


def test_only_computed_blocks_are_cached():
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    prompt = list(range(12))
    chunked = make_request("a", prompt)
    manager.allocate_slots(chunked, 6)
    chunked.num_computed_tokens = 6  # first chunk: one full block computed
    manager.cache_computed_blocks(chunked)
    _, num_hit = manager.get_computed_blocks(make_request("b", prompt))
    assert num_hit == 4


def test_freed_blocks_stay_cached_and_evict_in_lru_order():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    prompt = list(range(12))
    first = make_request("a", prompt)
    ids = admit(manager, first)
    assert ids == [0, 1, 2]
    manager.free(first)
    # Never-used blocks first, then the freed request tail first.
    assert manager.block_pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    assert manager.get_computed_blocks(make_request("b", prompt + [1]))[1] == 12
    other = make_request("c", range(50, 66))  # needs 4 blocks: evicts 3, 4, 5 and then 2
    assert admit(manager, other) == [3, 4, 5, 2]
    hits, num_hit = manager.get_computed_blocks(make_request("d", prompt + [1]))
    assert num_hit == 8 and [b.block_id for b in hits] == [0, 1]
    manager.free(other)
    assert_all_free(manager)


def test_hit_on_free_block_takes_it_out_of_free_queue():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    prompt = list(range(12))
    first = make_request("a", prompt)
    admit(manager, first)
    manager.free(first)
    second = make_request("b", prompt + [1, 2, 3, 4, 5])  # 17 tokens: 5 blocks > pool of 4
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 12
    # 3 hit blocks are free now but stop being free once used: 2 more needed, 1 left.
    assert not manager.can_allocate_slots(second, 5, hits)
    assert manager.allocate_slots(second, 5, hits) is None
    assert manager.num_free_blocks == 4
    third = make_request("c", prompt + [1])
    hits, num_hit = manager.get_computed_blocks(third)
    assert manager.allocate_slots(third, 1, hits) == [3]
    assert manager.num_free_blocks == 0
    assert manager.block_pool.free_queue.block_ids() == []
    manager.free(third)
    assert_all_free(manager)


def test_reset_prefix_cache_forgets_hashes():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(12))
    running = make_request("a", prompt)
    admit(manager, running)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request("b", prompt))[1] == 0
    assert manager.block_pool.cached_blocks == {}
    manager.free(running)
    assert_all_free(manager)


def test_double_free_is_an_error():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    request = make_request("a", range(4))
    manager.allocate_slots(request, 4)
    block = manager.req_to_blocks["a"][0]
    manager.free(request)
    with pytest.raises(ValueError, match="double free"):
        manager.block_pool.free_blocks([block])


def test_random_shared_prefixes_never_leak():
    rng = random.Random(0)
    manager = BlockManager(num_blocks=24, block_size=BLOCK_SIZE)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 13))] for _ in range(3)]
    live: list[Request] = []
    for step in range(300):
        if live and (rng.random() < 0.4 or manager.num_free_blocks < 6):
            manager.free(live.pop(rng.randrange(len(live))))
            continue
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
        request = make_request(f"r{step}", prompt)
        hits, num_hit = manager.get_computed_blocks(request)
        if manager.allocate_slots(request, request.num_tokens - num_hit, hits) is None:
            continue
        request.num_computed_tokens = request.num_tokens
        manager.cache_computed_blocks(request)
        live.append(request)
        held = sum(len(blocks) for blocks in manager.req_to_blocks.values())
        refs = sum(b.ref_cnt for b in manager.block_pool.blocks)
        assert refs == held  # every block-table entry holds exactly one reference
    for request in live:
        manager.free(request)
    assert_all_free(manager)
