"""AsyncEngine: runs the (not thread-safe) LLMEngine on one dedicated thread for an asyncio server."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from hybridllm.engine.errors import EngineDeadError
from hybridllm.entrypoints.openai.metrics import ServerMetrics
from hybridllm.outputs import RequestOutput
from hybridllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Command:
    """One unit of work for the engine thread; `future` carries its result back."""

    kind: str  # "add" | "abort" | "embed" | "stats" | "stop"
    args: tuple = ()
    future: concurrent.futures.Future | None = None


_IDLE_HEALTH_CHECK_S = 1.0
_END = object()  # wakes a consumer whose request was aborted by someone else


class RequestStream:
    """The outputs of one request, fed by the engine thread; `async with` aborts it on early exit.

    Bounded whatever the reader's pace: outputs are cumulative, so only the newest unfinished
    one is kept (a slow reader gets coalesced deltas) plus at most one terminal item (the
    final output, an error or the end of an abort). Putting never blocks the engine.
    """

    def __init__(self, request_id: str, owner: AsyncEngine, arrival: float) -> None:
        self.request_id = request_id
        self._owner = owner
        self._latest: RequestOutput | None = None  # newest unfinished output not yet read
        self._terminal: Any = None  # finished output, exception or _END, once it came
        self._ready = asyncio.Event()
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_tokens = 0  # generated tokens seen so far, over all samples
        self.finished = False  # the engine will send nothing more (final output, error or abort)
        self._exhausted = False  # the consumer has seen the last item

    @property
    def num_buffered(self) -> int:
        """Items waiting for the reader: never more than 2."""
        return (self._latest is not None) + (self._terminal is not None)

    def _put(self, item: RequestOutput | BaseException | object) -> None:
        if self._terminal is not None:
            return  # the first terminal item wins; nothing comes after it
        if isinstance(item, RequestOutput) and not item.finished:
            self._latest = item  # replaces an unread older one: it holds everything that one did
        else:
            self._terminal = item
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._exhausted:
            if self._latest is not None:
                item, self._latest = self._latest, None
                return item
            if self._terminal is not None:
                self._exhausted = True
                item, self._terminal = self._terminal, None
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                return item
            self._ready.clear()
            await self._ready.wait()
        raise StopAsyncIteration

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        # Client gone, task cancelled, or consumer broke out early: free the request's KV blocks.
        if not self.finished:
            self._owner.abort(self.request_id)


class AsyncEngine:
    """Owns the engine thread; every engine call (add/abort/step/embed/stats) happens there."""

    def __init__(self, engine: Any, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # orders submit vs. death: no command is left unanswered
        self._dead: BaseException | None = None
        self._accepting = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._last_stats: Any | None = None
        # Called on the event loop, after in-flight requests were failed, when the engine
        # died of an error (not on shutdown): the server exits so a supervisor restarts it.
        self.on_fatal: Callable[[BaseException], None] | None = None

    # ---- lifecycle ----

    @classmethod
    def launch(
        cls, build_engine: Callable[[], Any], metrics: ServerMetrics | None = None
    ) -> AsyncEngine:
        """Build the engine on a new engine thread, which then serves it; returns once built
        (raising what building raised). Call `start` from the event loop before submitting.

        Every torch op of the engine, loading included, thus runs on one thread. Torch's
        OpenMP pool belongs to the thread that opens a parallel region: once the main thread
        had one (from loading), libgomp counted more threads than cores and stopped spinning
        between regions, and each small op of the engine thread waited on a futex wake
        (SmolLM2 single stream 68 vs 130 tok/s in a second thread; a 200k-float add 33 vs 9 us).
        """
        async_engine = cls(None, metrics)
        built: concurrent.futures.Future = concurrent.futures.Future()

        def build_then_run() -> None:
            try:
                async_engine.engine = build_engine()
            except BaseException as exc:
                built.set_exception(exc)
                return
            built.set_result(None)
            async_engine._run()  # waits for commands, which come only after start()

        async_engine._thread = threading.Thread(
            target=build_then_run, name="hybridllm-engine", daemon=True
        )
        async_engine._thread.start()
        built.result()
        return async_engine

    def start(self) -> None:
        """Attach the event loop that will consume outputs (call from it); starts the engine
        thread unless `launch` already did."""
        self._loop = asyncio.get_running_loop()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hybridllm-engine", daemon=True)
            self._thread.start()
        grammars = getattr(self.engine, "structured_output", None)
        if grammars is not None:  # a server's first constrained request should not wait
            grammars.warm_up()  # for the compile children and the grammar tokenizer

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        return None if self._dead is None else f"{type(self._dead).__name__}: {self._dead}"

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Refuse new requests, let running ones finish for up to `timeout` s, fail the rest
        (a stream ends with an error event, then its end), then stop the engine thread, which
        shuts the engine down within the executor's bound. Calling it again, or while it
        runs, waits for the same end (the server calls it on its first exit signal, so that
        streams end before uvicorn cuts them, and again when its lifespan ends)."""
        from hybridllm.executor.shutdown import SHUTDOWN_BOUND_S

        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self.is_healthy:
            await asyncio.sleep(0.05)
        for request_id, stream in list(self._streams.items()):
            stream._put(EngineDeadError("the server is shutting down"))
            self.abort(request_id)
        if self._thread is not None and self._thread.is_alive():
            try:
                self._submit(_Command("stop"))
            except EngineDeadError:
                pass
            # The thread ends its step, then shuts the engine down, bounded by the executor;
            # leaving before that would let the process exit with workers and shared memory
            # still held. 5 s more for the step in progress.
            wait_s = SHUTDOWN_BOUND_S + 5.0
            await asyncio.to_thread(self._thread.join, wait_s)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %.1f s", wait_s)

    # ---- requests ----

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> RequestStream:
        """Queue a request; raises ValueError (bad input) or EngineDeadError before any output."""
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        arrival = time.monotonic()
        stream = RequestStream(request_id, self, arrival)
        self._streams[request_id] = stream  # registered first: the first output cannot be lost
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._submit(_Command("add", (request_id, prompt, params), future))
            await asyncio.wrap_future(future)
            self.metrics.observe_queued(time.monotonic() - arrival)
        except BaseException:
            self._streams.pop(request_id, None)
            # A cancelled future was never run; any other may have added the request: undo it.
            if not future.cancelled():
                self._submit_quietly(_Command("abort", ([request_id],)))
            raise
        return stream

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; closing or cancelling the iterator aborts it."""
        stream = await self.add_request(request_id, prompt, params)
        async with stream:
            async for output in stream:
                yield output

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None or stream.finished:
            return
        stream.finished = True
        stream._put(_END)
        self.metrics.observe_finished("abort", 0, 0, time.monotonic() - stream.arrival, None)
        logger.info("aborted request %s", request_id)
        self._submit_quietly(_Command("abort", ([request_id],)))

    async def embed(
        self, prompts: list[list[int]], pooling: str = "last", normalize: bool = True
    ) -> list[list[float]]:
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        return await self._call("embed", prompts, pooling, normalize)

    async def get_stats(self, include_workers: bool = True) -> Any | None:
        """The engine's EngineStats, read between steps; the last known ones if the engine died.
        `include_workers=False`: without the workers' busy seconds (no call to them)."""
        if not self.is_healthy:
            return self._last_stats
        stats = await self._call("stats", include_workers)
        if include_workers:
            self._last_stats = stats
        return stats

    async def _call(self, kind: str, *args: Any) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Command(kind, args, future))
        return await asyncio.wrap_future(future)

    def _submit(self, command: _Command) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self.dead_reason)
            self._commands.put(command)

    def _submit_quietly(self, command: _Command) -> None:
        try:
            self._submit(command)
        except EngineDeadError:
            pass

    # ---- event loop side ----

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted by us already; the engine's echo is expected
                continue
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            if stream.first_token_time is None and num_tokens > 0:
                stream.first_token_time = now
                self.metrics.observe_first_token(
                    now - stream.arrival, len(output.prompt_token_ids or ())
                )
            elif stream.last_token_time is not None and num_tokens > stream.num_tokens:
                self.metrics.observe_tokens(
                    now - stream.last_token_time, num_tokens - stream.num_tokens
                )
            if num_tokens > stream.num_tokens:
                stream.last_token_time = now
                stream.num_tokens = num_tokens
            if output.finished:
                del self._streams[output.request_id]
                stream.finished = True
                self._observe_finished(stream, output, num_tokens, now)
            stream._put(output)

    def _observe_finished(
        self, stream: RequestStream, output: RequestOutput, num_tokens: int, now: float
    ) -> None:
        reasons = {c.finish_reason for c in output.outputs}
        outcome = (
            "error"
            if output.error or "error" in reasons
            else ("abort" if "abort" in reasons else "length" if "length" in reasons else "stop")
        )
        tpot = None
        longest = max((len(c.token_ids) for c in output.outputs), default=0)
        if stream.first_token_time is not None and longest > 1:
            tpot = (now - stream.first_token_time) / (longest - 1)
        self.metrics.observe_finished(
            outcome, len(output.prompt_token_ids), num_tokens, now - stream.arrival, tpot
        )

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            del self._streams[request_id]
            stream.finished = True
            stream._put(error)
            self.metrics.observe_finished("error", 0, 0, time.monotonic() - stream.arrival, None)

    # ---- engine thread ----

    def _run(self) -> None:
        engine = self.engine
        try:
            stopping = False
            while not stopping:
                if not engine.has_unfinished_requests():
                    # Idle: block on the queue instead of spinning, looking at the workers
                    # now and then so that a dead one ends the server before a request
                    # finds it.
                    try:
                        command = self._commands.get(timeout=_IDLE_HEALTH_CHECK_S)
                    except queue.Empty:
                        engine.check_health()
                        continue
                    stopping = not self._handle(command)
                while not stopping:
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    stopping = not self._handle(command)
                if not stopping and engine.has_unfinished_requests():
                    outputs = engine.step()
                    if outputs:
                        snapshots = [_snapshot(o) for o in outputs]
                        self._loop.call_soon_threadsafe(self._dispatch, snapshots)
        except BaseException as exc:  # the engine is unusable after a failed step
            logger.exception("engine thread died")
            self._die(exc, fatal=True)
        else:
            self._die(EngineDeadError("the engine was shut down"))
        finally:
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine.shutdown() failed")

    def _handle(self, command: _Command) -> bool:
        """Run one command on the engine thread; False means stop."""
        kind, args, future = command.kind, command.args, command.future
        if kind == "stop":
            return False
        if kind == "abort":
            try:
                self.engine.abort_request(args[0])
            except Exception:  # unknown or finished ids are not worth dying for
                logger.debug("abort of %s failed", args[0], exc_info=True)
            return True
        call: Callable[..., Any] = {
            "add": self.engine.add_request,
            "embed": self.engine.embed,
            "stats": self.engine.get_stats,
        }[kind]
        if not future.set_running_or_notify_cancel():
            return True  # the caller went away before we got to it
        try:
            result = call(*args)
        except Exception as exc:  # bad input for this request only; the engine lives on
            future.set_exception(exc)
        else:
            future.set_result(result)
        return True

    def _die(self, exc: BaseException, fatal: bool = False) -> None:
        with self._lock:
            self._dead = exc
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        error = EngineDeadError(self.dead_reason)
        for command in pending:
            if command.future is not None and not command.future.done():
                command.future.set_exception(error)
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._fail_all, error)
                if fatal and self.on_fatal is not None:
                    self._loop.call_soon_threadsafe(self.on_fatal, exc)
            except RuntimeError:  # loop already closed during interpreter shutdown
                pass


def _snapshot(output: RequestOutput) -> RequestOutput:
    """Copy the lists the engine may keep appending to, so the event loop reads a stable view."""
    return dataclasses.replace(
        output,
        outputs=[
            dataclasses.replace(
                c,
                token_ids=list(c.token_ids),
                logprobs=None if c.logprobs is None else list(c.logprobs),
            )
            for c in output.outputs
        ],
        metrics=dict(output.metrics),
    )
