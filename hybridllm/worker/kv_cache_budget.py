"""How many bytes a worker may spend on its KV cache, from its device's memory and the caps."""

from __future__ import annotations

GiB = 1 << 30
# Without --kv-cache-memory, the CPU workers together take at most this much of the free RAM.
CPU_DEFAULT_KV_BYTES = 4 * GiB
CPU_DEFAULT_KV_FRACTION = 0.3


def gpu_kv_budget(
    total: int,
    free: int,
    utilization: float,
    activation_peak: int,
    allocated_by_worker: int,
    max_gpu_memory: int | None,
) -> int:
    """KV bytes on one GPU.

    `utilization` caps the whole card (everything already used on it counts, other processes
    included); `max_gpu_memory` caps this worker alone: its weights (`allocated_by_worker`),
    one step's activations and the KV cache together, as the planner assumed.
    """
    budget = int(total * utilization) - (total - free) - activation_peak
    if max_gpu_memory is not None:
        budget = min(budget, max_gpu_memory - allocated_by_worker - activation_peak)
    return budget


def cpu_kv_budget(
    available: int,
    num_cpu_workers: int,
    kv_cache_memory: int | None,
    max_cpu_memory: int | None,
    fixed_bytes_on_cpu: int,
) -> int:
    """KV bytes of one CPU worker; the CPU workers of a plan share the host's RAM evenly.

    `kv_cache_memory` is the CPU workers' KV cache together; without it, a default share of the
    free RAM, and never more than what `max_cpu_memory` leaves after the CPU workers' weights and
    activation workspace (`fixed_bytes_on_cpu`).
    """
    num_cpu_workers = max(1, num_cpu_workers)
    if kv_cache_memory is not None:
        total = kv_cache_memory
        if total > available:
            raise ValueError(
                f"kv_cache_memory ({total} bytes) exceeds available RAM ({available} bytes)"
            )
    else:
        total = min(CPU_DEFAULT_KV_BYTES, int(available * CPU_DEFAULT_KV_FRACTION))
        if max_cpu_memory is not None:
            total = min(total, max_cpu_memory - fixed_bytes_on_cpu)
    return total // num_cpu_workers


def profile_spans(
    max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int
) -> list[tuple[int, int, int]]:
    """The biggest step the scheduler can send, as (start, query length, context length) per
    sequence: the one a GPU worker runs to measure its activation peak.

    A step holds up to `max_num_batched_tokens` tokens of at most `max_num_seqs` sequences, none
    past `max_model_len`. A budget below `max_model_len` (chunked prefill) is at worst the last
    chunk of the longest prompt, attending to a whole `max_model_len` context; otherwise as few
    sequences as hold the budget, each a whole prompt (the longest attention there is).
    """
    if max_num_batched_tokens < max_model_len:
        return [(max_model_len - max_num_batched_tokens, max_num_batched_tokens, max_model_len)]
    spans: list[tuple[int, int, int]] = []
    left = max_num_batched_tokens
    while left > 0 and len(spans) < max_num_seqs:
        n = min(left, max_model_len)
        spans.append((0, n, n))
        left -= n
    return spans
