"""Model sizes against HF parameter counts, cost-model sanity, the cached hardware profile, discovery."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import transformers

from hybridllm.layers.cpu_kernels import load_cpu_kernels
from hybridllm.plan.cost_model import CPU_LAYER_OVERHEAD_S, CostModel
from hybridllm.plan.hardware_profile import (
    CpuRates,
    HardwareProfile,
    load_or_measure_profile,
    nominal_gpu_rates,
)
from hybridllm.plan.memory_budget import worker_shard, worker_weight_bytes
from hybridllm.plan.model_size import model_size
from hybridllm.plan.placement_args import PlacementArgs
from hybridllm.plan.plan import Plan
from hybridllm.plan.planner import build_plan
from hybridllm.platforms.discovery import (
    GpuInfo,
    HardwareInfo,
    NumaNode,
    discover_hardware,
    discover_numa_nodes,
    parse_cpulist,
)

GiB = 1 << 30
_TINY = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=100)
_LLAMA_TINY = dict(_TINY, intermediate_size=96, num_key_value_heads=2)
TINY_CONFIGS = [
    transformers.LlamaConfig(**_LLAMA_TINY, tie_word_embeddings=True),
    transformers.LlamaConfig(**_LLAMA_TINY, attention_bias=True, mlp_bias=True),
    transformers.Qwen2Config(**_LLAMA_TINY, tie_word_embeddings=False),
    transformers.Qwen3Config(**_LLAMA_TINY, head_dim=32),
    transformers.MistralConfig(**_LLAMA_TINY),
    transformers.OPTConfig(**_TINY, ffn_dim=96, max_position_embeddings=50, word_embed_proj_dim=32),
    transformers.OPTConfig(
        **_TINY, ffn_dim=96, max_position_embeddings=50, do_layer_norm_before=False
    ),
]
LLAMA3_8B = transformers.LlamaConfig(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
)  # fmt: skip
CPU = CpuRates(read_bandwidth=50e9, fp32_flops=1e12, bf16_flops=1e12, threads=32)


def hf_parameter_count(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # tied weights count once


@pytest.mark.parametrize("config", TINY_CONFIGS, ids=lambda c: c.model_type)
def test_model_size_matches_hf_parameter_count(config):
    size = model_size(config, "float32")
    assert size.total_bytes == 4 * hf_parameter_count(config)
    assert model_size(config, "bfloat16").total_bytes == 2 * hf_parameter_count(config)
    kv_heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert size.kv_bytes_per_token(3) == 3 * 2 * kv_heads * head_dim * 4


def test_a_tied_head_needs_its_own_copy_on_a_stage_without_the_embedding():
    size = model_size(TINY_CONFIGS[0], "float32")  # tied
    matrix = 100 * 64 * 4
    assert size.stage_bytes(0, 3, True, True) + matrix == size.stage_bytes(
        0, 2, True, False
    ) + size.stage_bytes(2, 3, False, True)
    untied = model_size(TINY_CONFIGS[2], "float32")
    assert untied.stage_bytes(0, 3, True, True) == untied.stage_bytes(
        0, 2, True, False
    ) + untied.stage_bytes(2, 3, False, True)
    with pytest.raises(ValueError, match="dtype must be one of"):
        model_size(TINY_CONFIGS[0], "int3")


def hardware(gpu_gib: float | None) -> HardwareInfo:
    gpus = (
        ()
        if gpu_gib is None
        else (GpuInfo(0, "H100", int(gpu_gib * GiB), int(gpu_gib * GiB), True),)
    )
    cpus = tuple(range(32))
    return HardwareInfo(gpus, "cpu", 32, 32, cpus, (NumaNode(0, cpus),), 256 * GiB, 256 * GiB)


def cost_model(hw: HardwareInfo) -> CostModel:
    return CostModel(HardwareProfile(CPU, tuple(nominal_gpu_rates(g.name) for g in hw.gpus)))


def test_more_gpu_layers_predict_faster_decode_and_prefill():
    hw = hardware(80)
    cost, size = cost_model(hw), model_size(LLAMA3_8B, "bfloat16")
    plans = [build_plan(LLAMA3_8B, PlacementArgs(gpu_layers=n), hw) for n in range(0, 33, 4)]
    for batch in (1, 8, 64):
        speeds = [cost.decode_tokens_per_s(p, size, batch) for p in plans]
        assert speeds == sorted(speeds) and len(set(speeds)) == len(speeds), (batch, speeds)
    prefill = [cost.prefill_tokens_per_s(p, size) for p in plans]
    assert prefill == sorted(prefill)
    # Batching amortizes the weight reads: more tokens/s at larger batches.
    prediction = cost.predict(plans[-1], size)
    decode = [tps for _, tps in prediction.decode_tokens_per_s]
    assert decode == sorted(decode)
    assert prediction.decode_latency_s == pytest.approx(1 / decode[0])


def test_batch_one_cpu_decode_is_bandwidth_bound_and_prefill_compute_bound():
    hw = hardware(None)
    cost, size = cost_model(hw), model_size(LLAMA3_8B, "float32")
    plan = build_plan(LLAMA3_8B, PlacementArgs(dtype="float32"), hw)
    ctx = cost.context_len
    read = size.total_bytes - size.embedding_bytes  # the embedding is gathered, not read
    read += 4096 * 4  # the one embedding row
    read += 32 * ctx * size.kv_bytes_per_token_per_layer  # the KV of the context, every layer
    read += 128256 * 4 * 3  # sampling passes over the fp32 logits
    expected = read / CPU.read_bandwidth + 33 * CPU_LAYER_OVERHEAD_S
    assert 1 / cost.decode_tokens_per_s(plan, size, 1) == pytest.approx(expected, rel=0.01)
    flops_per_token = 2 * 32 * size.matmul_params_per_layer
    assert cost.prefill_tokens_per_s(plan, size) == pytest.approx(
        CPU.fp32_flops / flops_per_token, rel=0.1
    )


def test_pipeline_batch_one_latency_is_the_sum_of_stages_and_the_hop():
    hw = hardware(80)
    cost, size = cost_model(hw), model_size(LLAMA3_8B, "bfloat16")
    plan = build_plan(LLAMA3_8B, PlacementArgs(gpu_layers=16), hw)
    ctx = cost.context_len
    stages = [cost.stage_time(s, size, 1, 1, ctx) for s in plan.stages]
    hop = cost.transfer_time(plan.stages[0], plan.stages[1], size, 1)
    assert 1 / cost.decode_tokens_per_s(plan, size, 1) == pytest.approx(sum(stages) + hop)
    # The CPU stage (first: --gpu-layers puts the GPU last) is the bottleneck and is
    # bandwidth-bound: pipelining cannot beat the sum.
    assert stages[0] > 10 * stages[1]


def test_speed_weighted_tensor_parallel_beats_equal_shards():
    hw = hardware(80)
    cost, size = cost_model(hw), model_size(LLAMA3_8B, "bfloat16")
    weighted = build_plan(LLAMA3_8B, PlacementArgs(tensor_parallel_size=2), hw, cost)
    equal = build_plan(LLAMA3_8B, PlacementArgs(tensor_parallel_size=2), hw, None)
    assert equal.stages[0].tp_weights == (1.0, 1.0) != weighted.stages[0].tp_weights
    assert cost.decode_tokens_per_s(weighted, size, 1) > 5 * cost.decode_tokens_per_s(
        equal, size, 1
    )


def test_nominal_rates_know_the_common_gpus():
    h100, h200, other = (nominal_gpu_rates(n) for n in ("NVIDIA H100 80GB HBM3", "H200", "Mystery"))
    assert h200.read_bandwidth > h100.read_bandwidth > other.read_bandwidth
    assert h100.nominal and h100.bf16_flops > 100 * CPU.bf16_flops / 1e3


def test_profile_is_measured_once_then_read_from_the_cache(tmp_path):
    hw = discover_hardware(include_gpus=False)
    fake = GpuInfo(0, "H200", 141 * GiB, 141 * GiB, simulated=True)
    hw = HardwareInfo((fake,), *[getattr(hw, f) for f in (
        "cpu_model", "physical_cores", "logical_cores", "cpu_affinity", "numa_nodes",
        "total_ram", "available_ram")])  # fmt: skip
    first = load_or_measure_profile(hw, cache_dir=str(tmp_path))
    assert first.cpu.read_bandwidth > 1e8 and first.cpu.fp32_flops > 1e8
    # the native op's Q4_1 block rate, where the op builds
    assert (first.cpu.block_read_bandwidth is None) == (not load_cpu_kernels())
    assert first.cpu.block_read_bandwidth is None or first.cpu.block_read_bandwidth > 1e8
    assert (first.cpu.block_gemm_flops is None) == (not load_cpu_kernels())
    assert first.cpu.block_gemm_flops is None or first.cpu.block_gemm_flops > 1e8
    assert first.gpus == (nominal_gpu_rates("H200"),)  # simulated GPUs are never measured
    (cache_file,) = tmp_path.iterdir()
    record = json.loads(cache_file.read_text())
    assert "torch" in record["key"] and record["profile"]["gpus"] == []
    record["profile"]["cpu"]["read_bandwidth"] = 123.0  # proves the second call reads the file
    cache_file.write_text(json.dumps(record))
    assert load_or_measure_profile(hw, cache_dir=str(tmp_path)).cpu.read_bandwidth == 123.0


def test_discovery_reads_this_machine():
    hw = discover_hardware(include_gpus=False)
    assert hw.logical_cores >= 1 and 1 <= hw.physical_cores <= hw.logical_cores
    assert set(hw.cpu_affinity) <= set(range(hw.logical_cores + 1024))
    assert 0 < hw.available_ram <= hw.total_ram
    assert hw.numa_nodes and all(hw.usable_cpus(n) for n in hw.numa_nodes)


def test_numa_nodes_from_sysfs_or_one_node(tmp_path):
    for node, cpus in (("node0", "0-3,8"), ("node1", "4-7"), ("node2", "")):
        os.makedirs(tmp_path / node)
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    nodes = discover_numa_nodes(str(tmp_path), (0, 1))
    assert nodes == (NumaNode(0, (0, 1, 2, 3, 8)), NumaNode(1, (4, 5, 6, 7)))  # node2: memory only
    assert discover_numa_nodes(str(tmp_path / "absent"), (0, 1)) == (NumaNode(0, (0, 1)),)
    assert parse_cpulist("0-2,5,7-8") == (0, 1, 2, 5, 7, 8)


def test_single_gpu_plan_fits_in_one_stage():
    plan = build_plan(LLAMA3_8B, PlacementArgs(), hardware(80), None)
    assert plan == Plan.single("cuda:0", 32)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (3.0, 1.0), (0.999, 0.001), (1.0, 1.0, 2.0)])
def test_tensor_parallel_shards_add_up_to_the_stage(weights):
    size = model_size(LLAMA3_8B, "bfloat16")
    stage = dataclasses.replace(
        Plan.uniform([["cpu"] * len(weights)], 32).stages[0], tp_weights=weights
    )
    shards = [worker_shard(size, stage, r) for r in range(len(weights))]
    assert sum(s.kv_heads for s in shards) == 8 and sum(s.q_heads for s in shards) == 32
    assert sum(s.intermediate for s in shards) == 14336 and sum(s.vocab for s in shards) == 128256
    assert all(s.kv_heads >= 1 for s in shards)  # whole KV groups, at least one per rank
    replicated = (len(weights) - 1) * (32 * size.layer_other_bytes + size.final_norm_bytes)
    total = sum(worker_weight_bytes(size, stage, r) for r in range(len(weights)))
    assert abs(total - replicated - size.total_bytes) <= len(weights) * 2
