"""How the KV budget is split between full and sliding-window groups, and what the planner counts."""

from __future__ import annotations

from types import SimpleNamespace

from hybridllm.engine.kv_cache_groups import KVCacheGroupSpec, kv_cache_groups
from hybridllm.plan.memory_budget import (
    MemoryBudgets,
    worker_kv_bytes_per_token,
    worker_sliding_kv_bytes,
)
from hybridllm.plan.model_size import model_size
from hybridllm.plan.plan import StagePlan, WorkerPlacement
from hybridllm.worker.kv_cache_budget import group_block_needs, split_paged_kv_budget

FULL = KVCacheGroupSpec(None, (1,))
SLIDING = KVCacheGroupSpec(128, (0, 2, 3))


def test_sliding_need_is_bounded_by_the_window_not_the_context():
    needs = group_block_needs([FULL, SLIDING], 16, 8, 32768, 512)
    assert needs[0] == 8 * 2048  # full: 8 whole contexts
    # sliding: 8 x (ceil(127 / 16) + 2) blocks + one step's 512 tokens + the null block
    assert needs[1] == 8 * 10 + 32 + 1
    short = group_block_needs([FULL, SLIDING], 16, 8, 64, 512)
    assert short[1] == 8 * 4 + 1  # never more than full attention would take


def test_sliding_groups_get_their_need_and_the_full_group_the_rest():
    per_block = [100, 300]  # one full layer, three sliding ones
    needs = [10_000, 113]
    blocks = split_paged_kv_budget(500_000, per_block, needs, first_is_full=True)
    assert blocks[1] == 113
    assert blocks[0] == (500_000 - 113 * 300) // 100
    assert split_paged_kv_budget(10**9, per_block, needs, True) == needs  # never more than needed


def test_a_short_budget_keeps_no_more_sliding_blocks_than_full_ones():
    # 50 full blocks cost 5,000 bytes; the sliding group then holds at most 51 (its null block)
    blocks = split_paged_kv_budget(20_300, [100, 300], [10_000, 113], first_is_full=True)
    assert blocks == [50, 51]
    assert 100 * blocks[0] + 300 * blocks[1] <= 20_300


def test_without_a_full_group_the_budget_is_shared_in_proportion():
    blocks = split_paged_kv_budget(30_000, [100, 300], [100, 200], first_is_full=False)
    assert blocks == [int(100 * 30_000 / 70_000), int(200 * 30_000 / 70_000)]


def test_one_group_takes_what_fits():
    assert split_paged_kv_budget(1000, [100], [50], True) == [10]
    assert split_paged_kv_budget(10**6, [100], [50], False) == [50]


def test_a_worker_without_a_group_does_not_limit_it():
    assert split_paged_kv_budget(10**6, [0, 300], [100, 20], True) == [100, 20]


def hybrid_config(**extra):
    values = dict(
        model_type="qwen2",
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=320,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=128,
        use_sliding_window=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"] * 1
        + ["sliding_attention"],
    )
    values.update(extra)
    return SimpleNamespace(**values)


def test_planner_counts_full_layers_per_token_and_sliding_ones_once():
    config = hybrid_config()
    assert [g.layers for g in kv_cache_groups(config)] == [(1,), (0, 2, 3)]
    size = model_size(config, "float32")
    stage = StagePlan(0, 0, 4, (WorkerPlacement(0, "cpu", 0, 0),), (1.0,), True, True)
    per_layer = size.kv_bytes_per_token_per_layer
    assert worker_kv_bytes_per_token(size, stage, 0) == per_layer  # one full layer
    budgets = MemoryBudgets((), 1 << 30, 100_000, 512, max_num_seqs=8)
    rows = 3 * (8 * (128 + 16) + 512)
    assert worker_sliding_kv_bytes(size, stage, 0, budgets) == rows * per_layer
    plain = model_size(hybrid_config(use_sliding_window=False), "float32")
    assert worker_kv_bytes_per_token(plain, stage, 0) == 4 * per_layer
    assert worker_sliding_kv_bytes(plain, stage, 0, budgets) == 0
