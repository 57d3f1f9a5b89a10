"""Process groups of a plan: torch.distributed over all workers, one `TPGroup` per worker."""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridllm.distributed.communicator import Communicator
from hybridllm.distributed.shm_allreduce import ShmAllReduce
from hybridllm.plan.plan import Plan, partition

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_SHM_SLOT_BYTES = 4 << 20  # per rank and parity; larger tensors fall back to gloo


@dataclass(frozen=True)
class TPGroup:
    """This worker's tensor-parallel group: its rank in it, the shard weights, the collectives."""

    rank: int  # tp_rank
    size: int
    weights: tuple[float, ...]  # the stage's tp_weights: relative shard sizes
    communicator: Communicator

    def shard_ranges(self, total: int, align: int = 1) -> list[tuple[int, int]]:
        """Every rank's [start, end) of `total` units, boundaries multiples of `align`."""
        return partition(total, self.weights, align)

    def shard_range(self, total: int, align: int = 1) -> tuple[int, int]:
        """This rank's [start, end) of `total` units."""
        return self.shard_ranges(total, align)[self.rank]

    def close(self) -> None:
        self.communicator.close()


def init_tp_group(
    plan: Plan,
    rank: int,
    init_method: str | None,
    device: torch.device,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    shm_slot_bytes: int = DEFAULT_SHM_SLOT_BYTES,
) -> TPGroup | None:
    """Join the plan's process groups as global `rank`; None when tensor_parallel_size == 1.

    Collective: every worker of the plan calls it. Initialises torch.distributed (gloo) over
    all `plan.world_size` workers unless already initialised with that world, then creates,
    for every stage in order (new_group is itself collective, so every rank creates every
    group, member or not): the stage's CPU group (gloo, all its ranks), its host group (gloo:
    the first GPU rank and the CPU ranks, when that differs from the CPU group) and its
    device group (NCCL among its GPU ranks only, when there are two or more: a CPU rank in an
    NCCL group deadlocks at init). Ranks sharing a node also share a memory segment for
    all-reduce among the host group.
    """
    if plan.tensor_parallel_size == 1:
        return None
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} is outside the plan's world of {plan.world_size} workers")
    device = torch.device(device)
    placement = plan.workers()[rank]
    if torch.device(placement.device).type != device.type:
        raise ValueError(
            f"rank {rank} runs on {device} but the plan places it on {placement.device}"
        )
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=plan.world_size,
            timeout=timeout,
        )
    elif (dist.get_rank(), dist.get_world_size()) != (rank, plan.world_size):
        raise ValueError(
            f"torch.distributed is already initialised as rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, not rank {rank} of {plan.world_size}"
        )
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # NCCL uses the current device
    hosts = _gather_host_ids(plan.world_size)

    mine = plan.stage_of(rank)
    groups: dict[str, dist.ProcessGroup | None] = {}
    for stage in plan.stages:
        ranks = [w.rank for w in stage.workers]
        gpu_ranks = [w.rank for w in stage.workers if not w.is_cpu]
        host_ranks = sorted(gpu_ranks[:1] + [w.rank for w in stage.workers if w.is_cpu])
        cpu_group = dist.new_group(ranks, timeout=timeout, backend="gloo")
        host_group = cpu_group if host_ranks == ranks else None
        if host_group is None and len(host_ranks) >= 2:
            host_group = dist.new_group(host_ranks, timeout=timeout, backend="gloo")
        device_group = None
        if len(gpu_ranks) >= 2:
            device_group = dist.new_group(gpu_ranks, timeout=timeout, backend="nccl")
        if stage is mine:
            # a non-member gets GroupMember.NON_GROUP_MEMBER; Communicator ignores those
            groups = dict(cpu=cpu_group, host=host_group, device=device_group)
            stage_ranks, stage_gpu_ranks, stage_host_ranks = ranks, gpu_ranks, host_ranks

    shm = None
    one_node = len({hosts[r] for r in stage_host_ranks}) == 1
    if rank in stage_host_ranks and len(stage_host_ranks) >= 2 and one_node:
        shm = ShmAllReduce.create(groups["host"], shm_slot_bytes, timeout_s)
    communicator = Communicator(
        rank=rank,
        ranks=tuple(stage_ranks),
        cpu_group=groups["cpu"],
        device_group=groups["device"],
        device_ranks=tuple(stage_gpu_ranks) if len(stage_gpu_ranks) >= 2 else (),
        host_group=groups["host"],
        host_ranks=tuple(stage_host_ranks) if len(stage_host_ranks) >= 2 else (),
        shm=shm,
    )
    return TPGroup(placement.tp_rank, plan.tensor_parallel_size, mine.tp_weights, communicator)


def _gather_host_ids(world_size: int) -> list[int]:
    """Every rank's host, as a hash of its name: a tensor, since peers on other nodes must
    never send us anything we would unpickle (all_gather_object would)."""
    digest = hashlib.sha256(socket.gethostname().encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:8], "little", signed=True)], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    return [int(t) for t in gathered]


def destroy_groups() -> None:
    """Tear down torch.distributed and every group of this process (close the TPGroup first)."""
    if dist.is_initialized():
        dist.destroy_process_group()
