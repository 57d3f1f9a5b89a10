"""The planner: model config + placement flags + hardware (+ cost model) -> a `Plan`.

Modes, in order of precedence:
- `device="cpu"`: every worker on the CPU (tp x pp as asked).
- `device="cuda"`: every worker on its own GPU; more ranks than GPUs is an error.
- `gpu_layers=N` (llama.cpp's -ngl): the last N layers, the final norm and the LM head on a GPU
  stage after a CPU stage with the embedding and the rest (the head is cheapest on the GPU).
- tp/pp/layer_split given (auto/heterogeneous): rank r runs on cuda:r while r < #GPUs, on the
  CPU beyond (as in the seeds); without a layer split, GPU stages take what their budget holds.
- nothing given: the whole model on cuda:0 when weights + KV reserve + activations fit (a model
  that fits is never slowed down); otherwise a GPU stage with as many layers as fit and a CPU
  stage with the rest. Stage order: the GPU stage may come first (it holds the embedding, the
  CPU the LM head) or last (the CPU holds the embedding, the GPU the LM head and sampling).
  The embedding is a cheap row gather wherever it lives, but the LM head is read in full every
  step (1 GiB for a 128k vocab at 4096 hidden): on the CPU that costs tens of ms per token. The
  cost model compares both orders at batch-1 decode (each with as many GPU layers as its own
  budget allows) and the faster wins; without a cost model, the LM head goes on the GPU.

Mixtures of experts: `cpu_moe` / `n_cpu_moe` put the routed experts of every (or the first N)
layer on the host CPU while the rest of those layers stays on their GPU stage (on a plan
without a GPU the stages still record it, which runs the same code path on the host). With
no flags, a model too big for the GPU first gets its routed experts moved to the CPU, layer by
layer, just enough to fit; only if all of them there is not enough are whole layers moved
(the GPU stage then keeps none of its layers' routed experts). MoE stages never stream
their weights (a layer would copy every expert for the few a step selects).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from hybridllm.plan.cost_model import CostModel
from hybridllm.plan.cpu_dtype import cpu_kv_cache_dtype
from hybridllm.plan.memory_budget import (
    MemoryBudgets,
    check_fits,
    device_memory,
    fits,
    format_bytes,
    memory_budgets,
    stream_kv_tokens,
    stream_sent_layer_bytes,
    stream_staging_bytes,
    worker_kv_bytes_per_token,
    worker_sliding_kv_bytes,
    worker_weight_bytes,
)
from hybridllm.plan.model_size import GGUFBlockSizes, ModelSize, model_size
from hybridllm.plan.numa_binding import numa_assignments
from hybridllm.plan.placement_args import PlacementArgs
from hybridllm.plan.plan import Plan, StagePlan, WorkerPlacement, partition
from hybridllm.platforms.discovery import HardwareInfo

logger = logging.getLogger(__name__)

__all__ = ["PlacementArgs", "build_plan", "resolve_plan_dtype"]


def resolve_plan_dtype(args: PlacementArgs, hw: HardwareInfo) -> str:
    """'auto': bf16 when a GPU will run layers, else `args.cpu_auto_dtype` (plan/cpu_dtype.py)."""
    if args.dtype != "auto":
        return args.dtype
    uses_gpu = hw.num_gpus > 0 and args.device != "cpu" and args.gpu_layers != 0
    return "bfloat16" if uses_gpu else args.cpu_auto_dtype


def build_plan(
    hf_config: Any,
    args: PlacementArgs,
    hw: HardwareInfo,
    cost: CostModel | None = None,
    cpu_blocks: GGUFBlockSizes | None = None,
) -> Plan:
    """Place the model `hf_config` describes; raises ValueError naming budgets and needs.

    `cpu_blocks`: the GGUF blocks a CPU worker keeps (smaller, faster to read).
    """
    size = plan_model_size(hf_config, args, hw, cpu_blocks)
    return _Planner(size, args, hw, cost, memory_budgets(hw, args)).build()


def plan_model_size(
    hf_config: Any, args: PlacementArgs, hw: HardwareInfo, cpu_blocks: GGUFBlockSizes | None
) -> ModelSize:
    """The model's sizes at the plan's dtype, CPU workers' KV caches in the dtype they store."""
    dtype = resolve_plan_dtype(args, hw)
    int8_blocks = cpu_blocks is not None and args.int8_blocks
    kv_dtype = cpu_kv_cache_dtype(args.kv_cache_dtype, dtype, int8_blocks)
    size = model_size(hf_config, dtype, cpu_blocks, kv_dtype)
    if args.mtp:  # the checkpoint's MTP layer drafts beside the last stage: an MoE layer
        moe = size.moe
        if moe is not None:
            sparse = moe.sparse_layers | {size.num_layers}
            moe = dataclasses.replace(moe, sparse_layers=sparse)
        size = dataclasses.replace(size, mtp_layers=1, moe=moe)
    return size


