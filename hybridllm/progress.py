"""Progress lines on stderr for long one-time steps (kernel build, cache writes, weight loading).

Every such line goes through the `hybridllm.progress` logger at INFO. The CLI's default level
(warning) would hide INFO, yet a first run that sits silent for minutes looks hung, so this
logger stays at INFO unless a level was asked for: `--log-level warning` or
`HYBRIDLLM_LOGGING_LEVEL=warning` quiets it, as does
`logging.getLogger("hybridllm.progress").setLevel(logging.WARNING)` from Python. Where nobody
configured logging (a script calling `LLM(...)`), a fallback handler writes the lines to
stderr itself; once any handler is on the root, it steps aside.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from hybridllm import envs

LOGGER_NAME = "hybridllm.progress"
FALLBACK_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

logger = logging.getLogger(LOGGER_NAME)


class _FallbackHandler(logging.StreamHandler):
    """Writes to stderr only while no handler up the hierarchy would take the record."""

    def emit(self, record: logging.LogRecord) -> None:
        node = logger
        while node.propagate and node.parent is not None:
            node = node.parent
            if node.handlers:
                return
        self.stream = sys.stderr  # the current one: tests and callers swap it
        super().emit(record)


def _initial_level() -> int:
    chosen = envs.read(envs.LOGGING_LEVEL)
    level = logging.getLevelName(chosen.upper()) if chosen else logging.INFO
    return level if isinstance(level, int) else logging.INFO  # the CLI reports a bad name


if not any(isinstance(h, _FallbackHandler) for h in logger.handlers):
    _fallback = _FallbackHandler()
    _fallback.setFormatter(logging.Formatter(FALLBACK_FORMAT))
    logger.addHandler(_fallback)
    logger.setLevel(_initial_level())


def enabled() -> bool:
    """Whether progress lines are shown (the logger is on for INFO)."""
    return logger.isEnabledFor(logging.INFO)


def bars_wanted() -> bool:
    """Whether to draw progress bars: progress is shown and stderr is a terminal."""
    return enabled() and sys.stderr is not None and sys.stderr.isatty()


@contextlib.contextmanager
def long_step(what: str, done: str, estimate: str = "", after_s: float = 0.0) -> Iterator[None]:
    """Log "<what> (<estimate>)..." as the block starts and "<done> in N s" when it ends.

    With `after_s`, the first line waits until the block has run that long and both lines
    are left out for a block that ends sooner: a warm start stays quiet. A block that raises
    logs no end line (its error says what happened).
    """
    start = time.monotonic()
    state = {"announced": False, "finished": False}
    lock = threading.Lock()

    def announce() -> None:
        with lock:
            if state["finished"]:
                return
            state["announced"] = True
        logger.info("%s (%s)...", what, estimate) if estimate else logger.info("%s...", what)

    timer = None
    if after_s <= 0:
        announce()
    else:
        timer = threading.Timer(after_s, announce)
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        with lock:
            state["finished"] = True
    if state["announced"]:
        logger.info("%s in %s", done, format_seconds(time.monotonic() - start))


def format_seconds(seconds: float) -> str:
    """`0.4 s`, `71 s`, `2 min 05 s`: precise while short, readable when long."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"


def set_level(level: int) -> None:
    """The level progress lines are logged at or above (INFO shows them)."""
    logger.setLevel(level)


@dataclass(frozen=True)
class LoggingSetup:
    """This process's logging, for a worker process to copy (spawn starts it unconfigured,
    which would swallow the worker's INFO lines, the kernel build's among them).

    `root_level`: None where nothing is configured on the root (the worker then relies on the
    fallback handler too); otherwise the worker logs to stderr at that level.
    """

    root_level: int | None
    progress_level: int


def current_setup() -> LoggingSetup:
    root = logging.getLogger()
    return LoggingSetup(root.level if root.handlers else None, logger.level)


def apply_setup(setup: LoggingSetup) -> None:
    """Make this (worker) process log as the engine's process does."""
    if setup.root_level is not None:
        from hybridllm.entrypoints.logging_config import LOG_FORMAT

        root = logging.getLogger()
        if not root.handlers:  # a host (Ray) that set up its own keeps it
            logging.basicConfig(format=LOG_FORMAT)
        root.setLevel(setup.root_level)
    logger.setLevel(setup.progress_level)
