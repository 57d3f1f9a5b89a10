"""An engine never hangs on exit: each scenario runs in a real subprocess that must end in time.

The engine bounds its own shutdown (`SHUTDOWN_BOUND_S`); the tests allow a wall-clock margin on
top for what is not the engine's (Ray's own disconnect at exit, interpreter teardown) and check
that nothing is left behind: no worker process, no shared-memory segment, no socket directory.
"""

from __future__ import annotations

import glob
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from hybridllm.distributed.shm_segment import SEGMENT_PREFIX, SHM_DIR, segment_creator_pid
from hybridllm.executor.shutdown import SHUTDOWN_BOUND_S
from tests.integration.openai_server import RemoteServer
from tests.model_helpers import make_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]
WALL_S = 30.0  # a whole scenario's exit, from the fault to the process's end
SMALL_ENGINE = dict(
    dtype="float32", max_model_len=128, block_size=4, kv_cache_memory="16MiB", use_tqdm=False
)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("llama")))


class Child:
    """A Python script in a subprocess; its output (stdout and stderr) is read on a thread so
    that waiting for a line can time out."""

    def __init__(self, script: str, env: dict[str, str] | None = None) -> None:
        full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script],
            cwd=REPO_ROOT,
            env=full_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def expect(self, tag: str, timeout: float) -> str:
        """The rest of the next line that starts with `tag`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                pytest.fail(f"no {tag!r} line within {timeout} s:\n{self.output[-6000:]}")
            if line is None:
                pytest.fail(f"exited ({self.proc.wait()}) before {tag!r}:\n{self.output[-6000:]}")
            if line.startswith(tag):
                return line[len(tag) :].strip()

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_exit(self, timeout: float) -> int:
        """The exit code; fails the test (after killing the process tree) if it hangs."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running {timeout} s later (hung):\n{self.output[-6000:]}")

    def kill(self) -> None:
        kill_tree(self.proc.pid)


def kill_tree(pid: int) -> None:
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)


def running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie counts: nobody reaped it); is_running compares the
    creation time too, so a reused pid does not count."""
    return [p for p in procs if p.is_running()]


def segments_of(pids: set[int]) -> list[str]:
    """Our shared-memory segments created by any of `pids` (other tests may run beside us)."""
    return [
        n
        for n in os.listdir(SHM_DIR)
        if n.startswith(SEGMENT_PREFIX) and segment_creator_pid(n) in pids
    ]


def socket_dirs_of(pids: set[int]) -> list[str]:
    base = tempfile.gettempdir()
    return [d for p in pids for d in glob.glob(os.path.join(base, f"hybridllm-mq-{p}_*"))]


def assert_nothing_left(procs: list[psutil.Process]) -> None:
    deadline = time.monotonic() + 5  # the last ones may still be being reaped
    while running(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running(procs) == [], "processes left running"
    pids = {p.pid for p in procs}
    assert segments_of(pids) == []
    assert socket_dirs_of(pids) == []


_RAY_CHILD = """
import sys, time
from hybridllm import LLM, SamplingParams
kwargs = dict({kwargs!r}, distributed_executor_backend="ray", cpu_threads=1)
first, second = LLM({model!r}, **kwargs), LLM({model!r}, **kwargs)
pids = []
for llm in (first, second):
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    pids += [d["pid"] for d in llm.llm_engine.executor.collective_rpc("describe")]
print("READY", pids, flush=True)
sys.stdin.readline()  # the cluster is gone
start = time.monotonic()
first.shutdown()
print("SHUTDOWN", time.monotonic() - start, flush=True)
print("EXITING", flush=True)  # `second` is shut down at exit
"""


def test_ray_cluster_gone_under_a_live_llm(model_path):
    """The cluster stops under two live engines: `shutdown()` of one and interpreter exit with
    the other end in time, warn once each and open no new Ray connection. Without the bound,
    shutdown blocked on the dead GCS until Ray ended the process (60 s), and at exit Ray's
    own hook disconnected first, so the engine's next Ray call connected anew to
    RAY_ADDRESS's dead cluster and hung."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args=dict(num_cpus=2, object_store_memory=100 << 20)
    )
    child = None
    try:
        script = _RAY_CHILD.format(model=model_path, kwargs=SMALL_ENGINE)
        child = Child(script, env={"RAY_ADDRESS": cluster.address})
        engine = psutil.Process(child.proc.pid)
        workers = [psutil.Process(p) for p in json.loads(child.expect("READY", 240))]
        cluster.shutdown()  # `ray stop` for this cluster only: others may run beside it
        cluster = None
        start = time.monotonic()
        child.send("go")
        assert float(child.expect("SHUTDOWN", WALL_S)) < SHUTDOWN_BOUND_S
        child.expect("EXITING", WALL_S)
        code = child.wait_exit(WALL_S - (time.monotonic() - start))
        assert code == 0, child.output[-6000:]
        assert_nothing_left(workers + [engine])
        log = child.output
        assert "Traceback" not in log, log[-6000:]
        # told once per engine, not once per Ray call
        assert log.count("the Ray cluster is unreachable") == 2, log[-6000:]
        assert "Connecting to existing Ray cluster" not in log.split("READY")[1], log[-6000:]
    finally:
        if child is not None and child.proc.poll() is None:
            child.kill()
        if cluster is not None:
            cluster.shutdown()


