"""`hybridllm bench serve` against real HTTP servers that close their connections like llama-server.

The fake server below is a real asyncio TCP server on a loopback port that speaks the streaming
OpenAI completions and chat completions (SSE) format. llama-server announces keep-alive and then
closes connections after a response; a client that reuses pooled connections writes requests into
closed sockets and loses them.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading

import pytest

from hybridllm.benchmarks.datasets import BenchRequest
from hybridllm.benchmarks.serve import run_benchmark
from hybridllm.benchmarks.serve_client import ServerTarget
from hybridllm.benchmarks.serve_metrics import compute_metrics
from tests.integration.openai_server import REPO_ROOT, RemoteServer

FIRST_TOKEN_DELAY = 0.05  # between the text-less first delta and the first text delta
TOKEN_DELAY = 0.002
SILENT_CLOSE_DELAY = 0.01


class SSEServer:
    """A streaming OpenAI-compatible server in a background thread, one response a connection.

    closing: "silent" announces keep-alive (no Connection header, HTTP/1.1) and closes the socket
    after the response, as llama-server does; "header" sends `Connection: close` first; "never"
    keeps connections open for the next request. failures maps a request's arrival number (0 is
    the first) to "503", "cut-chunked" (closed inside a chunked body) or "cut-eof" (a body
    delimited by the close, closed before a finish reason).
    """

    def __init__(
        self,
        closing: str = "silent",
        tokens_per_delta: int = 1,
        report_usage: bool = True,
        failures: dict[int, str] | None = None,
    ):
        self.closing = closing
        self.tokens_per_delta = tokens_per_delta
        self.report_usage = report_usage
        self.failures = failures or {}
        self.requests: list[tuple[str, dict]] = []  # (path, body) of every request read
        self.connections = 0
        self._handlers: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._started.wait(10)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=256)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            # Every connection handler ends (clients are done) and its socket is closed before
            # the loop stops, so no socket is left open behind the test.
            await asyncio.wait_for(asyncio.gather(*self._handlers), 10)
            await asyncio.sleep(0.01)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(20)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> SSEServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._handlers.add(asyncio.current_task())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip()
                    for k, v in (h.split(":", 1) for h in header_lines if ":" in h)
                }
                raw = await reader.readexactly(int(headers.get("content-length", 0)))
                if method == "GET":
                    await self._respond_json(writer, 200, {"data": [{"id": "fake-model"}]})
                else:
                    arrival = len(self.requests)
                    self.requests.append((path, json.loads(raw)))
                    await self._stream(writer, path, json.loads(raw), self.failures.get(arrival))
                if self.closing == "silent":
                    # A moment after the response, as a server thread finishing up would: long
                    # enough for a client to reuse the connection, whose request is then lost.
                    await asyncio.sleep(SILENT_CLOSE_DELAY)
                if self.closing != "never" or headers.get("connection") == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed its connection
        finally:
            writer.close()

    def _connection_header(self) -> bytes:
        return b"Connection: close\r\n" if self.closing == "header" else b""

    async def _respond_json(self, writer: asyncio.StreamWriter, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n".encode()
            + self._connection_header()
            + b"\r\n"
            + data
        )
        await writer.drain()

    async def _stream(
        self, writer: asyncio.StreamWriter, path: str, body: dict, failure: str | None
    ) -> None:
        if failure == "503":
            await self._respond_json(writer, 503, {"error": {"message": "overloaded"}})
            return
        chunked = failure != "cut-eof"
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            + (b"Transfer-Encoding: chunked\r\n" + self._connection_header() if chunked else b"")
            + (b"" if chunked else b"Connection: close\r\n")
            + b"\r\n"
        )

        def event(payload: dict | str) -> bytes:
            text = payload if isinstance(payload, str) else json.dumps(payload)
            data = f"data: {text}\n\n".encode()
            return b"%x\r\n%s\r\n" % (len(data), data) if chunked else data

        is_chat = path.endswith("chat/completions")
        n = body["max_tokens"]

        def choice(text: str | None, finish: str | None = None) -> dict:
            if is_chat:
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "finish_reason": finish}
            return {"index": 0, "text": text or "", "finish_reason": finish}

        kind = "chat.completion.chunk" if is_chat else "text_completion"
        # The first delta has no text (chat: the role alone), as llama-server's and vLLM's do.
        first = choice(None)
        if is_chat:
            first["delta"] = {"role": "assistant", "content": None}
        writer.write(event({"object": kind, "choices": [first]}))
        await writer.drain()
        await asyncio.sleep(FIRST_TOKEN_DELAY)
        for i in range(0, n, self.tokens_per_delta):
            if failure and failure.startswith("cut") and i >= 2:
                writer.close()  # gone mid-reply, no finish reason, no [DONE]
                return
            text = "".join(f" t{j}" for j in range(i, min(i + self.tokens_per_delta, n)))
            writer.write(event({"object": kind, "choices": [choice(text)]}))
            await writer.drain()
            await asyncio.sleep(TOKEN_DELAY)
        tail = event({"object": kind, "choices": [choice(None, "length")]})
        if self.report_usage and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
            tail += event({"object": kind, "choices": [], "usage": usage})
        tail += event("[DONE]")
        if chunked:
            tail += b"0\r\n\r\n"
        # The end of the reply in one write, then the close: the client reads the whole response
        # and puts the connection back in its pool before it sees the close.
        writer.write(tail)
        await writer.drain()


def bench_requests(count: int, output_len: int = 8) -> list[BenchRequest]:
    return [BenchRequest(f"prompt number {i}", 3, output_len) for i in range(count)]


def run(
    server_root: str,
    endpoint: str,
    requests: list[BenchRequest],
    concurrency: int,
    keep_alive: bool = False,
    model: str = "fake-model",
    ignore_eos: bool = False,
):
    target = ServerTarget(url=server_root + endpoint, model=model, ignore_eos=ignore_eos)
    results, duration = asyncio.run(
        run_benchmark(
            target,
            requests,
            max_concurrency=concurrency,
            show_progress=False,
            keep_alive=keep_alive,
        )
    )
    return results, compute_metrics(results, duration)


@pytest.mark.parametrize("closing", ["silent", "header"])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("concurrency,count", [(8, 24), (32, 96)])
def test_every_request_completes_against_a_server_closing_connections(
    closing, endpoint, concurrency, count
):
    with SSEServer(closing=closing, tokens_per_delta=2) as server:
        results, metrics = run(server.root, endpoint, bench_requests(count), concurrency)
        received = list(server.requests)
    errors = [r.error for r in results if not r.success]
    assert metrics.completed == count and metrics.failed == 0, errors
    # Each request reached the server exactly once: nothing was lost, nothing sent twice.
    assert len(received) == count and all(path == endpoint for path, _ in received)
    prompts = [
        body["messages"][0]["content"] if endpoint.endswith("chat/completions") else body["prompt"]
        for _, body in received
    ]
    assert sorted(prompts) == sorted(r.prompt for r in bench_requests(count))
    for _, body in received:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    for r in results:
        # 8 tokens in 4 deltas: the count is the server's usage, not the deltas.
        assert r.output_tokens == 8 and len(r.itl) == 3
        assert r.generated_text == "".join(f" t{j}" for j in range(8))
        # The first token is the first delta with text, not the text-less one before it.
        assert r.ttft >= FIRST_TOKEN_DELAY and r.latency > r.ttft


def test_tokens_are_counted_from_deltas_when_the_server_reports_no_usage():
    with SSEServer(report_usage=False) as server:
        results, metrics = run(server.root, "/v1/chat/completions", bench_requests(8, 5), 4)
    assert metrics.completed == 8
    assert [r.output_tokens for r in results] == [5] * 8 and all(len(r.itl) == 4 for r in results)


def test_keep_alive_reuses_connections_and_the_default_opens_one_per_request():
    with SSEServer(closing="never") as server:
        _, fresh = run(server.root, "/v1/completions", bench_requests(12), 2)
        fresh_connections = server.connections
    with SSEServer(closing="never") as server:
        _, reused = run(server.root, "/v1/completions", bench_requests(12), 2, keep_alive=True)
        reused_connections = server.connections
    assert fresh.completed == reused.completed == 12
    assert fresh_connections == 12
    # The two in flight; a few more if the end of a reply came in two reads, when the client
    # stops at [DONE] and drops that connection.
    assert reused_connections <= 4


def test_keep_alive_against_a_closing_server_reports_its_lost_requests():
    # The old client's behaviour, kept behind --keep-alive: it loses requests here, and says so.
    with SSEServer(closing="silent") as server:
        results, metrics = run(server.root, "/v1/completions", bench_requests(24), 8, True)
        received = len(server.requests)
    assert metrics.failed > 0 and metrics.completed + metrics.failed == 24
    assert sum(metrics.failure_reasons.values()) == metrics.failed
    assert received <= 24  # a failed request is not sent again


def test_failures_are_reported_by_reason_not_retried(tmp_path):
    from hybridllm.loader import default_model_path

    # Arrival 0 is the CLI's probe request; then 10 benchmark requests, 4 of them fail.
    failures = {2: "503", 4: "503", 6: "cut-chunked", 8: "cut-eof"}
    with SSEServer(failures=failures) as server:
        cmd = [
            sys.executable, "-m", "hybridllm", "bench", "serve",
            "--base-url", server.root, "--model", "fake-model",
            "--tokenizer", default_model_path(), "--endpoint", "/v1/chat/completions",
            "--num-prompts", "10", "--random-input-len", "4", "--random-output-len", "6",
            "--max-concurrency", "1", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "out.json",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": REPO_ROOT}
        proc = subprocess.run(
            cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        received = len(server.requests)
    assert proc.returncode == 0, proc.stderr
    assert received == 11  # the probe and each request once: no retries
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 4
    reasons = result["failure_reasons"]
    assert sum(reasons.values()) == 4 and reasons.pop("HTTP 503: overloaded") == 2
    assert reasons.pop("stream ended before a finish_reason or [DONE]") == 1
    # The chunked body cut short is aiohttp's payload error, whatever its exact words.
    ((cut_reason, cut_count),) = reasons.items()
    assert cut_count == 1 and cut_reason.startswith("ClientPayloadError")
    assert "Failures (count: reason)" in proc.stdout
    assert "    2: HTTP 503: overloaded" in proc.stdout
    assert sorted(e for e in result["errors"] if e) == sorted(
        ["HTTP 503: overloaded"] * 2 + ["stream ended before a finish_reason or [DONE]", cut_reason]
    )


@pytest.mark.slow
def test_against_hybridllm_serve_on_both_endpoints():
    args = ["--max-model-len", "512", "--max-num-seqs", "8", "--served-model-name", "smollm2"]
    with RemoteServer(args) as server:
        for endpoint in ("/v1/completions", "/v1/chat/completions"):
            results, metrics = run(
                server.root, endpoint, bench_requests(8, 4), 8, model="smollm2", ignore_eos=True
            )
            assert metrics.completed == 8, metrics.failure_reasons
            assert [r.output_tokens for r in results] == [4] * 8
            assert all(r.ttft > 0 and len(r.itl) >= 1 for r in results)