@dataclasses.dataclass(frozen=True)
class _Planner:
    size: ModelSize
    args: PlacementArgs
    hw: HardwareInfo
    cost: CostModel | None
    budgets: MemoryBudgets

    @property
    def num_layers(self) -> int:
        return self.size.num_layers

    def build(self) -> Plan:
        try:
            return self._build()
        except ValueError:
            if self.args.stream_threshold is not None or self.hw.num_gpus == 0:
                raise  # streaming was asked for, or plays no part
            # The staging buffers and the layers' pinned copies did not fit: plan without.
            args = dataclasses.replace(self.args, stream_threshold=-1)
            plan = dataclasses.replace(self, args=args)._build()
            logger.info(
                "no room for weight streaming's staging buffers and host copies: "
                "CPU stages compute every step"
            )
            return plan

    def _build(self) -> Plan:
        args, gpus = self.args, self.hw.num_gpus
        if args.device == "cpu":
            return self._all_cpu()
        if args.device == "cuda":
            return self._all_cuda()
        if gpus == 0:
            if args.gpu_layers:
                raise ValueError(f"gpu_layers={args.gpu_layers} but no CUDA GPU was found")
            if args.device == "heterogeneous":
                logger.warning(
                    "no CUDA GPU found: every rank of --device heterogeneous runs on the CPU"
                )
            return self._all_cpu()
        if args.gpu_layers is not None:
            return self._gpu_layers_plan(min(args.gpu_layers, self.num_layers))
        if args.explicit_layout:
            return self._rank_rule_plan()
        return self._automatic_plan()

    # --- modes ------------------------------------------------------------------------------

    def _all_cpu(self) -> Plan:
        tp, pp = self.args.tensor_parallel_size, self.args.num_stages
        plan = self._layout([["cpu"] * tp for _ in range(pp)], self._even_split(pp))
        check_fits(plan, self.size, self.budgets, "raise --max-cpu-memory or lower the KV reserve")
        return plan

    def _all_cuda(self) -> Plan:
        args, gpus = self.args, self.hw.num_gpus
        if gpus == 0:
            raise ValueError("device 'cuda' was asked for but no CUDA GPU was found")
        if args.gpu_layers is not None and args.gpu_layers < self.num_layers:
            raise ValueError(
                f"gpu_layers={args.gpu_layers} leaves layers on the CPU but device is 'cuda'; "
                "use --device heterogeneous or auto"
            )
        tp, pp = args.tensor_parallel_size, args.num_stages
        if tp * pp > gpus:
            raise ValueError(
                f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {tp * pp} ranks, "
                f"but only {gpus} GPU(s) were found; --device heterogeneous runs the ranks "
                "beyond the GPUs on the CPU"
            )
        devices = [[f"cuda:{i * tp + j}" for j in range(tp)] for i in range(pp)]
        plan = self._layout(devices, self._even_split(pp))
        check_fits(
            plan, self.size, self.budgets,
            "use --device heterogeneous or --gpu-layers to put layers on the CPU",
        )  # fmt: skip
        return plan

    def _gpu_layers_plan(self, n: int) -> Plan:
        tp, pp, gpus, total = (
            self.args.tensor_parallel_size, self.args.pipeline_parallel_size, self.hw.num_gpus,
            self.num_layers,
        )  # fmt: skip
        if n == 0:
            return self._all_cpu()
        if tp > gpus:
            raise ValueError(
                f"gpu_layers puts a tensor-parallel group of {tp} on GPUs but only {gpus} "
                "GPU(s) were found"
            )
        if n >= total:
            return self._all_cuda()
        if pp not in (1, 2):
            raise ValueError(
                f"gpu_layers={n} makes two stages (CPU, then GPU) but pipeline_parallel_size is "
                f"{pp}; give an explicit layer_split for more stages"
            )
        # As llama.cpp offloads the last N layers; the LM head, read in full every step, joins them
        devices = [["cpu"] * tp, [f"cuda:{j}" for j in range(tp)]]
        plan = self._layout(devices, [total - n, n])
        check_fits(plan, self.size, self.budgets, f"lower --gpu-layers (now {n})")
        return plan

    def _rank_rule_plan(self) -> Plan:
        tp, pp, gpus = self.args.tensor_parallel_size, self.args.num_stages, self.hw.num_gpus
        if tp * pp > gpus:
            logger.info(
                "%d ranks on %d GPU(s): ranks %d..%d run on the CPU", tp * pp, gpus, gpus,
                tp * pp - 1,
            )  # fmt: skip
        devices = [
            [f"cuda:{i * tp + j}" if i * tp + j < gpus else "cpu" for j in range(tp)]
            for i in range(pp)
        ]
        split = (
            list(self.args.layer_split) if self.args.layer_split else self._budget_split(devices)
        )
        plan = self._layout(devices, split)
        check_fits(plan, self.size, self.budgets, "change the layer split or the budgets")
        return plan

    def _automatic_plan(self) -> Plan:
        whole = self._layout([["cuda:0"]], [self.num_layers])
        if fits(whole.stages, self.size, self.budgets):
            return whole
        if self.size.moe is not None and not self.args.cpu_expert_prefix(self.num_layers):
            plan = self._experts_to_cpu_plan()
            if plan is not None:
                return plan
            # not even every routed expert on the host makes room: move layers too
            args = dataclasses.replace(self.args, cpu_moe=True)
            return dataclasses.replace(self, args=args)._automatic_plan()
        candidates = []
        for gpu_first in (False, True):
            k = self._max_gpu_layers(gpu_first)
            if k > 0:
                rows = [["cuda:0"], ["cpu"]] if gpu_first else [["cpu"], ["cuda:0"]]
                split = [k, self.num_layers - k] if gpu_first else [self.num_layers - k, k]
                candidates.append(self._layout(rows, split))
        if not candidates:
            logger.warning(
                "the GPU budget of %s cannot hold one layer beside the LM head and the KV "
                "reserve: running on the CPU only", format_bytes(self.budgets.gpus[0]),
            )  # fmt: skip
            return self._all_cpu()
        fitting = [p for p in candidates if fits(p.stages, self.size, self.budgets)]
        plan = self._fastest(fitting or candidates)
        gpu_layers = next(s.num_layers for s in plan.stages if not s.workers[0].is_cpu)
        check_fits(
            plan, self.size, self.budgets,
            f"the GPU budget holds {gpu_layers} of {self.num_layers} layers; the rest must fit "
            "the CPU: raise --max-cpu-memory, lower the KV reserve or use a smaller dtype",
        )  # fmt: skip
        return plan

    def _experts_to_cpu_plan(self) -> Plan | None:
        """The whole model on cuda:0 with the routed experts of as few first layers as needed
        on the CPU (fewest: the GPU reads its experts faster), or None when all do not suffice."""

        def with_experts(n: int) -> tuple[Plan, bool]:
            planner = dataclasses.replace(self, args=dataclasses.replace(self.args, n_cpu_moe=n))
            plan = planner._layout([["cuda:0"]], [self.num_layers])
            return plan, fits(plan.stages, self.size, self.budgets)

        low, high = 0, self.num_layers  # does not fit with `low` layers' experts; try up to high
        best, ok = with_experts(high)
        if not ok:
            return None
        while high - low > 1:  # fitting only grows with n: bisect the fewest that fit
            mid = (low + high) // 2
            plan, ok = with_experts(mid)
            low, high, best = (low, mid, plan) if ok else (mid, high, best)
        logger.info(
            "the model does not fit the GPU: the routed experts of its first %d of %d layers "
            "go to the CPU", high, self.num_layers,
        )  # fmt: skip
        return best

    # --- pieces -----------------------------------------------------------------------------

    def _cpu_experts(self, row: list[str], start: int, n: int) -> int:
        """How many first layers of a stage on `row` at [start, start + n) keep their routed
        experts on the CPU: those among the user's first N, on a GPU stage (or on any stage of
        a plan without a GPU: the same code path then runs on the host)."""
        prefix = self.args.cpu_expert_prefix(self.num_layers)
        if prefix == 0:
            return 0
        if self.size.moe is None:
            raise ValueError(
                f"cpu_moe / n_cpu_moe place routed experts, but {self.size.model_type!r} is not a "
                "mixture-of-experts model"
            )
        if len(row) != 1:
            raise ValueError(
                "cpu_moe / n_cpu_moe need tensor_parallel_size 1 (experts are not sharded)"
            )
        without_gpu = self.hw.num_gpus == 0 or self.args.device == "cpu"
        if row[0] == "cpu" and not without_gpu:
            return 0  # a CPU stage beside a GPU: its experts are on the CPU already
        return max(0, min(start + n, prefix) - start)

    def _fastest(self, plans: list[Plan]) -> Plan:
        """The plan with the fastest batch-1 decode; without a cost model, LM head on the GPU."""
        if self.cost is None or len(plans) == 1:
            return plans[0]
        speeds = [self.cost.decode_tokens_per_s(p, self.size, 1) for p in plans]
        best = max(range(len(plans)), key=speeds.__getitem__)
        for plan, speed in zip(plans, speeds):
            order = "GPU first" if not plan.stages[0].workers[0].is_cpu else "CPU first"
            logger.info("stage order %s: %.1f tokens/s predicted at batch 1", order, speed)
        return plans[best]

    def _max_gpu_layers(self, gpu_first: bool) -> int:
        """Layers a cuda:0 stage holds beside its KV reserve, activations and embedding or head."""
        size, budgets = self.size, self.budgets
        fixed = size.stage_bytes(0, 0, gpu_first, not gpu_first)
        fixed += size.activation_bytes(budgets.max_num_batched_tokens)
        if size.moe is not None and self.args.cpu_expert_prefix(self.num_layers):
            # a GPU stage of an MoE split keeps its layers' routed experts on the host
            per_layer = max(
                size.layer_weight_bytes(i, routed=False) for i in range(self.num_layers)
            )
        else:
            per_layer = size.layer_bytes
        streams = self.args.stream_threshold != -1 and size.moe is None
        if streams and self.args.stream_device in (None, "cuda:0"):
            # the CPU stage's staging buffers will live on this GPU
            cpu = StagePlan(0, 0, 1, (WorkerPlacement(0, "cpu", 0, 0),), (1.0,), True, False)
            kv_tokens = stream_kv_tokens(budgets.max_num_batched_tokens)
            fixed += stream_staging_bytes(size, kv_tokens, stream_sent_layer_bytes(size, cpu))
        per_layer += budgets.kv_reserve_tokens * size.kv_bytes_per_token(1)
        k = (budgets.gpus[0] - fixed) // per_layer
        return int(max(0, min(k, self.num_layers - 1)))

    def _even_split(self, pp: int) -> list[int]:
        if self.args.layer_split:
            return list(self.args.layer_split)
        if pp > self.num_layers:
            raise ValueError(f"cannot split {self.num_layers} layers into {pp} pipeline stages")
        return [end - start for start, end in partition(self.num_layers, (1.0,) * pp)]

    def _budget_split(self, devices: list[list[str]]) -> list[int]:
        """Stages with a GPU take as many layers as their budgets allow; CPU stages share the rest."""
        total, pp = self.num_layers, len(devices)
        has_gpu = [any(d != "cpu" for d in row) for row in devices]
        if all(has_gpu) or not any(has_gpu):
            return self._even_split(pp)
        cpu_stages = has_gpu.count(False)
        if pp > total:
            raise ValueError(f"cannot split {total} layers into {pp} pipeline stages")
        caps = {i: self._stage_capacity(i, devices) for i in range(pp) if has_gpu[i]}
        split = [0] * pp
        left = min(sum(caps.values()), total - cpu_stages)
        while left > 0:  # water-fill the GPU stages one layer at a time, up to their capacity
            progressed = False
            for i, cap in caps.items():
                if left > 0 and split[i] < cap:
                    split[i], left, progressed = split[i] + 1, left - 1, True
            if not progressed:
                break
        for i in caps:
            split[i] = max(split[i], 1)  # a stage cannot be empty; check_fits reports the overflow
        cpu_ranges = partition(total - sum(split), (1.0,) * cpu_stages)
        for i, (start, end) in zip((i for i in range(pp) if not has_gpu[i]), cpu_ranges):
            split[i] = end - start
        return split

    def _stage_capacity(self, index: int, devices: list[list[str]]) -> int:
        """The most layers stage `index` holds with every GPU worker inside its budget."""
        last = index == len(devices) - 1
        for n in range(self.num_layers, 0, -1):
            stage = self._stage(index, devices[index], 0, n, last)
            usage = device_memory((stage,), self.size, self.budgets)
            reserve = self.budgets.kv_reserve_tokens
            if all(m.need(reserve) <= m.budget for m in usage if m.device != "cpu"):
                return n
        return 0

    def _stage(self, index: int, row: list[str], start: int, n: int, last: bool) -> StagePlan:
        tp = len(row)
        workers = tuple(
            WorkerPlacement(rank=index * tp + j, device=device, pp_rank=index, tp_rank=j)
            for j, device in enumerate(row)
        )
        stage = StagePlan(
            index, start, start + n, workers, (1.0,) * tp, index == 0, last,
            cpu_expert_layers=self._cpu_experts(row, start, n),
        )  # fmt: skip
        return dataclasses.replace(stage, tp_weights=self._tp_weights(stage))

    def _layout(self, devices: list[list[str]], split: list[int]) -> Plan:
        if len(split) != len(devices) or sum(split) != self.num_layers:
            raise ValueError(
                f"layer split {split} must have {len(devices)} entries summing to "
                f"{self.num_layers} (the model's layers)"
            )
        stages, start = [], 0
        for i, (row, n) in enumerate(zip(devices, split)):
            stages.append(self._stage(i, row, start, n, i == len(devices) - 1))
            start += n
        return self._with_streaming(self._bind_cpu_workers(Plan(tuple(stages), self.num_layers)))

    def _tp_weights(self, stage: StagePlan) -> tuple[float, ...]:
        """Equal shards, except GPU+CPU groups: proportional to decode bandwidth, GPU capped to fit."""
        kinds = {w.is_cpu for w in stage.workers}
        if len(kinds) == 1 or self.cost is None:
            return stage.tp_weights
        n_cpu = sum(w.is_cpu for w in stage.workers)
        speeds = [
            self.cost.device_rates(
                w.device, self.size.dtype, n_cpu if w.is_cpu else 1
            ).read_bandwidth
            for w in stage.workers
        ]
        shares = [s / sum(speeds) for s in speeds]
        # Cap each GPU share to what fits its budget (weights and KV heads included), handing
        # the excess to the CPU ranks; KV heads split in whole heads, hence the few rounds.
        for _ in range(50):
            trial = dataclasses.replace(stage, tp_weights=tuple(shares))
            over = self._gpu_overflow(trial)
            if not over:
                break
            for j in over:
                shares[j] *= 0.95
            cpu_total = sum(s for s, w in zip(shares, stage.workers) if w.is_cpu)
            gpu_total = sum(s for s, w in zip(shares, stage.workers) if not w.is_cpu)
            shares = [
                s * (1 - gpu_total) / cpu_total if w.is_cpu else s
                for s, w in zip(shares, stage.workers)
            ]
        return tuple(round(max(s, 1e-6), 6) for s in shares)

    def _gpu_overflow(self, stage: StagePlan) -> list[int]:
        """tp ranks of `stage` on a GPU whose share would not fit that GPU's budget."""
        size, budgets = self.size, self.budgets
        over = []
        for j, w in enumerate(stage.workers):
            if w.is_cpu:
                continue
            need = (
                worker_weight_bytes(size, stage, j)
                + budgets.kv_reserve_tokens * worker_kv_bytes_per_token(size, stage, j)
                + worker_sliding_kv_bytes(size, stage, j, budgets)
                + size.activation_bytes(budgets.max_num_batched_tokens)
            )
            if need > budgets.budget_of(w.device):
                over.append(j)
        return over

    def _stream_device(self, plan: Plan) -> str | None:
        """Where CPU stages stream their weights: the user's choice, else the plan's first GPU."""
        if self.args.stream_threshold == -1 or self.size.moe is not None:
            return None  # an MoE layer would stream every expert: its experts run on the host
        gpus = (w.device for w in plan.workers() if not w.is_cpu)
        return self.args.stream_device or next(gpus, None)

    def _with_streaming(self, plan: Plan) -> Plan:
        """Let one-worker CPU stages stream to the GPU for steps past the cost model's crossover
        (or the user's --stream-threshold)."""
        device = self._stream_device(plan)
        if device is None:
            return plan
        kv_tokens = stream_kv_tokens(self.budgets.max_num_batched_tokens)
        stages = []
        for stage in plan.stages:
            if len(stage.workers) == 1 and stage.workers[0].is_cpu and not stage.cpu_expert_layers:
                stage = dataclasses.replace(
                    stage, stream_device=device, stream_threshold=0, stream_kv_tokens=kv_tokens
                )
                threshold = self.args.stream_threshold
                if threshold is None:
                    threshold = self._crossover(stage)
                stage = dataclasses.replace(stage, stream_threshold=threshold)
            stages.append(stage)
        return Plan(tuple(stages), plan.num_layers)

    def _crossover(self, stage: StagePlan) -> int:
        """The step size from which streaming wins: decode batches' crossover when streaming
        ever wins for them, else a prompt chunk's (-1: never, or no cost model to tell)."""
        if self.cost is None:
            return -1
        limit = self.budgets.max_num_batched_tokens
        context = self.cost.context_len
        decode = self.cost.stream_crossover(stage, self.size, context, limit, decode=True)
        if decode >= 0:
            return decode
        return self.cost.stream_crossover(stage, self.size, context, limit, decode=False)

    def _bind_cpu_workers(self, plan: Plan) -> Plan:
        """Bind CPU workers to NUMA nodes (round-robin when they outnumber the nodes)."""
        cpu_ranks = [w.rank for w in plan.workers() if w.is_cpu]
        if not cpu_ranks:
            return plan
        nodes = self.hw.numa_nodes
        if len(cpu_ranks) > len(nodes):
            logger.warning(
                "%d CPU workers share %d NUMA node(s) round-robin; their threads split each node",
                len(cpu_ranks), len(nodes),
            )  # fmt: skip
        bindings = numa_assignments(cpu_ranks, self.hw, self.args.cpu_threads)
        stages = []
        for stage in plan.stages:
            workers = []
            for w in stage.workers:
                if w.is_cpu:
                    node, threads = bindings[w.rank]
                    w = dataclasses.replace(w, numa_node=node, num_threads=threads)
                workers.append(w)
            stages.append(dataclasses.replace(stage, workers=tuple(workers)))
        return Plan(tuple(stages), plan.num_layers)
