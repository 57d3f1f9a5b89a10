"""OpenAI-style error bodies and the exception handlers that turn every failure into one."""

from __future__ import annotations

import json
import logging
import uuid
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridllm.engine.errors import EngineDeadError  # a worker's or the engine thread's: a 503
from hybridllm.engine.input_validation import InvalidInputError

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID_SCOPE_KEY = "hybridllm.request_id"  # set by AccessLogMiddleware on every HTTP scope
_MAX_REASON_CHARS = 200

# OpenAI's error `type` strings by status; the client maps the status to its exception class.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """A failure answered with `status` and an OpenAI-style body naming `param` when known."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


def new_request_id(scope: dict[str, Any]) -> str:
    """Give an HTTP request its id (answered as x-request-id, logged with its errors)."""
    request_id = f"req-{uuid.uuid4().hex}"
    scope[_REQUEST_ID_SCOPE_KEY] = request_id
    return request_id


def request_id_of(request: Request) -> str:
    return request.scope.get(_REQUEST_ID_SCOPE_KEY) or "-"


def short_reason(reason: str | None) -> str:
    """The first line of a failure, bounded: worker tracebacks stay in the log."""
    line = (reason or "unknown").strip().split("\n", 1)[0]
    return line if len(line) <= _MAX_REASON_CHARS else line[: _MAX_REASON_CHARS - 3] + "..."


def internal_error_message(request_id: str) -> str:
    # The exception text may name files, tensors or other users' data: it goes to the log only.
    return f"internal error (request id {request_id}); the server log has the details"


def engine_dead_message(reason: str | None) -> str:
    return f"the engine is not running: {short_reason(reason)}"


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status)


def from_value_error(exc: ValueError) -> OpenAIError:
    """Engine and SamplingParams errors -> 400, naming the field the error names: its `param`
    (engine/input_validation.py's InvalidInputError), or the `x` of `SamplingParams.x`."""
    message = str(exc)
    if isinstance(exc, InvalidInputError):
        return OpenAIError(message, 400, param=exc.param, code=exc.code)
    param = None
    if message.startswith("SamplingParams."):
        param = message[len("SamplingParams.") :].split(" ", 1)[0]
    return OpenAIError(message, 400, param=param)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """Pydantic's error list -> one readable sentence plus the offending parameter."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"malformed JSON body: {detail}".rstrip(": "), None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Drop pydantic's union-member tags (e.g. "str", "list[int]") from the parameter path.
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float")]
    param = ".".join(loc) or None
    if first.get("type") == "missing":
        message = f"missing required field '{param}'"
    elif first.get("type") == "model_attributes_type" or (
        param is None and "dict" in first.get("msg", "")
    ):
        message = "the request body must be a JSON object (sent as Content-Type: application/json)"
    else:
        message = f"invalid value for '{param}': {first.get('msg')}" if param else first.get("msg")
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app can raise leaves as `{"error": {...}}` with the right status."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(json.JSONDecodeError)
    async def _json_error(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(f"malformed JSON body: {exc}", 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
            code = "not_found"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        elif isinstance(exc.__cause__, RecursionError):
            # FastAPI's json.loads of a body nested past Python's stack: its own message ("There
            # was an error parsing the body") does not say why.
            message = "malformed JSON body: nested too deep to parse"
            code = None
        else:
            message = str(exc.detail) or HTTPStatus(exc.status_code).phrase
            code = None
        return JSONResponse(
            error_body(message, exc.status_code, None, code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(engine_dead_message(str(exc)), 503, code="engine_dead")

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(_: Request, exc: ClientDisconnected) -> JSONResponse:
        # Nobody reads this; 499 (nginx's "client closed request") keeps the access log honest.
        return error_response("client disconnected", 499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = request_id_of(request)
        logger.exception(
            "unhandled error on %s %s (request id %s)", request.method, request.url.path, request_id
        )
        # Starlette answers this one outside the middlewares, so the header is set here.
        return JSONResponse(
            error_body(internal_error_message(request_id), 500, code="internal_error"),
            status_code=500,
            headers={REQUEST_ID_HEADER: request_id},
        )
