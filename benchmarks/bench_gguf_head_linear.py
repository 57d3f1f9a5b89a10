"""Micro-benchmark: hybridllm::gguf_head_linear (per-head GGUF matrices) vs torch.bmm in fp32 and
vs one gguf_linear call a head.

DeepSeek MLA's absorbed decode products at B rows (default 1) and 128 heads: W_UK^T [512 out,
128 in] a head and W_UV [128, 512], in Q8_0, Q5_0 (llama.cpp's attn_k_b) and Q4_K / Q6_K
(attn_v_b; rows of 512 only). Each time is the median of 9 batches of calls; every call takes
the next of several copies of the weights that together exceed the last-level cache, as a
decode step meets each layer's weights once ("cold"). GB/s: the weight bytes a call reads (fp32
for bmm, the blocks for the GGUF ops) over its time.
Run: `PYTHONPATH=. python benchmarks/bench_gguf_head_linear.py [--batch 1] [--threads 2]`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time

import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from hybridllm.layers.cpu_kernels import load_cpu_kernels
from hybridllm.loader.gguf_dequant import dequantize

HEADS = 128
# (name, in, out, formats)
SHAPES = [
    ("W_UK^T", 128, 512, [Q.Q8_0, Q.Q5_0]),
    ("W_UV", 512, 128, [Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K]),
]


def median_seconds(fn, min_time: float) -> tuple[float, float]:
    """(median, fastest) of 9 timed batches of calls, each about min_time / 9 long, after a
    warm-up. On a shared machine the fastest says what the kernel does when it has the cores."""
    fn()
    t0 = time.perf_counter()
    fn()
    calls = max(1, int(min_time / 9 / max(time.perf_counter() - t0, 1e-7)))
    samples = []
    for _ in range(9):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples), min(samples)


def k_quant_blocks(fmt: Q, rows: int, k: int) -> torch.Tensor:
    """Plausible K-quant super-blocks (the gguf package does not quantize them): random bytes,
    small positive fp16 d (and dmin)."""
    from tests.gguf_helpers import random_k_quant_blocks

    return torch.from_numpy(random_k_quant_blocks((rows, k), fmt))


def cycle(tensor: torch.Tensor, cold_mb: int):
    copies = [tensor.clone() for _ in range(max(2, cold_mb * 2**20 // tensor.nbytes + 1))]
    return itertools.cycle(copies)


def cell(fn, nbytes: int, min_time: float) -> str:
    """ms at the median, GB/s of `nbytes` at the median (and for the fastest batch)."""
    t, fast = median_seconds(fn, min_time)
    return f"{t * 1e3:6.3f} {nbytes / t / 1e9:5.1f} ({nbytes / fast / 1e9:5.1f})"


def bench_bmm(x: torch.Tensor, w: torch.Tensor, args: argparse.Namespace) -> str:
    """torch.bmm of x [B, H, in] against fp32 w [H, out, in]."""
    xt, weights = x.transpose(0, 1), cycle(w, args.cold_mb)
    return cell(lambda: torch.bmm(xt, next(weights).transpose(1, 2)), w.nbytes, args.min_time)


def bench_format(x: torch.Tensor, w: torch.Tensor, fmt: Q, args: argparse.Namespace) -> list[str]:
    """gguf_head_linear (fp32, int8 activations) and gguf_linear a head at a time (same) on w
    [H, out, in] in GGUF blocks of fmt."""
    heads, n, k = w.shape
    if fmt in (Q.Q4_K, Q.Q6_K):
        raw = k_quant_blocks(fmt, heads * n, k)
    else:
        raw = torch.from_numpy(quantize(w.reshape(heads * n, k).numpy(), fmt))
    qweight = raw.reshape(heads, n, -1)
    weight = dequantize(raw.numpy(), fmt, (heads * n, k)).reshape(heads, n, k)
    head_op, linear = torch.ops.hybridllm.gguf_head_linear, torch.ops.hybridllm.gguf_linear
    y = head_op(x, qweight, int(fmt), n)
    ref = torch.einsum("bhk,hnk->bhn", x.double(), weight.double())
    assert torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max())
    blocks = cycle(qweight, args.cold_mb)

    def per_head(activations: int) -> None:
        q = next(blocks)
        for h in range(heads):
            linear(x[:, h], q[h], int(fmt), n, activations)

    cells = []
    for activations in (0, 1):
        fn = functools.partial(lambda a: head_op(x, next(blocks), int(fmt), n, a), activations)
        cells.append(cell(fn, qweight.nbytes, args.min_time))
    for activations in (0, 1):
        cells.append(cell(functools.partial(per_head, activations), qweight.nbytes, args.min_time))
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1, help="rows of x (decode tokens)")
    parser.add_argument("--cold-mb", type=int, default=256, help="MB of weight copies")
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds per measurement")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert load_cpu_kernels(), "native CPU kernels unavailable (no compiler, or disabled)"
    torch.manual_seed(0)
    print(
        f"threads={torch.get_num_threads()}, B={args.batch}, H={HEADS}; each cell: ms per call"
        " (median), GB/s at the median (GB/s of the fastest batch)"
    )
    print(
        f"{'product':>7} {'in->out':>8} {'fmt':>5} {'bmm fp32':>20} {'head_linear':>20}"
        f" {'head int8':>20} {'gguf_linear x128':>20} {'x128 int8':>20}"
    )
    for name, k, n, formats in SHAPES:
        w = torch.randn(HEADS, n, k) * 0.05
        x = torch.randn(args.batch, HEADS, k)
        bmm = bench_bmm(x, w, args)
        for fmt in formats:
            cells = [bmm, *bench_format(x, w, fmt, args)]
            print(f"{name:>7} {f'{k}->{n}':>8} {fmt.name:>5} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