_MP_CHILD = """
import gc, sys, time
from hybridllm import LLM, SamplingParams
llm = LLM({model!r}, tensor_parallel_size=2, distributed_executor_backend="mp", **{kwargs!r})
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
print("READY", [d["pid"] for d in llm.llm_engine.executor.collective_rpc("describe")], flush=True)
sys.stdin.readline()  # a worker was killed
start = time.monotonic()
del llm  # garbage collection shuts the engine down
gc.collect()
print("COLLECTED", time.monotonic() - start, flush=True)
"""


def test_sigkilled_mp_worker_then_garbage_collection(model_path):
    """A tensor-parallel worker is SIGKILLed while the engine idles; dropping the LLM shuts it
    down in time and leaves no process, segment or socket directory (the killed worker's
    included)."""
    child = Child(_MP_CHILD.format(model=model_path, kwargs=SMALL_ENGINE))
    engine = psutil.Process(child.proc.pid)
    try:
        workers = [psutil.Process(p) for p in json.loads(child.expect("READY", 240))]
        workers[1].kill()
        start = time.monotonic()
        child.send("go")
        assert float(child.expect("COLLECTED", WALL_S)) < SHUTDOWN_BOUND_S
        assert child.wait_exit(WALL_S - (time.monotonic() - start)) == 0, child.output[-6000:]
        assert_nothing_left(workers + [engine])
        assert "Traceback" not in child.output, child.output[-6000:]
    finally:
        if child.proc.poll() is None:
            child.kill()


DRAIN_S = 2.0  # --shutdown-timeout: what running requests get before they are failed


def _stream(root: str, body: dict, lines: list[str], errors: list[BaseException]) -> None:
    try:
        with httpx.stream("POST", f"{root}/v1/completions", json=body, timeout=60) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line:
                    lines.append(line)
    except BaseException as e:  # the stream was cut: what the test looks for
        errors.append(e)


def _post(root: str, body: dict, results: list, errors: list[BaseException]) -> None:
    try:
        response = httpx.post(f"{root}/v1/completions", json=body, timeout=60)
        results.append((response.status_code, response.json()))
    except BaseException as e:
        errors.append(e)


@pytest.mark.slow  # the embedded model: a stream long enough to be running at SIGTERM
def test_server_sigterm_mid_stream_ends_streams_and_exits():
    """SIGTERM while a stream and a plain request run: after the drain time both are failed
    (the stream with an error event and its [DONE]), the process exits in time, and its
    workers, segments and socket directories are gone. Before, uvicorn cancelled the stream
    mid-body after its graceful timeout: the client saw a cut connection."""
    args = [
        "--distributed-executor-backend", "mp",
        "--pipeline-parallel-size", "2",
        "--max-model-len", "1024",
        "--shutdown-timeout", str(DRAIN_S),
    ]  # fmt: skip
    server = RemoteServer(args)
    try:
        server_proc = psutil.Process(server.proc.pid)
        procs = [server_proc, *server_proc.children(recursive=True)]
        assert len(procs) >= 3  # the server and its two workers
        model = httpx.get(f"{server.root}/v1/models", timeout=30).json()["data"][0]["id"]
        body = dict(model=model, prompt="Once upon a time", max_tokens=900, ignore_eos=True)
        lines: list[str] = []
        results: list = []
        errors: list[BaseException] = []
        clients = [
            threading.Thread(target=_stream, args=(server.root, {**body, "stream": True}, lines, errors)),
            threading.Thread(target=_post, args=(server.root, body, results, errors)),
        ]  # fmt: skip
        for t in clients:
            t.start()
        deadline = time.monotonic() + 120
        while len(lines) < 3 and time.monotonic() < deadline and not errors:
            time.sleep(0.05)
        assert len(lines) >= 3 and not errors, (errors, server.log_tail())
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(DRAIN_S + WALL_S)
        except subprocess.TimeoutExpired:
            kill_tree(server.proc.pid)
            pytest.fail(f"server still running after SIGTERM:\n{server.log_tail()}")
        elapsed = time.monotonic() - start
        for t in clients:
            t.join(10)
        log = server.log_tail(20000)
        assert elapsed < DRAIN_S + SHUTDOWN_BOUND_S, log
        assert not errors, (errors, log)
        # the stream was failed, not cut: an error event, then its end
        assert lines[-1] == "data: [DONE]", lines[-3:]
        event = json.loads(lines[-2].removeprefix("data: "))
        assert (
            event["error"]["code"] == "engine_dead" and "shutting down" in event["error"]["message"]
        )
        # the plain request got its answer: an error saying why
        assert [(status, r["error"]["code"]) for status, r in results] == [(503, "engine_dead")]
        assert_nothing_left(procs)
        assert "Traceback" not in log, log
    finally:
        server.stop()
        os.unlink(server.log.name)
