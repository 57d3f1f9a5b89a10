"""The embedded SmolLM2-135M-Instruct: greedy output equals transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hybridllm import LLM, SamplingParams
from hybridllm.loader import default_model_path, open_model_source

NEW_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(dtype="float32", use_tqdm=False)  # no model: the embedded default
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_model():
    # The reference runs transformers' Llama on the weights our loader produced; the loader
    # itself is checked against transformers' own GGUF reader in test_loader.py.
    source = open_model_source(default_model_path())
    model = LlamaForCausalLM(LlamaConfig(**source.hf_config.to_dict())).eval()
    state = dict(source.iter_weights())
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def _hf_greedy(model, prompt_ids):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    scores = [torch.log_softmax(s[0].float(), -1) for s in out.scores]
    return tokens, scores


def test_default_model_matches_transformers(llm, hf_model):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ref_tokens, ref_scores = _hf_greedy(hf_model, tokenizer.encode(prompt))
        got = out.outputs[0]
        # The prompts were chosen for clear top-1 margins; check that they still are.
        margins = [s.topk(2).values for s in ref_scores]
        assert min(float(m[0] - m[1]) for m in margins) > 1e-3, prompt
        assert got.token_ids == ref_tokens, prompt
        ours = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        ref = [s[t].item() for s, t in zip(ref_scores, ref_tokens)]
        assert max(abs(a - b) for a, b in zip(ours, ref)) < 1e-3, prompt
        assert got.text == tokenizer.decode(got.token_ids, skip_special_tokens=True)


def test_chat_template_and_stop_string(llm):
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert "Paris" in out.text
    stopped = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=16, stop=["aris"]))[0]
    sample = stopped.outputs[0]
    assert sample.finish_reason == "stop" and sample.stop_reason == "aris"
    assert "aris" not in sample.text and sample.text.endswith("P")


def test_prompt_logprobs_match_transformers(llm, hf_model):
    prompt = PROMPTS[0]
    ids = llm.get_tokenizer().encode(prompt)
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        got = out.prompt_logprobs[pos][ids[pos]].logprob
        assert abs(got - ref[pos - 1, ids[pos]].item()) < 1e-3


def test_16_bit_kv_cache_follows_transformers(hf_model):
    # kv_cache_dtype="float16" under fp32 compute: the cache holds half the bytes (twice the
    # blocks in one budget), and greedy tokens still follow transformers' fp32 ones, with
    # logprobs off by what rounding keys and values to fp16 costs
    budget = 64 << 20
    engine = LLM(dtype="float32", kv_cache_dtype="float16", kv_cache_memory=budget, use_tqdm=False)
    try:
        c = open_model_source(default_model_path()).hf_config
        head_dim = c.hidden_size // c.num_attention_heads
        fp16_block = 2 * 16 * c.num_key_value_heads * head_dim * 2 * c.num_hidden_layers
        assert engine.llm_engine.num_blocks == budget // fp16_block
        tokenizer = engine.get_tokenizer()
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
        for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, params)):
            ref_tokens, ref_scores = _hf_greedy(hf_model, tokenizer.encode(prompt))
            got = out.outputs[0]
            assert got.token_ids == ref_tokens, prompt
            ours = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
            ref = [s[t].item() for s, t in zip(ref_scores, ref_tokens)]
            assert max(abs(a - b) for a, b in zip(ours, ref)) < 1e-2, prompt  # 3.3e-3 measured
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of"),
        ({"dtype": "bfloat16", "kv_cache_dtype": "float16"}, "with bfloat16 compute"),
        ({"dtype": "float16", "kv_cache_dtype": "float32"}, "with float16 compute"),
    ],
)
def test_kv_cache_dtype_rejects_what_it_cannot_store(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(use_tqdm=False, **kwargs)
