"""`Communicator`: the collectives of one tensor-parallel group, hierarchical across GPU and CPU."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridllm.distributed.shm_allreduce import ShmAllReduce


class Communicator:
    """All-reduce and all-gather among the ranks of one tensor-parallel group.

    The group's ranks split into GPU ranks and CPU ranks. GPU ranks talk among themselves
    over `device_group` (NCCL, only when there are at least two of them); the first GPU rank
    (the leader) and the CPU ranks form the host group, which sums over shared memory
    (`shm`, one node) or gloo (`host_group`). A mixed all-reduce therefore crosses PCIe once
    per direction, on the leader only: NCCL reduce to the leader, host all-reduce, NCCL
    broadcast back. `cpu_group` (gloo) spans every rank of the group.

    `ranks` are global ranks ordered by tensor-parallel rank; `device_ranks` and `host_ranks`
    list the members of `device_group` and `host_group` (empty when there is no such group).
    """

    def __init__(
        self,
        *,
        rank: int,
        ranks: tuple[int, ...],
        cpu_group: dist.ProcessGroup,
        device_group: dist.ProcessGroup | None = None,
        device_ranks: tuple[int, ...] = (),
        host_group: dist.ProcessGroup | None = None,
        host_ranks: tuple[int, ...] = (),
        shm: ShmAllReduce | None = None,
    ) -> None:
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not in its group's ranks {ranks}")
        self.rank = rank
        self.ranks = ranks
        self.tp_rank = ranks.index(rank)
        self.size = len(ranks)
        self.cpu_group = cpu_group
        self.device_group = device_group if rank in device_ranks else None
        self.device_ranks = device_ranks
        self.host_group = host_group if rank in host_ranks else None
        self.host_ranks = host_ranks
        self.shm = shm
        self.leader = device_ranks[0] if device_ranks else None
        # the host group is the whole TP group: it can run the all-gather too
        self._host_is_whole_group = set(host_ranks) == set(ranks)
        self._device_is_whole_group = set(device_ranks) == set(ranks)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of `t` over the group. Reduces in place when `t` is contiguous: use the result."""
        if self.size == 1:
            return t
        t = t.contiguous()
        if self.device_group is not None:
            if self._device_is_whole_group:
                dist.all_reduce(t, group=self.device_group)
                return t
            dist.reduce(t, dst=self.leader, group=self.device_group)
            if self.rank == self.leader:
                self._host_all_reduce(t)
            dist.broadcast(t, src=self.leader, group=self.device_group)
            return t
        return self._host_all_reduce(t)

    def all_gather(self, t: torch.Tensor, sizes: list[int], dim: int = -1) -> torch.Tensor:
        """Concatenation along `dim` of every rank's `t`; rank i's has `sizes[i]` there."""
        if len(sizes) != self.size:
            raise ValueError(f"all_gather needs one size per rank ({self.size}), got {sizes}")
        dim = dim % t.dim()
        if t.shape[dim] != sizes[self.tp_rank]:
            raise ValueError(
                f"tp rank {self.tp_rank}: tensor has {t.shape[dim]} along dim {dim}, "
                f"sizes says {sizes[self.tp_rank]}"
            )
        if self.size == 1:
            return t
        shard_bytes = t.numel() // max(t.shape[dim], 1) * max(sizes) * t.element_size()
        if self.shm is not None and self._host_is_whole_group and self.shm.fits(shard_bytes):
            return self.shm.all_gather(t, sizes, dim).to(t.device)
        if self.device_group is not None and self._device_is_whole_group:
            return _padded_all_gather(t, sizes, dim, self.device_group)
        # mixed group: gather host copies over gloo, then back to this rank's device
        return _padded_all_gather(t.cpu(), sizes, dim, self.cpu_group).to(t.device)

    def close(self) -> None:
        """Release the shared-memory segment; the process groups belong to `destroy_groups`."""
        if self.shm is not None:
            self.shm.close()

    def _host_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce among the leader and the CPU ranks; `t` may live on the GPU (leader)."""
        nbytes = t.numel() * t.element_size()
        if self.shm is not None and self.shm.fits(nbytes):
            out = self.shm.all_reduce(t)  # the leader's GPU tensor goes straight into its slot
        else:
            out = t if t.device.type == "cpu" else t.cpu()
            dist.all_reduce(out, group=self.host_group)
        if out is not t:
            t.copy_(out)
        return t


def _padded_all_gather(
    t: torch.Tensor, sizes: list[int], dim: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """all_gather of unequal shards: pad each to the largest along `dim`, then trim."""
    largest = max(sizes)
    t = t.contiguous()
    if t.shape[dim] < largest:
        pad_shape = list(t.shape)
        pad_shape[dim] = largest - t.shape[dim]
        t = torch.cat([t, t.new_zeros(pad_shape)], dim=dim)
    gathered = [torch.empty_like(t) for _ in sizes]
    dist.all_gather(gathered, t, group=group)
    return torch.cat([g.narrow(dim, 0, s) for g, s in zip(gathered, sizes)], dim=dim)
