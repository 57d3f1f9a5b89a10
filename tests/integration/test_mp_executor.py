"""The `mp` executor: one spawned process per worker; same tokens, clean failure, clean exit."""

from __future__ import annotations

import dataclasses
import glob
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hybridllm import LLM, SamplingParams
from hybridllm.distributed.shm_segment import SEGMENT_PREFIX, SHM_DIR, segment_creator_pid
from hybridllm.engine.scheduler_output import CachedRequestData, SchedulerOutput
from hybridllm.executor.executor import EngineDeadError
from tests.integration.test_pipeline_parallel import (
    ENGINE_KWARGS,
    assert_same_generation,
    generate,
    make_prompts,
)
from tests.model_helpers import make_tiny_model

MP_KWARGS = dict(ENGINE_KWARGS, distributed_executor_backend="mp")
DEATH_DEADLINE_S = 10.0
REPO_ROOT = Path(__file__).resolve().parents[2]


def _segments_of(pids: set[int]) -> list[str]:
    """Our shared-memory segments created by any of `pids` (other tests may run beside us)."""
    return [
        n
        for n in os.listdir(SHM_DIR)
        if n.startswith(SEGMENT_PREFIX) and segment_creator_pid(n) in pids
    ]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _worker_pids(llm: LLM) -> list[int]:
    return [d["pid"] for d in llm.llm_engine.executor.collective_rpc("describe")]


def _socket_dirs_of(pids: set[int]) -> list[str]:
    """The MessageQueue ipc socket directories created by any of `pids`."""
    base = tempfile.gettempdir()
    return [d for p in pids for d in glob.glob(os.path.join(base, f"hybridllm-mq-{p}_*"))]


def _assert_nothing_left(pids: set[int]) -> None:
    assert not [p for p in pids if p != os.getpid() and _alive(p)], "worker processes left"
    assert [p for p in multiprocessing.active_children() if p.pid in pids] == []
    assert _segments_of(pids) == []
    # workers' own queues (killed ones too) leave no socket directory behind
    assert _socket_dirs_of(pids - {os.getpid()}) == []


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


@pytest.fixture(scope="module")
def pp2(model_path):
    llm = LLM(model_path, pipeline_parallel_size=2, **MP_KWARGS)
    yield llm
    llm.shutdown()


def test_pp2_matches_single_worker(pp2, reference):
    want_tokens, want_embeds = reference
    assert_same_generation(generate(pp2, make_prompts()), want_tokens)
    embeds = pp2.llm_engine.embed([p["prompt_token_ids"] for p in make_prompts()[:3]])
    assert torch.allclose(torch.tensor(embeds), torch.tensor(want_embeds), atol=1e-5)


def test_workers_run_in_their_own_processes(pp2):
    described = pp2.llm_engine.executor.collective_rpc("describe")
    assert [d["rank"] for d in described] == [0, 1]
    assert [d["layers"] for d in described] == [(0, 2), (2, 3)]
    pids = {d["pid"] for d in described}
    assert len(pids) == 2 and os.getpid() not in pids
    # two CPU workers on a machine share its cores rather than oversubscribe them
    cores = len(os.sched_getaffinity(0))
    assert all(d["num_threads"] == max(1, cores // 2) for d in described)


def test_rpc_error_is_reported_and_worker_lives_on(pp2, reference):
    with pytest.raises(RuntimeError, match="no_such_method"):
        pp2.llm_engine.executor.collective_rpc("no_such_method")
    out = pp2.generate(make_prompts()[:1], SamplingParams(temperature=0, max_tokens=10))
    assert out[0].outputs[0].token_ids == reference[0][0][0]


def test_shutdown_leaves_nothing_behind(pp2):
    pids = set(_worker_pids(pp2)) | {os.getpid()}
    pp2.shutdown()
    _assert_nothing_left(pids)


def test_pp3_matches_then_a_killed_worker_fails_requests_clearly(model_path, reference):
    llm = LLM(model_path, pipeline_parallel_size=3, **MP_KWARGS)
    pids = set(_worker_pids(llm)) | {os.getpid()}
    try:
        assert_same_generation(generate(llm, make_prompts()), reference[0])
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        for i, prompt in enumerate(make_prompts()):
            engine.add_request(f"r{i}", prompt, params)
        for _ in range(3):
            engine.step()  # requests are mid-prefill or decoding, steps in flight
        victim = _worker_pids(llm)[1]  # the middle stage: both its neighbours notice
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError) as info:
            for _ in range(1000):
                engine.step()
        assert time.monotonic() - start < DEATH_DEADLINE_S
        message = str(info.value)
        assert f"worker rank 1 (pipeline stage 1, tp rank 0, device cpu, pid {victim})" in message
        assert "SIGKILL" in message
        # Every unfinished request ends with the error; then the engine is drained.
        errored = engine.step()
        assert {o.request_id for o in errored} == {f"r{i}" for i in range(len(make_prompts()))}
        assert all(o.finished and "worker rank 1" in o.error for o in errored)
        assert not engine.has_unfinished_requests()
        # LLM.generate surfaces the dead engine instead of hanging.
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            llm.generate(["hello"], params)
        _assert_nothing_left(pids)
    finally:
        llm.shutdown()


def test_exception_in_a_step_kills_the_engine_cleanly(model_path, reference):
    llm = LLM(model_path, **MP_KWARGS)  # one worker, in its own process
    pids = set(_worker_pids(llm)) | {os.getpid()}
    try:
        out = llm.generate(make_prompts()[:2], SamplingParams(temperature=0, max_tokens=10))
        assert [o.outputs[0].token_ids for o in out] == [t for t, _ in reference[0][:2]]
        # A step naming a request the worker never saw raises inside its execute_model.
        bogus = SchedulerOutput(
            scheduled_cached_reqs=[CachedRequestData("ghost", [5], ([],), 3)],
            num_scheduled_tokens={"ghost": 1},
            total_num_scheduled_tokens=1,
        )
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"(?s)worker rank 0 .*exception.*KeyError"):
            llm.llm_engine.executor.execute_model(bogus)
        assert time.monotonic() - start < DEATH_DEADLINE_S
        _assert_nothing_left(pids)
        with pytest.raises(EngineDeadError):
            llm.generate(["hello"])
    finally:
        llm.shutdown()


