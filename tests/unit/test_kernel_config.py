"""Kernel settings (native CPU kernels, GGUF activations, whole-layer decode): EngineArgs fields
that default to their environment variables, validated once into the frozen EngineConfig."""

from __future__ import annotations

import logging

import pytest

from hybridllm.config import KernelConfig
from hybridllm.engine_args import EngineArgs
from hybridllm.plan import cpu_dtype

VARIABLES = ("HYBRIDLLM_CPU_KERNELS", "HYBRIDLLM_GGUF_ACTIVATIONS", "HYBRIDLLM_NATIVE_DECODE_LAYER")


@pytest.fixture
def clean_env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_come_from_the_environment(clean_env):
    assert KernelConfig.from_env() == KernelConfig(True, "int8", True)
    clean_env.setenv("HYBRIDLLM_CPU_KERNELS", "0")
    clean_env.setenv("HYBRIDLLM_GGUF_ACTIVATIONS", "fp32")
    clean_env.setenv("HYBRIDLLM_NATIVE_DECODE_LAYER", "off")
    assert KernelConfig.from_env() == KernelConfig(False, "fp32", False)
    # what is given wins over the environment
    assert KernelConfig.from_env(True, "int8", None) == KernelConfig(True, "int8", False)


def test_bad_values_are_clear_errors(clean_env):
    with pytest.raises(ValueError, match="gguf_activations must be one of"):
        KernelConfig(gguf_activations="int4")
    with pytest.raises(ValueError, match="cpu_kernels must be True or False"):
        KernelConfig(cpu_kernels="no")
    clean_env.setenv("HYBRIDLLM_GGUF_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match="^HYBRIDLLM_GGUF_ACTIVATIONS: expected one of int8, fp32"):
        EngineArgs().create_engine_config()  # before anything is opened or built
    # a value given in code is not overridden, nor is the bad variable read
    assert EngineArgs(gguf_activations="fp32").kernel_config().gguf_activations == "fp32"


def test_the_config_carries_the_settings_and_the_kv_dtype_they_imply(clean_env, caplog):
    caplog.set_level(logging.INFO, logger="hybridllm.engine_args")
    # The embedded model's linears are Q4_1 blocks: kept where the kernels are (said to be) built.
    clean_env.setattr(cpu_dtype, "cpu_kernels_built", lambda asked: asked)
    small = dict(max_model_len=256, max_num_seqs=4, device="cpu")
    config = EngineArgs(**small).create_engine_config()
    assert config.kernel_config == KernelConfig(True, "int8", True)
    assert config.model_config.dtype == "float32" and config.cpu_kv_cache_dtype == "float16"
    assert (
        "cpu kernels on, GGUF activations int8, native decode layer on, CPU KV cache float16"
        in (caplog.text)
    )
    config = EngineArgs(gguf_activations="fp32", **small).create_engine_config()
    assert config.kernel_config.gguf_activations == "fp32"
    assert config.cpu_kv_cache_dtype == "float32"  # the exact path keeps the compute dtype
    config = EngineArgs(
        cpu_kernels=False, native_decode_layer=False, **small
    ).create_engine_config()
    assert config.kernel_config == KernelConfig(False, "int8", False)
    assert config.model_config.cpu_blocks is None  # no kernels: no blocks, nothing int8
    assert config.cpu_kv_cache_dtype == "float32"
    assert "cpu kernels off" in caplog.text and "native decode layer off" in caplog.text
