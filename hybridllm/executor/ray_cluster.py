"""The Ray cluster as the engine sees it: joining it, its nodes and hardware, the placement group."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from hybridllm.plan.cluster import ClusterNode
from hybridllm.plan.plan import Plan
from hybridllm.platforms.discovery import HardwareInfo, discover_hardware

logger = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"  # the label every Ray node carries; bundles select on it
_PROBE_TIMEOUT_S = 120.0


def import_ray() -> Any:
    """The `ray` module, or an ImportError saying how to install it (it is an extra)."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "distributed_executor_backend='ray' needs Ray: pip install 'hybridllm[ray]'"
        ) from e
    return ray


def connect(address: str | None = None) -> Any:
    """Join the cluster the user runs: an already initialised `ray`, else `address`, else
    RAY_ADDRESS, else one started with `ray start` on this machine; only when there is none
    does Ray start a local one. The connection lasts until this process exits."""
    ray = import_ray()
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or None
        logger.info("connecting to ray at %s", address or "a local cluster")
        # log_to_driver: the workers' logs (and tracebacks) show in the engine's output
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    return ray


def gcs_address() -> str | None:
    """host:port of the cluster's GCS, or None where Ray does not say (Ray Client)."""
    try:
        return import_ray().get_runtime_context().gcs_address
    except Exception:  # Ray Client's context has no GCS client
        return None


def gcs_reachable(address: str | None, timeout: float) -> bool:
    """Whether the GCS at `address` accepts a TCP connection within `timeout` seconds.

    A cheap look before Ray calls that go through the GCS (killing an actor, removing a
    placement group, starting a task): with the GCS gone they wait for it to come back, up to
    a minute, and then Ray ends the process. An address that cannot be read counts as
    reachable, leaving it to the call's own bound.
    """
    if address is None:
        return True
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except ValueError:
        return True
    except OSError:
        return False


def engine_node_id() -> str:
    return import_ray().get_runtime_context().get_node_id()


def node_addresses() -> dict[str, str]:
    """Node id -> the IP the cluster reaches it at, for every live node."""
    return {n["NodeID"]: n["NodeManagerAddress"] for n in import_ray().nodes() if n["Alive"]}


def cluster_nodes() -> list[ClusterNode]:
    """Every live node with its Ray resources and its hardware (one probe task per node,
    run there: GPUs, cores, NUMA layout and RAM as `discover_hardware` sees them)."""
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    engine = engine_node_id()
    alive = [n for n in ray.nodes() if n["Alive"]]
    # max_calls=1: the probing process exits, with any CUDA context it made
    probe = ray.remote(num_cpus=0, max_calls=1)(_probe_hardware)
    refs = [
        probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(n["Resources"].get("GPU", 0) > 0)
        for n in alive
    ]
    hardware = ray.get(refs, timeout=_PROBE_TIMEOUT_S)
    return [
        ClusterNode(
            node_id=n["NodeID"],
            address=n["NodeManagerAddress"],
            num_cpus=int(n["Resources"].get("CPU", 0)),
            num_gpus=int(n["Resources"].get("GPU", 0)),
            hardware=hw,
            is_engine=n["NodeID"] == engine,
        )
        for n, hw in zip(alive, hardware)
    ]


def _probe_hardware(include_gpus: bool) -> HardwareInfo:
    return discover_hardware(include_gpus=include_gpus)


def worker_bundles(plan: Plan, node_of: dict[int, str]) -> tuple[list[dict], list[dict]]:
    """Placement-group bundles, one per worker in rank order, and their node selectors: a
    GPU worker asks for a GPU, a CPU worker for its threads as CPUs, on its stage's node."""
    bundles, selectors = [], []
    for w in plan.workers():
        bundles.append({"CPU": float(w.num_threads or 1)} if w.is_cpu else {"GPU": 1.0})
        selectors.append({NODE_ID_LABEL: node_of[w.rank]})
    return bundles, selectors


def cleanup_node(node_id: str) -> Any:
    """Start sweeping stale segments and socket directories on `node_id` (a worker killed
    there could not unlink its own); returns the task's ref."""
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_calls=1)(_cleanup_here)
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return task.options(scheduling_strategy=strategy).remote()


def _cleanup_here() -> int:
    from hybridllm.distributed.message_queue import cleanup_stale_socket_dirs
    from hybridllm.distributed.shm_segment import cleanup_stale_segments

    return len(cleanup_stale_segments()) + len(cleanup_stale_socket_dirs())
