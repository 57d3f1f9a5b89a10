"""The planner: plans fit their budgets, a model that fits stays on the GPU, flags are honoured."""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import transformers

from hybridllm.plan.cost_model import CostModel
from hybridllm.plan.hardware_profile import CpuRates, HardwareProfile, nominal_gpu_rates
from hybridllm.plan.memory_budget import (
    device_memory,
    fits,
    memory_budgets,
    stream_kv_tokens,
    stream_staging_bytes,
    worker_weight_bytes,
)
from hybridllm.plan.model_size import GGUFBlockSizes, model_size
from hybridllm.plan.placement_args import PlacementArgs, parse_memory_size
from hybridllm.plan.plan import Plan, partition
from hybridllm.plan.planner import build_plan, plan_model_size, resolve_plan_dtype
from hybridllm.platforms.discovery import GpuInfo, HardwareInfo, NumaNode

GiB = 1 << 30

MODELS = {
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
    ),
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
    ),
    "llama3-70b": dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
    ),
}  # fmt: skip


def config(name: str) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**MODELS[name])


def machine(gpu_gib: tuple[float, ...] = (), ram_gib: float = 256, numa_nodes: int = 2):
    cpus = tuple(range(32))
    per_node = len(cpus) // numa_nodes
    nodes = tuple(NumaNode(i, cpus[i * per_node : (i + 1) * per_node]) for i in range(numa_nodes))
    gpus = tuple(
        GpuInfo(i, "H100", int(g * GiB), int(g * GiB), simulated=True)
        for i, g in enumerate(gpu_gib)
    )
    ram = int(ram_gib * GiB)
    return HardwareInfo(gpus, "test cpu", 32, 32, cpus, nodes, ram, ram)


def cost_model(hw: HardwareInfo) -> CostModel:
    cpu = CpuRates(read_bandwidth=50e9, fp32_flops=1e12, bf16_flops=1e12, threads=32)
    return CostModel(HardwareProfile(cpu, tuple(nominal_gpu_rates(g.name) for g in hw.gpus)))


def plan_for(name: str, hw: HardwareInfo, use_cost: bool = True, **kwargs) -> Plan:
    return build_plan(
        config(name), PlacementArgs(**kwargs), hw, cost_model(hw) if use_cost else None
    )


def assert_fits(plan: Plan, name: str, hw: HardwareInfo, **kwargs) -> None:
    args = PlacementArgs(**kwargs)
    size = model_size(config(name), resolve_plan_dtype(args, hw))
    budgets = memory_budgets(hw, args)
    for mem in device_memory(plan.stages, size, budgets):
        assert mem.need(args.kv_reserve_tokens) <= mem.budget, mem


def devices(plan: Plan) -> list[list[str]]:
    return [[w.device for w in s.workers] for s in plan.stages]


@pytest.mark.parametrize(
    "name, gpu_gib",
    [("smollm2-135m", 8), ("llama3-8b", 24), ("llama3-8b", 80), ("llama3-70b", 160)],
)
def test_everything_on_the_gpu_when_it_fits(name, gpu_gib):
    hw = machine((gpu_gib,))
    for device in ("auto", "heterogeneous"):
        plan = plan_for(name, hw, device=device)
        assert devices(plan) == [["cuda:0"]]
        assert plan.stages[0].has_embedding and plan.stages[0].has_lm_head
        assert_fits(plan, name, hw)


@pytest.mark.parametrize(
    "name, gpu_gib", [("llama3-8b", 8), ("llama3-8b", 12), ("llama3-70b", 80), ("llama3-70b", 24)]
)
def test_a_model_too_big_fills_the_gpu_and_puts_the_rest_on_the_cpu(name, gpu_gib):
    hw = machine((gpu_gib,), ram_gib=512)
    plan = plan_for(name, hw)
    assert_fits(plan, name, hw)
    # CPU first, GPU last: the LM head (read in full every step) is cheaper on the GPU.
    assert devices(plan) == [["cpu"], ["cuda:0"]]
    gpu_layers = plan.stages[1].num_layers
    # About the layers the budget holds after the head, KV reserve and activations.
    size = model_size(config(name), "bfloat16")
    free = 0.9 * gpu_gib * GiB - size.lm_head_bytes - size.activation_bytes(2048)
    free -= stream_staging_bytes(
        size, stream_kv_tokens(2048), size.layer_bytes
    )  # the CPU stage streams here
    expected = free // (size.layer_bytes + 4096 * size.kv_bytes_per_token_per_layer)
    assert abs(gpu_layers - expected) <= 1, (gpu_layers, expected)
    # ... and no more: one more GPU layer would overflow the budget.
    bigger = Plan.uniform([["cpu"], ["cuda:0"]], plan.num_layers, [
        plan.stages[0].num_layers - 1, gpu_layers + 1])  # fmt: skip
    cpu = plan.stages[0]
    streaming = dict(
        stream_device=cpu.stream_device,
        stream_threshold=cpu.stream_threshold,
        stream_kv_tokens=cpu.stream_kv_tokens,
    )
    stages = (dataclasses.replace(bigger.stages[0], **streaming), bigger.stages[1])
    assert cpu.stream_device == "cuda:0"
    assert not fits(stages, size, memory_budgets(hw, PlacementArgs()))


