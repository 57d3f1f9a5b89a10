"""All-reduce latency among CPU ranks on one node: shared memory (Communicator) vs gloo loopback.

Spawns `--ranks` processes that join a TP group (`init_tp_group`) and time, for hidden x
batch tensors, `Communicator.all_reduce` (the shared-memory path) against `dist.all_reduce`
on the same ranks' gloo group. Prints the median microseconds per call (rank 0's clock).

    PYTHONPATH=. python benchmarks/bench_allreduce.py [--ranks 2] [--hidden 4096] [--iters 200]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

import torch
import torch.distributed as dist

from hybridllm.distributed.parallel_groups import destroy_groups, init_tp_group
from hybridllm.plan.plan import Plan

SPAWN = mp.get_context("spawn")
BATCHES = (1, 8, 64, 256)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _time_us(fn, tensor: torch.Tensor, iters: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn(tensor)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn(tensor)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def _rank_main(rank: int, world: int, init_method: str, args, results) -> None:
    torch.set_num_threads(1)
    plan = Plan.uniform([["cpu"] * world], num_layers=1)
    tp = init_tp_group(plan, rank, init_method, torch.device("cpu"), shm_slot_bytes=16 << 20)
    comm = tp.communicator
    rows = []
    for dtype_name in args.dtypes.split(","):
        for batch in BATCHES:
            x = torch.randn(batch, args.hidden).to(DTYPES[dtype_name])
            dist.barrier(group=comm.cpu_group)
            shm_us = _time_us(comm.all_reduce, x, args.iters)
            dist.barrier(group=comm.cpu_group)
            gloo_us = _time_us(lambda t: dist.all_reduce(t, group=comm.cpu_group), x, args.iters)
            rows.append((dtype_name, batch, x.numel() * x.element_size(), shm_us, gloo_us))
    if rank == 0:
        results.put(rows)
    tp.close()
    destroy_groups()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--dtypes", default="bf16,fp32")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = SPAWN.Queue()
    procs = [
        SPAWN.Process(
            target=_rank_main, args=(r, args.ranks, f"tcp://127.0.0.1:{port}", args, results)
        )
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    rows = results.get(timeout=600)
    for p in procs:
        p.join()
    print(f"all-reduce among {args.ranks} CPU ranks, hidden {args.hidden}, median of {args.iters}")
    print(f"{'dtype':>5} {'batch':>5} {'bytes':>9} {'shm us':>9} {'gloo us':>9} {'speedup':>8}")
    for dtype_name, batch, nbytes, shm_us, gloo_us in rows:
        print(
            f"{dtype_name:>5} {batch:>5} {nbytes:>9} {shm_us:>9.1f} {gloo_us:>9.1f} "
            f"{gloo_us / shm_us:>7.1f}x"
        )


if __name__ == "__main__":
    main()
