"""Logging setup for the CLI and server: level from a flag or HYBRIDLLM_LOGGING_LEVEL."""

from __future__ import annotations

import logging

from hybridllm import envs

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def resolve_log_level(flag: str | None, default: str = "info") -> str:
    """The flag wins, then the environment, then `default`."""
    level = (flag or envs.read(envs.LOGGING_LEVEL) or default).lower()
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {LOG_LEVELS}, got {level!r}")
    return level


def configure_logging(flag: str | None = None, default: str = "info") -> str:
    """Route every logger (ours and uvicorn's) through one stderr handler; returns the level."""
    from hybridllm import progress

    level = resolve_log_level(flag, default)
    logging.basicConfig(format=LOG_FORMAT, level=level.upper(), force=True)
    # A first run's long steps (kernel build, cache writes) still say what they do under a
    # quiet default; a level the user chose (the flag or the environment) quiets them too.
    chosen = bool(flag or envs.read(envs.LOGGING_LEVEL))
    numeric = logging.getLevelName(level.upper())
    progress.set_level(numeric if chosen else min(numeric, logging.INFO))
    return level
