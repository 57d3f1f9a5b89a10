"""dtype="auto" on CPU workers: a bf16 checkpoint computes in bf16 where this CPU does it faster."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridllm.engine_args import EngineArgs
from hybridllm.plan import cpu_dtype, hardware_profile
from hybridllm.plan.cpu_dtype import checkpoint_dtype, cpu_auto_dtype
from tests.model_helpers import build_tiny_hf_model, make_tiny_tokenizer

BF16_CPU = {"avx2", "avx512f", "avx512_bf16"}


def rates(fp32: float, bf16: float):
    asked = []

    def gemm_rates() -> tuple[float, float]:
        asked.append(True)
        return fp32, bf16

    return gemm_rates, asked


def test_bf16_checkpoint_on_a_cpu_that_runs_bf16_faster():
    faster, _ = rates(3e11, 6e11)
    assert cpu_auto_dtype("bfloat16", True, BF16_CPU, faster) == "bfloat16"
    assert cpu_auto_dtype("bfloat16", True, {"amx_bf16"}, faster) == "bfloat16"
    slower, _ = rates(3e11, 1e11)  # bf16 instructions, but slower GEMMs (machine A's Xeon)
    assert cpu_auto_dtype("bfloat16", True, BF16_CPU, slower) == "float32"


@pytest.mark.parametrize(
    "checkpoint, float_weights, flags",
    [
        ("float32", True, BF16_CPU),  # an fp32 checkpoint stays fp32
        ("float16", True, BF16_CPU),
        (None, True, BF16_CPU),  # no dtype recorded
        ("bfloat16", False, BF16_CPU),  # GGUF blocks / on-load quantization: fp32 activations
        ("bfloat16", True, {"avx2", "avx512f"}),  # no bf16 dot products
    ],
)
def test_everything_else_stays_fp32_without_measuring(checkpoint, float_weights, flags):
    gemm_rates, asked = rates(1e11, 9e11)
    assert cpu_auto_dtype(checkpoint, float_weights, flags, gemm_rates) == "float32"
    assert not asked  # the profile (seconds on a new machine) is not read for nothing


def test_checkpoint_dtype_from_either_config_field():
    assert checkpoint_dtype(SimpleNamespace(dtype="bfloat16")) == "bfloat16"
    assert checkpoint_dtype(SimpleNamespace(torch_dtype="torch.bfloat16")) == "bfloat16"
    assert checkpoint_dtype(SimpleNamespace(torch_dtype=torch.float16)) == "float16"
    assert checkpoint_dtype(SimpleNamespace()) is None


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    model = build_tiny_hf_model("llama").to(torch.bfloat16)
    model.save_pretrained(path)
    make_tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("bf16_flops, want", [(6e11, "bfloat16"), (1e11, "float32")])
def test_engine_config_resolves_auto_on_cpu(bf16_folder, monkeypatch, bf16_flops, want):
    # the engine's config for a bf16 folder on a CPU-only plan: what the rule says for this
    # CPU's flags and rates (both set here, so the test means the same on every machine)
    profile = SimpleNamespace(cpu=SimpleNamespace(fp32_flops=3e11, bf16_flops=bf16_flops))
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: frozenset(BF16_CPU))
    monkeypatch.setattr(hardware_profile, "load_or_measure_profile", lambda hw: profile)
    config = EngineArgs(model=bf16_folder, device="cpu").create_engine_config()
    assert config.model_config.dtype == want
    assert config.plan.workers()[0].is_cpu
    # asked for, or quantized at load, the answer is not "auto"'s
    explicit = EngineArgs(model=bf16_folder, device="cpu", dtype="float32")
    assert explicit.create_engine_config().model_config.dtype == "float32"
    quantized = EngineArgs(model=bf16_folder, device="cpu", quantization="q8_0")
    assert quantized.create_engine_config().model_config.dtype == "float32"


@pytest.mark.parametrize(
    "kv_cache_dtype, compute, int8_blocks, expected",
    [
        ("auto", "float32", True, "float16"),  # GGUF blocks, int8 activations: llama.cpp's f16
        ("auto", "float32", False, "float32"),  # the exact paths keep the compute dtype
        ("auto", "bfloat16", True, "bfloat16"),  # 16-bit compute: its own dtype
        ("float32", "float32", True, "float32"),  # an explicit choice wins
        ("bfloat16", "float32", False, "bfloat16"),
    ],
)
def test_cpu_kv_cache_dtype(kv_cache_dtype, compute, int8_blocks, expected):
    assert cpu_dtype.cpu_kv_cache_dtype(kv_cache_dtype, compute, int8_blocks) == expected
