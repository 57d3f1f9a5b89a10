"""The main loop of one worker process (`mp` executor) or Ray actor, and its message protocol.

Engine -> workers, on the broadcast MessageQueue (every worker reads every message):
    ("connect", {pp_rank: Handle})    attach to the previous stage's activation channel (an
                                      edge between nodes is a torch.distributed group instead,
                                      made at start-up)
    ("execute", SchedulerOutput)      one step; nothing is answered except by the output worker
    ("embed", prompts, pooling, normalize)
    ("rpc", method, args, kwargs)
    ("shutdown",)
Worker -> engine at start-up, on a pipe: ("started", None), then ("ready", handles) or
("error", traceback) (a Ray actor returns the handles from its start call instead).
Worker -> engine, on the worker's own response MessageQueue, for everything but "execute":
    ("ok", result) | ("error", traceback) | ("fatal", (exit_code, traceback))
The last stage's tp-rank-0 worker (the output worker) also writes each step's
ModelRunnerOutput to its output MessageQueue. "fatal" means the worker is exiting: a failure
inside the pipeline (execute, embed, connect) leaves the other stages out of step.
"""

from __future__ import annotations

import signal
import sys
import traceback
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

from hybridllm.config import EngineConfig
from hybridllm.distributed.auth_store import StoreHandle
from hybridllm.distributed.message_queue import (
    Handle,
    MessageQueue,
    ReaderDiedError,
    WriterDiedError,
)
from hybridllm.distributed.world import World
from hybridllm.engine.scheduler_output import SchedulerOutput
from hybridllm.progress import LoggingSetup, apply_setup
from hybridllm.worker.dist_pipeline_channel import (
    DistPipelineReceiver,
    DistPipelineSender,
    create_edge_groups,
)
from hybridllm.worker.pipeline_channel import PipelineReceiver, PipelineSender
from hybridllm.worker.worker import Worker

EXIT_OK = 0
EXIT_FAILED = 1  # the worker's own exception
EXIT_PEER_DIED = 3  # a queue peer (another worker, or the engine mid-step) died first

_REPLY_TIMEOUT_S = 5.0  # a "fatal" reply must not keep a dying worker around for long
_RESPONSE_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class WorkerProcessArgs:
    """Everything a spawned worker (or Ray actor) needs; pickled to it."""

    config: EngineConfig
    rank: int
    broadcast: Handle
    tp_init_method: str | None
    show_progress: bool
    # Multi-node (the ray executor): the engine's cluster node (a worker on another one
    # answers over TCP with CURVE), the address this worker binds its sockets to, the
    # authenticated store it joins torch.distributed through, and its device as this process
    # sees it (Ray shows an actor only its own GPU, as cuda:0).
    engine_node: str | None = None
    host: str = "127.0.0.1"
    store: StoreHandle | None = field(default=None, repr=False)
    device: str | None = None
    # The engine's logging: spawn starts a worker unconfigured, which hides INFO lines such
    # as the kernel build's (None: leave this process's logging as it is).
    logging: LoggingSetup | None = None


def run_worker(args: WorkerProcessArgs, ready_pipe: Connection) -> None:
    """Process target: build the worker, report its queue handles, serve until shutdown."""
    # Ctrl-C reaches the whole process group; the engine decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Past spawn's bootstrap (which re-imports the main script): tells the engine a death
    # from then on is not a missing `if __name__ == "__main__":` guard.
    ready_pipe.send(("started", None))
    try:
        process = WorkerProcess(args)
    except BaseException:
        ready_pipe.send(("error", traceback.format_exc()))
        ready_pipe.close()
        sys.exit(EXIT_FAILED)
    try:
        ready_pipe.send(("ready", process.handles()))
        ready_pipe.close()
        code = process.run()
    finally:
        process.close()
    sys.exit(code)


