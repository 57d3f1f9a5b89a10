"""Sliding-window KV cache groups: blocks freed past the window, bounded footprint, prefix hits."""

from hybridllm.engine.kv_cache_groups import KVCacheGroupSpec, kv_cache_groups
from hybridllm.engine.kv_cache_manager import KVCacheManager
from hybridllm.engine.request import Request
from hybridllm.engine.sliding_block_manager import SlidingWindowBlockManager
from hybridllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
WINDOW = 8


def make_request(request_id, prompt) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=100), eos_token_id=None)


def held(manager: SlidingWindowBlockManager, request: Request) -> list[int]:
    """Positions (block indices) of the request's table that hold a real block."""
    blocks = manager.req_to_blocks[request.request_id]
    return [i for i, b in enumerate(blocks) if b is not manager.null_block]


def run_chunks(manager, request: Request, chunks: list[int]) -> None:
    for n in chunks:
        assert manager.allocate_slots(request, n) is not None
        request.num_computed_tokens += n
        manager.cache_computed_blocks(request)


def test_blocks_out_of_the_window_are_freed_as_the_request_advances():
    manager = SlidingWindowBlockManager(16, BLOCK_SIZE, WINDOW, enable_prefix_caching=False)
    request = make_request("a", range(40))
    run_chunks(manager, request, [16])
    assert held(manager, request) == [0, 1, 2, 3]
    # the next query sits at 16 and reads from 16 - 8 + 1 = 9: blocks 0 and 1 go
    run_chunks(manager, request, [1])
    assert held(manager, request) == [2, 3, 4]
    table = manager.get_block_ids("a")
    assert table[:2] == [0, 0]  # the null block keeps the table indexed by position
    assert manager.num_free_blocks == 16 - 1 - 3
    manager.free(request)
    assert manager.num_free_blocks == 15 and manager.req_to_blocks == {}


def test_chunked_prefill_keeps_what_the_chunk_reads():
    manager = SlidingWindowBlockManager(32, BLOCK_SIZE, WINDOW, enable_prefix_caching=False)
    request = make_request("a", range(64))
    run_chunks(manager, request, [13])
    # a chunk starting at 13 reads from 13 - 7 = 6: block 1 (positions 4..7) must stay
    assert manager.allocate_slots(request, 10) is not None
    assert held(manager, request)[0] == 1


def test_footprint_is_bounded_by_the_window():
    manager = SlidingWindowBlockManager(64, BLOCK_SIZE, WINDOW, enable_prefix_caching=True)
    request = make_request("a", range(200))
    chunk = 5
    bound = -(-(WINDOW - 1 + chunk) // BLOCK_SIZE) + 1
    while request.num_computed_tokens + chunk <= 200:
        run_chunks(manager, request, [chunk])
        assert len(held(manager, request)) <= bound
    spec = KVCacheGroupSpec(WINDOW, (0,))
    assert spec.blocks_per_request(BLOCK_SIZE, chunk, 200) == bound < 200 // BLOCK_SIZE


def test_prefix_hit_needs_the_window_before_the_hit_point():
    manager = SlidingWindowBlockManager(64, BLOCK_SIZE, WINDOW, enable_prefix_caching=True)
    first = make_request("a", range(100, 130))  # 30 tokens: 7 full blocks
    run_chunks(manager, first, [30])
    manager.free(first)
    second = make_request("b", list(range(100, 130)) + [7, 8])
    hits, num_hit = manager.get_computed_blocks(second)
    # 7 cached blocks cover 28 tokens and a query at 28 reads from 21: blocks 5 and 6 must be
    # cached, the table before them is the null block
    assert num_hit == 28
    assert [b is manager.null_block for b in hits] == [True] * 5 + [False] * 2
    assert manager.allocate_slots(second, second.num_tokens - num_hit, hits) is not None
    assert held(manager, second) == [5, 6, 7]
    manager.free(second)
    assert manager.num_free_blocks == 63


def test_evicted_window_block_shortens_the_hit():
    manager = SlidingWindowBlockManager(64, BLOCK_SIZE, WINDOW, enable_prefix_caching=True)
    first = make_request("a", range(100, 130))
    run_chunks(manager, first, [30])
    manager.free(first)
    hashes = first.update_block_hashes(BLOCK_SIZE)
    manager.block_pool._evict(manager.block_pool.get_cached_block(hashes[5]))
    second = make_request("b", list(range(100, 130)) + [7])
    _, num_hit = manager.get_computed_blocks(second)
    # hits of 6 or 7 blocks read block 5; a hit of 5 blocks reads blocks 3 and 4 (cached)
    assert num_hit == 5 * BLOCK_SIZE


def test_hybrid_manager_hit_is_the_longest_every_group_serves():
    groups = [KVCacheGroupSpec(None, (0,)), KVCacheGroupSpec(WINDOW, (1,))]
    manager = KVCacheManager(groups, [64, 32], BLOCK_SIZE, enable_prefix_caching=True)
    first = make_request("a", range(100, 130))
    assert manager.allocate_slots(first, 30) is not None
    first.num_computed_tokens = 30
    manager.cache_computed_blocks(first)
    manager.free(first)
    # the full group lost its block 4: hits end at 4 blocks, whose window the sliding group has
    full = manager.managers[0]
    hashes = first.update_block_hashes(BLOCK_SIZE)
    full.block_pool._evict(full.block_pool.get_cached_block(hashes[4]))
    second = make_request("b", list(range(100, 130)) + [1])
    blocks, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 16 and [len(b) for b in blocks] == [4, 4]
    ids = manager.allocate_slots(second, second.num_tokens - num_hit, blocks)
    assert ids is not None and len(ids) == 2
    manager.free(second)
    assert manager.num_free_blocks == manager.num_blocks


def test_hybrid_manager_allocates_in_every_group_or_none():
    groups = [KVCacheGroupSpec(None, (0,)), KVCacheGroupSpec(WINDOW, (1,))]
    manager = KVCacheManager(groups, [4, 64], BLOCK_SIZE, enable_prefix_caching=False)
    request = make_request("a", range(40))
    assert manager.allocate_slots(request, 20) is None  # the full group has 4 blocks
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.allocate_slots(request, 16) is not None


def test_groups_from_layer_types():
    class Config:
        num_hidden_layers = 6
        sliding_window = 16
        layer_types = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 3

    groups = kv_cache_groups(Config())
    assert [(g.sliding_window, g.layers) for g in groups] == [(None, (2,)), (16, (0, 1, 3, 4, 5))]
