"""End-to-end greedy generation through `LLM` equals Hugging Face transformers, per architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridllm import LLM, SamplingParams
from tests.model_helpers import ARCHITECTURES, make_tiny_model

NEW_TOKENS = 32


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", max_model_len=256, block_size=4, use_tqdm=False)
    yield request.param, hf, llm
    llm.shutdown()


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lens = (5, 13, 22)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
            min_new_tokens=NEW_TOKENS,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


def test_greedy_tokens_and_logprobs_match_hf(tiny):
    arch, hf, llm = tiny
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    prompts = _prompts(hf.config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_lps = _hf_greedy(hf, prompt)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, arch
        ours = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 1e-3, arch


def test_same_tokens_alone_and_in_batch(tiny):
    _, hf, llm = tiny
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(hf.config.vocab_size)]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone
