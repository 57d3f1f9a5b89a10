"""Memory budgets per device and what a plan puts on each: weights, activation workspace, KV cache."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hybridllm.plan.model_size import ModelSize
from hybridllm.plan.placement_args import PlacementArgs
from hybridllm.plan.plan import Plan, StagePlan, partition
from hybridllm.platforms.discovery import HardwareInfo

# Without --max-cpu-memory, leave the OS and other processes a tenth of the available RAM.
CPU_RAM_FRACTION = 0.9


@dataclass(frozen=True)
class MemoryBudgets:
    """Bytes the plan may use on each GPU (by CUDA index) and on the host (all CPU workers)."""

    gpus: tuple[int, ...]
    cpu: int
    kv_reserve_tokens: int
    max_num_batched_tokens: int
    gpu_sources: tuple[str, ...] = ()  # why each GPU budget is what it is, for error messages
    cpu_source: str = ""
    max_num_seqs: int = 128  # sequences whose windows sliding-window layers hold at once
    host_reserved_bytes: int = 0  # taken from the host before `cpu` (a draft model)
    host_reserved_note: str = ""

    def budget_of(self, device: str) -> int:
        return self.cpu if device == "cpu" else self.gpus[_cuda_index(device)]

    def source_of(self, device: str) -> str:
        if device == "cpu":
            return self.cpu_source
        index = _cuda_index(device)
        return self.gpu_sources[index] if index < len(self.gpu_sources) else ""


def memory_budgets(hw: HardwareInfo, args: PlacementArgs) -> MemoryBudgets:
    """GPU: min(total * utilization, free now, --max-gpu-memory); CPU: --max-cpu-memory or 90% of available RAM."""
    gpus, sources = [], []
    for gpu in hw.gpus:
        options = {
            f"{args.gpu_memory_utilization:g} x {format_bytes(gpu.total_memory)} total": int(
                gpu.total_memory * args.gpu_memory_utilization
            ),
            f"{format_bytes(gpu.free_memory)} free": gpu.free_memory,
        }
        if args.max_gpu_memory is not None:
            options["--max-gpu-memory"] = args.max_gpu_memory
        source = min(options, key=options.__getitem__)
        gpus.append(options[source])
        sources.append(source)
    if args.max_cpu_memory is not None:
        cpu, cpu_source = args.max_cpu_memory, "--max-cpu-memory"
    else:
        cpu = int(hw.available_ram * CPU_RAM_FRACTION)
        cpu_source = f"{CPU_RAM_FRACTION:g} x {format_bytes(hw.available_ram)} available RAM"
    if args.host_reserved_bytes:
        cpu = max(0, cpu - args.host_reserved_bytes)
        cpu_source += (
            f" less {format_bytes(args.host_reserved_bytes)} for {args.host_reserved_note}"
        )
    return MemoryBudgets(
        tuple(gpus),
        cpu,
        args.kv_reserve_tokens,
        args.max_num_batched_tokens,
        tuple(sources),
        cpu_source,
        args.max_num_seqs,
        args.host_reserved_bytes,
        args.host_reserved_note,
    )


@dataclass(frozen=True)
class WorkerShard:
    """What one tensor-parallel rank holds of every layer, and of the vocabulary."""

    q_heads: int
    kv_heads: int
    intermediate: int
    vocab: int


def worker_shard(size: ModelSize, stage: StagePlan, tp_rank: int) -> WorkerShard:
    """Split as the TP layers split: whole KV groups per rank (a replicated KV head below one
    per rank), MLP columns and vocabulary rows by `partition` of the stage's tp_weights."""
    weights, tp = stage.tp_weights, len(stage.workers)
    if tp == 1:
        return WorkerShard(
            size.num_heads, size.num_kv_heads, size.intermediate_size, size.vocab_size
        )
    group = size.num_heads // size.num_kv_heads
    if size.num_kv_heads >= tp:
        start, end = partition(size.num_heads, weights, group)[tp_rank]
        q_heads, kv_heads = end - start, (end - start) // group
    else:
        q_heads, kv_heads = max(1, round(size.num_heads * stage.tp_share(tp_rank))), 1
    (i0, i1), (v0, v1) = (
        partition(total, weights)[tp_rank] for total in (size.intermediate_size, size.vocab_size)
    )
    return WorkerShard(q_heads, kv_heads, i1 - i0, v1 - v0)


