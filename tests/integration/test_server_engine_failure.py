"""A real engine failure (a killed `mp` worker) under a real server: in-flight requests fail,
then the process exits non-zero so that a supervisor restarts it, leaving no shared memory."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from hybridllm.entrypoints.openai.api_server import EXIT_ENGINE_FAILED
from tests.integration.openai_server import RemoteServer
from tests.model_helpers import make_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("llama")))


def _workers(server: RemoteServer) -> list[psutil.Process]:
    children = psutil.Process(server.proc.pid).children()
    return [p for p in children if "spawn_main" in " ".join(p.cmdline())]


def _segments_of(pids: set[int]) -> list[str]:
    # Segment names embed their creator's pid (hybridllm_<pid>_...).
    return [n for n in os.listdir("/dev/shm") if any(f"hybridllm_{p}_" in n for p in pids)]


def _stream(server: RemoteServer, events: list[str], started: threading.Event) -> None:
    # Long enough to be in flight when the worker dies.
    body = {"prompt": "Hello world", "max_tokens": 480, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as r:
            events.append(f"status {r.status_code}")
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    started.set()
    except httpx.HTTPError as exc:
        events.append(f"closed: {type(exc).__name__}")
    started.set()


@pytest.mark.parametrize("when", ["in_flight", "idle"])
def test_killed_worker_fails_requests_and_the_server_exits_nonzero(model_path, when):
    args = [
        model_path,
        "--max-model-len",
        "512",
        "-pp",
        "2",
        "--distributed-executor-backend",
        "mp",
    ]
    with RemoteServer(args) as server:
        workers = _workers(server)
        assert len(workers) == 2, [p.cmdline() for p in workers]
        pids = {server.proc.pid} | {p.pid for p in workers}
        assert _segments_of(pids), "the mp executor should hold shared-memory segments"
        events: list[str] = []
        started = threading.Event()
        thread = None
        if when == "in_flight":
            thread = threading.Thread(target=_stream, args=(server, events, started))
            thread.start()
            assert started.wait(60) and any(e.startswith("data: {") for e in events), events
        workers[1].send_signal(signal.SIGKILL)
        start = time.monotonic()
        code = server.proc.wait(60)
        assert code == EXIT_ENGINE_FAILED, server.log_tail()
        assert time.monotonic() - start < 30
        if thread is not None:
            thread.join(30)
            # The stream was cut with an error event, not finished as if nothing happened.
            payloads = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
            assert any("error" in p for p in payloads), events
            assert not any(
                c.get("finish_reason") == "length" for p in payloads for c in p.get("choices", [])
            )
        log = server.log_tail(20000)
        assert "the engine failed" in log and "supervisor" in log
        assert "worker rank 1" in log and "SIGKILL" in log, log  # names the dead worker
        for p in workers:
            assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
        assert _segments_of(pids) == []
