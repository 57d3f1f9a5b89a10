"""A pool of spawned processes that run test cases as the ranks of a torch.distributed world."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

SPAWN = mp.get_context("spawn")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, inbox, outbox) -> None:
    import torch

    torch.set_num_threads(1)  # the CI machine has 2 cores shared by every rank
    while True:
        job = inbox.get()
        if job is None:
            return
        fn, args = job
        try:
            outbox.put((rank, True, fn(rank, *args)))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))


class RankPool:
    """`size` worker processes, started once and reused: spawning one costs seconds.

    `run(fn, world_size, *args)` calls `fn(rank, init_method, *args)` on ranks
    0..world_size-1 (a fresh tcp:// init_method per run) and returns their results in rank
    order. If a rank raises or the run times out, every worker is killed (the others may be
    stuck in a collective) and the next run starts fresh ones.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._procs: list = []
        self._inboxes: list = []
        self._outbox = None

    def _start(self) -> None:
        self._outbox = SPAWN.Queue()
        self._inboxes = [SPAWN.Queue() for _ in range(self.size)]
        self._procs = [
            SPAWN.Process(target=_serve, args=(r, self._inboxes[r], self._outbox), daemon=True)
            for r in range(self.size)
        ]
        for p in self._procs:
            p.start()

    def pids(self) -> list[int]:
        if not self._procs:
            self._start()
        return [p.pid for p in self._procs]

    def run(
        self,
        fn: Callable,
        world_size: int,
        *args: Any,
        timeout_s: float = 60,
        may_exit: frozenset[int] = frozenset(),
    ) -> list:
        """Results in rank order; a rank in `may_exit` whose process ends gives None."""
        if world_size > self.size:
            raise ValueError(f"the pool has {self.size} processes, {world_size} requested")
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        init_method = f"tcp://127.0.0.1:{free_port()}"
        for r in range(world_size):
            self._inboxes[r].put((fn, (init_method, *args)))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < world_size:
            try:
                rank, ok, value = self._outbox.get(timeout=0.1)
            except queue.Empty:
                for r in set(range(world_size)) - set(results):
                    if not self._procs[r].is_alive():
                        if r not in may_exit:
                            self.close(graceful=False)
                            raise AssertionError(f"{fn.__name__}: rank {r} died") from None
                        results[r] = None
                if time.monotonic() > deadline:
                    self.close(graceful=False)
                    raise TimeoutError(
                        f"{fn.__name__}: ranks {sorted(set(range(world_size)) - set(results))} "
                        f"did not finish within {timeout_s} s"
                    ) from None
                continue
            if not ok:
                self.close(graceful=False)
                raise AssertionError(f"{fn.__name__} failed on rank {rank}:\n{value}")
            results[rank] = value
        return [results[r] for r in range(world_size)]

    def close(self, graceful: bool = True) -> None:
        """Stop the workers: politely when idle, by kill when stuck or not `graceful`."""
        for p, inbox in zip(self._procs, self._inboxes):
            if p.is_alive() and graceful:
                inbox.put(None)
        for p in self._procs:
            p.join(timeout=2 if graceful else 0)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs, self._inboxes, self._outbox = [], [], None
