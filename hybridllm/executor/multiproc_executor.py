"""`mp` executor: one spawned process per worker, driven over shared-memory MessageQueues."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import weakref
from multiprocessing.connection import wait

from hybridllm.config import EngineConfig
from hybridllm.distributed.message_queue import MessageQueue, cleanup_stale_socket_dirs
from hybridllm.distributed.shm_segment import cleanup_stale_segments
from hybridllm.executor.queue_executor import QueueExecutor
from hybridllm.executor.shutdown import Deadline
from hybridllm.progress import current_setup
from hybridllm.worker.worker_process import WorkerProcessArgs, run_worker

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 600.0  # spawn + torch import + communicator set-up, on a slow machine
_TERMINATE_S = 1.0  # SIGTERM ends a worker at once unless it is stopped or deep in the kernel
_KILL_S = 1.0  # SIGKILL cannot be caught: this is for the kernel to reap it


class MultiprocExecutor(QueueExecutor):
    """Workers in their own processes (spawn: safe with CUDA and gloo, as the seed found).

    Driven as every `QueueExecutor` is; stages pass activations through per-edge
    shared-memory channels. A worker that dies turns the next wait into an EngineDeadError
    naming it (with its exit code), within about `POLL_S`; the other workers are then
    stopped and every segment is unlinked.
    """

    def __init__(self, config: EngineConfig, show_progress: bool = False):
        super().__init__(config)
        plan = config.plan
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._rendezvous_dir: str | None = None
        self._remove_rendezvous_dir: weakref.finalize | None = None
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # This is a spawned process re-importing the main script (multiprocessing sets
            # the flag while it does): the script builds an engine at import time. Say so
            # before creating anything, instead of multiprocessing's generic error.
            # spawn runs the script as __mp_main__ and installs it as __main__ only after
            script = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "(unknown)"
            raise RuntimeError(
                "this worker process (started with spawn) is re-importing the main script "
                f"{os.path.abspath(script)}, and that script creates an engine while being "
                "imported. " + _MAIN_GUARD_ADVICE
            )
        cleanup_stale_segments()  # leftovers of an earlier run killed by a signal
        cleanup_stale_socket_dirs()
        self._broadcast = MessageQueue(plan.world_size, max_chunks=plan.pipeline_parallel_size + 4)
        self._shut_down_at_exit()
        try:
            self._connect(self._start_workers(show_progress))
        except BaseException:
            self.shutdown()
            raise

    # ---- start-up -----------------------------------------------------------------------------

    def _start_workers(self, show_progress: bool) -> list[dict]:
        """Spawn every worker and wait for each one's queue handles."""
        ctx = multiprocessing.get_context("spawn")
        tp_init = None
        if self.config.plan.tensor_parallel_size > 1:
            tp_init = self._private_rendezvous()
        pipes = []
        for placement in self._placements:
            receive, send = ctx.Pipe(duplex=False)
            args = WorkerProcessArgs(
                self.config,
                placement.rank,
                self._broadcast.export_handle(),
                tp_init,
                show_progress and placement.rank == 0,
                logging=current_setup(),
            )
            proc = ctx.Process(
                target=run_worker,
                args=(args, send),
                name=f"hybridllm-worker-{placement.rank}",
                daemon=True,  # never outlive the engine's interpreter
            )
            proc.start()
            send.close()
            self._procs.append(proc)
            pipes.append(receive)
        handles: list[dict | None] = [None] * len(pipes)
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        pending = set(range(len(pipes)))
        started: set[int] = set()  # ranks whose process got as far as run_worker
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                names = ", ".join(self._describe(r) for r in sorted(pending))
                raise TimeoutError(f"workers did not start within {_STARTUP_TIMEOUT_S} s: {names}")
            wait(
                [pipes[r] for r in pending] + [self._procs[r].sentinel for r in pending], remaining
            )
            for rank in sorted(pending):
                if pipes[rank].poll():
                    try:
                        kind, payload = pipes[rank].recv()
                    except EOFError:
                        kind, payload = "error", self._silent_exit(rank, rank in started)
                    if kind == "started":
                        started.add(rank)
                        continue
                    if kind == "error":
                        raise RuntimeError(f"{self._describe(rank)} failed to start:\n{payload}")
                    handles[rank] = payload
                    pending.discard(rank)
                    pipes[rank].close()
                elif not self._procs[rank].is_alive():
                    reason = self._silent_exit(rank, rank in started)
                    raise RuntimeError(f"{self._describe(rank)} failed to start:\n{reason}")
        return handles

    def _silent_exit(self, rank: int, started: bool) -> str:
        """Why a worker that died without reporting did; one that never reached run_worker
        failed in spawn's bootstrap, which re-imports the main script."""
        proc = self._procs[rank]
        proc.join(timeout=5.0)  # its pipe closed: the exit code is moments away
        code = proc.exitcode if proc.exitcode is not None else "unknown"
        if started:
            return f"it exited (exit code {code}) without reporting"
        script = _main_script()
        if script is None:  # spawn re-imports nothing: its arguments failed to unpickle
            return f"it exited (exit code {code}) before running any worker code"
        return (
            f"it exited (exit code {code}) before running any worker code, while re-importing "
            f"the main script {script} (its traceback is on stderr above). " + _MAIN_GUARD_ADVICE
        )

    def _private_rendezvous(self) -> str:
        """A torch.distributed init_method only this user's processes can join: a FileStore
        in a new mode-0700 directory (no port to race for, nothing reachable by others),
        removed at shutdown or exit."""
        self._rendezvous_dir = tempfile.mkdtemp(prefix="hybridllm-tp-")
        self._remove_rendezvous_dir = weakref.finalize(
            self, shutil.rmtree, self._rendezvous_dir, ignore_errors=True
        )
        return "file://" + os.path.join(self._rendezvous_dir, "store")

    # ---- the worker processes -------------------------------------------------------------------

    def _exited(self) -> dict[int, int | str]:
        return {r: p.exitcode for r, p in enumerate(self._procs) if not p.is_alive()}

    def _any_exited(self) -> bool:
        return any(not p.is_alive() for p in self._procs)

    def _started(self) -> bool:
        return bool(self._procs)

    def _stop_workers(self, grace: Deadline | None, deadline: Deadline) -> None:
        """Join every worker process (until `grace`), then terminate, then kill what is left.

        A worker that is stopped (SIGSTOP), stuck in a collective with a dead peer or busy in
        a long step never reads "shutdown": the signals reach it anyway. They are sent even
        when the deadline is spent; only the waits for them are bounded.
        """
        left = _join_all(self._procs, grace or deadline.within(0.0))
        for proc in left:
            proc.terminate()
        left = _join_all(left, deadline.within(_TERMINATE_S))
        for proc in left:
            proc.kill()
        left = _join_all(left, deadline.within(_KILL_S))
        if left:
            names = ", ".join(self._describe(self._procs.index(p)) for p in left)
            logger.warning("worker process(es) not gone after SIGKILL: %s", names)

    def _after_teardown(self, deadline: Deadline) -> None:
        # Workers stopped by a signal could not unlink their own segments or socket dirs.
        cleanup_stale_segments()
        cleanup_stale_socket_dirs()
        if self._remove_rendezvous_dir is not None:
            self._remove_rendezvous_dir()

    def _describe(self, rank: int) -> str:
        p = self._placements[rank]
        pid = self._procs[rank].pid if rank < len(self._procs) else None
        return (
            f"worker rank {rank} (pipeline stage {p.pp_rank}, tp rank {p.tp_rank}, "
            f"device {p.device}, pid {pid})"
        )


_MAIN_GUARD_ADVICE = (
    "Worker processes are started with spawn, which runs the main script's top-level code "
    "again in every worker: the script that creates the engine must guard its top-level "
    'code with `if __name__ == "__main__":` (put the LLM(...) call and what uses it under it).'
)


def _join_all(
    procs: list[multiprocessing.process.BaseProcess], deadline: Deadline
) -> list[multiprocessing.process.BaseProcess]:
    """Wait until every process in `procs` has exited or `deadline` passes; those still alive."""
    alive = [p for p in procs if p.is_alive()]
    while alive and not deadline.expired():
        wait([p.sentinel for p in alive], deadline.remaining())
        alive = [p for p in alive if p.is_alive()]  # is_alive reaps an exited one
    return alive


def _main_script() -> str | None:
    """The main script's path, which spawn re-imports in every worker; None if there is none
    (interactive, `python -c`)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return os.path.abspath(path) if path else None
