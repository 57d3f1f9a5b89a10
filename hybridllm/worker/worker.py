"""One worker class for every device kind; what differs by device comes from its `Platform`."""

from __future__ import annotations

import time
from typing import Any

from hybridllm.config import EngineConfig
from hybridllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from hybridllm.platforms import Platform
from hybridllm.worker.model_runner import ModelRunner


class Worker:
    """Holds a model runner on one device and answers the executor's RPCs."""

    def __init__(
        self, config: EngineConfig, platform: Platform, rank: int = 0, show_progress: bool = False
    ):
        self.config = config
        self.platform = platform
        self.rank = rank
        self.busy_seconds = 0.0  # time spent executing steps (for /metrics)
        platform.set_threads(config.device_config.cpu_threads)
        self.model_runner = ModelRunner(config, platform, show_progress=show_progress)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        output = self.model_runner.execute_model(scheduler_output)
        self.busy_seconds += time.perf_counter() - start
        return output

    def embed(self, prompts: list[list[int]], pooling: str, normalize: bool) -> list[list[float]]:
        return self.model_runner.embed(prompts, pooling, normalize)

    def get_busy_seconds(self) -> float:
        return self.busy_seconds

    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "device": str(self.platform.device)}
