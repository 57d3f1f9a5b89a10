"""What the `mp` and `ray` executors share: driving out-of-process workers over MessageQueues."""

from __future__ import annotations

import atexit
import logging
import signal
import time
from abc import abstractmethod
from typing import Any

from hybridllm.config import EngineConfig
from hybridllm.distributed.message_queue import MessageQueue, WriterDiedError
from hybridllm.engine.errors import EngineDeadError
from hybridllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from hybridllm.executor.executor import Executor
from hybridllm.executor.shutdown import GRACEFUL_S, SHUTDOWN_BOUND_S, Deadline
from hybridllm.worker.worker_process import EXIT_FAILED, EXIT_PEER_DIED

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often a waiting engine checks that every worker still lives


class QueueExecutor(Executor):
    """Workers outside the engine's process, each running `WorkerProcess.run`.

    The engine broadcasts every SchedulerOutput and RPC through one MessageQueue
    (`_broadcast`); each worker answers RPCs through a response queue of its own; the
    output worker (last stage, tp rank 0) sends each step's ModelRunnerOutput through an
    output queue. Stages pass activations between themselves, never through the engine.

    Subclasses start the workers and say whether they still run (`_exited`); a worker
    that stops turns the next wait into an EngineDeadError naming it, within about
    `POLL_S`, and the rest are then stopped and everything is freed.

    Shutdown (and the teardown after a death) finishes within `SHUTDOWN_BOUND_S`: every wait
    in it takes its share of one deadline, workers get `GRACEFUL_S` of it to stop by
    themselves and are then stopped by force.
    """

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        plan = config.plan
        self._placements = plan.workers()
        self._output_rank = plan.stages[-1].workers[0].rank
        self._broadcast: MessageQueue | None = None
        self._responses: list[MessageQueue] = []
        self._output: MessageQueue | None = None
        self._dead: EngineDeadError | None = None
        self._closed = False
        self._num_submitted = 0
        self._num_collected = 0

    # ---- what a subclass provides --------------------------------------------------------------

    @abstractmethod
    def _exited(self) -> dict[int, int | str]:
        """Workers that no longer run: rank -> exit code, or a text saying how it died."""

    @abstractmethod
    def _stop_workers(self, grace: Deadline | None, deadline: Deadline) -> None:
        """Let every worker stop by itself until `grace` (None: no grace), then stop the rest;
        all by `deadline`."""

    @abstractmethod
    def _describe(self, rank: int) -> str:
        """'worker rank R (pipeline stage S, tp rank T, device D, ...)'."""

    def _any_exited(self) -> bool:
        return bool(self._exited())

    # ---- start-up --------------------------------------------------------------------------------

    def _connect(self, handles: list[dict]) -> None:
        """Attach to every worker's queues and link the stages (same-node edges)."""
        plan = self.config.plan
        self._responses = [MessageQueue.attach(h["response"], 0) for h in handles]
        self._output = MessageQueue.attach(handles[self._output_rank]["output"], 0)
        edges = {
            stage.pp_rank: handles[stage.workers[0].rank]["activations"]
            for stage in plan.stages[:-1]
        }
        self._broadcast_and_gather(("connect", edges), "connect")

    # ---- the executor interface ------------------------------------------------------------------

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

    # ---- transport -------------------------------------------------------------------------------

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
                return queue.dequeue(timeout=POLL_S)
            except WriterDiedError:
                raise self._fail() from None
            except TimeoutError:
                if self._any_exited():
                    raise self._fail() from None

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise RuntimeError("the executor was shut down")

    def check_health(self) -> None:
        self._check_alive()
        if self._any_exited():
            raise self._fail()

    # ---- failure and shutdown --------------------------------------------------------------------

    def _fail(self, reported: dict[int, tuple[int, str]] | None = None) -> EngineDeadError:
        """Describe the dead worker(s), stop the rest, free everything; returns the error.

        `reported`: rank -> (exit code, traceback) of "fatal" replies already read.
        """
        reported = dict(reported or {})
        time.sleep(POLL_S)  # let a peer's death, and any last words, arrive
        for rank, queue in enumerate(self._responses):
            while rank not in reported:
                try:
                    kind, payload = queue.dequeue(timeout=0)
                except (TimeoutError, RuntimeError):
                    break
                if kind == "fatal":
                    reported[rank] = payload
        exited = self._exited()
        codes = {r: code for r, (code, _) in reported.items()} | exited
        # Root causes: workers that failed by themselves, not those that saw a peer go.
        causes = [r for r in sorted(codes) if codes[r] not in (0, EXIT_PEER_DIED)]
        causes = causes or sorted(codes)
        lines = [f"{self._describe(r)} {exit_reason(codes[r])}" for r in causes]
        # everyone else: stopped below if it has not stopped by itself on seeing its peer go
        # (whether it had, by now, is a race: a stage that never waits on the dead one would not)
        followers = [p.rank for p in self._placements if p.rank not in causes]
        if followers:
            lines.append("then stopped: " + ", ".join(self._describe(r) for r in followers))
        lines += [reported[r][1].rstrip() for r in causes if r in reported]
        self._dead = EngineDeadError("engine is dead: " + "\n".join(lines))
        logger.error("%s", self._dead)
        self._teardown(grace=None)
        return self._dead

    def shutdown(self) -> None:
        if self._closed:
            return
        deadline = Deadline(SHUTDOWN_BOUND_S)
        grace: Deadline | None = deadline.within(GRACEFUL_S)
        if self._dead is None and self._broadcast is not None and self._started():
            try:
                # A full ring whose readers are alive but not reading waits; a dead reader
                # ends the wait at once (ReaderDiedError).
                self._broadcast.enqueue(("shutdown",), timeout=grace.remaining())
            except (TimeoutError, RuntimeError):
                grace = None
        else:
            grace = None
        self._teardown(grace, deadline)

    def _started(self) -> bool:
        """Whether any worker was started (a shutdown message has someone to reach)."""
        return True

    def _shut_down_at_exit(self) -> None:
        """Shut down at interpreter exit before the exit hooks registered so far run.

        Called once whatever starts the workers is imported: exit hooks run last registered
        first, and those of that machinery must come after this one (multiprocessing's joins
        its children without a timeout; Ray's disconnects, after which a Ray call would start
        a new connection, to a cluster that may be gone). The registration holds the executor
        until it is shut down, which its owner does (the engine, an LLM's finalizer).
        """
        atexit.register(self.shutdown)

    def _teardown(self, grace: Deadline | None, deadline: Deadline | None = None) -> None:
        """Stop every worker (after `grace`, if any), close every queue end, free what is
        left; by `deadline`."""
        deadline = deadline or Deadline(SHUTDOWN_BOUND_S)
        self._closed = True
        atexit.unregister(self.shutdown)
        try:
            self._stop_workers(grace, deadline)
        finally:
            for queue in [*self._responses, self._output, self._broadcast]:
                if queue is not None:
                    queue.close()
            self._after_teardown(deadline)

    def _after_teardown(self, deadline: Deadline) -> None:
        """Free what only exists once the queues are closed (subclasses), by `deadline`."""


def exit_reason(code: int | str) -> str:
    """How a worker ended, from its exit code (or the text its executor has)."""
    if isinstance(code, str):
        return f"died: {code}"
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
