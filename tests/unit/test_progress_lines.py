"""Long one-time steps say what they do on stderr, and `--log-level warning` quiets them."""

from __future__ import annotations

import fcntl
import logging
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from hybridllm import progress
from hybridllm.entrypoints.logging_config import configure_logging
from hybridllm.layers import cpu_kernels
from hybridllm.loader.gguf_cache import GGUFConversionCache
from hybridllm.loader.onload_quant import QuantizedWeightCache, quantize_weights


@pytest.fixture
def progress_caplog(caplog):
    caplog.set_level(logging.INFO, logger=progress.LOGGER_NAME)
    return caplog


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    saved = root.handlers[:], root.level, progress.logger.level
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    progress.logger.setLevel(saved[2])


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == progress.LOGGER_NAME]


def test_a_long_step_says_what_it_does_then_how_long_it_took(progress_caplog):
    with progress.long_step("building x", done="built x", estimate="about 1 s"):
        pass
    first, last = _messages(progress_caplog)
    assert first == "building x (about 1 s)..."
    assert last.startswith("built x in ") and last.endswith(" s")


def test_a_delayed_step_is_quiet_when_quick_and_speaks_when_slow(progress_caplog):
    with progress.long_step("loading", done="loaded", after_s=5.0):
        pass
    assert _messages(progress_caplog) == []
    with progress.long_step("loading", done="loaded", after_s=0.05):
        time.sleep(0.3)
    assert _messages(progress_caplog)[0] == "loading..."
    assert _messages(progress_caplog)[1].startswith("loaded in ")


def test_a_failed_step_logs_no_end_line(progress_caplog):
    with pytest.raises(RuntimeError), progress.long_step("building", done="built"):
        raise RuntimeError("compiler missing")
    assert _messages(progress_caplog) == ["building..."]


def test_the_kernel_build_logs_its_start_estimate_and_end(tmp_path, monkeypatch, progress_caplog):
    # The real build takes minutes: a stand-in compiler shows that the build path (fresh
    # cache directory, build lock, compile) announces itself and reports its time.
    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HYBRIDLLM_CPU_KERNELS", "1")
    built = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: built.append(kwargs))
    assert cpu_kernels.load_cpu_kernels.__wrapped__() is True
    assert built and built[0]["build_directory"].startswith(str(tmp_path))
    start, end = _messages(progress_caplog)
    assert start.startswith("building the native CPU kernels (once per machine and version; ")
    assert " core" in start and start.endswith(")...")
    assert end.startswith("built the native CPU kernels in ")


def test_the_build_estimate_follows_the_cores_and_the_load(monkeypatch):
    # 14 sources, as when a quiet 2-core machine built them in 72 s
    monkeypatch.setattr(cpu_kernels, "SOURCES", cpu_kernels.SOURCES[:14])

    def machine(cores: int, load: float) -> None:
        monkeypatch.setattr(cpu_kernels.os, "sched_getaffinity", lambda pid: range(cores))
        monkeypatch.setattr(cpu_kernels.os, "getloadavg", lambda: (load, load, load))

    machine(2, 0.5)
    assert cpu_kernels._build_estimate() == "about 1-2 minutes on 2 cores"
    machine(64, 3.0)
    assert cpu_kernels._build_estimate() == "about 10-20 s on 64 cores"
    machine(2, 14.0)  # seven times the work the cores can do: seven times as long
    assert cpu_kernels._build_estimate() == "about 8-16 minutes on 2 cores, busy (load 14)"


def test_waiting_for_another_builder_is_said(tmp_path, progress_caplog):
    lock_path = tmp_path / "build.flock"
    with open(lock_path, "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)  # another process's build
        with open(lock_path, "a") as guard:
            waiter = threading.Thread(target=cpu_kernels._lock_build, args=(guard, tmp_path))
            waiter.start()
            time.sleep(0.2)
            fcntl.flock(other, fcntl.LOCK_UN)
            waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert _messages(progress_caplog) == [
        f"waiting for another process building the native CPU kernels in {tmp_path}"
    ]


def test_a_gguf_conversion_says_what_it_does(tmp_path, progress_caplog):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF" + bytes(2000))
    cache = GGUFConversionCache(str(source), root=str(tmp_path / "cache"))
    cache.build(lambda folder: (Path(folder) / "weights").write_bytes(b"1"))
    start, end = _messages(progress_caplog)
    assert start.startswith("converting model.gguf into float weights in the GGUF cache ")
    assert start.endswith("(once per file; roughly 5 s for its 0.0 GB)...")
    assert end.startswith("converted model.gguf in ")


def test_quantizing_at_load_is_said_once_and_not_when_cached(tmp_path, progress_caplog):
    import torch

    weights = [("a.weight", torch.randn(8, 64)), ("b.weight", torch.randn(8, 64))]
    cache = QuantizedWeightCache("key", root=str(tmp_path))
    list(quantize_weights(weights, lambda name: "linear", "q8_0", cache))
    start, end = _messages(progress_caplog)
    assert start.startswith("quantizing the float linears into q8_0 blocks (once per checkpoint")
    assert end.startswith("quantized 2 tensors (0 M parameters) while loading, in ")
    progress_caplog.clear()
    list(quantize_weights(weights, lambda name: "linear", "q8_0", cache))
    assert _messages(progress_caplog) == []


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize(
    ("flag", "env", "shown"),
    [(None, None, True), ("warning", None, False), (None, "warning", False), ("info", None, True)],
)
def test_the_cli_default_shows_progress_and_a_chosen_level_quiets_it(flag, env, shown, monkeypatch):
    if env is None:
        monkeypatch.delenv("HYBRIDLLM_LOGGING_LEVEL", raising=False)
    else:
        monkeypatch.setenv("HYBRIDLLM_LOGGING_LEVEL", env)
    configure_logging(flag, default="warning")  # generate, chat and bench's default
    assert progress.enabled() is shown
    assert not logging.getLogger("hybridllm.engine").isEnabledFor(logging.INFO) or flag == "info"


SCRIPT = """
import logging, sys
from hybridllm import progress
from hybridllm.entrypoints.logging_config import configure_logging
{setup}
with progress.long_step("building the kernels", done="built the kernels"):
    logging.getLogger("hybridllm.engine").info("an ordinary INFO line")
"""


@pytest.mark.parametrize(
    ("setup", "want_progress", "want_info"),
    [
        ("configure_logging(None, default='warning')", True, False),  # hybridllm generate
        ("configure_logging('warning', default='warning')", False, False),  # --log-level warning
        ("pass", True, False),  # LLM(...) in a script that configures no logging
        (  # a worker process started by an engine configured as `hybridllm generate` is
            "progress.apply_setup(progress.LoggingSetup(logging.WARNING, logging.INFO))",
            True,
            False,
        ),
        ("logging.basicConfig(level=logging.INFO)", True, True),  # the script's own handler
    ],
)
def test_the_lines_reach_stderr(setup, want_progress, want_info, monkeypatch):
    monkeypatch.delenv("HYBRIDLLM_LOGGING_LEVEL", raising=False)
    code = textwrap.dedent(SCRIPT).format(setup=setup)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert ("building the kernels..." in done.stderr) is want_progress, done.stderr
    assert ("built the kernels in " in done.stderr) is want_progress, done.stderr
    assert ("an ordinary INFO line" in done.stderr) is want_info, done.stderr
    # once, never twice (the fallback handler steps aside for a configured root)
    assert done.stderr.count("building the kernels...") <= 1
    assert done.stdout == ""
