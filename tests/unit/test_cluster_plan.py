"""Cluster plans: the planner sees the nodes as one machine, then each stage goes to one node."""

from __future__ import annotations

import pytest

from hybridllm.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from hybridllm.plan.cluster import ClusterNode, assign_nodes, cluster_hardware, describe_cluster
from hybridllm.plan.describe import describe_plan
from hybridllm.plan.memory_budget import memory_budgets
from hybridllm.plan.model_size import model_size
from hybridllm.plan.placement_args import PlacementArgs
from hybridllm.plan.planner import build_plan
from tests.unit.test_planner import config, machine


def _node(name: str, gpus: int, cpus: int = 32, engine: bool = False) -> ClusterNode:
    hw = machine(gpu_gib=(80.0,) * gpus, ram_gib=256)
    return ClusterNode(f"{name}" * 8, f"10.0.0.{ord(name) - 96}", cpus, gpus, hw, engine)


def _plan(nodes, **placement):
    hw = cluster_hardware(nodes)
    args = PlacementArgs(**placement)
    plan = build_plan(config("llama3-70b"), args, hw, None)
    return assign_nodes(plan, nodes, args.cpu_threads), hw, args


def test_gpu_stages_run_where_their_gpus_are():
    nodes = [_node("b", 2), _node("a", 2, engine=True)]  # the engine's node counts first
    plan, hw, _ = _plan(nodes, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert hw.num_gpus == 4 and hw.total_ram == 2 * 256 << 30
    assert [g.simulated for g in hw.gpus] == [True, True, True, True]  # machine() fakes them
    assert [s.node for s in plan.stages] == ["a" * 8, "b" * 8]
    assert [[w.device for w in s.workers] for s in plan.stages] == [
        ["cuda:0", "cuda:1"],
        ["cuda:2", "cuda:3"],
    ]
    assert [plan.node_of(r) for r in range(4)] == ["a" * 8] * 2 + ["b" * 8] * 2


def test_a_tensor_parallel_group_never_spans_nodes():
    nodes = [_node("a", 1, engine=True), _node("b", 1)]
    with pytest.raises(ValueError, match="tensor-parallel group would span nodes"):
        _plan(nodes, tensor_parallel_size=2)


def test_cpu_stages_spread_over_nodes_and_fit_their_ray_cpus():
    nodes = [_node("a", 0, cpus=4, engine=True), _node("b", 0, cpus=2)]
    plan, _, _ = _plan(nodes, device="cpu", pipeline_parallel_size=3)
    assert [s.node for s in plan.stages] == ["a" * 8, "b" * 8, "a" * 8]
    # node a's two workers split its 4 Ray CPUs; node b's one worker gets its 2
    assert [w.num_threads for w in plan.workers()] == [2, 2, 2]
    assert plan.workers_on_node("b" * 8) == [plan.workers()[1]]


def test_plan_text_names_each_stage_node_and_the_cluster():
    nodes = [_node("a", 1, engine=True), _node("b", 1)]
    plan, hw, args = _plan(nodes, pipeline_parallel_size=2)
    size = model_size(config("llama3-70b"), "bfloat16")
    names = {n.node_id: n.name for n in nodes}
    text = describe_plan(plan, size, memory_budgets(hw, args), node_names=names)
    assert "[on node 10.0.0.1 (aaaaaaaa)]" in text and "[on node 10.0.0.2 (bbbbbbbb)]" in text
    listing = describe_cluster(nodes)
    assert "node 10.0.0.1 (aaaaaaaa) [engine]: 32 CPUs" in listing and "H100 80 GiB" in listing


def test_only_the_ray_executor_takes_a_plan_with_nodes():
    nodes = [_node("a", 0, engine=True), _node("b", 0)]
    plan, _, _ = _plan(nodes, device="cpu", pipeline_parallel_size=2)

    class Model:  # what EngineConfig reads of a ModelConfig
        num_layers = plan.num_layers

    parts = (Model(), CacheConfig(), SchedulerConfig(), DeviceConfig())
    with pytest.raises(ValueError, match="needs distributed_executor_backend='ray'"):
        EngineConfig(*parts, plan=plan, distributed_executor_backend="mp")
    with pytest.raises(ValueError, match="ray_address is for"):
        EngineConfig(*parts, ray_address="10.0.0.1:6379")
    assert EngineConfig(*parts, plan=plan, distributed_executor_backend="ray").plan is plan