def worker_weight_bytes(size: ModelSize, stage: StagePlan, tp_rank: int) -> int:
    """Parameter bytes of one worker: its shard of its stage's layers, embedding and LM head."""
    size = size.for_worker(stage, tp_rank)
    shard = worker_shard(size, stage, tp_rank)
    if size.moe is not None:
        # layer by layer; a GPU worker holds no routed experts the plan put on the CPU
        on_cpu = stage.workers[tp_rank].is_cpu
        layers = range(stage.layer_start, stage.layer_end)
        total = sum(
            size.layer_weight_bytes(i, on_cpu or not stage.experts_on_cpu(i)) for i in layers
        )
        total = round(total * stage.tp_share(tp_rank))  # MoE layers are not sharded: a bound
    else:
        total = stage.num_layers * size.shard_layer_bytes(
            shard.q_heads, shard.kv_heads, shard.intermediate
        )
    vocab_share = shard.vocab / size.vocab_size
    if stage.has_embedding:
        total += int(size.embedding_bytes * vocab_share)
    if stage.has_lm_head:
        total += size.final_norm_bytes
        total += int(size.head_matrix_bytes(stage.has_embedding) * vocab_share)
        total += size.mtp_bytes(routed=not mtp_experts_on_host(stage, tp_rank))
    return total


def mtp_experts_on_host(stage: StagePlan, tp_rank: int = 0) -> bool:
    """Whether the MTP layer's routed experts live on the host beside a GPU last stage: where
    the stage's last layer's do (worker/model_runner.py places them so)."""
    return not stage.workers[tp_rank].is_cpu and stage.experts_on_cpu(stage.layer_end - 1)


@dataclass(frozen=True)
class MtpMemory:
    """What the MTP layers beside the last stage hold: on the stage's device, and (their routed
    experts, where the last layer's are there) on the host."""

    device: str
    weight_bytes: int
    host_expert_bytes: int


def mtp_memory(size: ModelSize, stage: StagePlan) -> MtpMemory | None:
    """The MTP layers' bytes beside `stage` (None: no MTP layers, or not the last stage)."""
    if not (stage.has_lm_head and size.mtp_layers):
        return None
    on_host = mtp_experts_on_host(stage)
    layers = range(size.num_layers, size.num_layers + size.mtp_layers)
    cpu = size.cpu_view()
    return MtpMemory(
        stage.workers[0].device,
        size.for_worker(stage, 0).mtp_bytes(routed=not on_host),
        sum(cpu.routed_expert_bytes(i) for i in layers) if on_host else 0,
    )


def host_expert_bytes(size: ModelSize, stage: StagePlan) -> int:
    """Bytes of the routed experts a GPU stage keeps on the host CPU (as a CPU worker holds
    them: GGUF blocks where kept)."""
    if stage.cpu_expert_layers == 0 or all(w.is_cpu for w in stage.workers):
        return 0  # a CPU worker counts its experts among its own weights
    cpu = size.cpu_view()
    end = stage.layer_start + stage.cpu_expert_layers
    mtp = mtp_memory(size, stage)
    layers = sum(cpu.routed_expert_bytes(i) for i in range(stage.layer_start, end))
    return layers + (mtp.host_expert_bytes if mtp is not None else 0)


def worker_kv_bytes_per_token(size: ModelSize, stage: StagePlan, tp_rank: int) -> int:
    """KV bytes one token costs this worker: its full-attention layers x its KV heads (in its
    cache's dtype); sliding-window layers cost a bounded amount instead (below)."""
    per_head = size.for_worker(stage, tp_rank).kv_bytes_per_token_per_layer // size.num_kv_heads
    layers = size.full_attention_layers(stage.layer_start, stage.layer_end)
    if stage.has_lm_head:
        layers += size.mtp_layers  # the MTP layer's own cache, on the same block tables
    return layers * worker_shard(size, stage, tp_rank).kv_heads * per_head


