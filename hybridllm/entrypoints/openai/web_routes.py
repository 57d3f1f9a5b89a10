"""The web page's routes: the page itself (`/`, `/ui/*`), the plan (`/v1/plan`) and the live
rates (`/v1/live`), and the task that samples those rates once a second."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response

from hybridllm.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger(__name__)

WEB_DIR = Path(__file__).parent / "web"
# The page's files, by the name the page asks for: a fixed table, so no request names a path.
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
SAMPLE_INTERVAL_S = 1.0
# The page runs only its own script and style and draws no remote content: a model's reply
# that smuggles markup can neither run code nor call out.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_web_routes(
    app: FastAPI,
    engine: Any,
    plan_report: Callable[[], dict[str, Any]] | None,
    serve_page: bool,
) -> None:
    """`plan_report`: makes the served plan's report (plan/report.py; called once, in a
    thread: it may measure the device rates); None: /v1/plan answers 404.
    `serve_page`: False (--no-ui) leaves `/` and `/ui/*` unrouted."""
    cached: list[dict[str, Any]] = []
    lock = asyncio.Lock()

    @app.get("/v1/plan")
    async def get_plan(format: str = Query("json")) -> Response:
        if format not in ("json", "svg", "text"):
            raise OpenAIError(
                f"format must be 'json', 'svg' or 'text', got {format[:40]!r}", 400, param="format"
            )
        if plan_report is None:
            raise OpenAIError("this server has no placement plan to show", 404, code="no_plan")
        async with lock:  # one computation, however many pages open at once
            if not cached:
                cached.append(await asyncio.to_thread(plan_report))
        report = cached[0]
        if format == "svg":
            from hybridllm.plan.svg import plan_svg

            return Response(plan_svg(report), media_type="image/svg+xml")
        if format == "text":
            return PlainTextResponse(report["text"])
        return JSONResponse(report)

    @app.get("/v1/live")
    async def get_live(since: float = Query(300.0, ge=1.0, le=3600.0)) -> JSONResponse:
        snapshot = engine.metrics.live.snapshot(since, time.monotonic())
        snapshot["engine_healthy"] = engine.is_healthy
        return JSONResponse(snapshot)

    if not serve_page:
        return

    @app.get("/")
    async def page() -> Response:
        return FileResponse(WEB_DIR / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    @app.get("/ui/{name}")
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            return PlainTextResponse("not found", status_code=404)
        return FileResponse(WEB_DIR / name, media_type=ASSETS[name], headers=PAGE_HEADERS)


async def sample_live_stats(engine: Any, interval_s: float = SAMPLE_INTERVAL_S) -> None:
    """Close one live point a second until cancelled; the engine is asked for its counts only
    (no call to the workers), between its steps."""
    live = engine.metrics.live
    while True:
        stats = None
        if engine.is_healthy:
            try:
                stats = await engine.get_stats(include_workers=False)
            except Exception:  # a dying engine: the point goes without its counts
                logger.debug("live stats: the engine did not answer", exc_info=True)
        live.sample(time.monotonic(), stats)
        await asyncio.sleep(interval_s)
