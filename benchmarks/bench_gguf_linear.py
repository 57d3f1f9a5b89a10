"""Micro-benchmark: hybridllm::gguf_linear (GGUF blocks) vs F.linear on the fp32-dequantized weight.

SmolLM2-135M's linear shapes (Q4_1; the tied LM head is Q8_0) at several batch sizes M, then the
same shapes as plain fp32 weights (the op's F32 type, which CPU workers use where torch's BLAS
lacks AVX-512 kernels: `own_f32_gemm_preferred`); "int8": the op with int8 activations. "GB/s"
is the op's quantized-weight read rate at M=1: "hot" calls one weight again and again (it stays
in cache), "cold" cycles through copies larger than the last-level cache, as a decode step does.
Run: `PYTHONPATH=. python benchmarks/bench_gguf_linear.py [--cold-mb 512]`.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from hybridllm.layers.cpu_kernels import load_cpu_kernels
from hybridllm.loader.gguf_dequant import dequantize

# (name, in_features K, out_features N, format)
SHAPES = [
    ("q/o_proj", 576, 576, Q.Q4_1),
    ("k/v_proj", 576, 192, Q.Q4_1),
    ("gate/up", 576, 1536, Q.Q4_1),
    ("down", 1536, 576, Q.Q4_1),
    ("lm_head", 576, 49152, Q.Q8_0),
]
SHAPES += [(name, k, n, Q.F32) for name, k, n, _ in SHAPES]
M_VALUES = [1, 4, 16, 64, 512, 2048]


def seconds_per_call(fn, min_time: float) -> float:
    """Fastest of 7 timed batches, each about min_time/7 long, after a warm-up call.

    The minimum, not the median: on a shared machine the slow samples are other work.
    """
    fn()
    t0 = time.perf_counter()
    fn()
    calls = max(1, int(min_time / 7 / max(time.perf_counter() - t0, 1e-7)))
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def bench_shape(op, name: str, k: int, n: int, fmt: Q, args: argparse.Namespace) -> None:
    """One table row per M for the weight shape [n, k] in format fmt."""
    if fmt == Q.F32:
        weight = torch.randn(n, k) * 0.05
        raw = weight.view(torch.uint8).numpy()  # the op reads the floats' own bytes
    else:
        raw = quantize(torch.randn(n, k).numpy() * 0.05, fmt)
        weight = dequantize(raw, fmt, (n, k))  # fp32 [N, K]
    qweight = torch.from_numpy(raw)
    for m in M_VALUES:
        if n > 10_000 and m > 512:
            continue  # the LM head runs on sampling rows only, never a whole prefill chunk
        x = torch.randn(m, k)
        t_op = seconds_per_call(lambda x=x: op(x, qweight, int(fmt), n), args.min_time)
        t_ref = seconds_per_call(lambda x=x: F.linear(x, weight), args.min_time)
        line = f"{name:>9} {f'{k}->{n}':>11} {fmt.name:>4} {m:>4} {t_op * 1e3:8.3f}"
        line += f" {t_ref * 1e3:8.3f} {t_op / t_ref:6.2f}"
        if fmt != Q.F32:  # the op with int8 activations (activations=1): kernels or int8 GEMM
            t_int8 = seconds_per_call(lambda x=x: op(x, qweight, int(fmt), n, 1), args.min_time)
            line += f"  int8 {t_int8 * 1e3:8.3f}"
        if m == 1:
            # cycle through copies of the weight that together exceed the last-level cache
            copies = [qweight.clone() for _ in range(max(2, args.cold_mb * 2**20 // raw.nbytes))]
            order = itertools.cycle(copies)
            t_cold = seconds_per_call(
                lambda x=x, o=order: op(x, next(o), int(fmt), n), args.min_time
            )
            line += f"   {raw.nbytes / 1e3:6.0f} KB: hot {raw.nbytes / t_op / 1e9:5.1f} GB/s,"
            line += f" cold {raw.nbytes / t_cold / 1e9:5.1f} GB/s"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold-mb", type=int, default=512, help="MB of weight copies (cold)")
    parser.add_argument("--min-time", type=float, default=0.25, help="seconds per measurement")
    args = parser.parse_args()
    assert load_cpu_kernels(), "native CPU kernels unavailable (no compiler, or disabled)"
    torch.manual_seed(0)
    blas = "AVX-512" if torch.ops.hybridllm.blas_has_avx512_kernels() else "no AVX-512"
    print(f"threads={torch.get_num_threads()}, BLAS kernels: {blas}")
    print("ms per call (fastest batch); ratio = op / F.linear")
    print(f"{'shape':>9} {'K->N':>11} {'fmt':>4} {'M':>4} {'op':>8} {'F.linear':>8} {'ratio':>6}")
    for name, k, n, fmt in SHAPES:
        bench_shape(torch.ops.hybridllm.gguf_linear, name, k, n, fmt, args)


if __name__ == "__main__":
    main()
