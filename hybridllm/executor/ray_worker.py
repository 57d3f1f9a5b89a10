"""The Ray actor that hosts one worker: a `WorkerProcess`, exactly as an `mp` process runs it."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from hybridllm.worker.worker_process import WorkerProcess, WorkerProcessArgs


class RayWorker:
    """One worker of the plan inside a Ray actor (the actor is its process).

    `start` builds the worker (joining torch.distributed and the pipeline edges) and returns
    its queue handles; `run` then serves the engine's broadcast queue until shutdown and
    returns the exit code, so a finished `run` means the worker stopped, and a `run` that
    raises means the actor died (Ray says how).
    """

    def __init__(self) -> None:
        self.process: WorkerProcess | None = None

    def start(self, args: WorkerProcessArgs) -> tuple[dict[str, Any], int]:
        placement = args.config.plan.workers()[args.rank]
        if not placement.is_cpu:
            # Ray shows the actor only the GPU of its bundle (CUDA_VISIBLE_DEVICES)
            args = replace(args, device="cuda:0")
        self.process = WorkerProcess(args)
        return self.process.handles(), os.getpid()

    def run(self) -> int:
        try:
            return self.process.run()
        finally:
            self.process.close()  # unlinks this worker's segments before the actor is killed