def test_the_chosen_stage_order_is_the_faster_one():
    hw = machine((8,))
    cost = cost_model(hw)
    size = model_size(config("llama3-8b"), "bfloat16")
    auto = plan_for("llama3-8b", hw)
    # The other order, with as many GPU layers as that order's budget allows.
    gpu_first = next(
        plan
        for n in range(31, 0, -1)
        if fits(
            (plan := Plan.uniform([["cuda:0"], ["cpu"]], 32, [n, 32 - n])).stages,
            size,
            memory_budgets(hw, PlacementArgs()),
        )
    )
    assert cost.decode_tokens_per_s(auto, size, 1) > cost.decode_tokens_per_s(gpu_first, size, 1)
    # Without a cost model the head goes on the GPU too.
    assert devices(plan_for("llama3-8b", hw, use_cost=False)) == [["cpu"], ["cuda:0"]]


def test_a_max_gpu_memory_cap_moves_layers_to_the_cpu():
    hw = machine((80,))
    capped = [
        plan_for("llama3-8b", hw, max_gpu_memory=cap * GiB).stages[-1].num_layers
        for cap in (6, 8, 10, 12)
    ]
    assert capped == sorted(capped) and capped[0] < capped[-1] < 32


def test_the_kv_reserve_counts_against_the_gpu_budget():
    hw = machine(
        (18,)
    )  # 16.2 GiB budget: 15.3 GiB of weights + activations fit, 32k tokens of KV (4 GiB) do not
    assert devices(plan_for("llama3-8b", hw, kv_reserve_tokens=16)) == [["cuda:0"]]
    assert len(plan_for("llama3-8b", hw, kv_reserve_tokens=32768).stages) == 2


@pytest.mark.parametrize("n, expect", [(0, [["cpu"]]), (10, [["cpu"], ["cuda:0"]]),
                                       (32, [["cuda:0"]]), (99, [["cuda:0"]])])  # fmt: skip
def test_gpu_layers_is_honoured(n, expect):
    hw = machine((80,))
    plan = plan_for("llama3-8b", hw, gpu_layers=n)
    assert devices(plan) == expect
    if len(expect) == 2:
        assert (plan.stages[1].layer_start, plan.stages[1].layer_end) == (32 - n, 32)
        assert plan.stages[1].has_lm_head


def test_too_many_gpu_layers_names_the_budget_and_the_need():
    with pytest.raises(
        ValueError, match=r"cuda:0 needs .* budget is 7.20 GiB.*short by.*gpu-layers"
    ):
        plan_for("llama3-8b", machine((8,)), gpu_layers=30)


def test_layer_split_is_honoured_with_ranks_beyond_the_gpus_on_the_cpu():
    plan = plan_for("llama3-8b", machine((80,)), device="heterogeneous", layer_split=(10, 22))
    assert devices(plan) == [["cuda:0"], ["cpu"]]
    assert [s.num_layers for s in plan.stages] == [10, 22]
    plan = plan_for("llama3-8b", machine(), device="cpu", layer_split=(5, 7, 20))
    assert devices(plan) == [["cpu"]] * 3 and [s.num_layers for s in plan.stages] == [5, 7, 20]
    with pytest.raises(ValueError, match="summing to 32"):
        plan_for("llama3-8b", machine(), device="cpu", layer_split=(5, 7))


