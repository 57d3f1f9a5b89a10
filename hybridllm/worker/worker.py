"""One worker class for every device kind; what differs by device comes from its `Platform`."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from hybridllm import progress
from hybridllm.config import EngineConfig
from hybridllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from hybridllm.plan.plan import WorkerPlacement
from hybridllm.platforms import platform_for_device
from hybridllm.worker.cpu_binding import bind_cpu_worker
from hybridllm.worker.host_allocator import keep_freed_memory
from hybridllm.worker.intermediate_tensors import IntermediateTensors
from hybridllm.worker.model_runner import ModelRunner


class Worker:
    """One (pipeline stage, tensor-parallel rank) of the plan: a model runner on one device.

    `owns_process`: the worker has a process of its own (the `mp` executor), so it may pin
    the process to its NUMA node and size torch's thread pool for itself alone. In the
    engine's process (`uni`) those settings are process-wide and stay as configured.
    """

    def __init__(
        self,
        config: EngineConfig,
        placement: WorkerPlacement,
        *,
        owns_process: bool = False,
        tp_init_method: str | None = None,
        show_progress: bool = False,
    ):
        self.config = config
        self.placement = placement
        self.rank = placement.rank
        self.stage = config.plan.stage_of(placement.rank)
        self.platform = platform_for_device(placement.device)
        self.device = self.platform.device
        self.busy_seconds = 0.0  # time spent executing steps (for /metrics)
        self.show_progress = show_progress
        if owns_process and placement.is_cpu:
            bind_cpu_worker(placement, config.plan, config.device_config.cpu_threads)
        else:
            self.platform.set_threads(config.device_config.cpu_threads)
        if owns_process and self.platform.device.type == "cuda":
            torch.cuda.set_device(self.platform.device)
        self.tp_group = self._init_tp_group(tp_init_method)
        self.model_runner = ModelRunner(
            config, self.platform, self.stage, self.tp_group, show_progress=show_progress
        )

    def _init_tp_group(self, init_method: str | None) -> Any:
        plan = self.config.plan
        if plan.tensor_parallel_size == 1:
            return None
        import torch.distributed as dist

        if init_method is None and not dist.is_initialized():
            raise ValueError(
                "tensor parallelism needs an init_method (file:///private/dir/store, as the mp "
                "executor makes, or tcp://host:port) or a torch.distributed world already "
                "joined (the ray executor joins through its authenticated store first)"
            )
        from hybridllm.distributed.parallel_groups import init_tp_group

        return init_tp_group(plan, self.rank, init_method, self.platform.device)

    def load_model(self) -> None:
        plan = self.config.plan
        where = f" of worker rank {self.rank} ({self.device})" if plan.world_size > 1 else ""
        done = f"loaded the model weights{where}"
        if self.show_progress:  # the bar shows the load; a line then says how long it took
            start = time.perf_counter()
            self.model_runner.load_model()
            elapsed = progress.format_seconds(time.perf_counter() - start)
            progress.logger.info("%s in %s", done, elapsed)
            return
        # Without a bar, a load that drags on (a big checkpoint, a cold page cache) says so.
        with progress.long_step(f"loading the model weights{where}", done=done, after_s=5.0):
            self.model_runner.load_model()

    def determine_num_blocks(self) -> tuple[int, ...]:
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int | tuple[int, ...]) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        if self.placement.is_cpu:  # everything long-lived is allocated: steps from here on
            keep_freed_memory()

    def execute_model(
        self, scheduler_output: SchedulerOutput, intermediate: IntermediateTensors | None = None
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        """The last stage returns sampled tokens; earlier stages their activations."""
        start = time.perf_counter()
        output = self.model_runner.execute_model(scheduler_output, intermediate)
        self.busy_seconds += time.perf_counter() - start
        return output

    def embed(
        self,
        prompts: list[list[int]],
        pooling: str,
        normalize: bool,
        intermediate: list[IntermediateTensors] | None = None,
    ) -> list[list[float]] | list[IntermediateTensors]:
        return self.model_runner.embed(prompts, pooling, normalize, intermediate)

    def get_busy_seconds(self) -> float:
        return self.busy_seconds

    def describe(self) -> dict[str, Any]:
        p = self.placement
        return {
            "rank": p.rank,
            "device": str(self.platform.device),
            "pp_rank": p.pp_rank,
            "tp_rank": p.tp_rank,
            "layers": (self.stage.layer_start, self.stage.layer_end),
            "pid": os.getpid(),
            "num_threads": torch.get_num_threads(),
        }

    def close(self) -> None:
        """Release the tensor-parallel group, if the communicator offers a way to."""
        close = getattr(self.tp_group, "close", None)
        if callable(close):
            close()
        self.tp_group = None
