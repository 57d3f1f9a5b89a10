"""Text rendering of a plan: workers per stage, memory and KV capacity per device, predicted speed."""

from __future__ import annotations

from hybridllm.plan.cost_model import PlanPrediction
from hybridllm.plan.hardware_profile import HardwareProfile
from hybridllm.plan.memory_budget import (
    DeviceMemory,
    MemoryBudgets,
    device_memory,
    format_bytes,
    host_expert_bytes,
    host_resident,
    mtp_memory,
    stream_sent_layer_bytes,
    worker_shard,
    worker_weight_bytes,
)
from hybridllm.plan.model_size import ModelSize
from hybridllm.plan.plan import Plan, StagePlan
from hybridllm.platforms.discovery import HardwareInfo


def describe_hardware(hw: HardwareInfo, profile: HardwareProfile | None = None) -> str:
    lines = []
    for gpu in hw.gpus:
        note = " (simulated)" if gpu.simulated else f", {format_bytes(gpu.free_memory)} free"
        line = f"  {gpu.device}: {gpu.name}, {format_bytes(gpu.total_memory)}{note}"
        if profile is not None and gpu.index < len(profile.gpus):
            rates = profile.gpus[gpu.index]
            kind = "nominal" if rates.nominal else "measured"
            line += (
                f"; {kind}: {rates.read_bandwidth / 1e9:.0f} GB/s, "
                f"{rates.bf16_flops / 1e12:.0f} bf16 TFLOP/s, "
                f"host->device {rates.h2d_bandwidth / 1e9:.1f} GB/s"
            )
        lines.append(line)
    if not hw.gpus:
        lines.append("  no CUDA GPU")
    line = (
        f"  cpu: {hw.cpu_model}, {hw.physical_cores} cores / {hw.logical_cores} threads, "
        f"{len(hw.numa_nodes)} NUMA node(s), {format_bytes(hw.available_ram)} of "
        f"{format_bytes(hw.total_ram)} RAM available"
    )
    if profile is not None:
        cpu = profile.cpu
        line += (
            f"; measured: {cpu.read_bandwidth / 1e9:.1f} GB/s, "
            f"{cpu.fp32_flops / 1e9:.0f} fp32 / {cpu.bf16_flops / 1e9:.0f} bf16 GFLOP/s"
        )
        if cpu.block_read_bandwidth is not None:
            line += f", Q4_1 blocks at {cpu.block_read_bandwidth / 1e9:.1f} GB/s"
        if cpu.block_gemm_flops is not None:
            line += f" and {cpu.block_gemm_flops / 1e9:.0f} GFLOP/s"
    lines.append(line)
    return "hardware:\n" + "\n".join(lines)


