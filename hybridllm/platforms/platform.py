"""`Platform` objects: one per worker, passed explicitly (there is no process-wide current platform)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    """What a worker needs to know about its device; subclasses fill in the differences.

    It holds only what workers ask of it (memory, threads). The attention backend follows the
    device a layer is built on (layers/attention.py) and the process groups' backends follow
    each group's ranks (distributed/parallel_groups.py): neither is a per-worker choice.
    """

    device: torch.device

    def free_and_total_memory(self) -> tuple[int, int]:
        raise NotImplementedError

    def set_threads(self, num_threads: int | None) -> None:
        """Configure intra-op threading for this worker's process."""


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


def platform_for_device(device: str | torch.device) -> Platform:
    """Build the platform of one worker's device ("cpu", "cuda", "cuda:1")."""
    device = torch.device(device)
    if device.type == "cpu":
        return CpuPlatform(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", 0)
        return CudaPlatform(device)
    raise ValueError(f"unsupported device type {device.type!r}; expected cpu or cuda")


def _meminfo_available_and_total() -> tuple[int, int]:
    fields: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields.get("MemAvailable", fields["MemFree"]), fields["MemTotal"]
