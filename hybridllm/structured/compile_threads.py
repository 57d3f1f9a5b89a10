"""Threads with a stack sized for the grammar compiler (see `limits.COMPILE_STACK_BYTES`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from hybridllm.structured.limits import COMPILE_STACK_BYTES

T = TypeVar("T")


def _start_thread(target: Callable[[], None], name: str) -> threading.Thread:
    # threading.stack_size is process-wide: set it for this start only. A thread another
    # thread starts meanwhile gets the large stack too, which costs address space only
    # (stack pages are touched as they are used).
    previous = threading.stack_size(COMPILE_STACK_BYTES)
    try:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
    finally:
        threading.stack_size(previous)
    return thread


def run_on_big_stack(fn: Callable[[], T]) -> T:
    """fn() on a fresh large-stack thread; its result or exception."""
    future: Future = Future()

    def body() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the caller
            future.set_exception(exc)

    _start_thread(body, "grammar-compile").join()
    return future.result()


class CompileThreads:
    """A small pool of large-stack threads running submitted calls first come, first served."""

    def __init__(self, num_threads: int, name: str = "grammar-compile") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [_start_thread(self._run, f"{name}-{i}") for i in range(num_threads)]

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller's to see
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Cancel what has not started; each thread ends after its current call."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[1].cancel()
        for _ in self._threads:
            self._jobs.put(None)