def describe_plan(
    plan: Plan,
    size: ModelSize,
    budgets: MemoryBudgets,
    prediction: PlanPrediction | None = None,
    title: str = "",
    node_names: dict[str, str] | None = None,
    host_kv_bytes: int | None = None,
) -> str:
    """Stages and workers, then memory per device, then predicted tokens/s (when given).

    `node_names`: cluster node id -> how to show it, for a plan whose stages have nodes;
    `host_kv_bytes`: the CPU workers' KV cache bytes, to predict their resident memory."""
    lines = [
        f"plan{' for ' + title if title else ''}: {size.model_type}, {size.num_layers} layers, "
        f"{size.dtype}, {format_bytes(size.total_bytes)} of weights; tensor parallel "
        f"{plan.tensor_parallel_size} x pipeline parallel {plan.pipeline_parallel_size}"
    ]
    for stage in plan.stages:
        header = _stage_header(stage)
        if stage.node is not None:
            header += f"  [on node {(node_names or {}).get(stage.node, stage.node)}]"
        lines.append(header)
        for tp_rank, worker in enumerate(stage.workers):
            where = worker.device
            if worker.is_cpu and worker.numa_node is not None:
                where += f" (NUMA node {worker.numa_node}, {worker.num_threads} threads)"
            lines.append(
                f"    rank {worker.rank}: {where:<34} {_shard_text(size, stage, tp_rank)}"
                f"  weights {format_bytes(worker_weight_bytes(size, stage, tp_rank))}"
            )
        if stage.cpu_expert_layers:
            lines.append(_cpu_experts_text(stage, size))
        if stage.has_lm_head and size.mtp_layers:
            lines.append(_mtp_text(stage, size))
        if stage.stream_device is not None:
            lines.append(_streaming_text(stage, size, prediction))
    if size.moe is not None:
        lines.append(_experts_per_device(plan, size))
    lines.append("memory per device:")
    lines.append(
        f"  {'device':<8} {'budget':>12} {'weights':>12} {'activations':>12} "
        f"{'KV/token':>10} {'KV capacity':>16}"
    )
    usage = device_memory(plan.stages, size, budgets)
    for mem in usage:
        lines.append(
            f"  {mem.device:<8} {format_bytes(mem.budget):>12} {format_bytes(mem.weight_bytes):>12} "
            f"{format_bytes(mem.activation_bytes):>12} {format_bytes(mem.kv_bytes_per_token):>10} "
            + (f"{mem.kv_capacity_tokens:>9,} tokens" if mem.kv_bytes_per_token else f"{'-':>16}")
        )
    # a host holding only routed experts or streaming copies keeps no KV of its own
    capacity = min((m.kv_capacity_tokens for m in usage if m.kv_bytes_per_token), default=0)
    if size.layer_windows:
        lines.append(_sliding_text(size, usage, budgets))
    if size.linear_layers:
        lines.append(_linear_text(size, usage, budgets))
    lines.append(
        f"  KV cache: {capacity:,} tokens (the smallest device decides; "
        f"{budgets.kv_reserve_tokens:,} reserved), "
        + _kv_row_text(size.cpu_view() if all(w.is_cpu for w in plan.workers()) else size)
    )
    if budgets.host_reserved_bytes:
        lines.append(
            f"  host: {format_bytes(budgets.host_reserved_bytes)} for "
            f"{budgets.host_reserved_note}, outside the budget above"
        )
    if host_kv_bytes is not None:
        cpu_workers = sum(w.is_cpu for stage in plan.stages for w in stage.workers)
        resident = host_resident(usage, cpu_workers, host_kv_bytes)
        if resident is not None:
            lines.append(
                f"  resident memory of the CPU workers' processes: {format_bytes(resident.loaded)}"
                f" once loaded (weights + {format_bytes(resident.process_bytes)} for Python, "
                f"torch and the engine), at most {format_bytes(resident.serving)} serving (+ "
                f"{format_bytes(resident.kv_cache_bytes)} KV cache as it fills, + "
                f"{format_bytes(resident.activation_bytes)} activations)"
            )
    if prediction is not None:
        lines.append(f"predicted (context {prediction.context_len} tokens):")
        for batch, tps in prediction.decode_tokens_per_s:
            lines.append(
                f"  decode batch {batch:>3}: {tps:10,.1f} tokens/s ({1e3 * batch / tps:.2f} ms/step)"
            )
        lines.append(f"  prefill:         {prediction.prefill_tokens_per_s:10,.1f} tokens/s")
    return "\n".join(lines)


def _shard_text(size: ModelSize, stage: StagePlan, tp_rank: int) -> str:
    if len(stage.workers) == 1:
        return "whole layers"
    shard = worker_shard(size, stage, tp_rank)
    return (
        f"shard {stage.tp_share(tp_rank):.2%}: {shard.q_heads}/{size.num_heads} heads, "
        f"{shard.kv_heads}/{size.num_kv_heads} KV heads, {shard.intermediate}/"
        f"{size.intermediate_size} MLP, {shard.vocab}/{size.vocab_size} vocab"
    )


def _stage_header(stage: StagePlan) -> str:
    parts = [f"layers [{stage.layer_start}, {stage.layer_end})"]
    if stage.has_embedding:
        parts.insert(0, "embedding")
    if stage.has_lm_head:
        parts.append("final norm + LM head + sampling")
    return f"  stage {stage.pp_rank}: " + " + ".join(parts)


def _cpu_experts_text(stage: StagePlan, size: ModelSize) -> str:
    end = stage.layer_start + stage.cpu_expert_layers
    text = f"    routed experts of layers [{stage.layer_start}, {end}) on cpu"
    if not stage.workers[0].is_cpu:
        text += (
            f" ({format_bytes(host_expert_bytes(size, stage))}); the router, shared expert and "
            f"attention of those layers on {stage.workers[0].device}; hidden states cross per layer"
        )
    return text


