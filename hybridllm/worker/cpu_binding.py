"""Bind a CPU worker process to its NUMA node's cores and size its torch thread pool."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from hybridllm.plan.plan import Plan, WorkerPlacement

logger = logging.getLogger(__name__)

_NODE_DIR = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> set[int]:
    """Kernel cpulist syntax ('0-3,8,10-11') -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_node_cpus(node_dir: Path = _NODE_DIR) -> dict[int, set[int]]:
    """CPUs of every NUMA node with CPUs; empty when the kernel exposes no NUMA info."""
    nodes: dict[int, set[int]] = {}
    for path in sorted(node_dir.glob("node[0-9]*")):
        try:
            cpus = parse_cpu_list((path / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            nodes[int(path.name[4:])] = cpus
    return nodes


def resolve_numa_node(node: int | None, nodes: dict[int, set[int]]) -> int | None:
    """The node a worker asking for `node` lands on: itself, or `node % num_nodes` when
    the machine has fewer nodes than the plan assumed; None without NUMA information."""
    if node is None or not nodes or node in nodes:
        return node if nodes else None
    return sorted(nodes)[node % len(nodes)]


def bind_cpu_worker(
    placement: WorkerPlacement,
    plan: Plan,
    cpu_threads: int | None,
    nodes: dict[int, set[int]] | None = None,
) -> tuple[set[int], int]:
    """Pin this process to the placement's NUMA node and set torch's thread count.

    Call only in a process that belongs to this one worker. When the node does not exist
    (fewer nodes than the plan assumed) the worker shares node `numa_node % num_nodes`, as
    the seed system did, with a warning. Threads: the placement's own count, else
    `cpu_threads`, else the node's usable cores divided among the CPU workers that land
    on it, so several CPU stages on one machine do not oversubscribe it.
    Returns (the CPUs this process may run on, the thread count).
    """
    allowed = os.sched_getaffinity(0)
    nodes = numa_node_cpus() if nodes is None else nodes
    node = resolve_numa_node(placement.numa_node, nodes)
    if node != placement.numa_node and node is not None:
        logger.warning(
            "worker %d asks for NUMA node %d but this machine has nodes %s; sharing node %d",
            placement.rank,
            placement.numa_node,
            sorted(nodes),
            node,
        )
    if node is not None:
        cpus = nodes[node] & allowed
        if cpus:
            os.sched_setaffinity(0, cpus)
            allowed = cpus
        else:
            logger.warning(
                "worker %d: NUMA node %d has no CPUs this process may use; not binding",
                placement.rank,
                node,
            )
    sharing = sum(
        1 for w in plan.workers() if w.is_cpu and resolve_numa_node(w.numa_node, nodes) == node
    )
    threads = placement.num_threads or cpu_threads or max(1, len(allowed) // max(1, sharing))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return allowed, threads
