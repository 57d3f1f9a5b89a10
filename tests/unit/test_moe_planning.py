"""Mixtures of experts in the planner: sizes, the experts a step reads, --cpu-moe / --n-cpu-moe, the automatic split."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from hybridllm.plan.memory_budget import device_memory, fits, memory_budgets, worker_weight_bytes
from hybridllm.plan.model_size import model_size
from hybridllm.plan.moe_size import moe_size
from hybridllm.plan.placement_args import PlacementArgs
from hybridllm.plan.plan import Plan
from hybridllm.plan.planner import build_plan
from tests.moe_helpers import MOE_ARCHITECTURES, tiny_moe_config
from tests.unit.test_planner import config, cost_model, machine

GiB = 1 << 30
# Qwen3-30B-A3B's shape: 48 layers of 128 experts (top-8, 768 wide): 57 GiB in bf16
QWEN3_30B = transformers.Qwen3MoeConfig(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, vocab_size=151936,
)  # fmt: skip


def tiny_configs() -> list[transformers.PretrainedConfig]:
    configs = [tiny_moe_config(arch) for arch in MOE_ARCHITECTURES]
    # Qwen-MoE's dense layers from decoder_sparse_step too (layers 0 and 2 dense)
    configs += [tiny_moe_config(a, decoder_sparse_step=2) for a in ("qwen2_moe", "qwen3_moe")]
    return configs


@pytest.mark.parametrize("config", tiny_configs(), ids=lambda c: c.model_type)
def test_moe_model_size_matches_hf_parameter_count(config):
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in hf.parameters())
    assert model_size(config, "float32").total_bytes == 4 * params
    assert model_size(config, "bfloat16").total_bytes == 2 * params


def test_expert_bytes_per_layer_and_dense_layers():
    qwen2 = tiny_moe_config("qwen2_moe")  # mlp_only_layers=[1], 7 experts of 40, shared 56
    size = model_size(qwen2, "float32")
    moe = size.moe
    assert moe.sparse_layers == frozenset({0, 2})
    assert size.routed_expert_bytes(0) == 4 * 7 * 3 * 96 * 40
    assert size.routed_expert_bytes(1) == 0  # dense
    # router [7, 96], shared expert 3 x [56, 96] and its gate [1, 96] stay with the layer
    assert moe.sparse_fixed_params == 96 * 7 + 3 * 96 * 56 + 96
    assert size.layer_weight_bytes(0) - size.layer_weight_bytes(0, routed=False) == (
        size.routed_expert_bytes(0)
    )
    assert (
        moe_size(config("llama3-8b")) is None
        and model_size(config("llama3-8b"), "float32").moe is None
    )


@pytest.mark.parametrize("e, k", [(8, 2), (128, 8), (5, 5)])
def test_a_step_reads_the_expected_distinct_experts(e, k):
    moe = dataclasses.replace(moe_size(QWEN3_30B), num_experts=e, top_k=k)
    assert moe.active_experts(0) == 0
    assert moe.active_experts(1) == pytest.approx(k)  # one token: its top-k
    for b in (2, 7, 64):
        assert moe.active_experts(b) == pytest.approx(e * (1 - (1 - k / e) ** b))
        assert moe.active_experts(b - 1) <= moe.active_experts(b) <= e
    assert moe.active_experts(10_000) == pytest.approx(e)


def test_step_weight_bytes_count_only_the_selected_experts():
    size = model_size(QWEN3_30B, "bfloat16")
    fixed = size.layer_weight_bytes(0, routed=False)
    experts = size.routed_expert_bytes(0)
    assert size.step_weight_bytes(0, 1) == pytest.approx(fixed + experts * 8 / 128)
    assert size.step_weight_bytes(0, 64) == pytest.approx(
        fixed + experts * (1 - (1 - 8 / 128) ** 64)
    )
    # one token multiplies by top-8 experts, not 128
    moe = size.moe
    assert size.active_matmul_params(0) == (
        size.layer_matmul_params(0, routed=False) + 8 * moe.expert_params
    )


def plan_moe(hw, **kwargs) -> Plan:
    return build_plan(QWEN3_30B, PlacementArgs(**kwargs), hw, cost_model(hw))


def usage(plan: Plan, hw, **kwargs) -> dict[str, int]:
    args = PlacementArgs(**kwargs)
    size = model_size(QWEN3_30B, "bfloat16")
    return {
        m.device: m.weight_bytes for m in device_memory(plan.stages, size, memory_budgets(hw, args))
    }


def test_cpu_moe_keeps_every_layer_on_the_gpu_and_every_routed_expert_on_the_cpu():
    hw = machine((80,))
    plan = plan_moe(hw, cpu_moe=True)
    (stage,) = plan.stages
    assert stage.workers[0].device == "cuda:0" and stage.cpu_expert_layers == 48
    size = model_size(QWEN3_30B, "bfloat16")
    weights = usage(plan, hw)
    routed = sum(size.routed_expert_bytes(i) for i in range(48))
    assert weights["cpu"] == routed
    assert weights["cuda:0"] == size.total_bytes - routed
    assert weights["cuda:0"] == worker_weight_bytes(size, stage, 0) < 4 * GiB


def test_n_cpu_moe_puts_the_first_n_layers_experts_on_the_cpu():
    hw = machine((80,))
    plan = plan_moe(hw, n_cpu_moe=10)
    assert [(s.layer_start, s.cpu_expert_layers) for s in plan.stages] == [(0, 10)]
    assert plan.stages[0].experts_on_cpu(9) and not plan.stages[0].experts_on_cpu(10)
    size = model_size(QWEN3_30B, "bfloat16")
    assert usage(plan, hw)["cpu"] == 10 * size.routed_expert_bytes(0)
    # with a layer split, the prefix counts model layers across the GPU stages
    hw2 = machine((80, 80))
    plan = plan_moe(hw2, n_cpu_moe=30, device="cuda", layer_split=(20, 28))
    assert [s.cpu_expert_layers for s in plan.stages] == [20, 10]


def test_cost_model_ranks_more_experts_on_the_gpu_faster():
    hw = machine((80,))
    cost, size = cost_model(hw), model_size(QWEN3_30B, "bfloat16")
    speeds = [
        cost.decode_tokens_per_s(plan_moe(hw, **kw), size, 1)
        for kw in ({}, {"n_cpu_moe": 10}, {"cpu_moe": True})
    ]
    assert speeds[0] > speeds[1] > speeds[2]
    # all experts on a 50 GB/s host: batch 1 reads top-8 experts of every layer there
    per_token = 48 * 8 * size.routed_expert_bytes(0) / 128
    assert 1 / speeds[2] == pytest.approx(per_token / 50e9, rel=0.3)


def test_a_model_too_big_moves_routed_experts_before_layers():
    hw = machine((24,))
    plan = plan_moe(hw)
    (stage,) = plan.stages  # one GPU stage: layers stay, experts move
    assert stage.workers[0].device == "cuda:0"
    n = stage.cpu_expert_layers
    assert 0 < n < 48
    size, args = model_size(QWEN3_30B, "bfloat16"), PlacementArgs()
    budgets = memory_budgets(hw, args)
    assert fits(plan.stages, size, budgets)
    fewer = dataclasses.replace(stage, cpu_expert_layers=n - 1)
    assert not fits((fewer,), size, budgets)  # as few as needed
    # a GPU too small for even the non-expert weights: layers move, with no experts on the GPU
    hw = machine((2,))
    plan = plan_moe(hw)
    devices = [s.workers[0].device for s in plan.stages]
    assert sorted(devices) == ["cpu", "cuda:0"]
    gpu = next(s for s in plan.stages if s.workers[0].device == "cuda:0")
    assert gpu.cpu_expert_layers == gpu.num_layers
    assert fits(plan.stages, size, memory_budgets(hw, args))


def test_without_a_gpu_the_flags_mark_the_cpu_stages():
    hw = machine(())
    plan = build_plan(
        tiny_moe_config("mixtral"), PlacementArgs(n_cpu_moe=2, layer_split=(1, 2)), hw
    )
    assert [s.cpu_expert_layers for s in plan.stages] == [1, 1]
    assert all(s.workers[0].is_cpu and s.stream_device is None for s in plan.stages)


def test_bad_moe_placements_are_refused():
    hw = machine((80,))
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        build_plan(config("llama3-8b"), PlacementArgs(cpu_moe=True), hw)
    with pytest.raises(ValueError, match="n_cpu_moe must be >= 0"):
        PlacementArgs(n_cpu_moe=-1)
    with pytest.raises(ValueError, match="not both"):
        PlacementArgs(cpu_moe=True, n_cpu_moe=3)
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        plan_moe(machine((80, 80)), cpu_moe=True, tensor_parallel_size=2)
    stage = plan_moe(hw, cpu_moe=True).stages[0]
    with pytest.raises(ValueError, match="experts of 49 layers"):
        Plan((dataclasses.replace(stage, cpu_expert_layers=49),), 48)
