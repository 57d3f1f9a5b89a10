"""The executor interface every backend implements: `collective_rpc` and `execute_model`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from hybridllm.config import EngineConfig
from hybridllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """Starts the workers of a plan and drives them; the engine talks only to this."""

    def __init__(self, config: EngineConfig):
        self.config = config

    @abstractmethod
    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        """Call `method` on every worker; return their results in rank order."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # The last worker (last pipeline stage) holds the sampled tokens.
        return self.collective_rpc("execute_model", (scheduler_output,))[-1]

    def initialize(self) -> int:
        """Load the model on every worker and size the KV cache; returns the block count."""
        self.collective_rpc("load_model")
        # Every worker allocates the same number of blocks: the smallest capacity wins.
        num_blocks = min(self.collective_rpc("determine_num_blocks"))
        self.collective_rpc("initialize_kv_cache", (num_blocks,))
        return num_blocks

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free what they hold; safe to call twice."""


def create_executor(config: EngineConfig, show_progress: bool = False) -> Executor:
    from hybridllm.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor(config, show_progress=show_progress)
