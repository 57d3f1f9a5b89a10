"""Pure-ASGI middlewares: request id + access log + metrics, API key, body size and read timeout."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridllm.entrypoints.openai.errors import REQUEST_ID_HEADER, error_body, new_request_id
from hybridllm.entrypoints.openai.metrics import ServerMetrics

access_logger = logging.getLogger("hybridllm.access")

# The interactive docs describe every route and field: as private as the API they describe.
_DOC_PATHS = ("/docs", "/redoc", "/openapi.json")


async def send_error(send: Send, status: int, message: str, code: str | None = None) -> None:
    body = json.dumps(error_body(message, status, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class AccessLogMiddleware:
    """Gives each request an id (x-request-id), logs one line per request (id, method, path,
    status, latency) and counts statuses."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 0
        request_id = new_request_id(scope)
        id_header = (REQUEST_ID_HEADER.encode(), request_id.encode())

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                if not any(name.lower() == id_header[0] for name, _ in headers):
                    message = {**message, "headers": [*headers, id_header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        except Exception:
            status = status or 500  # Starlette's outermost handler answers it with a 500
            raise
        finally:
            # A stream whose client left ends without a status only if nothing was sent.
            self.metrics.observe_http(status or 499)
            client = scope.get("client")
            access_logger.info(
                '%s "%s %s" %d %.1f ms %s',
                f"{client[0]}:{client[1]}" if client else "-",
                scope["method"],
                scope["path"],
                status or 499,
                (time.perf_counter() - start) * 1000,
                request_id,
            )


class ApiKeyMiddleware:
    """Every /v1/* and API-docs request must carry `Authorization: Bearer <key>`, or
    `x-api-key: <key>` as Anthropic's clients send it."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_x_api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith("/v1") or path.startswith(_DOC_PATHS):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            given_x_api_key = headers.get(b"x-api-key", b"")
            # Constant-time compares, both always made: the key must not leak through timing.
            bearer_ok = hmac.compare_digest(given, self.expected)
            x_api_key_ok = hmac.compare_digest(given_x_api_key, self.expected_x_api_key)
            if not (bearer_ok or x_api_key_ok):
                reason = "missing" if not (given or given_x_api_key) else "invalid"
                await send_error(
                    send,
                    401,
                    f"{reason} API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                    "invalid_api_key",
                )
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Answer 413 to bodies over `max_bytes` (declared or streamed) before the app sees them,
    408 when the client sends no part of its body for `read_timeout` seconds (uvicorn waits
    forever, so slow clients could hold connections and buffers indefinitely), and 431 to
    headers over `max_header_bytes` (h11 bounds only headers still incomplete)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        read_timeout: float | None = None,
        max_header_bytes: int | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.max_header_bytes is not None:
            size = sum(len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > self.max_header_bytes:
                message = f"request headers are larger than the limit of {self.max_header_bytes}"
                await send_error(send, 431, message + " bytes", "headers_too_large")
                return
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send)
            return
        # Chunked or lying clients: buffer up to the limit, then replay the body to the app.
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout)
            except asyncio.TimeoutError:
                await send_error(
                    send,
                    408,
                    f"the request body did not arrive within {self.read_timeout:g} s",
                    "request_timeout",
                )
                return
            if message["type"] != "http.request":
                break  # disconnect: let the app notice through its own receive
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only http.disconnect arrives

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        await send_error(
            send,
            413,
            f"request body is larger than the limit of {self.max_bytes} bytes",
            "request_too_large",
        )


class FormBodyAsJsonMiddleware:
    """`curl -d '{...}'` labels its body `application/x-www-form-urlencoded`; every POST route
    here reads JSON, so such a body is read as JSON (and is a 400 when it is not JSON)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = scope["headers"]
            if any(k == b"content-type" and v.startswith(_FORM) for k, v in headers):
                relabelled = [(k, v) for k, v in headers if k != b"content-type"]
                scope = {**scope, "headers": [*relabelled, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


_FORM = b"application/x-www-form-urlencoded"


def add_middlewares(
    app: Any,
    metrics: ServerMetrics,
    api_key: str | None,
    max_bytes: int,
    read_timeout: float | None = None,
    max_header_bytes: int | None = None,
) -> None:
    """Order, outermost first: request id + access log, API key, header and body limits,
    form-labelled bodies read as JSON."""
    app.add_middleware(FormBodyAsJsonMiddleware)
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_bytes=max_bytes,
        read_timeout=read_timeout,
        max_header_bytes=max_header_bytes,
    )
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(AccessLogMiddleware, metrics=metrics)
