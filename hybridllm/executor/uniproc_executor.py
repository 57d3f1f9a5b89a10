"""`uni` executor: the worker lives in the engine's own process."""

from __future__ import annotations

from typing import Any

from hybridllm.config import EngineConfig
from hybridllm.executor.executor import Executor
from hybridllm.platforms import platform_for_device
from hybridllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, show_progress: bool = False):
        super().__init__(config)
        platform = platform_for_device(config.device_config.device)
        self.workers: list[Worker] = [Worker(config, platform, rank=0, show_progress=show_progress)]

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    def shutdown(self) -> None:
        self.workers = []
