"""A plan with everything shown beside it, as text (`hybridllm plan`) and as JSON (`plan --json`,
the server's /v1/plan, the placement picture of plan/svg.py): one source for all three."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridllm.plan.cost_model import PlanPrediction
from hybridllm.plan.describe import describe_hardware, describe_plan
from hybridllm.plan.hardware_profile import HardwareProfile
from hybridllm.plan.memory_budget import (
    MemoryBudgets,
    device_memory,
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

if TYPE_CHECKING:
    from hybridllm.config import SpeculativeConfig
    from hybridllm.engine_args import EngineArgs

REPORT_VERSION = 1  # bumped when a field changes meaning; readers check it


@dataclass(frozen=True)
class PlanReport:
    """A plan, the model's sizes, the device budgets and the predicted rates."""

    plan: Plan
    size: ModelSize
    budgets: MemoryBudgets
    hw: HardwareInfo
    profile: HardwareProfile | None
    prediction: PlanPrediction | None
    title: str = ""
    node_names: dict[str, str] | None = None
    host_kv_bytes: int | None = None  # the CPU workers' KV cache, all of them together

    def text(self) -> str:
        """What `hybridllm plan` prints."""
        return "\n".join(
            (
                describe_hardware(self.hw, self.profile),
                describe_plan(
                    self.plan,
                    self.size,
                    self.budgets,
                    self.prediction,
                    self.title,
                    self.node_names,
                    self.host_kv_bytes,
                ),
            )
        )

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON types; byte counts are ints, rates floats."""
        size, plan = self.size, self.plan
        usage = device_memory(plan.stages, size, self.budgets)
        kv_devices = [m for m in usage if m.kv_bytes_per_token]
        cpu_workers = sum(w.is_cpu for w in plan.workers())
        resident = (
            host_resident(usage, cpu_workers, self.host_kv_bytes)
            if self.host_kv_bytes is not None
            else None
        )
        return {
            "version": REPORT_VERSION,
            "model": {
                "path": self.title,
                "model_type": size.model_type,
                "num_layers": size.num_layers,
                "dtype": str(size.dtype),
                "weight_bytes": int(size.total_bytes),
                "moe": None
                if size.moe is None
                else {"num_experts": size.moe.num_experts, "top_k": size.moe.top_k},
            },
            "hardware": _hardware_dict(self.hw, self.profile),
            "tensor_parallel_size": plan.tensor_parallel_size,
            "pipeline_parallel_size": plan.pipeline_parallel_size,
            "stages": [self._stage_dict(stage) for stage in plan.stages],
            "devices": [
                {
                    "device": m.device,
                    "total_bytes": _device_total(self.hw, m.device),
                    "budget_bytes": int(m.budget),
                    "weight_bytes": int(m.weight_bytes),
                    "activation_bytes": int(m.activation_bytes),
                    "kv_bytes_per_token": int(m.kv_bytes_per_token),
                    "kv_fixed_bytes": int(m.kv_fixed_bytes),
                    "kv_capacity_tokens": int(m.kv_capacity_tokens),
                    "kv_cache_bytes": self._kv_cache_bytes(m),
                }
                for m in usage
            ],
            "kv_capacity_tokens": min((m.kv_capacity_tokens for m in kv_devices), default=0),
            "kv_reserve_tokens": self.budgets.kv_reserve_tokens,
            "host_resident": None
            if resident is None
            else {
                "loaded_bytes": int(resident.loaded),
                "serving_bytes": int(resident.serving),
            },
            "prediction": _prediction_dict(self.prediction),
            # speculative decoding's memory: the MTP layer beside the last stage, a draft
            # model's weights and KV in the engine's process (taken from the host budget)
            "mtp": self._mtp_dict(),
            "host_reserved": None
            if not self.budgets.host_reserved_bytes
            else {
                "bytes": int(self.budgets.host_reserved_bytes),
                "note": self.budgets.host_reserved_note,
            },
            "text": self.text(),
        }

    def _mtp_dict(self) -> dict[str, Any] | None:
        mtp = mtp_memory(self.size, self.plan.stages[-1])
        if mtp is None:
            return None
        return {
            "device": mtp.device,
            "weight_bytes": int(mtp.weight_bytes),
            "cpu_expert_bytes": int(mtp.host_expert_bytes),
        }

    def _kv_cache_bytes(self, mem) -> int:
        """What the engine gives the KV cache on this device: the rest of a GPU's budget, the
        CPU workers' cache size on the host."""
        if not (mem.kv_bytes_per_token or mem.kv_fixed_bytes):
            return 0
        rest = max(0, mem.budget - mem.weight_bytes - mem.activation_bytes)
        if mem.device == "cpu" and self.host_kv_bytes is not None:
            return int(min(rest, self.host_kv_bytes))
        return int(rest)

    def _stage_dict(self, stage: StagePlan) -> dict[str, Any]:
        size = self.size
        moe = size.moe
        expert_layers = [
            layer
            for layer in range(stage.layer_start, stage.layer_end)
            if moe is not None and moe.is_sparse(layer) and stage.experts_on_cpu(layer)
        ]
        stream = None
        if stage.stream_device is not None:
            crossings = [
                c
                for c in (self.prediction.stream_crossovers if self.prediction else ())
                if c[0] == stage.pp_rank
            ]
            stream = {
                "device": stage.stream_device,
                "threshold_tokens": stage.stream_threshold,
                "layer_bytes": int(stream_sent_layer_bytes(size, stage)),
                "decode_crossover_tokens": crossings[0][1] if crossings else None,
                "prefill_crossover_tokens": crossings[0][2] if crossings else None,
            }
        workers = []
        for tp_rank, w in enumerate(stage.workers):
            shard = None
            if len(stage.workers) > 1:
                s = worker_shard(size, stage, tp_rank)
                shard = {
                    "share": stage.tp_share(tp_rank),
                    "q_heads": s.q_heads,
                    "kv_heads": s.kv_heads,
                    "intermediate": s.intermediate,
                    "vocab": s.vocab,
                }
            workers.append(
                {
                    "rank": w.rank,
                    "device": w.device,
                    "tp_rank": w.tp_rank,
                    "numa_node": w.numa_node,
                    "num_threads": w.num_threads,
                    "weight_bytes": int(worker_weight_bytes(size, stage, tp_rank)),
                    "shard": shard,
                }
            )
        node = stage.node
        return {
            "pp_rank": stage.pp_rank,
            "layer_start": stage.layer_start,
            "layer_end": stage.layer_end,
            "has_embedding": stage.has_embedding,
            "has_lm_head": stage.has_lm_head,
            "node": None if node is None else (self.node_names or {}).get(node, node),
            "workers": workers,
            "cpu_expert_layers": expert_layers,
            "cpu_expert_bytes": int(host_expert_bytes(size, stage)) if expert_layers else 0,
            "stream": stream,
        }


