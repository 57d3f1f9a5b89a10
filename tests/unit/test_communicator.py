"""Communicator, process groups and the shared-memory all-reduce across real spawned CPU ranks."""

from __future__ import annotations

import dataclasses
import glob
import os
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hybridllm.distributed.communicator import Communicator
from hybridllm.distributed.parallel_groups import destroy_groups, init_tp_group
from hybridllm.distributed.shm_allreduce import PeerDiedError, ShmAllReduce
from hybridllm.distributed.shm_segment import SEGMENT_PREFIX, SHM_DIR
from hybridllm.plan.plan import Plan, partition
from tests.dist_pool import RankPool

SLOT_BYTES = 1 << 20  # small: a 2 MiB tensor takes the gloo fallback


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(4)
    yield pool
    pool.close(graceful=False)  # nothing to clean up in them: segments are unlinked early


def _leftovers(pids: list[int]) -> list[str]:
    return [
        name
        for pid in pids
        for name in glob.glob(os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{pid}_*"))
    ]


def _cpu_plan(devices: list[list[str]], weights: tuple[float, ...] | None = None) -> Plan:
    plan = Plan.uniform(devices, num_layers=len(devices))
    if weights is None:
        return plan
    stages = tuple(dataclasses.replace(s, tp_weights=weights) for s in plan.stages)
    return dataclasses.replace(plan, stages=stages)


def _rank_tensor(shape, rank: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small integers: exact in bf16 and fp32, so sums are exact whatever the order."""
    gen = torch.Generator().manual_seed(seed * 101 + rank)
    return torch.randint(-8, 8, shape, generator=gen).to(dtype)


# ---- cases run on each rank ------------------------------------------------------------------


def _case_collectives(rank, init_method, weights):
    world = len(weights)
    plan = _cpu_plan([["cpu"] * world], weights)
    tp = init_tp_group(plan, rank, init_method, torch.device("cpu"), shm_slot_bytes=SLOT_BYTES)
    comm = tp.communicator
    assert comm.shm is not None and comm.size == world and tp.rank == rank
    name = comm.shm.name
    if rank == 0:  # the creator unlinks once everyone has mapped it: nothing can leak now
        assert not os.path.exists(os.path.join(SHM_DIR, name))
    reduced = {}
    # small (one barrier), 512 KiB (reduce-scatter), 2 MiB (> slot: gloo), in both dtypes
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (7, 4096, 128 * 1024, 512 * 1024):
            shape = (numel // 7, 7) if numel % 7 == 0 else (numel // 64, 64)
            mine = _rank_tensor(shape, rank, dtype, numel)
            expected = sum(_rank_tensor(shape, r, dtype, numel).float() for r in range(world))
            out = comm.all_reduce(mine.clone())
            assert out.dtype == dtype and out.shape == mine.shape
            torch.testing.assert_close(out.float(), expected, atol=0, rtol=0)
    # random floats, sizes changing every call (parity reuse): identical bits on every rank
    gen = torch.Generator().manual_seed(5)
    for i in range(24):
        numel = int(torch.randint(1, 80_000, (1,), generator=gen))
        x = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * i + rank))
        reduced[i] = comm.all_reduce(x).numpy().copy()
    # unequal all-gather along either dim, and one too large for a slot (gloo, padded)
    gathered = {}
    for dim, rows in ((-1, 3), (0, 5), (-1, 12_000)):
        sizes = [e - s for s, e in partition(8 * world * 4, weights, 8)]
        shape = (rows, sizes[rank]) if dim == -1 else (sizes[rank], rows)
        part = torch.full(shape, float(rank)) + torch.arange(sizes[rank]).view(
            (1, -1) if dim == -1 else (-1, 1)
        )
        gathered[(dim, rows)] = comm.all_gather(part, sizes, dim=dim).numpy()
        expected = torch.cat(
            [
                torch.full((rows, s) if dim == -1 else (s, rows), float(r))
                + torch.arange(s).view((1, -1) if dim == -1 else (-1, 1))
                for r, s in enumerate(sizes)
            ],
            dim=dim,
        )
        torch.testing.assert_close(torch.from_numpy(gathered[(dim, rows)]), expected)
    with pytest.raises(ValueError, match="one size per rank"):
        comm.all_gather(part, sizes[:-1])
    tp.close()
    destroy_groups()
    return name, reduced


def _case_pipeline_stages(rank, init_method):
    """pp 2 x tp 2: each stage's collectives stay inside the stage."""
    plan = _cpu_plan([["cpu", "cpu"], ["cpu", "cpu"]])
    tp = init_tp_group(plan, rank, init_method, torch.device("cpu"))
    assert (tp.rank, tp.size) == (rank % 2, 2)
    assert tp.communicator.ranks == ((0, 1) if rank < 2 else (2, 3))
    out = tp.communicator.all_reduce(torch.full((3,), float(rank)))
    gathered = tp.communicator.all_gather(torch.full((tp.rank + 1, 2), float(rank)), [1, 2], dim=0)
    tp.close()
    destroy_groups()
    return out.tolist(), gathered.shape


def _case_tp1_is_none(rank, init_method):
    plan = _cpu_plan([["cpu"], ["cpu"]])
    return init_tp_group(plan, rank, init_method, torch.device("cpu")), dist.is_initialized()


def _case_hierarchical(rank, init_method, use_shm):
    """Ranks 0 and 1 play GPU ranks (their device group runs gloo here), rank 2 a CPU rank:
    reduce to the leader, leader + CPU rank reduce, broadcast back."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=3)
    cpu_group = dist.new_group([0, 1, 2])
    host_group = dist.new_group([0, 2])
    device_group = dist.new_group([0, 1])
    shm = ShmAllReduce.create(host_group, SLOT_BYTES) if use_shm and rank != 1 else None
    comm = Communicator(
        rank=rank,
        ranks=(0, 1, 2),
        cpu_group=cpu_group,
        device_group=device_group,
        device_ranks=(0, 1),
        host_group=host_group,
        host_ranks=(0, 2),
        shm=shm,
    )
    results = []
    for numel in (5, 300_000):
        x = _rank_tensor((numel,), rank, torch.float32, numel)
        expected = sum(_rank_tensor((numel,), r, torch.float32, numel) for r in range(3))
        out = comm.all_reduce(x)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
        results.append(float(out.sum()))
    gathered = comm.all_gather(torch.full((2, rank + 1), float(rank)), [1, 2, 3])
    assert gathered.tolist() == [[0, 1, 1, 2, 2, 2]] * 2
    comm.close()
    destroy_groups()
    return results


def _case_peer_never_attaches(rank, init_method):
    """Rank 1 skips the segment set-up: rank 0's create fails and removes its segment."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    group = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    error = None
    if rank == 0:
        try:
            ShmAllReduce.create(group, SLOT_BYTES)
        except Exception as e:  # gloo reports the missing peer as a timeout or a closed pair
            error = type(e).__name__
        mine = glob.glob(os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{os.getpid()}_*"))
        assert error is not None and mine == [], (error, mine)
    else:
        time.sleep(1.5)  # past rank 0's timeout
    destroy_groups()
    return error


def _case_peer_dies(rank, init_method):
    """A rank killed between collectives: its peer raises PeerDiedError instead of hanging."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    shm = ShmAllReduce.create(dist.new_group([0, 1]), SLOT_BYTES, timeout_s=30)
    shm.all_reduce(torch.ones(4))
    if rank == 1:
        os._exit(1)
    start = time.monotonic()
    with pytest.raises(PeerDiedError, match="rank 1"):
        shm.all_reduce(torch.ones(4))
    waited = time.monotonic() - start
    shm.close()
    destroy_groups()
    return waited


# ---- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [(1.0, 1.0), (2.0, 1.0, 1.0)], ids=["tp2", "tp3_unequal"])
def test_all_reduce_and_unequal_all_gather(pool, weights):
    results = pool.run(_case_collectives, len(weights), weights)
    names = {name for name, _ in results}
    assert len(names) == 1  # one segment per group
    for i in results[0][1]:
        for _, reduced in results[1:]:
            assert np.array_equal(results[0][1][i], reduced[i])  # same bits everywhere
    assert _leftovers(pool.pids()) == []


def test_groups_per_pipeline_stage(pool):
    results = pool.run(_case_pipeline_stages, 4)
    assert [r[0] for r in results] == [[1.0] * 3] * 2 + [[5.0] * 3] * 2
    assert all(tuple(r[1]) == (3, 2) for r in results)


def test_tensor_parallel_size_one_needs_no_group(pool):
    assert pool.run(_case_tp1_is_none, 2) == [(None, False)] * 2


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "gloo"])
def test_hierarchical_all_reduce(pool, use_shm):
    results = pool.run(_case_hierarchical, 3, use_shm)
    assert results[0] == results[1] == results[2]
    assert _leftovers(pool.pids()) == []


def test_failed_setup_leaves_no_segment(pool):
    error, _ = pool.run(_case_peer_never_attaches, 2)
    assert error is not None
    assert _leftovers(pool.pids()) == []


def test_dead_peer_raises_instead_of_hanging(pool):
    pids = pool.pids()
    waited, died = pool.run(_case_peer_dies, 2, may_exit=frozenset({1}))
    assert died is None and waited < 5
    assert _leftovers(pids) == []
