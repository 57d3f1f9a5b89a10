"""Speculative decoding with a draft model, on real models: the output is plain decoding's."""

from __future__ import annotations

import random

import pytest
import torch

from hybridllm import LLM, SamplingParams
from hybridllm.engine_args import EngineArgs
from hybridllm.loader import default_model_path
from hybridllm.worker.draft_runner import DraftModelRunner
from tests.integration.test_speculative_decoding import assert_same, outputs_of, spec_counts
from tests.model_helpers import (
    make_tiny_model,
    make_tiny_tokenizer,
    random_eager_model,
    tiny_config,
)


def draft(model, **extra) -> dict:
    return {"model": str(model), "num_speculative_tokens": 3, **extra}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny random target, and another tiny random model of the same vocabulary."""
    root = tmp_path_factory.mktemp("draft_models")
    return make_tiny_model("llama", root / "target", seed=0), make_tiny_model(
        "llama", root / "other", seed=1
    )


@pytest.fixture(scope="module")
def plain(models):
    llm = LLM(str(models[0]), use_tqdm=False)
    yield llm
    llm.shutdown()


def test_the_runner_drafts_the_draft_models_greedy_continuation(models, plain):
    # Three sequences grow as verify steps grow them (some drafts kept, then a token of the
    # target's own); whatever the draft's KV already holds, its drafts are the greedy
    # continuation a fresh run of the same model computes. Blocks for two full contexts (512
    # tokens) and three sequences of 25 blocks: the least recently drafted one is dropped and
    # catches up from its whole history later; a batch of all three leaves one without drafts.
    config = EngineArgs(str(models[0]), speculative_config=draft(models[0]))
    draft_config = config.create_engine_config().speculative_config.draft_config
    runner = DraftModelRunner(draft_config, num_speculative_tokens=3, max_seqs=2)
    try:
        rng = random.Random(0)
        vocab = draft_config.model_config.vocab_size
        seqs = {f"r{i}": [rng.randrange(vocab) for _ in range(390 + 3 * i)] for i in range(3)}
        greedy = SamplingParams(temperature=0, max_tokens=3)
        num_without = 0
        for round_ in range(6):
            ids = ["r0", "r1"] if round_ % 2 else ["r1", "r2", "r0"][: 2 + round_ % 3 // 2]
            batch = [(req_id, seqs[req_id], 1 + (round_ + i) % 3) for i, req_id in enumerate(ids)]
            drafts = runner.propose(batch)
            for (req_id, tokens, k), got in zip(batch, drafts):
                if not got:  # no room this time: all three were in the batch
                    assert len(batch) == 3
                    num_without += 1
                    continue
                [out] = plain.generate({"prompt_token_ids": tokens}, greedy, use_tqdm=False)
                assert got == out.outputs[0].token_ids[:k], (round_, req_id)
                kept = rng.randrange(k + 1)
                seqs[req_id] = tokens + got[:kept] + [rng.randrange(vocab)]
        assert len(runner.seqs) <= 2 and num_without > 0
        runner.retain(set())
        assert not runner.seqs and runner.pool.num_free_blocks == runner.num_blocks
        # a new request with r0's tokens: the prefix cache holds all its full blocks but the
        # last token's, so the draft runs the rest only, and drafts what it drafted before
        tokens = seqs["r0"]
        before = runner.num_tokens_run
        [got] = runner.propose([("again", tokens, 1)])
        [out] = plain.generate({"prompt_token_ids": tokens}, greedy, use_tqdm=False)
        assert got == out.outputs[0].token_ids[:1]
        cached = (len(tokens) - 1) // 16 * 16
        assert runner.num_tokens_run - before == len(tokens) - cached
    finally:
        runner.shutdown()


@pytest.mark.parametrize("which", ["itself", "another model"])
def test_greedy_and_seeded_outputs_are_plain_decodings(models, plain, which):
    target, other = models
    draft_model = target if which == "itself" else other
    llm = LLM(
        str(target),
        use_tqdm=False,
        speculative_config=draft(draft_model, disable_by_batch_size=None),
    )
    llm.llm_engine.drafter.price_drafts = False  # the counts below must not hang on timings
    try:
        prompts = [{"prompt_token_ids": [5 + i, 17, 3 * i + 1, 40, 2]} for i in range(4)]
        params = [
            SamplingParams(temperature=0, max_tokens=40, logprobs=2),
            SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, n=2),
            SamplingParams(temperature=0.7, seed=3, max_tokens=30, repetition_penalty=1.2),
        ]
        assert_same(outputs_of(llm, prompts, params), outputs_of(plain, prompts, params))
        drafted, accepted = spec_counts(llm)
        if which == "itself":
            # the target drafting for itself: every greedy draft is what it samples
            outputs_of(llm, prompts[:2], params[:2])
            now = spec_counts(llm)
            assert now[0] - drafted > 20 and now[1] - accepted == now[0] - drafted
        else:
            assert drafted > accepted
    finally:
        llm.shutdown()


def test_the_embedded_model_drafting_for_itself_keeps_its_greedy_output():
    # GGUF blocks on both sides; fp32 activations, whose sums do not depend on how many rows a
    # step has (int8 activations round a verify step's larger batch differently, as they do
    # plain decoding's: docs/benchmarks.md)
    prompts = ["The capital of France is", "List the days of the week:", "def add(a, b):"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kwargs = {"gguf_activations": "fp32", "max_model_len": 512, "use_tqdm": False}
    plain = LLM(**kwargs)
    want = outputs_of(plain, prompts, params)
    plain.shutdown()
    llm = LLM(**kwargs, speculative_config=draft(default_model_path(), num_speculative_tokens=4))
    llm.llm_engine.drafter.price_drafts = False  # a model drafting for itself never pays
    try:
        assert_same(outputs_of(llm, prompts, params), want)
        drafted, accepted = spec_counts(llm)
        assert drafted > 40 and accepted > 0.9 * drafted
    finally:
        llm.shutdown()


def test_preemption_and_chunked_prefill_leave_the_output_unchanged(models):
    # A KV cache too small for all requests at once (5 x 6 blocks in 20): requests are
    # preempted and recomputed, prompts arrive in chunks of 32 tokens; the draft's KV follows
    # (dropped with a preempted request, caught up when it drafts again).
    target = str(models[0])
    kwargs = dict(use_tqdm=False, max_num_batched_tokens=32, num_gpu_blocks_override=20)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 1 for j in range(50)]} for i in range(5)]
    results = []
    for config in (None, draft(target, disable_by_batch_size=None)):
        llm = LLM(target, speculative_config=config, **kwargs)
        if config is not None:
            llm.llm_engine.drafter.price_drafts = False
        try:
            results.append(outputs_of(llm, prompts, params))
            stats = llm.llm_engine.get_stats()
            assert stats.num_preemptions > 0
            if config is not None:
                assert stats.spec_num_accepted_tokens > 0
                # the draft KV of every request but the last to finish is freed (the last's at
                # the next step, when the drafter sees it no longer runs)
                assert len(llm.llm_engine.drafter.runner.seqs) <= 1
        finally:
            llm.shutdown()
    assert_same(results[1], results[0])


def test_a_draft_with_a_larger_vocabulary_drafts_only_the_targets_tokens(models, tmp_path):
    # a draft whose (padded) vocabulary is larger: its logits past the target's are never
    # drafted (the target's embedding has no row for them)
    config = tiny_config("llama")
    config.vocab_size = 640
    big = random_eager_model(config)
    with torch.no_grad():  # the padding's rows: 10x the others, they win every argmax
        big.lm_head.weight[320:] = 10 * big.lm_head.weight[:320]
    big.save_pretrained(tmp_path / "big")
    make_tiny_tokenizer(640).save_pretrained(tmp_path / "big")
    spec = EngineArgs(str(models[0]), speculative_config=draft(tmp_path / "big"))
    draft_config = spec.create_engine_config().speculative_config.draft_config
    for vocab_size, in_range in ((None, False), (320, True)):
        runner = DraftModelRunner(draft_config, 3, 1, vocab_size=vocab_size)
        [drafts] = runner.propose([("r", [5, 17, 40, 2], 3)])
        runner.shutdown()
        assert all(t < 320 for t in drafts) == in_range, drafts
    llm = LLM(str(models[0]), use_tqdm=False, speculative_config=draft(tmp_path / "big"))
    try:
        params = SamplingParams(temperature=0, max_tokens=16)
        prompts = [{"prompt_token_ids": [5, 17, 40, 2]}]
        out = llm.generate(prompts, params)
        assert out[0].outputs[0].finish_reason == "length" and spec_counts(llm)[0] > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "config, error",
    [
        ({"model": "/no/such/draft", "num_speculative_tokens": 2}, "model '/no/such/draft'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "goes with method"),
        ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "goes with method"),
    ],
)
def test_bad_draft_configs_name_the_problem(config, error):
    with pytest.raises(ValueError, match=error):
        EngineArgs(speculative_config=config).create_engine_config()


def test_a_draft_with_linear_attention_layers_is_refused(tmp_path):
    linear = make_tiny_model("qwen3_next", tmp_path / "qwen3_next")
    target = make_tiny_model("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="a draft with linear-attention layers"):
        EngineArgs(str(target), speculative_config=draft(linear)).create_engine_config()


def test_server_with_a_draft_model_answers_as_plain_decoding(tmp_path):
    # A tiny random draft with the embedded model's vocabulary: cheap enough that the drafter
    # drafts (its guard pauses it soon, since it guesses badly), and the answer is plain
    # decoding's whatever it guesses.
    import json

    from tests.integration.openai_server import RemoteServer

    config = tiny_config("llama")
    config.vocab_size = 49152
    torch.manual_seed(0)
    random_eager_model(config).save_pretrained(tmp_path / "draft")
    prompt = "List the planets of the solar system in order:"
    plain_llm = LLM(max_model_len=512, use_tqdm=False)
    try:
        want = plain_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32))
    finally:
        plain_llm.shutdown()
    spec = json.dumps(draft(tmp_path / "draft", disable_by_batch_size=None))
    args = ["--max-model-len", "512", "--speculative-config", spec]
    with RemoteServer(args) as server:
        client = server.client()
        model = client.models.list().data[0].id
        got = client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)
        assert got.choices[0].text == want[0].outputs[0].text
        assert server.metrics()["hybridllm:spec_decode_num_draft_tokens_total"] >= 3


def test_the_plan_counts_the_draft_as_the_runner_allocates_it(models):
    from hybridllm.plan.draft_memory import draft_max_seqs, draft_memory

    args = EngineArgs(str(models[0]), max_model_len=256, speculative_config=draft(models[1]))
    spec = args.create_engine_config().speculative_config
    predicted = draft_memory(spec, args.max_num_seqs)
    runner = DraftModelRunner(
        spec.draft_config, spec.num_speculative_tokens, draft_max_seqs(spec, args.max_num_seqs)
    )
    try:
        kv = sum(c.numel() * c.element_size() for c in runner.runner.kv_caches)
        # the weights as loaded (not the rotary tables, nor the LM head's int8 copy)
        weights = sum(
            t.numel() * t.element_size()
            for t in runner.runner.model.parameters()
            if t.is_floating_point()
        )
    finally:
        runner.shutdown()
    assert predicted.kv_cache_bytes == kv
    assert abs(predicted.weight_bytes - weights) <= 0.02 * weights, (predicted, weights)
    # and `hybridllm plan`'s budget leaves it out of what the plan's CPU workers may use
    placement = args.placement_args(256, 256, speculative_config=spec)
    assert placement.host_reserved_bytes == predicted.total_bytes