def _hardware_dict(hw: HardwareInfo, profile: HardwareProfile | None) -> dict[str, Any]:
    gpus = []
    for gpu in hw.gpus:
        entry = {
            "device": gpu.device,
            "name": gpu.name,
            "total_bytes": int(gpu.total_memory),
            "free_bytes": int(gpu.free_memory),
            "simulated": gpu.simulated,
        }
        if profile is not None and gpu.index < len(profile.gpus):
            rates = profile.gpus[gpu.index]
            entry["read_bandwidth"] = rates.read_bandwidth
            entry["bf16_flops"] = rates.bf16_flops
        gpus.append(entry)
    cpu = {
        "model": hw.cpu_model,
        "physical_cores": hw.physical_cores,
        "logical_cores": hw.logical_cores,
        "numa_nodes": len(hw.numa_nodes),
        "total_bytes": int(hw.total_ram),
        "available_bytes": int(hw.available_ram),
    }
    if profile is not None:
        cpu["read_bandwidth"] = profile.cpu.read_bandwidth
        cpu["fp32_flops"] = profile.cpu.fp32_flops
    return {"gpus": gpus, "cpu": cpu}


def _device_total(hw: HardwareInfo, device: str) -> int:
    """A device's whole memory: a GPU's, or the host's RAM for "cpu"."""
    if device == "cpu":
        return int(hw.total_ram)
    for gpu in hw.gpus:
        if gpu.device == device:
            return int(gpu.total_memory)
    return 0


