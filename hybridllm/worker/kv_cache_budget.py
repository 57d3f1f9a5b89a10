"""How many bytes a worker may spend on its KV cache, from its device's memory and the caps."""

from __future__ import annotations

from collections.abc import Sequence

from hybridllm.engine.kv_cache_groups import KVCacheGroupSpec, cdiv

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


def group_block_needs(
    groups: Sequence[KVCacheGroupSpec],
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> list[int]:
    """Most blocks each KV cache group can use: a full group max_num_seqs whole sequences; a
    sliding group with window W what max_num_seqs sequences hold once their blocks out of the
    window are freed (ceil((W - 1) / block_size) + 2 each: the window's and the straddling
    ones) plus one step's chunks (max_num_batched_tokens) and its null block, and never more
    than the full-attention count; a state group one slot per request."""
    full = max_num_seqs * cdiv(max_model_len, block_size)
    needs = []
    for spec in groups:
        if spec.is_state:  # a state slot per running request
            needs.append(max_num_seqs)
            continue
        if spec.sliding_window is None:
            needs.append(full)
            continue
        per_seq = cdiv(spec.sliding_window - 1, block_size) + 2
        step = cdiv(max_num_batched_tokens, block_size)
        needs.append(min(full, max_num_seqs * per_seq + step) + 1)
    return needs


def split_kv_budget(
    budget: int,
    bytes_per_block: Sequence[int],
    needs: Sequence[int],
    groups: Sequence[KVCacheGroupSpec],
) -> list[int]:
    """Blocks of each KV cache group from one worker's `budget` bytes.

    A state group (linear attention) first: a slot for each of the requests it may run (its
    need), from at most half the budget, since each slot can be large (Qwen3-Next-80B: 79 MB
    over its 36 linear layers) and every running request needs paged KV beside it; then the
    paged groups share the rest (`split_paged_kv_budget`).
    """
    state = [i for i, spec in enumerate(groups) if spec.is_state]
    paged = [i for i, spec in enumerate(groups) if not spec.is_state]
    blocks = [0] * len(groups)
    for i in state:
        per_slot = bytes_per_block[i]
        # half, unless this worker holds no paged layer
        share = budget // 2 if any(bytes_per_block[j] for j in paged) else budget
        blocks[i] = needs[i] if per_slot == 0 else min(needs[i], share // per_slot)
        budget -= blocks[i] * per_slot
    if paged:
        rest = split_paged_kv_budget(
            budget,
            [bytes_per_block[i] for i in paged],
            [needs[i] for i in paged],
            groups[paged[0]].is_full,
        )
        for i, n in zip(paged, rest):
            blocks[i] = n
    return blocks


def split_paged_kv_budget(
    budget: int, bytes_per_block: Sequence[int], needs: Sequence[int], first_is_full: bool
) -> list[int]:
    """Blocks of each KV cache group from one worker's `budget` bytes.

    One group takes what fits (at most its need). With a full group (the first,
    `first_is_full`), the largest full-group count n whose total fits, each sliding group
    getting min(its need, n + 1): a sliding group never holds more blocks than the full group
    does for the same requests (+1, its null block), and its need (what max_num_seqs requests
    use within their windows) is all it can use; so a roomy budget goes to the full group and a
    short one does not strand blocks in sliding groups. Without a full group every group gets
    the same fraction of its need. A group none of this worker's layers hold
    (bytes_per_block 0) reports its need, so that the workers' minimum is set by the others.
    """
    if len(needs) == 1:
        return [min(budget // bytes_per_block[0], needs[0]) if bytes_per_block[0] else needs[0]]
    if first_is_full:

        def blocks(n: int) -> list[int]:
            return [n, *(min(need, n + 1) for need in needs[1:])]

        def cost(n: int) -> int:
            return sum(b * k for b, k in zip(bytes_per_block, blocks(n)))

        low, high = 0, needs[0]  # the largest n in [low, high] with cost(n) <= budget
        while low < high:
            mid = (low + high + 1) // 2
            if cost(mid) <= budget:
                low = mid
            else:
                high = mid - 1
        return [n if b else need for n, b, need in zip(blocks(low), bytes_per_block, needs)]
    total = sum(b * n for b, n in zip(bytes_per_block, needs))
    fraction = min(1.0, budget / max(1, total))
    return [n if b == 0 else int(n * fraction) for b, n in zip(bytes_per_block, needs)]
