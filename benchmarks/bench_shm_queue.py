"""Round-trip latency of a small message: MessageQueue (shm, zmq-only) vs multiprocessing.Queue.

An echo process dequeues each message from one queue and enqueues it on a second one;
the parent times enqueue -> echo -> dequeue. Run: `PYTHONPATH=. python benchmarks/bench_shm_queue.py`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

from hybridllm.distributed.message_queue import MessageQueue
from hybridllm.distributed.spin_timer import SpinPolicy

SPAWN = mp.get_context("spawn")


def _echo_message_queue(inbox_handle, outbox_handles, done, remote_ranks, n_messages) -> None:
    inbox = MessageQueue.attach(inbox_handle, 0)
    outbox = MessageQueue(1, remote_reader_ranks=remote_ranks, spin_policy=inbox_handle.spin_policy)
    outbox_handles.put(outbox.export_handle())
    for _ in range(n_messages):
        outbox.enqueue(inbox.dequeue(timeout=60), timeout=60)
    done.wait(60)  # keep the outbox alive until the parent has read everything
    outbox.close()
    inbox.close()


def _echo_mp_queue(inbox, outbox, n_messages: int) -> None:
    for _ in range(n_messages):
        outbox.put(inbox.get(timeout=60))


def _summarize(name: str, seconds: list[float]) -> str:
    us = sorted(s * 1e6 for s in seconds)
    p99 = us[min(len(us) - 1, int(len(us) * 0.99))]
    return f"{name:<28} {statistics.median(us):>9.1f} {statistics.fmean(us):>9.1f} {p99:>9.1f}"


def bench_message_queue(
    payload: bytes, iters: int, warmup: int, remote: bool, policy: SpinPolicy
) -> list[float]:
    ranks = [0] if remote else []
    to_echo = MessageQueue(1, remote_reader_ranks=ranks, spin_policy=policy)
    outbox_handles, done = SPAWN.Queue(), SPAWN.Event()
    echo = SPAWN.Process(
        target=_echo_message_queue,
        args=(to_echo.export_handle(), outbox_handles, done, ranks, warmup + iters),
    )
    echo.start()
    from_echo = MessageQueue.attach(outbox_handles.get(timeout=60), 0)
    times = []
    for i in range(warmup + iters):
        start = time.perf_counter()
        to_echo.enqueue(payload, timeout=60)
        assert from_echo.dequeue(timeout=60) == payload
        if i >= warmup:
            times.append(time.perf_counter() - start)
    done.set()
    echo.join(60)
    from_echo.close()
    to_echo.close()
    return times


def bench_mp_queue(payload: bytes, iters: int, warmup: int) -> list[float]:
    inbox, outbox = SPAWN.Queue(), SPAWN.Queue()
    echo = SPAWN.Process(target=_echo_mp_queue, args=(inbox, outbox, warmup + iters))
    echo.start()
    times = []
    for i in range(warmup + iters):
        start = time.perf_counter()
        inbox.put(payload)
        assert outbox.get(timeout=60) == payload
        if i >= warmup:
            times.append(time.perf_counter() - start)
    echo.join(60)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=4096, help="message size in bytes")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--spin-us", type=float, default=SpinPolicy.spin_s * 1e6)
    args = parser.parse_args()
    policy = SpinPolicy(spin_s=args.spin_us * 1e-6)
    payload = os.urandom(args.size)
    print(
        f"round trip of a {args.size}-byte message, {args.iters} iterations, cpus={os.cpu_count()}"
    )
    print(f"{'transport':<28} {'median us':>9} {'mean us':>9} {'p99 us':>9}")
    runs = {
        "MessageQueue (shm ring)": lambda: bench_message_queue(
            payload, args.iters, args.warmup, remote=False, policy=policy
        ),
        "MessageQueue (zmq, remote)": lambda: bench_message_queue(
            payload, args.iters, args.warmup, remote=True, policy=policy
        ),
        "multiprocessing.Queue": lambda: bench_mp_queue(payload, args.iters, args.warmup),
    }
    for name, run in runs.items():
        print(_summarize(name, run()), flush=True)


if __name__ == "__main__":
    main()
