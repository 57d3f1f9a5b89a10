"""DeepSeek MLA decode attention (absorbed form): hybridllm::mla_decode_attention vs torch.

DeepSeek-V3's shape by default (128 heads, latent rows of 512 + 64), batch 1: the native op
against the torch form (index_select of the sequence's blocks, the rows widened to fp32,
q @ rows.T, softmax, p @ rows[:, :latent]), the two interleaved over --rounds rounds (each
round a median of 3 calls), reporting the rounds' median and best and the speed-up of the
medians, for every context length and cache dtype.

    python benchmarks/bench_mla_decode.py [--contexts 512 4096] [--threads N] [--library F.so]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def torch_form(query, cache, table, length, scale, latent):
    """One sequence's rows gathered, then two matmuls and a softmax; query [H, D] -> [H, latent]."""
    rows = cache.index_select(0, table).flatten(0, 1)[:length].float()
    p = torch.softmax(torch.matmul(query, rows.T) * scale, dim=-1)
    return torch.matmul(p, rows[:, :latent])


def median_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_case(op, args, context: int, dtype: torch.dtype) -> tuple[list[float], list[float]]:
    """Each round's native and torch ms, one batch-1 sequence of `context` tokens in shuffled
    blocks."""
    dim, bs = args.latent + args.rope, args.block_size
    blocks = -(-context // bs)
    g = torch.Generator().manual_seed(context)
    cache = torch.randn(blocks + 8, bs, dim, generator=g).to(dtype)
    table = torch.randperm(blocks + 8, generator=g)[:blocks].to(torch.int32)
    query = torch.randn(1, args.heads, dim, generator=g)
    lens = torch.tensor([context], dtype=torch.int32)
    scale = dim**-0.5

    def native():
        return op(query, cache, table[None], lens, scale, args.latent)

    def ref():
        return torch_form(query[0], cache, table, context, scale, args.latent)

    torch.testing.assert_close(native()[0], ref(), rtol=1e-3, atol=1e-4)
    native_ms, torch_ms = [], []
    for _ in range(args.rounds):  # interleaved: both see the same machine load
        native_ms.append(median_ms(native, 3))
        torch_ms.append(median_ms(ref, 3))
    return native_ms, torch_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--latent", type=int, default=512)
    parser.add_argument("--rope", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--library", help="load this built kernel library instead of building")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.library:
        torch.ops.load_library(args.library)
    else:
        from hybridllm.layers.cpu_kernels import load_cpu_kernels

        assert load_cpu_kernels(), "the native CPU kernels did not build"
    op = torch.ops.hybridllm.mla_decode_attention
    dim = args.latent + args.rope
    print(f"threads {torch.get_num_threads()}, heads {args.heads}, D {dim}, latent {args.latent}")
    print("| context | cache | native ms (median / best) | torch ms (median / best) | speed-up |")
    print("|---|---|---|---|---|")
    for context in args.contexts:
        for name in args.dtypes:
            native, ref = time_case(op, args, context, getattr(torch, name))
            a, b = statistics.median(native), statistics.median(ref)
            cells = f"{a:.3f} / {min(native):.3f} | {b:.3f} / {min(ref):.3f} | {b / a:.2f}x"
            print(f"| {context} | {name} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
