"""uvicorn's h11 protocol with a deadline on request headers, which uvicorn does not have."""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from hybridllm.entrypoints.openai.errors import error_body


def _timeout_response(timeout: float) -> bytes:
    body = json.dumps(
        error_body(
            f"the request headers did not arrive within {timeout:g} s", 408, code="request_timeout"
        )
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\n"
        "content-type: application/json\r\n"
        "connection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


def header_timeout_protocol(timeout: float) -> type[H11Protocol]:
    """An H11Protocol class that closes a connection, with a 408, when a request's headers are
    not complete `timeout` seconds after the connection opened or its last response ended.

    Without it a client that trickles header bytes holds its connection (and a slot of
    --limit-concurrency) forever: uvicorn's keep-alive timer restarts on every byte.
    """

    class HeaderTimeoutH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_deadline: asyncio.TimerHandle | None = None
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()  # a kept-alive connection waits for the next headers

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_deadline()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            self._cancel_header_deadline()
            if not self.transport.is_closing():
                self._header_deadline = self.loop.call_later(timeout, self._headers_overdue)

        def _cancel_header_deadline(self) -> None:
            handle = getattr(self, "_header_deadline", None)
            if handle is not None:
                handle.cancel()
                self._header_deadline = None

        def _headers_overdue(self) -> None:
            self._header_deadline = None
            # Once h11 has parsed a request line and headers, the client is no longer IDLE;
            # the body then has its own per-read timeout in BodySizeLimitMiddleware.
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            partial, _ = self.conn.trailing_data
            if partial and self.conn.our_state is h11.IDLE:  # a request started arriving
                self.transport.write(_timeout_response(timeout))
            self.transport.close()  # an idle connection just closes, as on keep-alive expiry

    return HeaderTimeoutH11Protocol
