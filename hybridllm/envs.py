"""Every HYBRIDLLM_* environment variable, declared once: name, type, default and one line of help.

Code reads a setting as `envs.read(envs.CPU_KERNELS)`, never `os.environ` directly, so the
CLI's --help and the README list exactly what the engine looks at. The settings that
change results or memory are also `EngineArgs` fields; there the variable is only the default.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    """One environment variable the engine reads."""

    name: str
    default: Any
    parse: Callable[[str], Any]
    help: str


def _flag(value: str) -> bool:
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 0/1, true/false, yes/no or on/off, got {value!r}")


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        text = value.strip().lower()
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {value!r}")
        return text

    return parse


def _text(value: str) -> str | None:
    return value or None


CACHE_DIR = EnvVar(
    "HYBRIDLLM_CACHE_DIR",
    None,
    _text,
    "where built kernels, GGUF repacks, quantized weights and hardware profiles are cached "
    "(default ~/.cache/hybridllm)",
)
CPU_KERNELS = EnvVar(
    "HYBRIDLLM_CPU_KERNELS",
    True,
    _flag,
    "0 turns the native CPU kernels off (the torch paths run); default of --cpu-kernels",
)
GGUF_ACTIVATIONS = EnvVar(
    "HYBRIDLLM_GGUF_ACTIVATIONS",
    "int8",
    _choice("int8", "fp32"),
    "activations GGUF linears on the CPU compute with: int8 or fp32; default of --gguf-activations",
)
NATIVE_DECODE_LAYER = EnvVar(
    "HYBRIDLLM_NATIVE_DECODE_LAYER",
    True,
    _flag,
    "0 turns the native whole-layer CPU decode off; default of --native-decode-layer",
)
LOGGING_LEVEL = EnvVar(
    "HYBRIDLLM_LOGGING_LEVEL",
    None,
    _text,
    "log level when --log-level is not given (debug, info, warning, error, critical)",
)
API_KEY = EnvVar(
    "HYBRIDLLM_API_KEY",
    None,
    _text,
    "the server's API key when --api-key is not given; bench serve's key too",
)

ALL: tuple[EnvVar, ...] = (
    CACHE_DIR,
    CPU_KERNELS,
    GGUF_ACTIVATIONS,
    NATIVE_DECODE_LAYER,
    LOGGING_LEVEL,
    API_KEY,
)


def read(var: EnvVar) -> Any:
    """The variable's parsed value, or its default when unset or empty; a bad value is an
    error that names the variable."""
    raw = os.environ.get(var.name)
    if raw is None or raw == "":
        return var.default
    try:
        return var.parse(raw)
    except ValueError as exc:
        raise ValueError(f"{var.name}: {exc}") from None


def describe() -> str:
    """One line per variable: name, default, help (for --help and the docs)."""
    return "\n".join(f"{v.name} (default {_shown(v.default)}): {v.help}" for v in ALL)


def _shown(default: Any) -> str:
    # as a user would write the value: flags as 1/0, no value as "unset"
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "1" if default else "0"
    return str(default)
