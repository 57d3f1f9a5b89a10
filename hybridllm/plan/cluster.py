"""A plan for a cluster of machines: which node runs each stage, from what each node offers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hybridllm.plan.numa_binding import numa_assignments
from hybridllm.plan.plan import Plan, StagePlan
from hybridllm.platforms.discovery import GpuInfo, HardwareInfo


@dataclass(frozen=True)
class ClusterNode:
    """One machine of the cluster: its Ray node id, address, Ray resources and hardware."""

    node_id: str
    address: str  # the IP the cluster reaches it at
    num_cpus: int  # Ray's CPU resource (may be fewer than the cores)
    num_gpus: int  # Ray's GPU resource
    hardware: HardwareInfo
    is_engine: bool = False  # the engine (driver) runs here

    @property
    def name(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"


def cluster_hardware(nodes: list[ClusterNode]) -> HardwareInfo:
    """The cluster as one machine for the planner, which then places layers as usual (and
    `assign_nodes` puts each stage on one node): the engine's node first, GPUs numbered
    across nodes ("cuda:2" is the first GPU of the second node when the first has two; a
    worker sees its own GPU as Ray exposes it), RAM and cores added up. GPUs of other nodes are marked simulated: the
    hardware profile measures this machine's and gives theirs the nominal rates."""
    nodes = sorted(nodes, key=lambda n: not n.is_engine)
    gpus = []
    for node in nodes:
        for gpu in node.hardware.gpus[: node.num_gpus]:
            gpus.append(
                dataclasses.replace(
                    gpu, index=len(gpus), simulated=gpu.simulated or not node.is_engine
                )
            )
    first = nodes[0].hardware
    return dataclasses.replace(
        first,
        gpus=tuple(gpus),
        physical_cores=sum(n.hardware.physical_cores for n in nodes),
        logical_cores=sum(n.hardware.logical_cores for n in nodes),
        total_ram=sum(n.hardware.total_ram for n in nodes),
        available_ram=sum(n.hardware.available_ram for n in nodes),
    )


def assign_nodes(plan: Plan, nodes: list[ClusterNode], cpu_threads: int | None = None) -> Plan:
    """Put every stage on one node (`StagePlan.node`) and bind its CPU workers there.

    A stage with GPU workers runs where its GPUs are (the cluster numbering of
    `cluster_hardware`); the others go to the node with the fewest stages so far, the
    engine's first on a tie, so that pipeline stages spread over the machines. CPU workers
    then get NUMA nodes and threads from their own node's cores and Ray CPUs.
    """
    nodes = sorted(nodes, key=lambda n: not n.is_engine)
    gpu_node = [n for n in nodes for _ in range(min(n.num_gpus, len(n.hardware.gpus)))]
    load = {n.node_id: 0 for n in nodes}
    stages: list[StagePlan] = []
    for stage in plan.stages:
        homes = set()
        for w in stage.workers:
            if not w.is_cpu:
                index = int(w.device.partition(":")[2] or 0)
                if index >= len(gpu_node):
                    raise ValueError(
                        f"worker {w.rank} runs on {w.device}, but the cluster has "
                        f"{len(gpu_node)} GPU(s)"
                    )
                homes.add(gpu_node[index].node_id)
        if len(homes) > 1:
            raise ValueError(
                f"stage {stage.pp_rank}'s tensor-parallel group would span nodes "
                f"{sorted(homes)}: a group must stay on one node; lower -tp to the GPUs "
                "of one node and add pipeline stages instead"
            )
        node = homes.pop() if homes else min(load, key=lambda n: load[n])
        load[node] += 1
        stages.append(dataclasses.replace(stage, node=node))
    stages = _bind_per_node(stages, nodes, cpu_threads)
    return Plan(tuple(stages), plan.num_layers)


def _bind_per_node(
    stages: list[StagePlan], nodes: list[ClusterNode], cpu_threads: int | None
) -> list[StagePlan]:
    bindings: dict[int, tuple[int, int]] = {}
    for node in nodes:
        ranks = [w.rank for s in stages if s.node == node.node_id for w in s.workers if w.is_cpu]
        if ranks:
            bindings |= numa_assignments(ranks, node.hardware, cpu_threads, node.num_cpus)
    out = []
    for stage in stages:
        workers = tuple(
            dataclasses.replace(w, numa_node=bindings[w.rank][0], num_threads=bindings[w.rank][1])
            if w.is_cpu
            else w
            for w in stage.workers
        )
        out.append(dataclasses.replace(stage, workers=workers))
    return out


def describe_cluster(nodes: list[ClusterNode]) -> str:
    """One line per node: address, id, Ray CPUs and GPUs, the GPUs' names and memory, RAM."""
    lines = []
    for node in sorted(nodes, key=lambda n: not n.is_engine):
        hw = node.hardware
        gpus = ", ".join(_gpu_text(g) for g in hw.gpus[: node.num_gpus]) or "no GPU"
        lines.append(
            f"  node {node.name}{' [engine]' if node.is_engine else ''}: {node.num_cpus} CPUs "
            f"({hw.physical_cores} cores), {node.num_gpus} GPU(s): {gpus}; "
            f"{hw.available_ram / (1 << 30):.1f} of {hw.total_ram / (1 << 30):.1f} GiB RAM free"
        )
    return "ray cluster:\n" + "\n".join(lines)


def _gpu_text(gpu: GpuInfo) -> str:
    return f"{gpu.name} {gpu.total_memory / (1 << 30):.0f} GiB"
