"""The scheduler over sliding-window KV cache groups, driven by the fake worker that checks the
KV each query reads: same tokens as full attention, bounded blocks, prefix hits, preemption."""

from __future__ import annotations

import random

import pytest

from hybridllm.engine.kv_cache_groups import KVCacheGroupSpec
from tests.unit.test_scheduler import (
    BLOCK_SIZE,
    FakeWorker,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)

WINDOW = 8
HYBRID = (KVCacheGroupSpec(None, (0, 2)), KVCacheGroupSpec(WINDOW, (1, 3)))
ALL_SLIDING = (KVCacheGroupSpec(WINDOW, (0, 1)),)


def workload(seed: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs; some prompts repeat, so prefix caching hits."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 90) for _ in range(rng.randrange(3, 40))] for _ in range(6)]
    return [(rng.choice(prompts), rng.randrange(1, 30)) for _ in range(12)]


def run(groups, num_blocks, seed=0, **scheduler_kwargs) -> tuple[dict, object]:
    scheduler = make_scheduler(num_blocks=num_blocks, kv_cache_groups=groups, **scheduler_kwargs)
    windows = tuple(g.sliding_window for g in groups)
    worker = FakeWorker(BLOCK_SIZE, windows=windows)
    requests = []
    for i, (prompt, max_tokens) in enumerate(workload(seed)):
        requests.append(make_request(f"r{i}", prompt, eos=None, max_tokens=max_tokens))
        scheduler.add_request(requests[-1])
        if i % 3 == 2:
            step(scheduler, worker)  # arrivals spread over steps: later ones hit the cache
    run_to_completion(scheduler, worker)  # checks every read and that nothing leaks
    return {r.request_id: r.output_token_ids for r in requests}, scheduler


@pytest.mark.parametrize("groups", [HYBRID, ALL_SLIDING], ids=["hybrid", "all-sliding"])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
@pytest.mark.parametrize("budget", [64, 6])
def test_same_tokens_as_full_attention(groups, enable_prefix_caching, budget):
    kwargs = dict(max_num_batched_tokens=budget, enable_prefix_caching=enable_prefix_caching)
    expected, _ = run((KVCacheGroupSpec(None, (0,)),), 256, **kwargs)
    outputs, scheduler = run(groups, 256, **kwargs)
    assert outputs == expected
    if enable_prefix_caching:
        assert scheduler.prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("groups", [HYBRID, ALL_SLIDING], ids=["hybrid", "all-sliding"])
def test_preemption_under_a_small_pool(groups):
    expected, _ = run((KVCacheGroupSpec(None, (0,)),), 256, max_num_batched_tokens=16)
    outputs, scheduler = run(groups, 24, max_num_batched_tokens=16)
    assert outputs == expected
    assert scheduler.num_preemptions > 0


def test_long_request_holds_only_its_window_in_the_sliding_group():
    scheduler = make_scheduler(
        num_blocks=512, max_num_batched_tokens=8, max_model_len=1024, kv_cache_groups=HYBRID
    )
    worker = FakeWorker(BLOCK_SIZE, windows=(None, WINDOW))
    request = make_request("long", range(10, 10 + 8 * WINDOW), eos=None, max_tokens=4 * WINDOW)
    scheduler.add_request(request)
    full, sliding = scheduler.block_manager.managers
    bound = -(-(WINDOW - 1 + 8) // BLOCK_SIZE) + 1
    most = 0
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
        if request.request_id in sliding.req_to_blocks:
            most = max(most, sliding.num_usable_blocks - sliding.num_free_blocks)
            num_computed = request.num_computed_tokens  # the full group holds all of them
            assert full.num_blocks - full.num_free_blocks == -(-num_computed // BLOCK_SIZE)
    assert 0 < most <= bound
    assert request.num_output_tokens == 4 * WINDOW


def test_prompt_that_cannot_fit_a_sliding_group_fails_alone():
    scheduler = make_scheduler(num_blocks=3, max_num_batched_tokens=64, kv_cache_groups=ALL_SLIDING)
    request = make_request("big", range(10, 40), max_tokens=2)
    scheduler.add_request(request)
    assert request.is_finished() and "window 8" in request.error
