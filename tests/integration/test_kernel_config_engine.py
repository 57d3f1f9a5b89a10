"""An engine computes with its config's kernel settings, whatever the environment says.

GGUF activations (with the CPU KV cache dtype they imply), the native whole-layer decode and the
native CPU kernels at all reach every worker's modules by value (config.KernelConfig); the
environment variables are only the defaults of settings left unset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridllm import LLM, SamplingParams, envs
from hybridllm.layers import gguf_linear as gguf_linear_module
from hybridllm.layers.attention import PagedAttention
from hybridllm.layers.gguf_linear import FP32_ACTIVATIONS, INT8_ACTIVATIONS, gguf_kernel_types
from hybridllm.layers.linear import Linear
from hybridllm.layers.norm import RMSNorm
from hybridllm.layers.vocab_embedding import LMHead, VocabEmbedding
from tests.kernel_helpers import require_cpu_kernels

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
ENGINE = dict(dtype="float32", max_model_len=256, use_tqdm=False)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    require_cpu_kernels()


@pytest.fixture
def environment(monkeypatch):
    """Sets HYBRIDLLM_GGUF_ACTIVATIONS; modules then start from it (`default_activations`), so
    an engine must replace it with its own setting."""

    def set_activations(mode: str) -> None:
        monkeypatch.setenv(envs.GGUF_ACTIVATIONS.name, mode)
        gguf_linear_module.default_activations.cache_clear()

    yield set_activations
    monkeypatch.undo()
    gguf_linear_module.default_activations.cache_clear()


def greedy(llm: LLM) -> list:
    """Each prompt's greedy tokens and top logprobs, as JSON gives them back."""
    outputs = llm.generate(PROMPTS, PARAMS)
    results = [
        [
            list(out.outputs[0].token_ids),
            [sorted((t, lp.logprob) for t, lp in step.items()) for step in out.outputs[0].logprobs],
        ]
        for out in outputs
    ]
    return json.loads(json.dumps(results))


def greedy_in_a_process(activations: str) -> list:
    """`greedy` of an engine built without settings in a fresh process whose environment says
    `activations`: what the environment alone gives."""
    code = (
        "import json\n"
        "from hybridllm import LLM\n"
        "from tests.integration.test_kernel_config_engine import ENGINE, greedy\n"
        "llm = LLM(**ENGINE)\n"
        "print(json.dumps(greedy(llm)))\n"
        "llm.shutdown()\n"
    )
    env = {**os.environ, envs.GGUF_ACTIVATIONS.name: activations}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def model_runner(llm: LLM):
    return llm.llm_engine.executor.workers[0].model_runner


def block_activations(model: torch.nn.Module) -> set[int]:
    """The `activations` of every module that computes from GGUF blocks."""
    return {
        module.activations
        for module in model.modules()
        if isinstance(module, (Linear, LMHead))
        and (module.qweight is not None or getattr(module, "shard_blocks", None))
    }


def native_form_activations(model: torch.nn.Module) -> set[int]:
    """The `activations` each layer's native decode form passes the op (its last attention
    argument)."""
    return {form.attention[-1] for form in model.execution.native_forms if form is not None}


@pytest.fixture(scope="module")
def fp32_reference() -> list:
    """The exact path's outputs: an engine asked for fp32 activations."""
    llm = LLM(gguf_activations="fp32", **ENGINE)
    try:
        return greedy(llm)
    finally:
        llm.shutdown()


def test_int8_activations_by_config_in_an_fp32_environment(environment, fp32_reference):
    environment("fp32")
    llm = LLM(gguf_activations="int8", **ENGINE)
    try:
        runner = model_runner(llm)
        assert llm.llm_engine.config.kernel_config.gguf_activations == "int8"
        assert block_activations(runner.model) == {INT8_ACTIVATIONS}
        assert native_form_activations(runner.model) == {INT8_ACTIVATIONS}
        assert runner.kv_cache_dtype == torch.float16  # "auto" beside int8 over GGUF blocks
        int8 = greedy(llm)
    finally:
        llm.shutdown()
    assert int8 != fp32_reference  # the int8 path moves logprobs
    # what a process whose environment says int8 computes, bit for bit
    assert int8 == greedy_in_a_process("int8")


def test_fp32_activations_by_config_in_an_int8_environment(environment, fp32_reference):
    environment("int8")
    llm = LLM(gguf_activations="fp32", **ENGINE)
    try:
        runner = model_runner(llm)
        assert block_activations(runner.model) == {FP32_ACTIVATIONS}
        assert native_form_activations(runner.model) == {FP32_ACTIVATIONS}
        assert runner.kv_cache_dtype == torch.float32
        assert greedy(llm) == fp32_reference
    finally:
        llm.shutdown()


def test_native_decode_layer_off_by_config(monkeypatch, fp32_reference):
    monkeypatch.setenv(envs.NATIVE_DECODE_LAYER.name, "1")
    llm = LLM(gguf_activations="fp32", native_decode_layer=False, **ENGINE)
    try:
        execution = model_runner(llm).model.execution
        assert not execution.any_native and execution.stack is None
        assert execution.native_forms == [None] * len(execution.layers)
        # the per-op path runs the same kernels in the same order
        assert greedy(llm) == fp32_reference
    finally:
        llm.shutdown()


def test_cpu_kernels_off_by_config(fp32_reference):
    assert gguf_kernel_types(torch.device("cpu"), False) == frozenset()
    assert gguf_kernel_types(torch.device("cpu"), True)  # built here: the switch decides
    llm = LLM(gguf_activations="int8", cpu_kernels=False, **ENGINE)
    try:
        runner = model_runner(llm)
        model = runner.model
        modules = list(model.modules())
        # no GGUF blocks kept: every weight dequantized, nothing computed with int8
        assert llm.llm_engine.config.model_config.cpu_blocks is None
        for module in modules:
            if isinstance(module, (Linear, LMHead, VocabEmbedding)):
                assert module.qweight is None
            if isinstance(module, Linear):
                assert not module.shard_blocks
        assert runner.kv_cache_dtype == torch.float32
        # torch everywhere: attention, norms, decode, the sampler's argmax
        attention = [m for m in modules if isinstance(m, PagedAttention)]
        assert attention and not any(m.backend.native_ops for m in attention)
        assert not any(m.native for m in modules if isinstance(m, RMSNorm))
        assert not model.execution.any_native and model.execution.stack is None
        assert not runner.sampler.native_argmax
        outputs = greedy(llm)
    finally:
        llm.shutdown()
    # dequantized floats in torch against fp32 math over the blocks: rounding apart
    for (tokens, steps), (ref_tokens, ref_steps) in zip(outputs, fp32_reference):
        assert tokens == ref_tokens
        for step, ref_step in zip(steps, ref_steps):
            assert [t for t, _ in step] == [t for t, _ in ref_step]
            assert [lp for _, lp in step] == pytest.approx([lp for _, lp in ref_step], abs=1e-3)
