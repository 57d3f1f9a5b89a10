"""Grammar compiles tried first in child processes: a crash or an overlong compile fails
only its own grammar, and a compile past its deadline is killed, not left running."""

from __future__ import annotations

import json
import logging
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from hybridllm.structured.backend import GrammarError
from hybridllm.structured.compile_child import read_frame, write_frame

logger = logging.getLogger(__name__)

# Grammars up to this many characters may use the small-grammar child, which takes the
# smallest waiting one first: a large compile never makes a small one wait behind it.
SMALL_GRAMMAR_CHARS = 16 << 10
MAX_START_FAILURES = 3


@dataclass
class _Job:
    kind: str
    spec: str
    future: Future = field(default_factory=Future)


@dataclass
class _Child:
    small_only: bool
    proc: subprocess.Popen | None = None
    ready: bool = False
    job: _Job | None = None
    deadline: float = 0.0


class IsolatedCompiler:
    """Two compile children: one for small grammars (smallest first), one for any grammar
    (oldest first). `submit` returns a future that is None when the grammar compiled within
    `timeout_s`, or raises GrammarError saying why not (its error, the deadline, a crash).
    Children start on first use and again after a crash or a kill."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        timeout_s: float = 10.0,
    ) -> None:
        self.timeout_s = timeout_s
        self._tokenizer_pickle = pickle.dumps((hf_tokenizer, vocab_size, list(eos_token_ids)))
        self._children = [_Child(small_only=True), _Child(small_only=False)]
        self._pending: list[_Job] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe already says "wake up"
        self._closed = False
        self._start_failures = 0
        self._eager = False  # keep both children started, not only when work waits
        self._thread = threading.Thread(target=self._loop, name="grammar-isolate", daemon=True)
        self._thread.start()

    def submit(self, kind: str, spec: str) -> Future:
        job = _Job(kind, spec)
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is shut down")
            self._pending.append(job)
            self._wake()  # under the lock: shutdown closes the pipe after it
        return job.future

    def start_children(self) -> None:
        """Start both children now and again after each kill, so no grammar waits for one."""
        with self._lock:
            if self._closed:
                return
            self._eager = True
            self._wake()

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, []
            self._wake()
        for job in pending:
            job.future.cancel()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # else it may still select on them: leave them
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    # -- the dispatcher thread --------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._closed:
                self._dispatch()
                self._wait()
        finally:
            for child in self._children:
                self._stop(child, "the grammar compiler is shut down")

    def _pick(self, child: _Child) -> _Job | None:
        with self._lock:
            if child.small_only:
                small = [j for j in self._pending if len(j.spec) <= SMALL_GRAMMAR_CHARS]
                job = min(small, key=lambda j: len(j.spec), default=None)
            else:
                job = self._pending[0] if self._pending else None
            if job is not None:
                self._pending.remove(job)
        return job

    def _has_work(self, child: _Child) -> bool:
        with self._lock:
            if child.small_only:
                return any(len(j.spec) <= SMALL_GRAMMAR_CHARS for j in self._pending)
            return bool(self._pending)

    def _dispatch(self) -> None:
        for child in self._children:
            if child.proc is None and (self._eager or self._has_work(child)):
                self._spawn(child)
            while child.ready and child.job is None:
                job = self._pick(child)
                if job is None:
                    break
                if not job.future.running() and not job.future.set_running_or_notify_cancel():
                    continue  # cancelled while it waited (a job put back is running already)
                try:
                    write_frame(
                        child.proc.stdin, json.dumps({"kind": job.kind, "spec": job.spec}).encode()
                    )
                except OSError:  # the child died before it took the job: the job goes back
                    with self._lock:
                        self._pending.insert(0, job)
                    self._stop(child, "the grammar compile child had died")
                    break
                child.job, child.deadline = job, time.monotonic() + self.timeout_s

    def _spawn(self, child: _Child) -> None:
        if self._start_failures >= MAX_START_FAILURES:
            self._fail_pending("the grammar compiler cannot start (see the server log)")
            return
        import hybridllm

        root = os.path.dirname(os.path.dirname(os.path.abspath(hybridllm.__file__)))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        }
        child.proc = subprocess.Popen(
            [sys.executable, "-m", "hybridllm.structured.compile_child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env=env,
        )
        child.ready = False
        stdin, payload = child.proc.stdin, self._tokenizer_pickle
        # A few MB: written beside the dispatcher, which must not wait for the child's imports.
        threading.Thread(target=_write_quietly, args=(stdin, payload), daemon=True).start()

    def _wait(self) -> None:
        busy = [c for c in self._children if c.job is not None]
        timeout = min((c.deadline for c in busy), default=None)
        if timeout is not None:
            timeout = max(0.0, timeout - time.monotonic())
        fds = [self._wake_r] + [c.proc.stdout.fileno() for c in self._children if c.proc]
        readable, _, _ = select.select(fds, [], [], timeout)
        if self._wake_r in readable:
            os.read(self._wake_r, 4096)
        for child in self._children:
            if child.proc is not None and child.proc.stdout.fileno() in readable:
                self._read(child)
        now = time.monotonic()
        for child in self._children:
            if child.job is not None and now >= child.deadline:
                self._stop(child, f"the grammar did not compile within {self.timeout_s:g} s")

    def _read(self, child: _Child) -> None:
        frame = read_frame(child.proc.stdout)
        if frame is None:
            if not child.ready:
                self._start_failures += 1
                logger.error("a grammar compile child exited at start-up (%s)", child.proc.poll())
            self._stop(child, "the grammar compiler crashed on this grammar")
            return
        message = json.loads(frame)
        if message.get("ready"):
            child.ready, self._start_failures = True, 0
            return
        job, child.job = child.job, None
        if job is None:
            return
        if message["ok"]:
            job.future.set_result(None)
        else:
            job.future.set_exception(GrammarError(message["error"]))

    def _stop(self, child: _Child, reason: str) -> None:
        """Kill the child (if any) and fail its job with `reason`."""
        if child.proc is not None:
            child.proc.kill()
            child.proc.wait()
            for stream in (child.proc.stdin, child.proc.stdout):
                stream.close()
            if child.job is not None:
                logger.warning("grammar compile child stopped: %s", reason)
        job, child.job, child.proc, child.ready = child.job, None, None, False
        if job is not None and not job.future.done():
            job.future.set_exception(GrammarError(reason))

    def _fail_pending(self, reason: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for job in pending:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(GrammarError(reason))


def _write_quietly(stream: Any, payload: bytes) -> None:
    try:
        write_frame(stream, payload)
    except (OSError, ValueError):
        pass  # the child died at start-up (its pipe may be closed already): its reader says so
