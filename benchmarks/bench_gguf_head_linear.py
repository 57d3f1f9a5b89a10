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


def median_seconds(fn, min_time: float) -> float:
    """Median over 9 timed batches of calls, each about min_time / 9 long, after a warm-up."""
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
    return statistics.median(samples)


def k_quant_blocks(fmt: Q, rows: int, k: int) -> torch.Tensor:
    """Plausible K-quant super-blocks (the gguf package does not quantize them): random bytes,
    small positive fp16 d (and dmin)."""
    from tests.gguf_helpers import random_k_quant_blocks

    return torch.from_numpy(random_k_quant_blocks((rows, k), fmt))


def cycle(tensor: torch.Tensor, cold_mb: int):
    copies = [tensor.clone() for _ in range(max(2, cold_mb * 2**20 // tensor.nbytes + 1))]
    return itertools.cycle(copies)


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
    head_op, linear = torch.ops.hybridllm.gguf_head_linear, torch.ops.hybridllm.gguf_linear
    print(f"threads={torch.get_num_threads()}, B={args.batch}, H={HEADS}; ms per call (median)")
    print(
        f"{'product':>7} {'in->out':>8} {'fmt':>5} {'bmm fp32':>17} {'head_linear':>17}"
        f" {'head int8':>17} {'gguf_linear x128':>17} {'x128 int8':>17}"
    )
    for name, k, n, formats in SHAPES:
        w = torch.randn(HEADS, n, k) * 0.05
        x = torch.randn(args.batch, HEADS, k)
        xt = x.transpose(0, 1)
        fp32 = cycle(w, args.cold_mb)
        t_bmm = median_seconds(
            lambda: torch.bmm(xt, next(fp32).transpose(1, 2)), args.min_time
        )
        bmm_cell = f"{t_bmm * 1e3:6.3f} {w.nbytes / t_bmm / 1e9:5.1f} GB/s"
        for fmt in formats:
            if fmt in (Q.Q4_K, Q.Q6_K):
                raw = k_quant_blocks(fmt, HEADS * n, k)
            else:
                raw = torch.from_numpy(quantize(w.reshape(HEADS * n, k).numpy(), fmt))
            qweight = raw.reshape(HEADS, n, -1)
            weight = dequantize(raw.numpy(), fmt, (HEADS * n, k)).reshape(HEADS, n, k)
            y = head_op(x, qweight, int(fmt), n)
            ref = torch.einsum("bhk,hnk->bhn", x.double(), weight.double())
            assert torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max())
            blocks = cycle(qweight, args.cold_mb)
            cells = [bmm_cell]

            def cell(fn):
                t = median_seconds(fn, args.min_time)
                return f"{t * 1e3:6.3f} {qweight.nbytes / t / 1e9:5.1f} GB/s"

            for activations in (0, 1):
                cells.append(cell(lambda a=activations: head_op(x, next(blocks), int(fmt), n, a)))
            for activations in (0, 1):

                def per_head(a=activations):
                    q = next(blocks)
                    for h in range(HEADS):
                        linear(x[:, h], q[h], int(fmt), n, a)

                cells.append(cell(per_head))
            print(f"{name:>7} {f'{k}->{n}':>8} {fmt.name:>5} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
