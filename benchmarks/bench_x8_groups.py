"""One weight matrix through `gguf_linear` from its type's own rows and from its x8 groups.

For each type and shape: random weights quantized by `gguf.quants.quantize` (random valid
blocks for the types it cannot quantize: the K-quants, IQ4_NL), repacked into groups of 8 rows
(`repack_x8`), then both forms timed on the same random rows of x (int8 activations),
alternating call by call in this one process so that both meet the machine's drifts alike;
prints the median time of each and their ratio, and the largest difference of the two results
relative to the largest output. Matrices larger than the last-level cache are
read from DRAM at every call (the two forms evict each other).

    python benchmarks/bench_x8_groups.py --types Q8_0 Q4_1 --shapes 49152x576 3072x576 \
        --rows 1 5 8 16 [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridllm.layers.cpu_kernels import load_cpu_kernels  # noqa: E402
from hybridllm.layers.gguf_linear import INT8_ACTIVATIONS, X8_TYPES, repack_x8  # noqa: E402
from tests.gguf_helpers import random_k_quant_blocks  # noqa: E402
from tests.gguf_random_blocks import FP16_OFFSETS, random_blocks  # noqa: E402

Q = GGMLQuantizationType


def random_rows(fmt: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, bytes] blocks of random weights where gguf can quantize the type; else random codes
    under valid fp16 fields: the tests' K-quant and code-block helpers, IQ4_NL's d its first two
    bytes."""
    try:
        return quantize(rng.standard_normal((n, k), np.float32), fmt)
    except NotImplementedError:
        pass
    seed = int(rng.integers(2**31))
    if fmt in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return random_k_quant_blocks((n, k), Q(fmt), seed)
    if fmt in FP16_OFFSETS:
        return random_blocks(fmt, n, k, torch.Generator().manual_seed(seed)).numpy()
    block_weights, block_bytes = GGML_QUANT_SIZES[Q(fmt)]
    blocks = rng.integers(0, 256, (n * k // block_weights, block_bytes), dtype=np.uint8)
    blocks[:, :2] = rng.uniform(0.01, 0.1, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", nargs="+", default=["Q8_0"], help="GGML types with an x8 form")
    ap.add_argument("--shapes", nargs="+", default=["49152x576"], help="N x K (rows x columns)")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 5, 7, 8, 16])
    ap.add_argument("--calls", type=int, default=100, help="timed calls of each form")
    args = ap.parse_args()
    if not load_cpu_kernels() or not torch.ops.hybridllm.x8_source_types():
        raise SystemExit(
            "needs the native kernels with x8 groups (AVX512-VNNI, or AVX2's K-quants)"
        )
    op = torch.ops.hybridllm.gguf_linear
    rng = np.random.default_rng(0)
    for name in args.types:
        fmt = int(Q[name])
        if fmt not in torch.ops.hybridllm.x8_source_types():
            raise SystemExit(
                f"this build computes no {name} in x8 groups (those with an x8 form: {sorted(X8_TYPES)})"
            )
        for shape in args.shapes:
            n, k = (int(v) for v in shape.split("x"))
            rows = torch.from_numpy(random_rows(fmt, n, k, rng))
            groups, x8_type = repack_x8(rows, fmt)
            forms = {"rows": (rows, fmt), "x8": (groups, x8_type)}
            for m in args.rows:
                x = torch.randn(m, k)
                outputs = {f: op(x, w, t, n, INT8_ACTIVATIONS) for f, (w, t) in forms.items()}
                diff = (outputs["rows"] - outputs["x8"]).abs().max() / outputs["rows"].abs().max()
                times: dict[str, list[float]] = {f: [] for f in forms}
                for _ in range(args.calls):
                    for f, (w, t) in forms.items():
                        start = time.perf_counter()
                        op(x, w, t, n, INT8_ACTIVATIONS)
                        times[f].append(time.perf_counter() - start)
                plain, x8 = (statistics.median(times[f]) for f in forms)
                print(
                    f"{name} {n}x{k} rows of x {m}: own rows {plain * 1e3:.3f} ms, x8 groups "
                    f"{x8 * 1e3:.3f} ms, x8 / rows {x8 / plain:.2f} (difference {diff:.1e})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
