"""Environment variables: declared once in hybridllm/envs.py, read through it, listed in --help."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridllm import envs
from hybridllm.entrypoints.cli import main

PACKAGE = Path(envs.__file__).parent
# Reads that belong to other modules' owners and are routed through envs.read by them.
NOT_YET_ROUTED = {"models/llama.py"}


def test_read_parses_and_defaults(monkeypatch):
    monkeypatch.delenv("HYBRIDLLM_CPU_KERNELS", raising=False)
    assert envs.read(envs.CPU_KERNELS) is True
    for text, value in (("0", False), ("off", False), ("1", True), ("Yes", True)):
        monkeypatch.setenv("HYBRIDLLM_CPU_KERNELS", text)
        assert envs.read(envs.CPU_KERNELS) is value
    monkeypatch.setenv("HYBRIDLLM_CPU_KERNELS", "")
    assert envs.read(envs.CPU_KERNELS) is True  # empty is unset
    monkeypatch.setenv("HYBRIDLLM_GGUF_ACTIVATIONS", " FP32 ")
    assert envs.read(envs.GGUF_ACTIVATIONS) == "fp32"


@pytest.mark.parametrize(
    "var, bad", [(envs.GGUF_ACTIVATIONS, "int4"), (envs.CPU_KERNELS, "2")], ids=lambda v: str(v)
)
def test_a_bad_value_is_an_error_naming_the_variable(monkeypatch, var, bad):
    monkeypatch.setenv(var.name, bad)
    with pytest.raises(ValueError, match=rf"^{var.name}: expected .*got '{bad}'"):
        envs.read(var)


def test_the_package_reads_hybridllm_variables_only_through_envs():
    direct = re.compile(r"(os\.environ|os\.getenv)[^\n]*(HYBRIDLLM_|_ENV\b)")
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        name = path.relative_to(PACKAGE).as_posix()
        if name == "envs.py" or name in NOT_YET_ROUTED:
            continue
        if direct.search(path.read_text()):
            offenders.append(name)
    assert offenders == []


def test_module_constants_stay_aliases_of_the_declared_names():
    from hybridllm.layers import cpu_kernels, gguf_linear
    from hybridllm.loader import gguf_cache
    from hybridllm.plan import hardware_profile

    assert cpu_kernels.DISABLE_ENV == envs.CPU_KERNELS.name
    assert gguf_linear.ACTIVATIONS_ENV == envs.GGUF_ACTIVATIONS.name
    assert gguf_cache.CACHE_DIR_ENV == hardware_profile.CACHE_DIR_ENV == envs.CACHE_DIR.name


@pytest.mark.parametrize(
    "command", [[], ["serve"], ["generate"], ["chat"], ["bench", "latency"], ["plan"]]
)
def test_every_help_ends_with_the_environment_variables(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    tail = out[out.index("environment variables:") :]
    for var in envs.ALL:
        assert f"  {var.name} (default " in tail, var.name


def test_cache_dir_and_log_level_come_from_envs(monkeypatch, tmp_path):
    from hybridllm.entrypoints.logging_config import resolve_log_level
    from hybridllm.loader.gguf_cache import cache_root
    from hybridllm.plan.hardware_profile import default_cache_dir

    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", str(tmp_path))
    assert cache_root() == str(tmp_path) == default_cache_dir()
    monkeypatch.setenv("HYBRIDLLM_LOGGING_LEVEL", "DEBUG")
    assert resolve_log_level(None) == "debug" and resolve_log_level("error") == "error"
