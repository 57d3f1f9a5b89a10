"""All-reduce and all-gather among processes on one node through one shared-memory segment."""

from __future__ import annotations

import os
import threading
import time
import weakref

import numpy as np
import torch
import torch.distributed as dist

from hybridllm.distributed.shm_segment import (
    attach_segment,
    create_segment,
    new_segment_name,
    pid_alive,
    release_segment,
    unlink_segment,
)
from hybridllm.distributed.spin_timer import SpinPolicy, SpinTimer

_HEADER_STRIDE = 64  # one cache line per rank: [sequence number, pid, unused...] as int64
_DATA_ALIGN = 4096
_MAX_CACHED_VIEWS = 64
_LIVENESS_INTERVAL_S = 0.05  # how often a blocked rank checks whether a peer process died
# Above this size each rank sums only its chunk and the others copy it (two barriers instead
# of one, but no rank reads every slot in full).
_REDUCE_SCATTER_MIN_BYTES = 256 << 10
# Ranks arrive within microseconds of each other when the work is balanced: spin (yielding
# the core) a while before sleeping, and keep the sleeps short.
DEFAULT_SPIN_POLICY = SpinPolicy(spin_s=5e-3, first_sleep_s=20e-6, max_sleep_s=2e-4)


class PeerDiedError(RuntimeError):
    """A rank waited on a peer whose process is gone; the collective can never finish."""