def _prediction_dict(prediction: PlanPrediction | None) -> dict[str, Any] | None:
    if prediction is None:
        return None
    return {
        "context_len": prediction.context_len,
        "decode": [{"batch": b, "tokens_per_s": t} for b, t in prediction.decode_tokens_per_s],
        "prefill_tokens_per_s": prediction.prefill_tokens_per_s,
    }


def build_plan_report(
    engine_args: EngineArgs,
    hw: HardwareInfo,
    profile: HardwareProfile,
    *,
    context_len: int,
    kv_reserve_tokens: int | None = None,
    plan: Plan | None = None,
    nodes: list | None = None,
    placement_hook=None,
    speculative_config: SpeculativeConfig | None = None,
) -> PlanReport:
    """The report of `engine_args`' model on `hw`: the plan the planner makes, or `plan` (a
    running engine's) with the sizes, budgets and predictions around it. `nodes`: the Ray
    cluster's nodes, which the planned stages are assigned to. `speculative_config`: the
    running engine's, resolved already (else a draft model is resolved here, to count it).

    `placement_hook`: applied to the placement args before planning (the CLI's auto dtype)."""
    from hybridllm.loader import default_model_path, open_model_source
    from hybridllm.plan.cost_model import CostModel
    from hybridllm.plan.memory_budget import memory_budgets
    from hybridllm.plan.planner import build_plan, plan_model_size
    from hybridllm.worker.kv_cache_budget import cpu_kv_budget

    kernels = engine_args.kernel_config()
    path = engine_args.model or default_model_path()
    source = open_model_source(path)
    hf_config = source.hf_config
    # The context and step budget the engine would run with decide the KV and workspace.
    max_model_len = engine_args.resolve_max_model_len(hf_config)
    batched = engine_args.resolve_max_num_batched_tokens(max_model_len)
    cpu_blocks = engine_args.kept_cpu_blocks(source, hf_config, kernels)
    int8_blocks = kernels.int8_over_blocks(cpu_blocks)
    speculative = speculative_config
    spec = engine_args.speculative_config
    if speculative is None and isinstance(spec, dict) and spec.get("model") is not None:
        # a draft model runs on the host beside the plan: resolved to count it
        speculative = engine_args.resolve_speculative_config(hf_config, max_model_len, batched)
    placement = engine_args.placement_args(
        max_model_len, batched, int8_blocks=int8_blocks, speculative_config=speculative
    )
    if kv_reserve_tokens is not None:
        placement = dataclasses.replace(placement, kv_reserve_tokens=kv_reserve_tokens)
    if placement.mtp:
        engine_args.check_mtp(hf_config)  # the plan counts an MTP layer only where there is one
    if placement_hook is not None:
        placement = placement_hook(placement, source, hf_config, cpu_blocks)
    cost = CostModel(profile, context_len=context_len)
    node_names = None
    if plan is None:
        plan = build_plan(hf_config, placement, hw, cost, cpu_blocks)
        if nodes is not None:
            from hybridllm.plan.cluster import assign_nodes

            plan = assign_nodes(plan, nodes, engine_args.cpu_threads)
    if nodes is not None:
        node_names = {n.node_id: n.name for n in nodes}
    size = plan_model_size(hf_config, placement, hw, cpu_blocks)
    return PlanReport(
        plan=plan,
        size=size,
        budgets=memory_budgets(hw, placement),
        hw=hw,
        profile=profile,
        prediction=cost.predict(plan, size),
        title=path,
        node_names=node_names,
        # the KV cache the CPU workers would allocate (resident as it fills), as the engine sizes it
        host_kv_bytes=cpu_kv_budget(hw.available_ram, 1, None, None, 0),
    )
