"""The placement plan: which worker runs which layers and shard on which device."""

from hybridllm.plan.plan import Plan, StagePlan, WorkerPlacement, partition

__all__ = ["Plan", "StagePlan", "WorkerPlacement", "partition"]
