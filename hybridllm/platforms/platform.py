"""`Platform` objects: one per worker, passed explicitly (there is no process-wide current platform)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    """What a worker needs to know about its device; subclasses fill in the differences."""

    device: torch.device
    dist_backend: str
    attention_backend: str
    supports_graph_capture: bool

    def free_and_total_memory(self) -> tuple[int, int]:
        raise NotImplementedError

    def set_threads(self, num_threads: int | None) -> None:
        """Configure intra-op threading for this worker's process."""

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op where work is synchronous)."""


@dataclass(frozen=True)
class CpuPlatform(Platform):
    def free_and_total_memory(self) -> tuple[int, int]:
        return _meminfo_available_and_total()

    def set_threads(self, num_threads: int | None) -> None:
        n = num_threads or len(os.sched_getaffinity(0))
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


@dataclass(frozen=True)
class CudaPlatform(Platform):
    def free_and_total_memory(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def platform_for_device(device: str | torch.device) -> Platform:
    """Build the platform of one worker's device ("cpu", "cuda", "cuda:1")."""
    device = torch.device(device)
    if device.type == "cpu":
        return CpuPlatform(device, "gloo", "cpu_paged", supports_graph_capture=False)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", 0)
        return CudaPlatform(device, "nccl", "cuda_paged", supports_graph_capture=True)
    raise ValueError(f"unsupported device type {device.type!r}; expected cpu or cuda")


def _meminfo_available_and_total() -> tuple[int, int]:
    fields: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields.get("MemAvailable", fields["MemFree"]), fields["MemTotal"]
