"""The executor interface every backend implements: `collective_rpc` and `execute_model`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from hybridllm import progress
from hybridllm.config import EngineConfig
from hybridllm.engine.errors import EngineDeadError as EngineDeadError  # raised by executors
from hybridllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """Starts the workers of a plan and drives them; the engine talks only to this.

    Steps may be pipelined: `execute_model_async` submits a step and returns a handle at
    once, `get_output` waits for it. Handles must be collected in submission order; up to
    `pipeline_parallel_size` steps are in flight so that the stages overlap.
    """

    def __init__(self, config: EngineConfig):
        self.config = config

    @abstractmethod
    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        """Call `method` on every worker; return their results in rank order."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step through every stage and wait for its sampled tokens."""
        return self.get_output(self.execute_model_async(scheduler_output))

    @abstractmethod
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Any:
        """Submit one step without waiting for it; returns a handle for `get_output`."""

    @abstractmethod
    def get_output(self, handle: Any) -> ModelRunnerOutput:
        """The sampled tokens of a submitted step (the oldest one not yet collected)."""

    @abstractmethod
    def embed(self, prompts: list[list[int]], pooling: str, normalize: bool) -> list[list[float]]:
        """Pooled final hidden states of each prompt, through every pipeline stage."""

    def initialize(self) -> tuple[int, ...]:
        """Load the model on every worker and size the KV cache; returns the block count of
        each KV cache group."""
        self.collective_rpc("load_model")
        # Every worker allocates the same number of blocks per group: the smallest capacity
        # wins (a worker without layers of a group reports what the scheduler could use).
        num_blocks = tuple(
            min(counts) for counts in zip(*self.collective_rpc("determine_num_blocks"))
        )
        self.collective_rpc("initialize_kv_cache", (num_blocks,))
        return num_blocks

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker died; called while the engine idles, so that a
        dead worker is noticed without waiting for the next request. In-process workers
        cannot die on their own: nothing to check."""
        return None

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free what they hold; safe to call twice."""


def create_executor(config: EngineConfig, show_progress: bool = False) -> Executor:
    """The executor named by `config.distributed_executor_backend`.

    `show_progress` draws the weight-loading bar; it is drawn anyway where progress lines
    reach a terminal (the CLI's engines, quieted by `--log-level warning`)."""
    show_progress = show_progress or progress.bars_wanted()
    backend = config.distributed_executor_backend
    if backend == "mp":
        from hybridllm.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config, show_progress=show_progress)
    if backend == "uni":
        from hybridllm.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor(config, show_progress=show_progress)
    if backend == "ray":
        from hybridllm.executor.ray_executor import RayExecutor

        return RayExecutor(config, show_progress=show_progress)
    raise ValueError(f"unknown distributed_executor_backend {backend!r}; expected uni, mp or ray")
