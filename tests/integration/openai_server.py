"""A real `hybridllm serve` subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments skipped)."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


class RemoteServer:
    """Starts `python -m hybridllm serve --port <free> ARGS`, waits for /health, stops on exit."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, timeout: float = 240):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(
            prefix="hybridllm-serve-", suffix=".log", delete=False
        )
        cmd = [sys.executable, "-m", "hybridllm", "serve", "--port", str(self.port), *args]
        full_env = {**os.environ, "PYTHONPATH": REPO_ROOT, **(env or {})}
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=full_env, stdout=self.log, stderr=subprocess.STDOUT
        )
        self._wait_healthy(timeout)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.root}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]

    def client(self, api_key: str = "unused", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kwargs)

    def async_client(self, api_key: str = "unused", **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        response = httpx.get(f"{self.root}/metrics", timeout=30)
        response.raise_for_status()
        return parse_metrics(response.text)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        os.unlink(self.log.name)