def test_cpu_workers_share_numa_nodes_round_robin_with_a_warning(caplog):
    hw = machine(numa_nodes=2)
    with caplog.at_level(logging.WARNING):
        plan = plan_for("smollm2-135m", hw, device="cpu", tensor_parallel_size=2,
                        pipeline_parallel_size=2)  # fmt: skip
    assert plan.world_size == 4 and devices(plan) == [["cpu", "cpu"]] * 2
    assert [w.numa_node for w in plan.workers()] == [0, 1, 0, 1]
    assert [w.num_threads for w in plan.workers()] == [8] * 4  # 16 cores a node, 2 workers each
    assert "share 2 NUMA node(s)" in caplog.text
    caplog.clear()
    one = plan_for("smollm2-135m", hw, device="cpu", cpu_threads=3)
    assert (one.workers()[0].numa_node, one.workers()[0].num_threads) == (0, 3)
    assert "NUMA" not in caplog.text


def test_mixed_tensor_parallel_shards_follow_device_speed():
    hw = machine((80,))
    plan = plan_for("llama3-8b", hw, tensor_parallel_size=2)
    assert devices(plan) == [["cuda:0", "cpu"]]
    gpu, cpu = plan.stages[0].tp_share(0), plan.stages[0].tp_share(1)
    gpu_bw = nominal_gpu_rates("H100").read_bandwidth
    assert gpu / cpu == pytest.approx(gpu_bw / 50e9, rel=1e-3)
    assert plan_for("llama3-8b", hw, use_cost=False, tensor_parallel_size=2).stages[
        0
    ].tp_weights == (1.0, 1.0)
    # A small GPU takes only what fits; the CPU rank takes the rest.
    small = machine((6,))
    plan = plan_for("llama3-8b", small, tensor_parallel_size=2)
    assert plan.stages[0].tp_share(0) < gpu / (gpu + cpu)
    assert_fits(plan, "llama3-8b", small)


def test_two_gpus_tensor_parallel_stays_equal():
    plan = plan_for("llama3-8b", machine((80, 80)), device="cuda", tensor_parallel_size=2)
    assert devices(plan) == [["cuda:0", "cuda:1"]] and plan.stages[0].tp_weights == (1.0, 1.0)


def test_heterogeneous_pipeline_gives_the_gpu_stage_what_its_budget_holds():
    hw = machine((8,))
    plan = plan_for("llama3-8b", hw, device="heterogeneous", pipeline_parallel_size=3)
    assert devices(plan) == [["cuda:0"], ["cpu"], ["cpu"]]
    assert_fits(plan, "llama3-8b", hw, device="heterogeneous", pipeline_parallel_size=3)
    assert 10 <= plan.stages[0].num_layers <= 16  # fills the 7.2 GiB budget
    assert abs(plan.stages[1].num_layers - plan.stages[2].num_layers) <= 1


def test_cuda_errors_name_the_counts_and_budgets():
    with pytest.raises(ValueError, match=r"2 ranks, but only 1 GPU"):
        plan_for("smollm2-135m", machine((80,)), device="cuda", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        plan_for("smollm2-135m", machine(), device="cuda")
    with pytest.raises(ValueError, match=r"cuda:0 needs 1[45]\.\d+ GiB .* budget is 7.20 GiB"):
        plan_for("llama3-8b", machine((8,)), device="cuda")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        plan_for("smollm2-135m", machine(), gpu_layers=3)


def test_a_model_that_fits_nowhere_names_the_cpu_shortfall():
    with pytest.raises(
        ValueError, match=r"cpu needs .* budget is 57.60 GiB .*short by .*GPU budget holds"
    ):
        plan_for("llama3-70b", machine((24,), ram_gib=64))


def test_without_a_gpu_auto_runs_on_the_cpu_in_fp32(caplog):
    hw = machine()
    plan = plan_for("smollm2-135m", hw)
    assert devices(plan) == [["cpu"]]
    assert resolve_plan_dtype(PlacementArgs(), hw) == "float32"
    assert resolve_plan_dtype(PlacementArgs(), machine((8,))) == "bfloat16"
    with caplog.at_level(logging.WARNING):
        plan = plan_for("smollm2-135m", hw, device="heterogeneous", tensor_parallel_size=3)
    assert devices(plan) == [["cpu"] * 3] and "no CUDA GPU" in caplog.text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(device="tpu"), "device must be one of"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
        (dict(gpu_layers=-1), "gpu_layers must be >= 0"),
        (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
        (dict(layer_split=(4, 0)), "positive layer count"),
        (dict(layer_split=(4, 4), pipeline_parallel_size=3), "layer_split has 2 stages"),
        (dict(layer_split=(4, 4), gpu_layers=2), "not both"),
        (dict(device="cpu", gpu_layers=2), "asks for a GPU"),
        (dict(max_gpu_memory=0), "max_gpu_memory must be >= 1"),
    ],
)
def test_placement_args_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PlacementArgs(**kwargs)