def _mtp_text(stage: StagePlan, size: ModelSize) -> str:
    """The MTP layer speculative decoding drafts with, beside the last stage."""
    mtp = mtp_memory(size, stage)
    text = (
        f"    + the MTP layer (speculative decoding's drafts) on {mtp.device}: "
        f"{format_bytes(mtp.weight_bytes)} with its own embedding and LM head"
    )
    if mtp.host_expert_bytes:
        text += f", its routed experts on cpu ({format_bytes(mtp.host_expert_bytes)})"
    return text + "; its KV counted in KV/token"


def _experts_per_device(plan: Plan, size: ModelSize) -> str:
    """Routed experts per device: E experts x sparse layers, and their bytes."""
    moe = size.moe
    counts: dict[str, list[int]] = {}
    for stage in plan.stages:
        for layer in range(stage.layer_start, stage.layer_end):
            if not moe.is_sparse(layer):
                continue
            where = "cpu" if stage.experts_on_cpu(layer) else stage.workers[0].device
            view = size.cpu_view() if where == "cpu" else size
            entry = counts.setdefault(where, [0, 0])
            entry[0] += 1
            entry[1] += view.routed_expert_bytes(layer)
    parts = [
        f"{device}: {n} layers x {moe.num_experts} ({format_bytes(nbytes)})"
        for device, (n, nbytes) in counts.items()
    ]
    return f"routed experts (top-{moe.top_k} of {moe.num_experts}): " + ", ".join(parts)


def _streaming_text(stage: StagePlan, size: ModelSize, prediction: PlanPrediction | None) -> str:
    if stage.stream_threshold < 0:
        when = "never (threshold -1)"
    else:
        when = f"for steps of >= {stage.stream_threshold:,} tokens"
    sent = stream_sent_layer_bytes(size, stage)
    what = (
        "their GGUF blocks, decoded there"
        if sent != size.layer_bytes
        else f"dense {size.dtype} copies of the layers"
    )
    text = (
        f"    streaming to {stage.stream_device} {when}: {what} "
        f"({format_bytes(sent)} a layer), KV blocks copied per step"
    )
    crossing = [
        c for c in (prediction.stream_crossovers if prediction else ()) if c[0] == stage.pp_rank
    ]
    if crossing:
        _, decode, prefill = crossing[0]
        shown = [f"{n:,} tokens" if n >= 0 else "never" for n in (decode, prefill)]
        text += f"; cost-model crossover: decode {shown[0]}, prefill {shown[1]}"
    return text


def _sliding_text(size: ModelSize, usage: tuple[DeviceMemory, ...], budgets: MemoryBudgets) -> str:
    """The sliding-window layers' bounded KV: not per token, so not in KV/token."""
    windows = sorted({w for w in size.layer_windows if w is not None})
    num_sliding = sum(w is not None for w in size.layer_windows)
    fixed = ", ".join(
        f"{m.device} {format_bytes(m.kv_fixed_bytes)}" for m in usage if m.kv_fixed_bytes
    )
    return (
        f"  sliding-window layers: {num_sliding} of {size.num_layers} (window "
        f"{'/'.join(str(w) for w in windows)}) keep {budgets.max_num_seqs} sequences' windows "
        f"and one step's tokens, whatever the context: {fixed}; KV/token counts the "
        f"{size.num_layers - num_sliding} full-attention layers"
    )


def _linear_text(size: ModelSize, usage: tuple[DeviceMemory, ...], budgets: MemoryBudgets) -> str:
    """The linear-attention layers' states: per sequence, not per token."""
    num_linear = sum(size.linear_layers)
    fixed = ", ".join(
        f"{m.device} {format_bytes(m.kv_fixed_bytes)}" for m in usage if m.kv_fixed_bytes
    )
    return (
        f"  linear-attention layers: {num_linear} of {size.num_layers} keep a "
        f"{format_bytes(size.state_bytes_per_layer)} state per sequence each, whatever the "
        f"context ({budgets.max_num_seqs} sequences: {fixed}); KV/token counts the "
        f"{size.num_layers - num_linear} full-attention layers"
    )


def _kv_row_text(size: ModelSize) -> str:
    """What one token costs in one layer's cache, and what it holds."""
    per_layer = format_bytes(size.kv_bytes_per_token_per_layer)
    if size.mla_attention_params:
        return f"{per_layer} a token a layer (one MLA latent row for all heads)"
    return (
        f"{per_layer} a token a layer (keys and values of {size.num_kv_heads} KV heads x "
        f"{size.head_dim})"
    )
