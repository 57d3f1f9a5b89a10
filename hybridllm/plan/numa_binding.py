"""Which NUMA node, and how many threads, each CPU worker of one machine gets."""

from __future__ import annotations

from hybridllm.platforms.discovery import HardwareInfo


def numa_assignments(
    cpu_ranks: list[int], hw: HardwareInfo, cpu_threads: int | None, cpus: int | None = None
) -> dict[int, tuple[int, int]]:
    """rank -> (NUMA node id, torch threads) for the CPU workers sharing machine `hw`.

    Nodes are dealt round-robin (workers that outnumber the nodes share them); threads are
    `cpu_threads` when given, else the node's usable cores split among the workers on it,
    and never more than `cpus` (what a cluster lets the machine's workers use) split among
    all of them.
    """
    nodes = hw.numa_nodes
    node_of = {rank: nodes[i % len(nodes)] for i, rank in enumerate(cpu_ranks)}
    sharing = {n.node_id: sum(m is n for m in node_of.values()) for n in nodes}
    out = {}
    for rank, node in node_of.items():
        threads = max(1, len(hw.usable_cpus(node)) // sharing[node.node_id])
        if cpus is not None:
            threads = min(threads, max(1, cpus // len(cpu_ranks)))
        out[rank] = (node.node_id, cpu_threads or threads)
    return out