class ShmAllReduce:
    """Sum (or gather) CPU tensors among the `size` ranks of a gloo group on one node.

    Layout: [header: size x 64 B (seq, pid) | pad to 4 KiB | data: 2 x size x slot_bytes].
    Each collective uses the data half of its parity (double buffering), so one barrier per
    collective suffices: a rank can only reuse a half after every rank has posted the next
    collective's flag, i.e. after every rank finished reading it.

    Small tensors: each rank writes its slot, bumps its sequence number, waits until all
    have, and sums every slot in rank order (identical bits on every rank). Large tensors:
    rank r sums chunk r only and writes it back into its own slot, a second barrier, then
    everyone copies the chunks. Tensors larger than a slot are the caller's job (`fits`).

    The group's first rank creates the segment; the others attach; once all have mapped
    it, the creator unlinks its name, so nothing is left in /dev/shm even if a rank is
    killed later. A finalizer unmaps (and, before that point, unlinks) on close, garbage
    collection and interpreter exit. Stores then flag: x86 keeps stores in order; the lock
    round-trip in `_fence` is a full barrier on weaker CPUs.
    """

    def __init__(
        self,
        segment,
        owner: bool,
        rank: int,
        size: int,
        slot_bytes: int,
        timeout_s: float | None,
        spin_policy: SpinPolicy,
    ) -> None:
        self.rank = rank
        self.size = size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self.spin_policy = spin_policy
        self.name = segment.name
        self._finalizer = weakref.finalize(self, release_segment, segment, owner)
        self._unlinked = not owner
        header = np.frombuffer(segment.buf, dtype=np.int64, count=size * _HEADER_STRIDE // 8)
        self._header = header.reshape(size, _HEADER_STRIDE // 8)  # [size, 8] int64
        self._seqs = self._header[:, 0]  # [size] barrier sequence numbers
        data_offset = _data_offset(size)
        self._data = torch.frombuffer(
            segment.buf, dtype=torch.uint8, offset=data_offset, count=2 * size * slot_bytes
        ).view(2, size, slot_bytes)  # [parity, rank, bytes]
        self._views: dict[tuple[int, torch.dtype, int], torch.Tensor] = {}
        self._fence_lock = threading.Lock()
        self._seq = 0
        self._ops = 0
        self._header[rank, 1] = os.getpid()

    @staticmethod
    def segment_size(size: int, slot_bytes: int) -> int:
        return _data_offset(size) + 2 * size * slot_bytes

    @classmethod
    def create(
        cls,
        group: dist.ProcessGroup,
        slot_bytes: int = 4 << 20,
        timeout_s: float | None = 600.0,
        spin_policy: SpinPolicy = DEFAULT_SPIN_POLICY,
    ) -> ShmAllReduce:
        """Collective over every rank of the gloo `group` (all on this node)."""
        if slot_bytes < 64:
            raise ValueError(f"slot_bytes must be at least 64, got {slot_bytes}")
        slot_bytes = -(-slot_bytes // 64) * 64
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if size < 2:
            raise ValueError("a shared-memory all-reduce needs at least two ranks")
        src = dist.get_global_rank(group, 0)
        total = cls.segment_size(size, slot_bytes)
        if rank == 0:
            segment = create_segment(new_segment_name(), total)
            try:
                # zero the header: sequence numbers start at 0 for every rank
                segment.buf[: _data_offset(size)] = bytes(_data_offset(size))
                shm = cls(segment, True, rank, size, slot_bytes, timeout_s, spin_policy)
            except BaseException:
                release_segment(segment, owner=True)
                raise
            try:
                dist.broadcast_object_list([shm.name], src=src, group=group)
                dist.barrier(group=group)  # every rank has mapped the segment
            except BaseException:
                shm.close()
                raise
            shm.unlink()
            return shm
        names = [None]
        dist.broadcast_object_list(names, src=src, group=group)
        segment = attach_segment(names[0])
        try:
            if len(segment.buf) != total:
                raise ValueError(
                    f"segment {names[0]!r} is {len(segment.buf)} bytes, expected {total}: "
                    "ranks disagree on slot_bytes"
                )
            shm = cls(segment, False, rank, size, slot_bytes, timeout_s, spin_policy)
        except BaseException:
            release_segment(segment, owner=False)
            raise
        dist.barrier(group=group)
        return shm

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def unlink(self) -> None:
        """Remove the segment's name; existing mappings stay valid."""
        if not self._unlinked:
            unlink_segment(self.name)
            self._unlinked = True

    def close(self) -> None:
        """Unmap (and unlink, if still named); the object is unusable afterwards."""
        self._header = self._seqs = self._data = None
        self._views.clear()
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    # ---- collectives ---------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `tensor`; a CPU tensor is reduced in place, a device tensor
        into a new CPU tensor (the caller copies it back)."""
        nbytes = tensor.numel() * tensor.element_size()
        if not self.fits(nbytes):
            raise ValueError(f"{nbytes} bytes exceed the {self.slot_bytes}-byte slot")
        out = tensor if tensor.device.type == "cpu" else torch.empty_like(tensor, device="cpu")
        flat_out = out.view(-1)  # [numel]
        slots = self._slots(tensor.dtype, tensor.numel())  # [size, numel]
        slots[self.rank].copy_(tensor.reshape(-1))
        self._barrier()
        if nbytes < _REDUCE_SCATTER_MIN_BYTES:
            _sum_rows(slots, flat_out)
            return out
        bounds = _chunk_bounds(tensor.numel(), self.size)
        start, end = bounds[self.rank]
        mine = flat_out[start:end]
        _sum_rows(slots[:, start:end], mine)
        slots[self.rank, start:end].copy_(mine)
        self._barrier()
        for r, (start, end) in enumerate(bounds):
            if r != self.rank:
                flat_out[start:end].copy_(slots[r, start:end])
        return out

    def all_gather(self, tensor: torch.Tensor, sizes: list[int], dim: int) -> torch.Tensor:
        """Every rank's `tensor` (rank r's has `sizes[r]` along `dim`) concatenated on CPU."""
        dim = dim % tensor.dim()
        if tensor.shape[dim] != sizes[self.rank]:
            raise ValueError(
                f"rank {self.rank}: size {tensor.shape[dim]} along dim {dim}, "
                f"but sizes says {sizes[self.rank]}"
            )
        shapes = [tensor.shape[:dim] + (s,) + tensor.shape[dim + 1 :] for s in sizes]
        numels = [int(np.prod(s)) for s in shapes]
        if not self.fits(max(numels) * tensor.element_size()):
            raise ValueError(
                f"a shard of {max(numels) * tensor.element_size()} bytes exceeds "
                f"the {self.slot_bytes}-byte slot"
            )
        slots = self._slots(tensor.dtype, max(numels))  # [size, max numel]
        slots[self.rank, : numels[self.rank]].view(shapes[self.rank]).copy_(tensor)
        self._barrier()
        parts = [slots[r, : numels[r]].view(shapes[r]) for r in range(self.size)]
        return torch.cat(parts, dim=dim)

    # ---- internals ----------------------------------------------------------------------------

    def _slots(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """This collective's half of the data area as [size, numel] of `dtype`."""
        parity = self._ops & 1
        self._ops += 1
        key = (parity, dtype, numel)
        view = self._views.get(key)
        if view is None:
            # decode steps repeat a few shapes: building the view costs more than the copy
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()
            view = self._data[parity, :, : numel * dtype.itemsize].view(dtype)
            self._views[key] = view
        return view

    def _fence(self) -> None:
        with self._fence_lock:
            pass

    def _barrier(self) -> None:
        """Post our sequence number and wait until every rank has posted it."""
        self._seq += 1
        seq = self._seq
        self._fence()  # our slot writes must be visible before the flag
        self._seqs[self.rank] = seq
        if self._seqs.min() >= seq:
            self._fence()
            return
        timer = SpinTimer(self.timeout_s, self.spin_policy)
        next_check = time.monotonic() + _LIVENESS_INTERVAL_S
        while self._seqs.min() < seq:
            if time.monotonic() >= next_check:
                self._check_peers(seq)
                next_check = time.monotonic() + _LIVENESS_INTERVAL_S
            if timer.expired():
                late = [r for r in range(self.size) if self._seqs[r] < seq]
                raise TimeoutError(
                    f"shared-memory all-reduce {self.name}: ranks {late} did not arrive "
                    f"within {self.timeout_s} s"
                )
            timer.pause()
        self._fence()  # the peers' slot writes are visible after their flags

    def _check_peers(self, seq: int) -> None:
        for r in range(self.size):
            pid = int(self._header[r, 1])
            if self._seqs[r] < seq and pid > 0 and not pid_alive(pid):
                raise PeerDiedError(
                    f"shared-memory all-reduce {self.name}: rank {r} (pid {pid}) died"
                )


def _data_offset(size: int) -> int:
    return -(-size * _HEADER_STRIDE // _DATA_ALIGN) * _DATA_ALIGN


def _chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    step = -(-numel // parts)
    return [(min(r * step, numel), min((r + 1) * step, numel)) for r in range(parts)]


def _sum_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """out = rows[0] + rows[1] + ... in rank order, so every rank gets identical bits."""
    torch.add(rows[0], rows[1], out=out)
    for r in range(2, rows.shape[0]):
        out.add_(rows[r])
