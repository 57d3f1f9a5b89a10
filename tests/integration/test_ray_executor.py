"""The `ray` executor on a two-node local Ray cluster: same tokens, stages on both nodes, clean
failure and shutdown, and no way in for a peer without the run's key."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch
import zmq
from ray.cluster_utils import Cluster

from hybridllm import LLM, SamplingParams
from hybridllm.entrypoints.cli_plan import main as plan_main
from hybridllm.executor.executor import EngineDeadError
from tests.integration.openai_server import RemoteServer
from tests.integration.test_mp_executor import _alive, _segments_of, _socket_dirs_of
from tests.integration.test_pipeline_parallel import (
    ENGINE_KWARGS,
    assert_same_generation,
    generate,
    make_prompts,
)
from tests.model_helpers import make_tiny_model

# One thread per CPU worker: the cluster's two "machines" share this one's cores.
RAY_KWARGS = dict(ENGINE_KWARGS, distributed_executor_backend="ray", cpu_threads=1)
DEATH_DEADLINE_S = 10.0
_NODE_ARGS = dict(num_cpus=2, object_store_memory=100 << 20)


@pytest.fixture(scope="module")
def cluster():
    """A head node and a second node, both on this machine, each with its own resources."""
    c = Cluster(initialize_head=True, head_node_args=_NODE_ARGS)
    c.add_node(**_NODE_ARGS)
    c.wait_for_nodes()
    ray.init(address=c.address)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def reference(model_path):
    llm = LLM(model_path, **ENGINE_KWARGS)
    try:
        embeds = llm.llm_engine.embed([p["prompt_token_ids"] for p in make_prompts()[:3]])
        return generate(llm, make_prompts()), embeds
    finally:
        llm.shutdown()


def _described(llm: LLM) -> list[dict]:
    return llm.llm_engine.executor.collective_rpc("describe")


def _assert_swept(pids: set[int]) -> None:
    """No actor left alive and nothing of theirs in /dev/shm or the temp dir (both nodes
    live on this machine, so one look covers every node)."""
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "actor processes left"
    assert _segments_of(pids) == []
    assert _socket_dirs_of(pids) == []


def test_pp2_runs_one_stage_per_node_and_matches_single_worker(cluster, model_path, reference):
    llm = LLM(model_path, pipeline_parallel_size=2, **RAY_KWARGS)
    executor = llm.llm_engine.executor
    try:
        plan = llm.llm_engine.config.plan
        nodes = [s.node for s in plan.stages]
        assert len(set(nodes)) == 2 and set(nodes) <= {n["NodeID"] for n in ray.nodes()}
        described = _described(llm)
        assert [d["layers"] for d in described] == [(0, 2), (2, 3)]
        assert os.getpid() not in {d["pid"] for d in described}
        assert all(d["num_threads"] == 1 for d in described)
        # the stage on the other node reads the scheduler output over TCP, not shared memory
        handle = executor._broadcast.export_handle()
        remote = [r for r in range(2) if r not in handle.local_reader_ranks]
        assert remote == [1] and handle.reader_addresses[1].startswith("tcp://")
        assert handle.curve is not None
        want_tokens, want_embeds = reference
        assert_same_generation(generate(llm, make_prompts()), want_tokens)
        embeds = llm.llm_engine.embed([p["prompt_token_ids"] for p in make_prompts()[:3]])
        assert torch.allclose(torch.tensor(embeds), torch.tensor(want_embeds), atol=1e-5)
        pids = {d["pid"] for d in described}
        pg = executor._pg
    finally:
        llm.shutdown()
    _assert_swept(pids)
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"


def test_tp2_pp2_spans_two_nodes_and_matches_single_worker(cluster, model_path, reference):
    llm = LLM(model_path, tensor_parallel_size=2, pipeline_parallel_size=2, **RAY_KWARGS)
    try:
        plan = llm.llm_engine.config.plan
        assert plan.world_size == 4 and len({s.node for s in plan.stages}) == 2
        assert_same_generation(generate(llm, make_prompts()), reference[0])
        pids = {d["pid"] for d in _described(llm)}
    finally:
        llm.shutdown()
    _assert_swept(pids)


def test_killed_actor_fails_requests_clearly_and_leaves_nothing(cluster, model_path, reference):
    llm = LLM(model_path, pipeline_parallel_size=2, **RAY_KWARGS)
    try:
        engine = llm.llm_engine
        pids = {d["pid"] for d in _described(llm)}
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        for i, prompt in enumerate(make_prompts()):
            engine.add_request(f"r{i}", prompt, params)
        for _ in range(3):
            engine.step()  # requests are mid-prefill or decoding, steps in flight
        victim = _described(llm)[1]["pid"]  # the last stage, on the other node
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError) as info:
            for _ in range(1000):
                engine.step()
        assert time.monotonic() - start < DEATH_DEADLINE_S
        message = str(info.value)
        assert "worker rank 1 (pipeline stage 1, tp rank 0, device cpu, node " in message
        assert f"pid {victim}) died" in message
        # the other stage saw its peer go: it is named as stopped, not as a cause
        assert "then stopped: worker rank 0" in message
        errored = engine.step()
        assert {o.request_id for o in errored} == {f"r{i}" for i in range(len(make_prompts()))}
        assert all(o.finished and "worker rank 1" in o.error for o in errored)
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            llm.generate(["hello"], params)
        _assert_swept(pids)
    finally:
        llm.shutdown()


def test_a_peer_without_the_run_key_cannot_read_or_inject(cluster, model_path, reference):
    llm = LLM(model_path, pipeline_parallel_size=2, **RAY_KWARGS)
    executor = llm.llm_engine.executor
    ctx = zmq.Context()
    try:
        handle = executor._broadcast.export_handle()
        store = executor._store.handle
        strangers = []
        for server_key in (None, handle.curve.server_public):
            pull = ctx.socket(zmq.PULL)  # would take every other scheduler output if let in
            push = ctx.socket(zmq.DEALER)  # would write into the rendezvous store
            for sock in (pull, push):
                sock.setsockopt(zmq.LINGER, 0)
                if server_key is not None:  # the server's public key, a key pair of its own
                    sock.curve_serverkey = server_key
                    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
            pull.connect(handle.reader_addresses[1])
            push.connect(store.address)
            push.send_multipart([b"", b"\0" * 8, b"set", b"injected", b"1"])
            strangers += [pull, push]
        # the engine's messages all reach the real reader: same tokens as one worker
        assert_same_generation(generate(llm, make_prompts()), reference[0])
        assert not any(s.poll(200, zmq.POLLIN) for s in strangers), "a stranger got a message"
        from hybridllm.distributed.auth_store import AuthStore

        keyholder = AuthStore(store)
        assert not keyholder.check(["injected"])
        keyholder.close()
        for sock in strangers:
            sock.close()
    finally:
        ctx.term()
        llm.shutdown()


def test_plan_lists_cluster_nodes_and_where_each_stage_runs(cluster, model_path, capsys):
    args = [model_path, "-pp", "2", "--distributed-executor-backend", "ray", "--cpu-threads", "1"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert "ray cluster:" in out
    node_lines = [line for line in out.splitlines() if line.startswith("  node ")]
    assert len(node_lines) == 2 and sum("[engine]" in line for line in node_lines) == 1
    stages = [line for line in out.splitlines() if "[on node " in line]
    assert len(stages) == 2 and stages[0].split("[on node ")[1] != stages[1].split("[on node ")[1]


def test_server_on_the_ray_executor_answers_like_one_worker(cluster, model_path):
    prompts = ["The capital of France is", "List three colors:"]
    llm = LLM(model_path, **ENGINE_KWARGS)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        expected = [o.outputs[0].text for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
    args = [
        model_path, "-pp", "2", "--distributed-executor-backend", "ray",
        "--ray-address", cluster.address, "--cpu-threads", "1", "--max-model-len", "128",
        "--kv-cache-memory", "16MiB", "--dtype", "float32",
    ]  # fmt: skip
    with RemoteServer(args) as server:
        client = server.client()
        model = client.models.list().data[0].id
        batch = client.completions.create(
            model=model, prompt=prompts, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == expected