class WorkerProcess:
    """A Worker plus its transport: broadcast in, responses out, activations between stages."""

    def __init__(self, args: WorkerProcessArgs):
        if args.logging is not None:
            apply_setup(args.logging)
        config = args.config
        plan = config.plan
        self.placement = plan.workers()[args.rank]
        self.stage = plan.stage_of(args.rank)
        self.name = (
            f"worker rank {args.rank} (pipeline stage {self.placement.pp_rank}, "
            f"tp rank {self.placement.tp_rank}, device {self.placement.device})"
        )
        # Answers to an engine on another node go over TCP (CURVE), bound to `host`.
        remote = dict(remote_host=args.host)
        if args.engine_node is not None and self.stage.node != args.engine_node:
            remote["remote_reader_ranks"] = (0,)
        self.world: World | None = None
        self.broadcast = MessageQueue.attach(args.broadcast, args.rank)
        self.response = MessageQueue(
            1, max_chunk_bytes=_RESPONSE_CHUNK_BYTES, max_chunks=4, **remote
        )
        self.output: MessageQueue | None = None
        self.next_stage: PipelineSender | DistPipelineSender | None = None
        self.prev_stage: PipelineReceiver | DistPipelineReceiver | None = None
        lead = self.placement.tp_rank == 0
        crosses = {s.pp_rank for s, n in zip(plan.stages, plan.stages[1:]) if s.node != n.node}
        if lead and self.stage.has_lm_head:
            # Up to pipeline_parallel_size outputs wait for the engine; never block on it.
            chunks = plan.pipeline_parallel_size + 2
            self.output = MessageQueue(
                1, max_chunk_bytes=_RESPONSE_CHUNK_BYTES, max_chunks=chunks, **remote
            )
        elif lead and self.stage.pp_rank not in crosses:
            self.next_stage = PipelineSender(config, num_receivers=plan.tensor_parallel_size)
        if args.store is not None:
            self.world = World(args.rank, plan.world_size, args.store, args.host)
        placement = self.placement
        if args.device is not None:
            placement = replace(placement, device=args.device)
        self.worker = Worker(
            config,
            placement,
            owns_process=True,
            tp_init_method=args.tp_init_method,
            show_progress=args.show_progress,
        )
        if crosses:
            # Collective over the world: every worker creates every edge's group, in order.
            edges = create_edge_groups(plan)
            device = self.worker.device
            if lead and self.stage.pp_rank in edges:
                self.next_stage = DistPipelineSender(edges[self.stage.pp_rank], device)
            if self.stage.pp_rank - 1 in edges:
                self.prev_stage = DistPipelineReceiver(edges[self.stage.pp_rank - 1], device)

    def handles(self) -> dict[str, Handle | None]:
        return {
            "response": self.response.export_handle(),
            "output": self.output.export_handle() if self.output else None,
            "activations": (
                self.next_stage.export_handle()
                if isinstance(self.next_stage, PipelineSender)
                else None
            ),
        }

    def run(self) -> int:
        """Serve messages until shutdown; returns the process exit code."""
        while True:
            try:
                message = self.broadcast.dequeue()
            except WriterDiedError:
                return EXIT_OK  # the engine is gone: nobody is left to serve
            kind = message[0]
            if kind == "shutdown":
                return EXIT_OK
            try:
                self._handle(kind, message[1:])
            except (WriterDiedError, ReaderDiedError) as e:
                return self._reply_fatal(EXIT_PEER_DIED, f"{self.name}: a peer process died: {e}")
            except Exception:
                text = f"{self.name} failed in {kind!r}:\n{traceback.format_exc()}"
                return self._reply_fatal(EXIT_FAILED, text)

    def _handle(self, kind: str, body: tuple) -> None:
        if kind == "execute":
            self._execute(body[0])
        elif kind == "embed":
            self.response.enqueue(("ok", self._embed(*body)))
        elif kind == "connect":
            if not self.stage.has_embedding and self.prev_stage is None:  # same node
                handle = body[0][self.placement.pp_rank - 1]
                self.prev_stage = PipelineReceiver(handle, self.placement.tp_rank)
            self.response.enqueue(("ok", None))
        elif kind == "rpc":
            self._rpc(*body)
        else:
            raise ValueError(f"unknown message kind {kind!r}")

    def _execute(self, so: SchedulerOutput) -> None:
        activations = None
        if self.prev_stage is not None and not so.is_empty:
            activations = self.prev_stage.recv()
        result = self.worker.execute_model(so, activations)
        if self.next_stage is not None and result is not None:
            self.next_stage.send(result)
        elif self.output is not None:
            self.output.enqueue(result)

    def _embed(self, prompts: list[list[int]], pooling: str, normalize: bool) -> Any:
        activations = self.prev_stage.recv() if self.prev_stage is not None else None
        result = self.worker.embed(prompts, pooling, normalize, activations)
        if self.stage.has_lm_head:
            return result
        if self.next_stage is not None:
            self.next_stage.send(result)
        return None

    def _rpc(self, method: str, args: tuple, kwargs: dict) -> None:
        try:
            result = getattr(self.worker, method)(*args, **kwargs)
        except Exception:
            # Outside the pipeline the worker stays usable: report and carry on.
            self.response.enqueue(("error", f"{self.name}: {traceback.format_exc()}"))
            return
        self.response.enqueue(("ok", result))

    def _reply_fatal(self, exit_code: int, text: str) -> int:
        """Tell the engine why this worker is about to exit; returns the exit code."""
        try:
            self.response.enqueue(("fatal", (exit_code, text)), timeout=_REPLY_TIMEOUT_S)
        except (TimeoutError, RuntimeError):
            pass  # the engine is gone or not listening; the exit code still tells
        return exit_code

    def close(self) -> None:
        """Close every queue end (this process's segments are unlinked) and the TP group."""
        for end in (self.prev_stage, self.next_stage, self.output, self.response, self.broadcast):
            if end is not None:
                end.close()
        self.worker.close()
        if self.world is not None:
            self.world.close()
