"""Device discovery: CUDA GPUs with their memory, CPU cores, NUMA nodes and RAM, as one frozen value."""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

_SYS_NODE_DIR = "/sys/devices/system/node"
_SYS_CPU_DIR = "/sys/devices/system/cpu"


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device. `simulated` GPUs come from `--fake-gpu` and exist only on paper."""

    index: int
    name: str
    total_memory: int  # bytes
    free_memory: int  # bytes, at discovery time
    simulated: bool = False

    @property
    def device(self) -> str:
        return f"cuda:{self.index}"


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node and the logical CPUs on it (all of them, not only those we may use)."""

    node_id: int
    cpus: tuple[int, ...]


@dataclass(frozen=True)
class HardwareInfo:
    """What this machine offers a plan: GPUs, CPU cores, NUMA layout and RAM."""

    gpus: tuple[GpuInfo, ...]
    cpu_model: str
    physical_cores: int
    logical_cores: int
    cpu_affinity: tuple[int, ...]  # logical CPUs this process may run on
    numa_nodes: tuple[NumaNode, ...]
    total_ram: int  # bytes
    available_ram: int  # bytes

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    def usable_cpus(self, node: NumaNode) -> tuple[int, ...]:
        """The node's CPUs this process may use; all of them when the affinity excludes the node."""
        allowed = set(self.cpu_affinity)
        return tuple(c for c in node.cpus if c in allowed) or node.cpus


def discover_hardware(include_gpus: bool = True) -> HardwareInfo:
    """Look at this machine. `include_gpus=False` skips CUDA (no context is created)."""
    affinity = tuple(sorted(os.sched_getaffinity(0)))
    logical = os.cpu_count() or len(affinity)
    available, total = read_meminfo()
    return HardwareInfo(
        gpus=discover_gpus() if include_gpus else (),
        cpu_model=_cpu_model(),
        physical_cores=_physical_cores() or logical,
        logical_cores=logical,
        cpu_affinity=affinity,
        numa_nodes=discover_numa_nodes(_SYS_NODE_DIR, affinity),
        total_ram=total,
        available_ram=available,
    )


def discover_gpus() -> tuple[GpuInfo, ...]:
    import torch

    if not torch.cuda.is_available():
        return ()
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        gpus.append(GpuInfo(i, props.name, int(total), int(free)))
    return tuple(gpus)


def discover_numa_nodes(node_dir: str, affinity: tuple[int, ...]) -> tuple[NumaNode, ...]:
    """NUMA nodes from sysfs; one node holding every allowed CPU where sysfs has none."""
    nodes = []
    for path in glob.glob(os.path.join(node_dir, "node[0-9]*")):
        try:
            with open(os.path.join(path, "cpulist")) as f:
                cpus = parse_cpulist(f.read())
        except OSError:
            continue
        if cpus:  # memory-only nodes (CXL, HBM) have no CPUs to bind threads to
            nodes.append(NumaNode(int(os.path.basename(path)[4:]), cpus))
    if not nodes:
        return (NumaNode(0, affinity),)
    return tuple(sorted(nodes, key=lambda n: n.node_id))


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-")
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return tuple(sorted(set(cpus)))


def read_meminfo(path: str = "/proc/meminfo") -> tuple[int, int]:
    """(available, total) RAM in bytes."""
    fields: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            name, _, value = line.partition(":")
            parts = value.split()
            if parts:
                fields[name] = int(parts[0]) * 1024  # /proc/meminfo counts kB
    return fields.get("MemAvailable", fields.get("MemFree", 0)), fields.get("MemTotal", 0)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Processor", "cpu model")):
                    return re.sub(r"\s+", " ", line.partition(":")[2]).strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown cpu"


def _physical_cores() -> int:
    """Distinct (package, core) pairs; 0 when sysfs does not say."""
    cores = set()
    for topo in glob.glob(os.path.join(_SYS_CPU_DIR, "cpu[0-9]*", "topology")):
        try:
            with open(os.path.join(topo, "physical_package_id")) as f:
                package = f.read().strip()
            with open(os.path.join(topo, "core_id")) as f:
                core = f.read().strip()
        except OSError:
            continue
        cores.add((package, core))
    return len(cores)
