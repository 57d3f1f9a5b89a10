"""Contiguous shards of a count (layers, heads, rows) in proportion to weights.

Plain arithmetic that the planner (layer splits, tensor-parallel shares) and the tensor-parallel
layers (their heads and rows) both need; it lives below both so neither imports the other.
"""

from __future__ import annotations


def partition(total: int, weights: tuple[float, ...], align: int = 1) -> list[tuple[int, int]]:
    """Split `total` units into contiguous [start, end) ranges proportional to `weights`.

    Every boundary is a multiple of `align` (e.g. a KV-head group) and every range gets at
    least `align` units while `total` allows it. Equal weights give equal shards.
    """
    if total % align:
        raise ValueError(f"total {total} is not a multiple of align {align}")
    if not weights or any(w <= 0 for w in weights):
        raise ValueError(f"weights must be positive, got {weights}")
    units = total // align
    n = len(weights)
    if units < n:
        raise ValueError(f"cannot split {units} units of {align} among {n} shards")
    scale = sum(weights)
    # Largest-remainder rounding, then make sure nobody gets zero units.
    raw = [units * w / scale for w in weights]
    counts = [max(1, int(r)) for r in raw]
    while sum(counts) > units:
        # Take back from the most over-served shard that can spare a unit (never below one).
        spare = [j for j in range(n) if counts[j] > 1]
        i = max(spare, key=lambda j: (counts[j] - raw[j], counts[j]))
        counts[i] -= 1
    while sum(counts) < units:
        i = max(range(n), key=lambda j: raw[j] - counts[j])
        counts[i] += 1
    ranges, start = [], 0
    for c in counts:
        ranges.append((start * align, (start + c) * align))
        start += c
    return ranges
