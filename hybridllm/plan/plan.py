"""`Plan`: for every worker, its device, pipeline stage, layer range and tensor-parallel shard.

Everything downstream (loader, KV cache, workers, communicators) reads the plan; nothing
re-derives placement on its own. Plans are frozen and validated once.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridllm.partition import partition


@dataclass(frozen=True)
class WorkerPlacement:
    """One worker: global rank, device, and its place in the pipeline and TP group."""

    rank: int  # pp_rank * tensor_parallel_size + tp_rank
    device: str  # "cuda:0", "cpu"
    pp_rank: int
    tp_rank: int
    numa_node: int | None = None  # CPU workers: the node their threads are bound to
    num_threads: int | None = None  # CPU workers: torch intra-op threads

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: a layer range run by a tensor-parallel group of workers."""

    pp_rank: int
    layer_start: int
    layer_end: int  # exclusive
    workers: tuple[WorkerPlacement, ...]  # ordered by tp_rank
    tp_weights: tuple[float, ...]  # relative shard sizes (equal by default)
    has_embedding: bool
    has_lm_head: bool  # final norm + LM head + sampling
    # A CPU stage may compute steps of at least `stream_threshold` tokens on `stream_device`
    # by streaming its layers' weights there (worker/weight_streamer.py); -1: never.
    stream_device: str | None = None
    stream_threshold: int = -1
    stream_kv_tokens: int = 0  # KV rows a streamed step may read (its staging buffers hold)
    # Mixtures of experts: the routed experts of the stage's first `cpu_expert_layers` layers
    # live and compute on the host CPU; the router, shared expert and the rest stay here.
    cpu_expert_layers: int = 0
    # The cluster node (a Ray node id) that runs every worker of the stage, its whole
    # tensor-parallel group; None: the engine's machine (the uni and mp executors).
    node: str | None = None

    def experts_on_cpu(self, layer: int) -> bool:
        """Whether layer `layer`'s routed experts live on the CPU beside this stage."""
        return self.layer_start <= layer < self.layer_start + self.cpu_expert_layers

    @property
    def streams(self) -> bool:
        return self.stream_device is not None and self.stream_threshold >= 0

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def tp_share(self, tp_rank: int) -> float:
        """Fraction of the stage's sharded weights that `tp_rank` holds."""
        return self.tp_weights[tp_rank] / sum(self.tp_weights)


@dataclass(frozen=True)
class Plan:
    """The whole placement. Ranks are numbered stage-major: rank = pp_rank * tp + tp_rank."""

    stages: tuple[StagePlan, ...]
    num_layers: int

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a plan needs at least one stage")
        tp = len(self.stages[0].workers)
        expect = 0
        for i, stage in enumerate(self.stages):
            if stage.pp_rank != i:
                raise ValueError(f"stage {i} has pp_rank {stage.pp_rank}")
            if stage.layer_start != expect or stage.layer_end <= stage.layer_start:
                raise ValueError(
                    f"stage {i} covers layers [{stage.layer_start}, {stage.layer_end}); "
                    f"expected a non-empty range starting at {expect}"
                )
            expect = stage.layer_end
            if len(stage.workers) != tp or len(stage.tp_weights) != tp:
                raise ValueError(
                    f"stage {i} has {len(stage.workers)} workers; every stage needs {tp}"
                )
            for tp_rank, w in enumerate(stage.workers):
                if (w.pp_rank, w.tp_rank, w.rank) != (i, tp_rank, i * tp + tp_rank):
                    raise ValueError(f"worker {w} is out of place in stage {i}")
            if stage.stream_device is not None and (
                len(stage.workers) != 1 or not stage.workers[0].is_cpu
            ):
                raise ValueError(
                    f"stage {i} streams its weights to {stage.stream_device}, but only a stage "
                    "of one CPU worker can"
                )
            if not 0 <= stage.cpu_expert_layers <= stage.num_layers:
                raise ValueError(
                    f"stage {i} puts the experts of {stage.cpu_expert_layers} layers on the CPU; "
                    f"it has {stage.num_layers}"
                )
            if stage.cpu_expert_layers and (len(stage.workers) != 1 or stage.stream_device):
                raise ValueError(
                    f"stage {i} has routed experts on the CPU: it needs one worker (experts are "
                    "not sharded) and no weight streaming"
                )
            if stage.has_embedding != (i == 0):
                raise ValueError("the first stage, and only it, holds the embedding")
            if stage.has_lm_head != (i == len(self.stages) - 1):
                raise ValueError("the last stage, and only it, holds the LM head")
        if expect != self.num_layers:
            raise ValueError(f"stages cover {expect} layers; the model has {self.num_layers}")

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.stages[0].workers)

    @property
    def pipeline_parallel_size(self) -> int:
        return len(self.stages)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def workers(self) -> list[WorkerPlacement]:
        return [w for stage in self.stages for w in stage.workers]

    def stage_of(self, rank: int) -> StagePlan:
        return self.stages[rank // self.tensor_parallel_size]

    def node_of(self, rank: int) -> str | None:
        """The cluster node worker `rank` runs on (None: the engine's machine)."""
        return self.stage_of(rank).node

    def workers_on_node(self, node: str | None) -> list[WorkerPlacement]:
        """The workers that share a machine with a worker on `node`."""
        return [w for s in self.stages if s.node == node for w in s.workers]

    @classmethod
    def single(cls, device: str, num_layers: int) -> Plan:
        """Everything on one worker."""
        worker = WorkerPlacement(rank=0, device=device, pp_rank=0, tp_rank=0)
        stage = StagePlan(0, 0, num_layers, (worker,), (1.0,), True, True)
        return cls((stage,), num_layers)

    @classmethod
    def uniform(
        cls, devices: list[list[str]], num_layers: int, layer_splits: list[int] | None = None
    ) -> Plan:
        """devices[pp][tp] -> a plan; layer_splits gives layers per stage (default: even)."""
        pp = len(devices)
        if layer_splits is None:
            layer_splits = [r[1] - r[0] for r in partition(num_layers, (1.0,) * pp)]
        if len(layer_splits) != pp or sum(layer_splits) != num_layers:
            raise ValueError(
                f"layer split {layer_splits} must have {pp} entries summing to {num_layers}"
            )
        stages, start = [], 0
        tp = len(devices[0])
        for i, (row, n) in enumerate(zip(devices, layer_splits)):
            workers = tuple(
                WorkerPlacement(rank=i * tp + j, device=d, pp_rank=i, tp_rank=j)
                for j, d in enumerate(row)
            )
            stages.append(
                StagePlan(i, start, start + n, workers, (1.0,) * len(row), i == 0, i == pp - 1)
            )
            start += n
        return cls(tuple(stages), num_layers)
