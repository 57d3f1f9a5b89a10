"""`ray` executor: one Ray actor per worker, placed by a placement group built from the plan."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from hybridllm.config import EngineConfig
from hybridllm.distributed.auth_store import StoreServer
from hybridllm.distributed.message_queue import MessageQueue, cleanup_stale_socket_dirs
from hybridllm.distributed.shm_segment import cleanup_stale_segments
from hybridllm.executor import ray_cluster
from hybridllm.executor.queue_executor import QueueExecutor
from hybridllm.executor.ray_worker import RayWorker
from hybridllm.executor.shutdown import CallTimedOut, Deadline, call_bounded
from hybridllm.progress import current_setup
from hybridllm.worker.worker_process import WorkerProcessArgs

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 120.0  # the cluster may have to free (or autoscale) resources
_STARTUP_TIMEOUT_S = 600.0
# Shares of the shutdown bound (`Deadline`), each clipped to what is left of it.
_PROBE_S = 1.0  # the GCS accepts a connection at once when it lives on a reachable node
_KILL_S = 1.5  # ray.kill of every actor: a message each to the GCS
_KILLED_S = 2.0  # a killed actor's run ends once its process is gone
_REMOVE_PG_S = 1.5
_CLEANUP_S = 5.0  # the sweep tasks on the other nodes: a task each
_CLOSED = "this process's Ray connection was closed (ray.shutdown()) before the engine shut down"


class RayExecutor(QueueExecutor):
    """Workers as Ray actors, possibly on several machines.

    Each worker's bundle sits on its stage's node (`StagePlan.node`, chosen by the plan;
    a plan without nodes runs on the engine's node). The engine drives the workers as the
    `mp` executor does: the broadcast queue reaches workers on the engine's node through
    shared memory and the others over TCP (ZeroMQ with CURVE, bound to the node's cluster
    address); their answers come back the same way. Stages on one node hand activations
    over shared memory, stages on different nodes over torch.distributed (NCCL between
    GPUs, gloo otherwise), which the workers join through the engine's `StoreServer`: only
    holders of the run's key reach it. Ray's own traffic (actor calls, which carry the
    queue handles and keys) is Ray's to secure.

    A worker whose actor dies (or whose node goes) turns the next wait into an
    EngineDeadError naming it and its node; `shutdown` kills the actors, removes the
    placement group and sweeps every node the plan used.

    Shutdown is bounded whatever became of the cluster: no Ray call is made once this
    process's Ray connection is closed (it would connect anew, to a cluster that may be
    gone), nor once the GCS accepts no connection (calls through it would wait for it to
    come back); every other call is bounded (`call_bounded`). A cluster found unreachable is
    reported once, with a warning; Ray frees a departed driver's actors and placement group.
    """

    def __init__(self, config: EngineConfig, show_progress: bool = False):
        super().__init__(config)
        ray = ray_cluster.connect(config.ray_address)
        plan = config.plan
        self._ray = ray
        self._engine_node = ray_cluster.engine_node_id()
        addresses = ray_cluster.node_addresses()
        self._host = addresses[self._engine_node]
        self._node_of = {w.rank: plan.node_of(w.rank) or self._engine_node for w in plan.workers()}
        missing = sorted({n for n in self._node_of.values() if n not in addresses})
        if missing:
            raise RuntimeError(
                f"the plan places workers on Ray node(s) {missing}, which are not in the "
                f"cluster (live nodes: {sorted(addresses)}); plan again"
            )
        self._addresses = addresses
        self._actors: list[Any] = []
        self._runs: list[Any] = []
        self._pids: dict[int, int] = {}
        self._ended: dict[int, int | str] = {}
        self._pg = None
        self._store: StoreServer | None = None
        self._gcs = ray_cluster.gcs_address()
        self._unreachable: str | None = None  # why Ray calls are no longer made, once known
        self._shut_down_at_exit()  # before Ray's own exit hook disconnects
        try:
            self._pg = self._place()
            remote = [r for r, n in self._node_of.items() if n != self._engine_node]
            self._broadcast = MessageQueue(
                plan.world_size,
                max_chunks=plan.pipeline_parallel_size + 4,
                remote_reader_ranks=remote,
                remote_host=self._host,
            )
            self._broadcast.watch_remote_readers(self._rank_alive)
            crosses = any(a.node != b.node for a, b in zip(plan.stages, plan.stages[1:]))
            if plan.tensor_parallel_size > 1 or crosses:
                self._store = StoreServer(self._host)
            self._connect(self._start_workers(show_progress))
        except BaseException:
            self.shutdown()
            raise

    # ---- start-up --------------------------------------------------------------------------------

    def _place(self) -> Any:
        from ray.util.placement_group import placement_group

        bundles, selectors = ray_cluster.worker_bundles(self.config.plan, self._node_of)
        pg = placement_group(bundles, strategy="PACK", bundle_label_selector=selectors)
        ready, _ = self._ray.wait([pg.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            self._ray.util.remove_placement_group(pg)
            wanted = ", ".join(
                f"rank {r}: {b} on node {self._name(self._node_of[r])}"
                for r, b in enumerate(bundles)
            )
            raise RuntimeError(
                f"Ray could not place the workers within {_PLACEMENT_TIMEOUT_S:.0f} s: {wanted}; "
                f"the cluster has {self._ray.available_resources()} free"
            )
        return pg

    def _start_workers(self, show_progress: bool) -> list[dict]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        plan = self.config.plan
        actor_class = self._ray.remote(RayWorker)
        nodes_in_plan = any(s.node is not None for s in plan.stages)
        starts = []
        for w in plan.workers():
            strategy = PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=w.rank
            )
            actor = actor_class.options(
                num_cpus=float(w.num_threads or 1) if w.is_cpu else 0,
                num_gpus=0 if w.is_cpu else 1,
                scheduling_strategy=strategy,
            ).remote()
            args = WorkerProcessArgs(
                self.config,
                w.rank,
                self._broadcast.export_handle(),
                None,
                show_progress and w.rank == 0,
                logging=current_setup(),
                engine_node=self._engine_node if nodes_in_plan else None,
                host=self._addresses[self._node_of[w.rank]],
                store=self._store.handle if self._store else None,
            )
            self._actors.append(actor)
            starts.append(actor.start.remote(args))
        pending = dict(enumerate(starts))
        handles: list[dict | None] = [None] * len(starts)
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while pending:
            if time.monotonic() > deadline:
                names = ", ".join(self._describe(r) for r in sorted(pending))
                raise TimeoutError(f"workers did not start within {_STARTUP_TIMEOUT_S} s: {names}")
            ready, _ = self._ray.wait(list(pending.values()), num_returns=1, timeout=1.0)
            for ref in ready:
                rank = next(r for r, x in pending.items() if x is ref)
                del pending[rank]
                try:
                    handles[rank], self._pids[rank] = self._ray.get(ref)
                except Exception as e:  # RayTaskError (with the traceback) or RayActorError
                    raise RuntimeError(f"{self._describe(rank)} failed to start:\n{e}") from None
        self._runs = [actor.run.remote() for actor in self._actors]
        return handles

    # ---- liveness --------------------------------------------------------------------------------

    def _exited(self) -> dict[int, int | str]:
        if not self._runs:
            return dict(self._ended)
        todo = [ref for r, ref in enumerate(self._runs) if r not in self._ended]
        if todo and not self._ray.is_initialized():
            # Ray took the actors down with the connection; asking would connect anew
            for rank in range(len(self._runs)):
                self._ended.setdefault(rank, _CLOSED)
        elif todo:
            ready, _ = self._ray.wait(todo, num_returns=len(todo), timeout=0)
            for ref in ready:
                rank = self._runs.index(ref)
                try:
                    self._ended[rank] = self._ray.get(ref)
                except Exception as e:  # the actor (or its node) died
                    self._ended[rank] = _first_lines(str(e))
        return dict(self._ended)

    def _rank_alive(self, rank: int) -> bool | None:
        if not self._runs:
            return None
        if not self._ray.is_initialized():
            return False  # its actor went with the connection
        ready, _ = self._ray.wait([self._runs[rank]], timeout=0)
        return not ready

    def _started(self) -> bool:
        return bool(self._runs)

    # ---- shutdown --------------------------------------------------------------------------------

    def _stop_workers(self, grace: Deadline | None, deadline: Deadline) -> None:
        """Let the workers finish (until `grace`), kill every actor, remove the placement
        group; each call bounded, none once the cluster is unreachable."""
        ray, runs = self._ray, self._runs
        if grace is not None and runs:
            self._ray_call(
                "waiting for the workers to stop",
                lambda: ray.wait(runs, num_returns=len(runs), timeout=grace.remaining()),
                deadline.remaining(grace.remaining() + _PROBE_S),
            )
        if self._actors:
            actors = self._actors

            def kill() -> None:
                for actor in actors:
                    ray.kill(actor, no_restart=True)

            if self._ray_call("killing the actors", kill, deadline.remaining(_KILL_S)) and runs:
                # a killed actor's run ends with an error once its process is gone
                self._ray_call(
                    "waiting for the killed actors",
                    lambda: ray.wait(runs, num_returns=len(runs), timeout=_KILLED_S),
                    deadline.remaining(_KILLED_S + _PROBE_S),
                )
        if self._pg is not None:
            pg, self._pg = self._pg, None
            self._ray_call(
                "removing the placement group",
                lambda: ray.util.remove_placement_group(pg),
                deadline.remaining(_REMOVE_PG_S),
            )

    def _after_teardown(self, deadline: Deadline) -> None:
        """Sweep what killed workers left: here directly, on the other nodes with a task."""
        if self._store is not None:
            self._store.close()
            self._store = None
        cleanup_stale_segments()
        cleanup_stale_socket_dirs()
        if not self._actors:
            return  # nothing ran on the other nodes
        others = {n for n in self._node_of.values() if n != self._engine_node}
        nodes = [n for n in sorted(others) if n in self._addresses]
        if nodes:
            # a dead node has nothing left to sweep, nor a /dev/shm: its task's error is told
            ray = self._ray
            self._ray_call(
                "sweeping the other nodes",
                lambda: ray.get([ray_cluster.cleanup_node(n) for n in nodes], timeout=_CLEANUP_S),
                deadline.remaining(_CLEANUP_S + _PROBE_S),
            )

    def _ray_call(self, what: str, call: Callable[[], Any], timeout: float) -> bool:
        """Make one Ray call of the shutdown, within `timeout`; whether it was made and
        returned. Skipped once the cluster is unreachable; a call that does not return in
        time makes it so (the cluster went away under it)."""
        if timeout <= 0:
            logger.warning("no time left in the shutdown bound for %s", what)
            return False
        if self._cluster_unreachable(min(timeout, _PROBE_S)) is not None:
            return False
        try:
            call_bounded(call, timeout, what)
        except CallTimedOut:
            self._mark_unreachable(f"{what} did not return within {timeout:.1f} s")
            return False
        except Exception as e:  # a RayError: the actor, task or node died under the call
            logger.warning("%s during shutdown failed: %s", what, _first_lines(str(e), 2))
            return False
        return True

    def _cluster_unreachable(self, probe_s: float) -> str | None:
        """Why no Ray call can be made now without connecting anew or waiting on a GCS that
        is gone; None while calls can be made (the GCS answered within `probe_s`)."""
        if self._unreachable is None:
            if not self._ray.is_initialized():
                self._mark_unreachable(_CLOSED)
            elif not ray_cluster.gcs_reachable(self._gcs, probe_s):
                self._mark_unreachable(f"its GCS at {self._gcs} accepts no connection")
        return self._unreachable

    def _mark_unreachable(self, reason: str) -> None:
        """Stop making Ray calls, and say so once."""
        if self._unreachable is not None:
            return
        self._unreachable = reason
        logger.warning(
            "the Ray cluster is unreachable: %s. The engine stops without it: it does not "
            "kill its actors, remove its placement group or sweep other nodes (Ray frees a "
            "departed driver's actors and placement groups; a node that went down took them).",
            reason,
        )

    def _describe(self, rank: int) -> str:
        p = self._placements[rank]
        node = self._name(self._node_of[rank])
        return (
            f"worker rank {rank} (pipeline stage {p.pp_rank}, tp rank {p.tp_rank}, "
            f"device {p.device}, node {node}, pid {self._pids.get(rank)})"
        )

    def _name(self, node_id: str) -> str:
        return f"{self._addresses.get(node_id, '?')} ({node_id[:8]})"


def _first_lines(text: str, limit: int = 6) -> str:
    """Ray's account of a death, without the long tail it sometimes carries."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[:limit])
