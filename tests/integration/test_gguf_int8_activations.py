"""Decode steps with int8 activations (`gguf_activations="int8"`, the default outside the tests)
against the exact fp32 path: the embedded model's greedy text, and K-quant linears."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from hybridllm import LLM, SamplingParams, envs
from hybridllm.layers.gguf_linear import X8_TYPES, x8_source_types
from hybridllm.layers.linear import Linear
from tests.gguf_helpers import tokenizer_vocab, write_k_m_like_gguf
from tests.kernel_helpers import require_cpu_kernels

# Measured on the embedded model (benchmarks/int8_agreement.py, docs/benchmarks.md): the int8
# path moves a token's logprob by 0.03 on average, 0.3 at the 99th percentile, 0.6 at most.
TOLERANCE = 1.0
MEAN_TOLERANCE = 0.1


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    require_cpu_kernels()


def run_with(mode: str | None, fn, **engine_kwargs):
    """`fn(llm)` of an engine asked for `mode` activations (None: the environment's)."""
    llm = LLM(dtype="float32", use_tqdm=False, gguf_activations=mode, **engine_kwargs)
    try:
        return fn(llm)
    finally:
        llm.shutdown()


def _assert_agree(fp32_outputs, int8_outputs) -> None:
    """The same greedy tokens until a near-tie: every shared position's chosen-token logprobs
    within TOLERANCE (their mean within MEAN_TOLERANCE), and where the texts part, fp32's own
    top two within 2 * TOLERANCE of each other."""
    deltas = []
    for a, b in zip(fp32_outputs, int8_outputs):
        ta, tb = a.outputs[0], b.outputs[0]
        for token_a, token_b, top_a, top_b in zip(
            ta.token_ids, tb.token_ids, ta.logprobs, tb.logprobs
        ):
            if token_a != token_b:
                best = sorted((lp.logprob for lp in top_a.values()), reverse=True)
                assert best[0] - best[1] < 2 * TOLERANCE, (token_a, token_b, top_a)
                break
            deltas.append(abs(top_a[token_a].logprob - top_b[token_a].logprob))
    assert len(deltas) >= 16 and max(deltas) < TOLERANCE
    assert sum(deltas) / len(deltas) < MEAN_TOLERANCE


def test_embedded_model_greedy_agrees():
    prompts = ["The capital of France is", "def fibonacci(n):", "Three primary colors are"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)

    def generate(llm):
        return llm.generate(prompts, params)

    fp32, int8 = run_with("fp32", generate), run_with("int8", generate)
    _assert_agree(fp32, int8)
    # the two paths do differ: int8 is on (fp32's logprobs would be bit for bit the same)
    assert any(a.outputs[0].logprobs[0] != b.outputs[0].logprobs[0] for a, b in zip(fp32, int8))


@pytest.mark.parametrize("base", [Q.Q4_K, Q.Q5_K], ids=lambda t: t.name)
def test_k_quant_prompt_logprobs_in_int8_chunks(tmp_path, base):
    # A Q4_K_M-like (Q5_K_M-like) model, v and down Q6_K; prefill in chunks of 16 rows, so the
    # prompt's positions run through the int8 path too (teacher-forced, no divergence).
    vocab = len(tokenizer_vocab())
    path = write_k_m_like_gguf(tmp_path / "k.gguf", base)
    prompt = torch.randint(0, vocab - 3, (64,), generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)

    def prompt_logprobs(llm):
        out = llm.generate([{"prompt_token_ids": prompt.tolist()}], params)[0]
        return [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]

    def block_types(llm):
        model = llm.llm_engine.executor.workers[0].model_runner.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        return {m.ggml_type for m in linears} | {t for m in linears for _, t, _ in m.shard_blocks}

    kwargs = dict(model=str(path), max_num_batched_tokens=16, enable_prefix_caching=False)

    def run(mode: str):
        return run_with(mode, lambda llm: (prompt_logprobs(llm), block_types(llm)), **kwargs)

    (fp32, fp32_types), (int8, types) = run("fp32"), run("int8")
    # the K-quant linears (base, and v / down's Q6_K) compute from the x8 layout on the int8 path
    # (the prompt's chunks: the GEMM unpacking it); the fp32 path keeps the types' own layouts
    for fmt in (base, Q.Q6_K):
        x8 = int(fmt) in x8_source_types()
        assert (X8_TYPES[int(fmt)] in types) == x8 and (int(fmt) in types) != x8
        assert int(fmt) in fp32_types and X8_TYPES[int(fmt)] not in fp32_types
    deltas = [abs(a - b) for a, b in zip(fp32, int8)]
    assert len(deltas) == 63 and 0 < max(deltas) < TOLERANCE
    assert sum(deltas) / len(deltas) < MEAN_TOLERANCE


def test_auto_kv_cache_dtype_follows_the_activations(monkeypatch):
    # kv_cache_dtype="auto" on a CPU worker: float16 beside the int8 path over GGUF blocks (the
    # default), the compute dtype beside the exact paths (fp32 activations, dequantized weights)
    def kv_dtype(llm):
        return llm.llm_engine.executor.workers[0].model_runner.kv_cache_dtype

    assert run_with("int8", kv_dtype) == torch.float16
    assert run_with("fp32", kv_dtype) == torch.float32
    assert run_with("int8", kv_dtype, quantization="none") == torch.float32
    assert run_with("int8", kv_dtype, kv_cache_dtype="float32") == torch.float32
    # not asked: HYBRIDLLM_GGUF_ACTIVATIONS decides
    monkeypatch.setenv(envs.GGUF_ACTIVATIONS.name, "int8")
    assert run_with(None, kv_dtype) == torch.float16
