"""`mp` executor: one spawned process per worker, driven over shared-memory MessageQueues."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
import weakref
from multiprocessing.connection import wait
from typing import Any

from hybridllm.config import EngineConfig
from hybridllm.distributed.message_queue import (
    MessageQueue,
    WriterDiedError,
    cleanup_stale_socket_dirs,
)
from hybridllm.distributed.shm_segment import cleanup_stale_segments
from hybridllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from hybridllm.executor.executor import EngineDeadError, Executor
from hybridllm.worker.worker_process import (
    EXIT_FAILED,
    EXIT_PEER_DIED,
    WorkerProcessArgs,
    run_worker,
)

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often a waiting engine checks that every worker process still lives
_STARTUP_TIMEOUT_S = 600.0  # spawn + torch import + communicator set-up, on a slow machine
_SHUTDOWN_TIMEOUT_S = 5.0  # graceful exit before SIGTERM, then SIGKILL


class MultiprocExecutor(Executor):
    """Workers in their own processes (spawn: safe with CUDA and gloo, as the seed found).

    The engine broadcasts every SchedulerOutput and RPC through one MessageQueue; each
    worker answers RPCs through a response queue of its own; the output worker (last
    stage, tp rank 0) sends each step's ModelRunnerOutput through an output queue. Stages
    pass activations through per-edge shared-memory channels, never through the engine.

    A worker that dies turns the next wait into an EngineDeadError naming it, within
    about `_POLL_S`; the other workers are then stopped and every segment is unlinked.
    """

    def __init__(self, config: EngineConfig, show_progress: bool = False):
        super().__init__(config)
        plan = config.plan
        self._placements = plan.workers()
        self._output_rank = plan.stages[-1].workers[0].rank
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._responses: list[MessageQueue] = []
        self._output: MessageQueue | None = None
        self._dead: EngineDeadError | None = None
        self._closed = False
        self._num_submitted = 0
        self._num_collected = 0
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
        try:
            handles = self._start_workers(show_progress)
            self._responses = [MessageQueue.attach(h["response"], 0) for h in handles]
            self._output = MessageQueue.attach(handles[self._output_rank]["output"], 0)
            edges = {
                stage.pp_rank: handles[stage.workers[0].rank]["activations"]
                for stage in plan.stages[:-1]
            }
            self._broadcast_and_gather(("connect", edges), "connect")
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

    # ---- the executor interface ---------------------------------------------------------------

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        return self._broadcast_and_gather(("rpc", method, tuple(args), kwargs or {}), method)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> int:
        self._send(("execute", scheduler_output))
        self._num_submitted += 1
        return self._num_submitted - 1

    def get_output(self, handle: int) -> ModelRunnerOutput:
        if handle != self._num_collected:
            raise ValueError(
                f"get_output({handle}): steps are collected in submission order; "
                f"the next one is {self._num_collected}"
            )
        self._check_alive()
        output = self._receive(self._output, self._output_rank)
        self._num_collected += 1
        return output

    def embed(self, prompts: list[list[int]], pooling: str, normalize: bool) -> list[list[float]]:
        if pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
        results = self._broadcast_and_gather(("embed", prompts, pooling, normalize), "embed")
        return results[self._output_rank]

    # ---- transport ----------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        self._check_alive()
        try:
            self._broadcast.enqueue(message)  # ReaderDiedError soon after a reader dies
        except TimeoutError:
            raise self._fail() from None

    def _broadcast_and_gather(self, message: tuple, what: str) -> list[Any]:
        """Send `message` to every worker and collect one answer from each, in rank order."""
        self._send(message)
        results, errors = [], []
        for rank, queue in enumerate(self._responses):
            kind, payload = self._receive(queue, rank)
            if kind == "fatal":
                raise self._fail({rank: payload})
            if kind == "error":
                errors.append(payload)
            results.append(payload)
        if errors:
            raise RuntimeError(f"{what} failed on {len(errors)} worker(s):\n" + "\n".join(errors))
        return results

    def _receive(self, queue: MessageQueue, rank: int) -> Any:
        """The next message from `rank`'s queue, watching every worker while waiting."""
        while True:
            try:
                return queue.dequeue(timeout=_POLL_S)
            except WriterDiedError:
                raise self._fail() from None
            except TimeoutError:
                if any(not p.is_alive() for p in self._procs):
                    raise self._fail() from None

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise RuntimeError("the executor was shut down")

    def check_health(self) -> None:
        self._check_alive()
        if any(not p.is_alive() for p in self._procs):
            raise self._fail()

    # ---- failure and shutdown -----------------------------------------------------------------

    def _fail(self, reported: dict[int, tuple[int, str]] | None = None) -> EngineDeadError:
        """Describe the dead worker(s), stop the rest, free everything; returns the error.

        `reported`: rank -> (exit code, traceback) of "fatal" replies already read.
        """
        reported = dict(reported or {})
        time.sleep(_POLL_S)  # let a peer's death, and any last words, arrive
        for rank, queue in enumerate(self._responses):
            while rank not in reported:
                try:
                    kind, payload = queue.dequeue(timeout=0)
                except (TimeoutError, RuntimeError):
                    break
                if kind == "fatal":
                    reported[rank] = payload
        exited = {r: p.exitcode for r, p in enumerate(self._procs) if not p.is_alive()}
        codes = {r: code for r, (code, _) in reported.items()} | exited
        # Root causes: workers that failed by themselves, not those that saw a peer go.
        causes = [r for r in sorted(codes) if codes[r] not in (0, EXIT_PEER_DIED)]
        causes = causes or sorted(codes)
        lines = [f"{self._describe(r)} {_exit_reason(codes[r])}" for r in causes]
        followers = [r for r in sorted(codes) if r not in causes]
        if followers:
            lines.append("then stopped: " + ", ".join(self._describe(r) for r in followers))
        lines += [reported[r][1].rstrip() for r in causes if r in reported]
        self._dead = EngineDeadError("engine is dead: " + "\n".join(lines))
        logger.error("%s", self._dead)
        self._teardown(graceful=False)
        return self._dead

    def shutdown(self) -> None:
        if self._closed:
            return
        graceful = self._dead is None and bool(self._procs)
        if graceful:
            try:
                self._broadcast.enqueue(("shutdown",), timeout=_SHUTDOWN_TIMEOUT_S)
            except (TimeoutError, RuntimeError):
                graceful = False
        self._teardown(graceful)

    def _teardown(self, graceful: bool) -> None:
        """Join (or stop) every worker, close every queue end, unlink leftover segments."""
        self._closed = True
        deadline = time.monotonic() + (_SHUTDOWN_TIMEOUT_S if graceful else 0.0)
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(timeout=1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=1.0)
        for queue in [*self._responses, self._output, self._broadcast]:
            if queue is not None:
                queue.close()
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


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    if code == EXIT_FAILED:
        return f"failed with an exception (exit code {code})"
    if code == EXIT_PEER_DIED:
        return f"stopped because a peer process died (exit code {code})"
    return f"exited with code {code}"


_MAIN_GUARD_ADVICE = (
    "Worker processes are started with spawn, which runs the main script's top-level code "
    "again in every worker: the script that creates the engine must guard its top-level "
    'code with `if __name__ == "__main__":` (put the LLM(...) call and what uses it under it).'
)


def _main_script() -> str | None:
    """The main script's path, which spawn re-imports in every worker; None if there is none
    (interactive, `python -c`)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return os.path.abspath(path) if path else None
