"""Bind a CPU worker process to its NUMA node's cores and size its torch thread pool."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from hybridllm.plan.plan import Plan, WorkerPlacement

logger = logging.getLogger(__name__)

_NODE_DIR = Path("/sys/devices/system/node")
_CPU_DIR = Path("/sys/devices/system/cpu")


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


def core_siblings(cpus: set[int], cpu_dir: Path = _CPU_DIR) -> dict[int, frozenset[int]]:
    """cpu -> the logical CPUs of its physical core (itself alone where sysfs does not say)."""
    out: dict[int, frozenset[int]] = {}
    for cpu in cpus:
        try:
            text = (cpu_dir / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
            out[cpu] = frozenset(parse_cpu_list(text) | {cpu})
        except (OSError, ValueError):
            out[cpu] = frozenset({cpu})
    return out


def reserved_cpus(
    plan: Plan,
    nodes: dict[int, set[int]],
    allowed: set[int],
    siblings: dict[int, frozenset[int]] | None = None,
    machine: str | None = None,
) -> set[int]:
    """CPUs that no CPU worker binds to: one core for each GPU worker's process and one for
    the engine's, whose Python threads launch kernels and move batches (a GPU stage stalls
    whenever they wait behind compute threads). None without a GPU worker in the plan.

    Allowed cores on nodes without CPU workers count first; the rest come one core (all its
    hyperthreads) at a time from the node with the most cores per CPU worker, its lowest
    numbered core first (CPU 0's, which also takes the kernel's housekeeping), and never a
    worker's last core. Every CPU worker computes the same set from the same plan.
    Only the workers on cluster node `machine` count (the plan's `StagePlan.node`).
    """
    workers = plan.workers_on_node(machine)
    num_gpu = sum(1 for w in workers if not w.is_cpu)
    if not num_gpu or not any(w.is_cpu for w in workers):
        return set()
    siblings = siblings if siblings is not None else core_siblings(allowed)
    sharing: dict[int | None, int] = {}
    for w in workers:
        if w.is_cpu:
            node = resolve_numa_node(w.numa_node, nodes)
            sharing[node] = sharing.get(node, 0) + 1
    pools = {n: (allowed if n is None else nodes[n] & allowed) or allowed for n in sharing}
    taken = set().union(*pools.values())
    free_cores = {siblings.get(c, frozenset({c})) for c in allowed - taken}
    need = num_gpu + 1 - len(free_cores)
    cores = {n: sorted({siblings.get(c, frozenset({c})) & pool for c in pool}, key=min)
             for n, pool in pools.items()}  # fmt: skip
    reserved: set[int] = set()
    while need > 0:
        # the node whose workers keep the most cores each, once it gives one up
        candidates = [n for n in cores if len(cores[n]) > sharing[n]]
        if not candidates:
            break  # every CPU worker is down to one core
        node = max(candidates, key=lambda n: (len(cores[n]) / sharing[n], -(n or 0)))
        core = cores[node].pop(0)
        reserved |= core
        for other in cores.values():  # pools overlap where a node fell back to all CPUs
            other[:] = [c for c in other if not c & core]
        need -= 1
    return reserved


def bind_cpu_worker(
    placement: WorkerPlacement,
    plan: Plan,
    cpu_threads: int | None,
    nodes: dict[int, set[int]] | None = None,
    siblings: dict[int, frozenset[int]] | None = None,
) -> tuple[set[int], int]:
    """Pin this process to the placement's NUMA node and set torch's thread count.

    Call only in a process that belongs to this one worker. When the node does not exist
    (fewer nodes than the plan assumed) the worker shares node `numa_node % num_nodes`, as
    the seed system did, with a warning. Threads: the placement's own count, else
    `cpu_threads`, else the node's usable cores divided among the CPU workers that land
    on it, so several CPU stages on one machine do not oversubscribe it. Beside GPU workers
    the cores of `reserved_cpus` stay free and the threads fit in what is left.
    Returns (the CPUs this process may run on, the thread count).
    """
    allowed = os.sched_getaffinity(0)
    nodes = numa_node_cpus() if nodes is None else nodes
    machine = plan.node_of(placement.rank)  # workers on other cluster nodes do not count
    reserved = reserved_cpus(plan, nodes, allowed, siblings, machine)
    node = resolve_numa_node(placement.numa_node, nodes)
    if node != placement.numa_node and node is not None:
        logger.warning(
            "worker %d asks for NUMA node %d but this machine has nodes %s; sharing node %d",
            placement.rank,
            placement.numa_node,
            sorted(nodes),
            node,
        )
    cpus = allowed if node is None else nodes[node] & allowed
    if not cpus:
        logger.warning(
            "worker %d: NUMA node %d has no CPUs this process may use; not binding",
            placement.rank,
            node,
        )
        cpus = allowed
    cpus = (cpus - reserved) or cpus
    if cpus != allowed:
        os.sched_setaffinity(0, cpus)
        allowed = cpus
    sharing = sum(
        1
        for w in plan.workers_on_node(machine)
        if w.is_cpu and resolve_numa_node(w.numa_node, nodes) == node
    )
    fair = max(1, len(allowed) // max(1, sharing))
    threads = placement.num_threads or cpu_threads or fair
    if reserved:
        # the plan counted the node's every core: never more threads than the cores left
        threads = min(threads, fair)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return allowed, threads
