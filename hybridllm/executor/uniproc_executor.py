"""`uni` executor: every worker lives in the engine's own process; stages hand over by reference."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from hybridllm.config import EngineConfig
from hybridllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from hybridllm.executor.executor import Executor
from hybridllm.worker.intermediate_tensors import IntermediateTensors
from hybridllm.worker.worker import Worker


@dataclass
class MicroBatch:
    """One submitted step on its way through the stages."""

    scheduler_output: SchedulerOutput
    next_stage: int = 0
    activations: IntermediateTensors | None = None  # output of stage next_stage - 1
    output: ModelRunnerOutput | None = None  # set once the last stage ran


class UniProcExecutor(Executor):
    """Runs the plan's workers (one per stage; no tensor parallelism) in this process.

    Pipelined steps advance as a wavefront: each tick runs every micro-batch in flight
    through its next stage, newest first. The newest one is on the earliest stage, so a
    GPU stage's kernels are queued (CUDA runs them asynchronously) before a later CPU
    stage computes an older micro-batch, and the two devices work at the same time. Each
    stage still sees the steps in submission order, which its request state relies on.
    """

    def __init__(self, config: EngineConfig, show_progress: bool = False):
        super().__init__(config)
        self.workers: list[Worker] = [
            Worker(config, placement, show_progress=show_progress)
            for placement in config.plan.workers()
        ]
        self._in_flight: deque[MicroBatch] = deque()

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if len(self.workers) == 1 and not self._in_flight:
            # The single-worker path, as direct as it can be (decode latency).
            return self.workers[0].execute_model(scheduler_output)
        return self.get_output(self.execute_model_async(scheduler_output))

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> MicroBatch:
        batch = MicroBatch(scheduler_output)
        self._in_flight.append(batch)
        self._tick()
        return batch

    def get_output(self, handle: MicroBatch) -> ModelRunnerOutput:
        if not self._in_flight or self._in_flight[0] is not handle:
            raise ValueError("get_output must collect steps in the order they were submitted")
        while handle.output is None:
            self._tick()
        self._in_flight.popleft()
        return handle.output

    def _tick(self) -> None:
        for batch in reversed(self._in_flight):
            if batch.output is None:
                self._run_stage(batch)

    def _run_stage(self, batch: MicroBatch) -> None:
        worker = self.workers[batch.next_stage]
        result = worker.execute_model(batch.scheduler_output, batch.activations)
        batch.next_stage += 1
        if batch.next_stage == len(self.workers):
            batch.activations, batch.output = None, result
        elif result is not None:
            # Start a GPU->CPU copy now, before the GPU is handed the next micro-batch.
            batch.activations = result.start_copy_to(self.workers[batch.next_stage].device)
        else:
            batch.activations = None  # a step with nothing to compute

    def embed(self, prompts: list[list[int]], pooling: str, normalize: bool) -> list[list[float]]:
        activations = None
        for worker in self.workers:
            activations = worker.embed(prompts, pooling, normalize, activations)
        return activations

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.close()
        self.workers = []
        self._in_flight.clear()