def _rendezvous_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "hybridllm-tp-*")))


@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)], ids=["tp2", "tp2xpp2"])
def test_tensor_parallel_matches_single_worker(model_path, reference, tp, pp):
    before = _rendezvous_dirs()
    llm = LLM(model_path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **MP_KWARGS)
    try:
        # The rendezvous is a file in a directory only we can enter, not a loopback port.
        rendezvous = llm.llm_engine.executor._rendezvous_dir
        assert rendezvous in _rendezvous_dirs() - before
        assert os.stat(rendezvous).st_mode & 0o777 == 0o700
        assert llm.llm_engine.config.plan.world_size == tp * pp
        assert_same_generation(generate(llm, make_prompts()), reference[0])
    finally:
        llm.shutdown()
    assert not os.path.exists(rendezvous)


def test_script_without_main_guard_is_told_to_add_one(model_path, tmp_path):
    # Spawned workers re-run the main script's top-level code: here that builds another LLM.
    script = tmp_path / "unguarded.py"
    kwargs = dict(MP_KWARGS, pipeline_parallel_size=2)
    script.write_text(
        textwrap.dedent(
            f"""\
            from hybridllm import LLM

            llm = LLM({model_path!r}, **{kwargs!r})
            print("engine started")
            llm.shutdown()
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0 and "engine started" not in out.stdout
    # The engine's own error (the last one: the workers' tracebacks come before it).
    engine_error = out.stderr[out.stderr.rfind("failed to start:") :]
    assert "failed to start:" in engine_error, out.stderr
    assert 'guard its top-level code with `if __name__ == "__main__":`' in engine_error
    assert "started with spawn" in engine_error and str(script) in engine_error


def test_cpu_binding_shares_a_missing_numa_node_and_splits_cores(caplog):
    from hybridllm.plan.plan import Plan
    from hybridllm.worker.cpu_binding import bind_cpu_worker, parse_cpu_list

    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    cpus = os.sched_getaffinity(0)
    plan = Plan.uniform([["cpu"], ["cpu"]], num_layers=4)
    # The plan puts the two CPU stages on nodes 1 and 2; this machine shows only node 0.
    stages = tuple(
        dataclasses.replace(
            s, workers=tuple(dataclasses.replace(w, numa_node=w.rank + 1) for w in s.workers)
        )
        for s in plan.stages
    )
    plan = dataclasses.replace(plan, stages=stages)
    threads_before = torch.get_num_threads()
    try:
        allowed, threads = bind_cpu_worker(plan.workers()[1], plan, None, nodes={0: set(cpus)})
        assert allowed == cpus and "sharing node 0" in caplog.text
        # both workers landed on node 0: they split its cores
        assert threads == max(1, len(cpus) // 2) == torch.get_num_threads()
        explicit = dataclasses.replace(plan.workers()[0], num_threads=1)
        assert bind_cpu_worker(explicit, plan, None, nodes={})[1] == 1
    finally:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads_before)
