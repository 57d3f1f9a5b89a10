"""How many KV cache blocks a worker allocates, of which dtype, and how it zeroes them."""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable

import torch

from hybridllm.config import EngineConfig
from hybridllm.engine.kv_cache_groups import KVCacheGroupSpec, kv_cache_groups
from hybridllm.plan.memory_budget import host_expert_bytes, worker_weight_bytes
from hybridllm.plan.model_size import ModelSize, model_size
from hybridllm.plan.plan import StagePlan, WorkerPlacement
from hybridllm.platforms import Platform
from hybridllm.sample import SamplingMetadata
from hybridllm.sampling_params import SamplingParams
from hybridllm.worker.kv_cache_budget import (
    cpu_kv_budget,
    gpu_kv_budget,
    group_block_needs,
    split_kv_budget,
)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# runs one profiling step; calls its argument once the step's temporary KV cache exists
ProfileForward = Callable[[Callable[[], None]], int]


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What this worker's KV cache holds: GPU workers their (16-bit) compute dtype, CPU workers
    the config's `cpu_kv_cache_dtype` (from its kernel settings; plan/cpu_dtype.py)."""
    if device.type != "cpu":
        return dtype
    return TORCH_DTYPES[config.cpu_kv_cache_dtype]


def kv_cache_bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over every layer of the stage: what the model's cache holds for
    `block_size` tokens (keys and values, or MLA's latent)."""
    elements = math.prod(model.kv_cache_shape(1, block_size))
    return elements * dtype.itemsize * model.num_layers_in_stage


def layer_cache_layout(
    model: torch.nn.Module,
    spec: KVCacheGroupSpec,
    num_blocks: int,
    block_size: int,
    kv_dtype: torch.dtype,
) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of one layer's cache in group `spec` with `num_blocks` blocks: paged
    keys and values in `kv_dtype`, or `num_blocks` linear-attention state slots in fp32 (the
    recurrence accumulates over the whole sequence)."""
    if spec.is_state:
        return (num_blocks * model.state_floats_per_slot(),), torch.float32
    return tuple(model.kv_cache_shape(num_blocks, block_size)), kv_dtype


def group_bytes_per_block(
    model: torch.nn.Module,
    block_size: int,
    dtype: torch.dtype,
    groups: list[KVCacheGroupSpec],
) -> list[int]:
    """Bytes of one block (a state group: one slot) of each KV cache group over the stage's
    layers in it (0 for a group with none here)."""
    counts = [0] * len(groups)
    for group in model.execution.layer_groups:
        counts[group] += 1
    sizes = []
    for spec, count in zip(groups, counts):
        shape, layer_dtype = layer_cache_layout(model, spec, 1, block_size, dtype)
        sizes.append(math.prod(shape) * layer_dtype.itemsize * count)
    return sizes


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. Zeros, not empty: padded slots of a gathered block are masked,
    but 0 * NaN would still leak.

    On the CPU an anonymous private mapping hands out zero pages on first touch, so a multi-GiB
    cache costs nothing until used (torch.zeros writes every byte up front). It asks for small
    pages: on the 2-core VM of docs/benchmarks.md a huge page's first touch ran at 0.33-0.43
    GB/s against 2.2-2.4 for 4 KB pages, and KV writes (which touch fresh blocks) took 2.4 s of
    a 64-prompt run with huge pages against 0.6 s without; decode attention read the same.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    # the tensor keeps the mapping alive; it is unmapped with the last reference
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def determine_num_blocks(
    config: EngineConfig,
    platform: Platform,
    stage: StagePlan,
    bytes_per_block: list[int],
    profile_forward: ProfileForward,
) -> tuple[int, ...]:
    """Blocks of each KV cache group (`bytes_per_block[group]` bytes each over this stage's
    layers) that fit this worker's KV budget (never more than the scheduler could use)."""
    cache_config, scheduler_config = config.cache_config, config.scheduler_config
    if cache_config.num_gpu_blocks_override is not None:
        return (cache_config.num_gpu_blocks_override,) * len(bytes_per_block)
    device = platform.device
    if device.type == "cuda":
        if any(worker.is_cpu for worker in stage.workers):
            # The CPU ranks of a mixed tensor-parallel group size their KV cache without a
            # forward pass, so a profiling forward here would wait in its collectives for
            # them forever: take the planner's estimate of one full step's activations.
            peak = estimated_activation_bytes(config)
        else:
            # Activations of one full step, measured by a profiling forward pass.
            peak = profile_activation_bytes(device, profile_forward)
        # Read after the forward: what it allocated outside torch's caching allocator
        # (cuBLAS workspaces, NCCL buffers, lazily loaded kernels) stays and must count.
        free, total = platform.free_and_total_memory()
        budget = gpu_kv_budget(
            total,
            free,
            cache_config.gpu_memory_utilization,
            peak,
            torch.cuda.memory_allocated(device),
            cache_config.max_gpu_memory_bytes,
        )
    else:
        available, _ = platform.free_and_total_memory()
        plan = config.plan
        cpu_workers = [worker for worker in plan.workers() if worker.is_cpu]
        # The default budget is a share of this machine's RAM: split it among the CPU
        # workers on this cluster node; an explicit one is the whole plan's.
        here = plan.workers_on_node(stage.node)
        if cache_config.kv_cache_memory_bytes:
            sharing = cpu_workers
        else:
            sharing = [worker for worker in here if worker.is_cpu]
        fixed = cpu_fixed_bytes(config, cpu_workers) if cache_config.max_cpu_memory_bytes else 0
        budget = cpu_kv_budget(
            available,
            len(sharing),
            cache_config.kv_cache_memory_bytes,
            cache_config.max_cpu_memory_bytes,
            fixed,
        )
    # No point in more blocks than max_num_seqs full-length sequences (a sliding group: than
    # they hold within their window).
    groups = kv_cache_groups(config.model_config.hf_config)
    needs = group_block_needs(
        groups,
        cache_config.block_size,
        scheduler_config.max_num_seqs,
        scheduler_config.max_model_len,
        scheduler_config.max_num_batched_tokens,
    )
    num_blocks = split_kv_budget(budget, bytes_per_block, needs, groups)
    for spec, n in zip(groups, num_blocks):
        if n < (2 if spec.is_sliding else 1):
            raise ValueError(
                f"no memory left for the KV cache on {device} (budget {budget} bytes, "
                f"{bytes_per_block} bytes per block of each KV cache group): lower "
                "max_model_len or raise the memory budget"
            )
    return tuple(int(n) for n in num_blocks)


def _model_size(config: EngineConfig) -> ModelSize:
    model_config = config.model_config
    return model_size(model_config.hf_config, model_config.dtype, model_config.cpu_blocks)


def estimated_activation_bytes(config: EngineConfig) -> int:
    """The planner's bound on one full step's activations."""
    return _model_size(config).activation_bytes(config.scheduler_config.max_num_batched_tokens)


def cpu_fixed_bytes(config: EngineConfig, cpu_workers: list[WorkerPlacement]) -> int:
    """Weights and activation workspace of every CPU worker (they share the host's RAM),
    counted as the planner counts them."""
    size = _model_size(config)
    plan = config.plan
    weights = sum(worker_weight_bytes(size, plan.stage_of(w.rank), w.tp_rank) for w in cpu_workers)
    weights += sum(host_expert_bytes(size, stage) for stage in plan.stages)  # GPU stages' MoE
    max_tokens = config.scheduler_config.max_num_batched_tokens
    return weights + len(cpu_workers) * size.activation_bytes(max_tokens)


def profile_activation_bytes(device: torch.device, profile_forward: ProfileForward) -> int:
    """Peak device memory of `profile_forward` beyond what was allocated before its forward
    (its temporary KV cache excluded: the real one is budgeted on its own)."""
    base = 0

    def cache_ready() -> None:
        nonlocal base
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)

    profile_forward(cache_ready)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    return int(peak)


def profile_sampling_metadata(num_rows: int, device: torch.device) -> SamplingMetadata:
    """`num_rows` rows that take the sampler's most costly path (top-k, top-p, penalties,
    logprobs), for a profiling step."""
    params = SamplingParams(
        temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1, logprobs=5
    )
    return SamplingMetadata.build([params] * num_rows, [[0]] * num_rows, [[0]] * num_rows, device)
