"""Speculative decoding (n-gram drafts) on real models: the output is plain decoding's."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from hybridllm import LLM, SamplingParams
from hybridllm.engine_args import EngineArgs
from hybridllm.structured.params import StructuredOutputsParams
from tests.model_helpers import make_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
SOURCE = (Path(__file__).parents[2] / "hybridllm" / "engine" / "block_pool.py").read_text()[:1200]
# input-grounded: the answer repeats the prompt, so most drafts are right
COPY_PROMPT = f"Repeat this code exactly:\n{SOURCE}\n\nHere it is again:\n"
PROMPTS = [COPY_PROMPT, "The capital of France is", "List the days of the week: Monday,"]


def outputs_of(llm: LLM, prompts, params) -> list:
    return [
        (c.token_ids, c.text, c.finish_reason, c.logprobs)
        for o in llm.generate(prompts, params)
        for c in o.outputs
    ]


def spec_counts(llm: LLM) -> tuple[int, int]:
    stats = llm.llm_engine.get_stats()
    return stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens


def assert_same(got, want) -> None:
    """Identical tokens, text and finish reasons; logprobs equal up to float rounding (a verify
    step computes its rows in another batch shape)."""
    assert [g[:3] for g in got] == [w[:3] for w in want]
    for g, w in zip(got, want):
        if w[3] is None:
            assert g[3] is None
            continue
        assert len(g[3]) == len(w[3])
        for got_step, want_step in zip(g[3], w[3]):
            assert got_step.keys() == want_step.keys()
            for token in want_step:
                assert got_step[token].logprob == pytest.approx(want_step[token].logprob, abs=1e-3)


@pytest.fixture(scope="module")
def plain():
    llm = LLM(dtype="float32", use_tqdm=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def spec():
    llm = LLM(dtype="float32", use_tqdm=False, speculative_config=NGRAM)
    yield llm
    llm.shutdown()


def test_greedy_output_is_plain_decodings(plain, spec):
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    before = spec_counts(spec)
    assert_same(outputs_of(spec, PROMPTS, params), outputs_of(plain, PROMPTS, params))
    drafted, accepted = (a - b for a, b in zip(spec_counts(spec), before))
    assert accepted > 30 and drafted > accepted  # drafts were kept and drafts were refused


def test_seeded_sampling_with_every_processor_is_plain_decodings(plain, spec):
    # Each row draws with its position's generator after the drafts before it, so even a
    # seeded sample (penalties, min_tokens, top-p, stop strings) comes out token for token.
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40, logprobs=1),
        SamplingParams(
            temperature=0.7,
            seed=3,
            max_tokens=40,
            repetition_penalty=1.2,
            frequency_penalty=0.3,
            presence_penalty=0.2,
            min_tokens=12,
        ),
        SamplingParams(temperature=0.5, seed=11, max_tokens=40, stop=["def ", "\n\n"], n=2),
    ]
    prompts = [COPY_PROMPT] * 3
    assert_same(outputs_of(spec, prompts, params), outputs_of(plain, prompts, params))


def test_max_tokens_and_stop_tokens_end_inside_accepted_drafts(plain, spec):
    greedy = SamplingParams(temperature=0, max_tokens=48)
    [(tokens, *_)] = outputs_of(plain, [COPY_PROMPT], greedy)
    # a stop token that plain decoding reaches in the middle of what a verify step accepts
    stop_at = tokens[20]
    for params in (
        SamplingParams(temperature=0, max_tokens=9),
        SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[stop_at]),
        SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[stop_at], ignore_eos=True),
    ):
        assert_same(
            outputs_of(spec, [COPY_PROMPT], params), outputs_of(plain, [COPY_PROMPT], params)
        )


def test_structured_output_drafts_are_checked_against_the_grammar(plain, spec):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "days": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "days"],
    }
    prompt = (
        'Answer in JSON. {"name": "week", "days": ["Monday", "Tuesday", "Wednesday"]} '
        'Again, the same JSON: {"name": "week", "days": ["Monday",'
    )
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)
    )
    assert_same(outputs_of(spec, [prompt], params), outputs_of(plain, [prompt], params))


def test_rejected_drafts_leave_the_kv_blocks_as_plain_decoding_does(tmp_path):
    # A random model's drafts are mostly wrong: after the same requests both engines hold the
    # same free blocks and cache the same prefixes (no block of a rejected draft registered).
    model = str(make_tiny_model("llama", tmp_path / "llama"))
    kwargs = dict(dtype="float32", block_size=4, max_model_len=256, use_tqdm=False)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 6 + [5, 6]}, {"prompt_token_ids": [9, 10] * 9}]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engines = [LLM(model, **kwargs), LLM(model, speculative_config=NGRAM, **kwargs)]
    try:
        results = [outputs_of(llm, prompts, params) for llm in engines]
        assert results[0] == results[1]
        pools = [llm.llm_engine.scheduler.block_manager.managers[0].block_pool for llm in engines]
        assert pools[0].num_free_blocks == pools[1].num_free_blocks == pools[0].num_blocks
        assert pools[0].cached_blocks.keys() == pools[1].cached_blocks.keys()
        drafted, accepted = spec_counts(engines[1])
        assert drafted > accepted  # some drafts were rejected
    finally:
        for llm in engines:
            llm.shutdown()


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - p for p = 0.001 (z of the normal), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_outputs_keep_the_target_distribution(tmp_path):
    # Unseeded sampling over three tokens, top-k 3 (at most 27 outcomes), with and without
    # drafts: a two-sample chi-square test that the outcome frequencies are the same law.
    # logit_bias favours the prompt's tokens so that drafts are accepted as well as refused.
    model = str(make_tiny_model("llama", tmp_path / "llama"))
    kwargs = dict(dtype="float32", max_model_len=64, use_tqdm=False, max_num_seqs=256)
    prompt = {"prompt_token_ids": [5, 6, 7] * 4 + [5, 6]}
    params = SamplingParams(
        temperature=1.0,
        top_k=3,
        max_tokens=3,
        ignore_eos=True,
        logit_bias={5: 4.0, 6: 4.0, 7: 4.0},
    )
    num_samples = 1500
    counts = []
    spec_config = {**NGRAM, "disable_by_batch_size": None}
    for config in (None, spec_config):
        llm = LLM(model, speculative_config=config, **kwargs)
        try:
            outs = llm.generate([prompt] * num_samples, params)
            counts.append(Counter(tuple(o.outputs[0].token_ids) for o in outs))
            if config is not None:
                drafted, accepted = spec_counts(llm)
                assert 0 < accepted < drafted
        finally:
            llm.shutdown()
    outcomes = sorted(set(counts[0]) | set(counts[1]))
    statistic = 0.0
    for outcome in outcomes:
        a, b = counts[0][outcome], counts[1][outcome]
        statistic += (a - b) ** 2 / (a + b)  # equal sample sizes
    assert len(outcomes) > 4
    assert statistic < _chi_square_critical(len(outcomes) - 1), (statistic, counts)


def test_linear_attention_models_are_refused(tmp_path):
    model = str(make_tiny_model("qwen3_next", tmp_path / "qwen3_next"))
    with pytest.raises(ValueError, match="linear-attention layers"):
        EngineArgs(model, speculative_config=NGRAM).create_engine_config()


@pytest.mark.parametrize(
    "config, error",
    [
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": 1, "prompt_lookup_min": 3}, "<="),
        ({"num_speculative_tokens": "4"}, "integer in"),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"model": "/some/draft", "num_speculative_tokens": 2}, "model '/some/draft'"),
        ({"num_speculative_tokens": 2, "temperature": 1}, "unknown keys"),
    ],
)
def test_bad_speculative_configs_name_the_problem(config, error):
    with pytest.raises(ValueError, match=error):
        EngineArgs(speculative_config=config).create_engine_config()


@pytest.mark.slow
def test_server_takes_the_flag_reports_the_counters_and_bench_prints_them(plain):
    import json
    import subprocess
    import sys

    from tests.integration.openai_server import REPO_ROOT, RemoteServer

    flag = json.dumps(NGRAM)
    args = [
        "--max-model-len",
        "1024",
        "--served-model-name",
        "smollm2",
        "--speculative-config",
        flag,
    ]
    with RemoteServer(args) as server:
        client = server.client()
        got = client.completions.create(
            model="smollm2", prompt=COPY_PROMPT, max_tokens=40, temperature=0
        )
        [(want_tokens, want_text, *_)] = outputs_of(
            plain, [COPY_PROMPT], SamplingParams(temperature=0, max_tokens=40)
        )
        assert got.choices[0].text == want_text
        metrics = server.metrics()
        assert metrics["hybridllm:spec_decode_num_accepted_tokens_total"] > 10
        assert (
            metrics["hybridllm:spec_decode_num_draft_tokens_total"]
            >= (metrics["hybridllm:spec_decode_num_accepted_tokens_total"])
        )
        bench = subprocess.run(
            [sys.executable, "-m", "hybridllm", "bench", "serve", "--base-url", server.root]
            + ["--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "48"]
            + ["--temperature", "0", "--ignore-eos", "--disable-tqdm"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert bench.returncode == 0, bench.stderr[-2000:]
        assert "Speculative decoding:" in bench.stdout, bench.stdout
    refused = subprocess.run(
        [sys.executable, "-m", "hybridllm", "serve", "--speculative-config", "{not json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "--speculative-config" in refused.stderr


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_pipeline_parallel_verifies_drafts_as_one_worker_does(tmp_path, backend):
    # Two stages (in process, and one process each with the step pickled through shared
    # memory) verify the same drafts: greedy tokens and logprobs equal a single worker's.
    model = str(make_tiny_model("llama", tmp_path / "llama"))
    kwargs = dict(dtype="float32", block_size=4, max_model_len=128, use_tqdm=False)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 5 + [5, 6]}, {"prompt_token_ids": [9, 10] * 7}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    single = LLM(model, **kwargs)
    want = outputs_of(single, prompts, params)
    single.shutdown()
    staged = LLM(
        model,
        speculative_config=NGRAM,
        pipeline_parallel_size=2,
        distributed_executor_backend=backend,
        **kwargs,
    )
    try:
        assert_same(outputs_of(staged, prompts, params), want)
        drafted, accepted = spec_counts(staged)
        assert drafted > 0
    finally:
        staged.shutdown()


def test_chunked_prefill_prefix_hits_and_preemption_leave_the_output_unchanged(tmp_path):
    # Prompts in chunks of 32 tokens, a shared prefix served from the cache, several requests
    # decoding together with different drafts, and a pool so small that requests are preempted
    # and recomputed: the same tokens as plain decoding under the same limits.
    kwargs = dict(
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=26,
        use_tqdm=False,
    )
    prompts = [COPY_PROMPT, COPY_PROMPT + "```python", PROMPTS[2], PROMPTS[1]]
    params = SamplingParams(temperature=0, max_tokens=40)
    results = []
    for config in (None, {**NGRAM, "disable_by_batch_size": None}):
        llm = LLM(speculative_config=config, **kwargs)
        try:
            results.append(outputs_of(llm, prompts, params))
            stats = llm.llm_engine.get_stats()
            if config is not None:
                assert stats.spec_num_accepted_tokens > 0
            assert stats.num_preemptions > 0
        finally:
            llm.shutdown()
    assert [r[:3] for r in results[1]] == [r[:3] for r in results[0]]
