"""Which cores CPU workers leave to the GPU workers' and the engine's Python threads."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from hybridllm.plan.plan import Plan
from hybridllm.worker.cpu_binding import bind_cpu_worker, core_siblings, reserved_cpus


def make_plan(devices: list[list[str]], nodes: list[int | None] | None = None) -> Plan:
    """A plan over `devices` (one row per stage) whose CPU workers sit on `nodes`, in order."""
    plan = Plan.uniform(devices, num_layers=4 * len(devices))
    nodes_left = iter(nodes or [])

    def place(w):
        return dataclasses.replace(w, numa_node=next(nodes_left)) if w.is_cpu else w

    stages = tuple(
        dataclasses.replace(s, workers=tuple(place(w) for w in s.workers)) for s in plan.stages
    )
    return dataclasses.replace(plan, stages=stages)


def no_smt(cpus):
    return {c: frozenset({c}) for c in cpus}


def test_nothing_reserved_without_a_gpu_worker():
    plan = make_plan([["cpu"], ["cpu"]], [0, 0])
    assert reserved_cpus(plan, {0: set(range(8))}, set(range(8)), no_smt(range(8))) == set()
    gpu_only = make_plan([["cuda:0"]])
    assert reserved_cpus(gpu_only, {0: set(range(8))}, set(range(8)), no_smt(range(8))) == set()


def test_one_core_per_gpu_worker_and_one_for_the_engine():
    plan = make_plan([["cuda:0"], ["cpu"]], [0])
    cpus = set(range(8))
    assert reserved_cpus(plan, {0: cpus}, cpus, no_smt(cpus)) == {0, 1}
    # a GPU + CPU tensor-parallel pair in each of two stages: two GPU workers
    plan = make_plan([["cuda:0", "cpu"], ["cuda:0", "cpu"]], [0, 0])
    assert reserved_cpus(plan, {0: cpus}, cpus, no_smt(cpus)) == {0, 1, 2}


def test_whole_cores_with_their_hyperthreads():
    # 4 cores with two threads each: cpu i and i + 4 share a core
    cpus = set(range(8))
    siblings = {c: frozenset({c % 4, c % 4 + 4}) for c in cpus}
    plan = make_plan([["cuda:0"], ["cpu"]], [0])
    assert reserved_cpus(plan, {0: cpus}, cpus, siblings) == {0, 4, 1, 5}


def test_cores_outside_the_cpu_workers_nodes_count_first():
    nodes = {0: set(range(8)), 1: set(range(8, 16))}
    allowed = set(range(16))
    plan = make_plan([["cuda:0"], ["cpu"]], [0])  # node 1 has no CPU worker: it is free
    assert reserved_cpus(plan, nodes, allowed, no_smt(allowed)) == set()
    # a process confined to node 0 and one CPU of node 1: one core is still missing
    allowed = set(range(9))
    assert reserved_cpus(plan, nodes, allowed, no_smt(allowed)) == {0}


def test_reserved_cores_come_from_the_node_with_most_cores_per_worker():
    nodes = {0: set(range(8)), 1: set(range(8, 16))}
    allowed = set(range(16))
    two_gpus = [["cuda:0", "cpu"], ["cuda:1", "cpu"]]
    # two GPU workers and the engine: 3 cores, taken alternately, node 0 first on ties
    assert reserved_cpus(make_plan(two_gpus, [0, 1]), nodes, allowed, no_smt(allowed)) == {
        0,
        1,
        8,
    }
    # node 0 holds two CPU workers and node 1 one: node 1 gives its cores first
    plan = make_plan([["cuda:0", "cpu"], ["cpu", "cpu"]], [1, 0, 0])
    assert reserved_cpus(plan, nodes, allowed, no_smt(allowed)) == {8, 9}


def test_every_cpu_worker_keeps_a_core():
    plan = make_plan([["cuda:0", "cpu"], ["cpu", "cpu"]], [0, 0, 0])  # three CPU workers
    assert reserved_cpus(plan, {0: {0, 1, 2}}, {0, 1, 2}, no_smt({0, 1, 2})) == set()
    assert reserved_cpus(plan, {0: set(range(4))}, set(range(4)), no_smt(range(4))) == {0}
    # no NUMA information: the allowed CPUs are one pool
    assert reserved_cpus(plan, {}, set(range(6)), no_smt(range(6))) == {0, 1}


def test_core_siblings_from_sysfs(tmp_path):
    for cpu, text in ((0, "0,4\n"), (4, "0,4\n")):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text)
    assert core_siblings({0, 4, 7}, tmp_path) == {
        0: frozenset({0, 4}),
        4: frozenset({0, 4}),
        7: frozenset({7}),  # sysfs says nothing: its own core
    }


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_bind_leaves_the_reserved_cores_and_sizes_threads_to_the_rest():
    cpus = os.sched_getaffinity(0)
    plan = make_plan([["cuda:0"], ["cpu"]], [0])
    threads_before = torch.get_num_threads()
    try:
        worker = plan.workers()[1]
        allowed, threads = bind_cpu_worker(worker, plan, None, {0: set(cpus)}, no_smt(cpus))
        reserved = reserved_cpus(plan, {0: set(cpus)}, cpus, no_smt(cpus))
        assert reserved and allowed == cpus - reserved == os.sched_getaffinity(0)
        assert threads == len(allowed) == torch.get_num_threads()
        # the planner's thread count (the whole node's) shrinks to the cores left
        planned = dataclasses.replace(worker, num_threads=len(cpus))
        os.sched_setaffinity(0, cpus)
        assert bind_cpu_worker(planned, plan, None, {0: set(cpus)}, no_smt(cpus))[1] == threads
    finally:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads_before)