def worker_sliding_kv_bytes(
    size: ModelSize, stage: StagePlan, tp_rank: int, budgets: MemoryBudgets
) -> int:
    """KV bytes this worker's sliding-window layers hold at most: max_num_seqs windows and one
    step's tokens each, whatever the context; and its linear-attention layers' states, one per
    sequence (0 without such layers)."""
    states = size.state_bytes(stage.layer_start, stage.layer_end, budgets.max_num_seqs)
    if not size.layer_windows:
        return states
    per_head = size.for_worker(stage, tp_rank).kv_bytes_per_token_per_layer // size.num_kv_heads
    rows = size.sliding_kv_tokens(
        stage.layer_start,
        stage.layer_end,
        budgets.kv_reserve_tokens,
        budgets.max_num_seqs,
        budgets.max_num_batched_tokens,
    )
    return states + rows * worker_shard(size, stage, tp_rank).kv_heads * per_head


@dataclass(frozen=True)
class DeviceMemory:
    """What a plan puts on one device ("cuda:N", or "cpu" for all CPU workers together)."""

    device: str
    budget: int
    weight_bytes: int
    activation_bytes: int
    kv_bytes_per_token: int  # full-attention layers
    kv_fixed_bytes: int = 0  # sliding-window layers: bounded, whatever the context

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache that fit beside the weights, activations and sliding-window
        layers' KV (0 when none do)."""
        free = self.budget - self.weight_bytes - self.activation_bytes - self.kv_fixed_bytes
        if self.kv_bytes_per_token == 0:
            return 0
        return max(0, free // self.kv_bytes_per_token)

    def need(self, kv_tokens: int) -> int:
        fixed = self.weight_bytes + self.activation_bytes + self.kv_fixed_bytes
        return fixed + kv_tokens * self.kv_bytes_per_token


# KV rows a streamed step may read: decode batches of long contexts stream too.
_MIN_STREAM_KV_TOKENS = 65536


def stream_kv_tokens(max_num_batched_tokens: int) -> int:
    """KV rows (over a step's sequences) the staging buffers of a streaming stage hold."""
    return max(2 * max_num_batched_tokens, _MIN_STREAM_KV_TOKENS)


def stream_sent_layer_bytes(size: ModelSize, stage: StagePlan) -> int:
    """Bytes of one layer a streaming CPU stage sends: its GGUF blocks (the accelerator decodes
    them), else the dense layer."""
    return size.for_worker(stage, 0).layer_bytes


def stream_staging_bytes(size: ModelSize, kv_tokens: int, sent_layer_bytes: int) -> int:
    """Two staging slots on the stream device, each a dense layer, the blocks it is decoded
    from when it arrives as blocks (dense values land in place), and `kv_tokens` of its KV."""
    blocks = sent_layer_bytes if sent_layer_bytes != size.layer_bytes else 0
    kv = kv_tokens * size.kv_bytes_per_token_per_layer
    return 2 * (size.layer_bytes + blocks + kv)


def device_memory(
    stages: Iterable[StagePlan], size: ModelSize, budgets: MemoryBudgets
) -> tuple[DeviceMemory, ...]:
    """Per device, in order of first appearance among `stages` (a plan's, or a candidate's)."""
    totals: dict[str, list[int]] = {}
    for stage in stages:
        for rank, worker in enumerate(stage.workers):
            t = totals.setdefault(worker.device, [0, 0, 0, 0])
            t[0] += worker_weight_bytes(size, stage, rank)
            t[1] += size.activation_bytes(budgets.max_num_batched_tokens)
            t[2] += worker_kv_bytes_per_token(size, stage, rank)
            t[3] += worker_sliding_kv_bytes(size, stage, rank, budgets)
        experts = host_expert_bytes(size, stage)
        if experts:
            totals.setdefault("cpu", [0, 0, 0, 0])[0] += experts
        if stage.stream_device is not None:
            # staging slots on the device; pinned dense copies of the layers on the host
            t = totals.setdefault(stage.stream_device, [0, 0, 0, 0])
            sent = stream_sent_layer_bytes(size, stage)
            t[0] += stream_staging_bytes(size, stage.stream_kv_tokens, sent)
            totals.setdefault("cpu", [0, 0, 0, 0])[0] += stage.num_layers * sent
    return tuple(
        DeviceMemory(device, budgets.budget_of(device), w, a, kv, fixed)
        for device, (w, a, kv, fixed) in totals.items()
    )


# What a CPU process holds beside its model and KV cache: Python, torch and the libraries it
# maps, the tokenizer and the engine (0.23-0.26 GiB measured on x86-64 Linux, torch 2.x), and
# room for the one matrix the loader holds twice while it stacks or repacks it.
HOST_PROCESS_BYTES = 320 << 20


@dataclass(frozen=True)
class HostResident:
    """The resident memory (RSS) of the processes of a plan's CPU workers.

    A CPU worker keeps its weights once: GGUF blocks are copied out of the mapped file tensor
    by tensor and each tensor's mapped pages dropped after its copy (the page cache keeps them,
    outside the RSS), dequantized tensors exist only as their floats.
    """

    process_bytes: int  # Python, torch, tokenizer and engine, all the processes together
    weight_bytes: int
    kv_cache_bytes: int  # what the CPU's KV cache may grow to (resident as it is written)
    activation_bytes: int

    @property
    def loaded(self) -> int:
        """The peak while loading and right after: the processes and the weights."""
        return self.process_bytes + self.weight_bytes

    @property
    def serving(self) -> int:
        """The bound while serving: once loaded, a full KV cache and a full step's workspace."""
        return self.loaded + self.kv_cache_bytes + self.activation_bytes


def host_resident(
    usage: Iterable[DeviceMemory], num_processes: int, kv_cache_bytes: int
) -> HostResident | None:
    """What `num_processes` processes of CPU workers hold, from the plan's "cpu" usage and
    their KV cache's bytes (all the workers together); None when the plan has no CPU work."""
    cpu = next((m for m in usage if m.device == "cpu"), None)
    if cpu is None:
        return None
    kv = kv_cache_bytes if cpu.kv_bytes_per_token or cpu.kv_fixed_bytes else 0
    return HostResident(
        max(1, num_processes) * HOST_PROCESS_BYTES, cpu.weight_bytes, kv, cpu.activation_bytes
    )


def check_fits(plan: Plan, size: ModelSize, budgets: MemoryBudgets, hint: str = "") -> None:
    """Raise ValueError naming the device, what it needs, its budget and the shortfall."""
    for mem in device_memory(plan.stages, size, budgets):
        need = mem.need(budgets.kv_reserve_tokens)
        if need > mem.budget:
            raise ValueError(
                f"{mem.device} needs {format_bytes(need)} (weights "
                f"{format_bytes(mem.weight_bytes)} + KV for {budgets.kv_reserve_tokens} tokens "
                f"{format_bytes(budgets.kv_reserve_tokens * mem.kv_bytes_per_token)} + "
                f"activations {format_bytes(mem.activation_bytes)}) but its budget is "
                f"{format_bytes(mem.budget)} ({budgets.source_of(mem.device)}): short by "
                f"{format_bytes(need - mem.budget)}" + (f"; {hint}" if hint else "")
            )


def fits(stages: Iterable[StagePlan], size: ModelSize, budgets: MemoryBudgets) -> bool:
    return all(
        m.need(budgets.kv_reserve_tokens) <= m.budget for m in device_memory(stages, size, budgets)
    )


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _cuda_index(device: str) -> int:
    return int(device.partition(":")[2] or 0)