def test_parse_memory_size():
    assert parse_memory_size("8GiB") == 8 * GiB
    assert parse_memory_size("1.5 GB") == 1_500_000_000
    assert parse_memory_size("512") == 512
    with pytest.raises(ValueError, match="cannot read memory size"):
        parse_memory_size("8 parsecs")


def test_partition_properties():
    rng = random.Random(0)
    for _ in range(300):
        align = rng.choice([1, 2, 8, 64])
        n = rng.randint(1, 6)
        total = align * rng.randint(n, 200)
        weights = tuple(rng.uniform(0.05, 10) for _ in range(n))
        ranges = partition(total, weights, align)
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous
        for (start, end), w in zip(ranges, weights):
            assert start % align == 0 and end - start >= align
            # within one alignment unit of the exact share, unless lifted to the minimum
            if end - start > align:
                assert abs((end - start) - total * w / sum(weights)) <= align
    assert partition(12, (1.0, 1.0, 1.0)) == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="cannot split 2 units"):
        partition(2, (1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="not a multiple"):
        partition(10, (1.0,), align=4)
    with pytest.raises(ValueError, match="positive"):
        partition(10, (1.0, 0.0))


def test_a_gpu_too_small_for_one_layer_leaves_everything_on_the_cpu(caplog):
    hw = machine((1,), ram_gib=512)  # 0.9 GiB cannot hold the 1 GiB LM head and a layer
    with caplog.at_level(logging.WARNING):
        plan = plan_for("llama3-8b", hw)
    assert devices(plan) == [["cpu"]] and "running on the CPU only" in caplog.text


def q4_1_blocks(name: str) -> GGUFBlockSizes:
    """Every layer matmul and the head as Q4_1 blocks (20 bytes per 32 weights)."""
    size = model_size(config(name), "float32")
    params = size.matmul_params_per_layer * size.num_layers
    head = size.vocab_size * size.hidden_size * 20 // 32
    return GGUFBlockSizes(params, params * 20 // 32, params, head)


def test_gguf_blocks_shrink_cpu_workers_only():
    hw = machine((24,), ram_gib=64)
    blocks = q4_1_blocks("llama3-70b")
    # 70B at bf16 does not fit a 24 GiB GPU + 64 GiB of RAM; as 4-bit blocks on the CPU it does
    plan = build_plan(config("llama3-70b"), PlacementArgs(), hw, cost_model(hw), blocks)
    assert devices(plan) == [["cuda:0"], ["cpu"]] or devices(plan) == [["cpu"], ["cuda:0"]]
    size = model_size(config("llama3-70b"), "bfloat16", blocks)
    plain = model_size(config("llama3-70b"), "bfloat16")
    for stage in plan.stages:
        ours, bf16 = (worker_weight_bytes(s, stage, 0) for s in (size, plain))
        if stage.workers[0].is_cpu:
            assert ours < 0.35 * bf16  # 0.625 of 2 bytes per weight, plus norms
        else:
            assert ours == bf16
    # the ranks of a tensor-parallel CPU stage keep their slices of the blocks
    tp_plan = plan_for("smollm2-135m", machine(), device="cpu", tensor_parallel_size=2)
    small, small_plain = (
        model_size(config("smollm2-135m"), "float32", b)
        for b in (q4_1_blocks("smollm2-135m"), None)
    )
    stage = tp_plan.stages[0]
    shards = [worker_weight_bytes(small, stage, rank) for rank in (0, 1)]
    for rank, ours in enumerate(shards):
        assert ours < 0.35 * worker_weight_bytes(small_plain, stage, rank)
    whole = plan_for("smollm2-135m", machine(), device="cpu").stages[0]
    assert sum(shards) == pytest.approx(worker_weight_bytes(small, whole, 0), rel=0.01)


def test_gguf_blocks_make_the_cpu_stage_faster_in_the_cost_model():
    hw = machine()
    plan = plan_for("llama3-8b", hw, device="cpu")
    cost = cost_model(hw)
    blocks = q4_1_blocks("llama3-8b")
    plain = cost.decode_tokens_per_s(plan, model_size(config("llama3-8b"), "float32"), 1)
    ours = cost.decode_tokens_per_s(plan, model_size(config("llama3-8b"), "float32", blocks), 1)
    assert ours > 4 * plain  # bandwidth-bound batch 1: ~6x fewer bytes per token


def llama3_8b_on_cpu_costs(rate_field: str, rates: tuple):
    """Llama-3-8B on one CPU worker: (plan, sizes as Q4_1 blocks, fp32 sizes, {rate: cost
    model whose CPU profile has `rate_field` = rate})."""
    plan = plan_for("llama3-8b", machine(), device="cpu")
    blocks = model_size(config("llama3-8b"), "float32", q4_1_blocks("llama3-8b"))
    plain = model_size(config("llama3-8b"), "float32")
    cpu = CpuRates(read_bandwidth=50e9, fp32_flops=1e12, bf16_flops=1e12, threads=32)
    cost = {
        rate: CostModel(HardwareProfile(dataclasses.replace(cpu, **{rate_field: rate})))
        for rate in rates
    }
    return plan, blocks, plain, cost


def test_cpu_blocks_are_read_at_the_measured_block_rate():
    # where decoding the blocks is slower than the memory, the blocks set the pace; floats
    # (and any GPU) keep the memory's
    plan, blocks, plain, cost = llama3_8b_on_cpu_costs("block_read_bandwidth", (None, 50e9, 25e9))
    step = {rate: 1 / c.decode_tokens_per_s(plan, blocks, 1) for rate, c in cost.items()}
    assert step[None] == step[50e9]  # not measured: the memory's rate
    stage = plan.stages[0]
    # every weight byte but the embedding table's (a step gathers a few rows of it)
    weights = worker_weight_bytes(blocks, stage, 0) - blocks.for_worker(stage, 0).embedding_bytes
    assert step[25e9] - step[50e9] == pytest.approx(weights / 25e9 - weights / 50e9, rel=0.01)
    same = {c.decode_tokens_per_s(plan, plain, 1) for c in cost.values()}
    assert len(same) == 1


def test_cpu_blocks_are_multiplied_at_the_measured_block_gemm_rate():
    # prefill is compute-bound: from blocks at the op's GEMM rate (the int8 GEMM), floats at
    # the float GEMM's; unmeasured, the float rate
    plan, blocks, plain, cost = llama3_8b_on_cpu_costs("block_gemm_flops", (None, 1e12, 3e12))
    prefill = {rate: c.prefill_tokens_per_s(plan, blocks) for rate, c in cost.items()}
    assert prefill[None] == prefill[1e12]
    assert prefill[3e12] > 2 * prefill[1e12]
    assert len({c.prefill_tokens_per_s(plan, plain) for c in cost.values()}) == 1


def test_cpu_kv_caches_are_sized_in_the_dtype_they_store():
    # a GGUF model on CPU workers beside int8 activations stores a float16 cache ("auto"):
    # half the KV bytes a token (and twice the capacity) of an fp32 one; GPU workers of a
    # heterogeneous plan keep their compute dtype's
    blocks = GGUFBlockSizes(kept_params=1, kept_bytes=1, total_params=1, lm_head_bytes=None)
    hw = machine((), ram_gib=64)

    def cpu_memory(**kwargs):
        args = PlacementArgs(device="cpu", **kwargs)
        plan = build_plan(config("llama3-8b"), args, hw, None, blocks)
        size = plan_model_size(config("llama3-8b"), args, hw, blocks)
        (mem,) = device_memory(plan.stages, size, memory_budgets(hw, args))
        return mem

    fp32 = cpu_memory()
    fp16 = cpu_memory(int8_blocks=True)
    assert fp32.kv_bytes_per_token == 32 * 2 * 8 * 128 * 4  # layers x K,V x kv heads x dim
    assert fp16.kv_bytes_per_token * 2 == fp32.kv_bytes_per_token
    assert cpu_memory(int8_blocks=True, kv_cache_dtype="float32") == fp32
    assert cpu_memory(kv_cache_dtype="bfloat16").kv_bytes_per_token == fp16.kv_bytes_per_token
    # without blocks (dense weights) auto stays the compute dtype, int8 or not
    args = PlacementArgs(device="cpu", int8_blocks=True)
    dense = plan_model_size(config("llama3-8b"), args, hw, None)
    assert dense.cpu_view().kv_bytes_per_token_per_layer == fp32.kv_bytes_per_token // 32
    # a GPU worker's view keeps bf16 whatever the CPU workers store
    gpu_args = PlacementArgs(int8_blocks=True, kv_cache_dtype="float16")
    size = plan_model_size(config("llama3-8b"), gpu_args, machine((80,)), blocks)
    assert size.kv_bytes_per_token_per_layer == 2 * 8 * 128 * 2
