"""`LLM(..., skip_tokenizer_init=True)`: token ids in, token ids out, for folders without a tokenizer."""

from __future__ import annotations

import pytest
import torch

from hybridllm import LLM, SamplingParams
from hybridllm.loader import MissingTokenizerError
from tests.model_helpers import build_tiny_hf_model, make_tiny_tokenizer

NEW_TOKENS = 12
ARCHS = ("llama", "mistral", "qwen2")


@pytest.fixture(scope="module", params=ARCHS)
def no_tokenizer_model(request, tmp_path_factory):
    """(arch, folder without tokenizer files, the HF model those weights came from)."""
    path = tmp_path_factory.mktemp(f"{request.param}_no_tok")
    hf = build_tiny_hf_model(request.param)
    hf.save_pretrained(path)
    assert not any(p.name.startswith(("tokenizer", "vocab")) for p in path.iterdir())
    return request.param, path, hf


@pytest.fixture(scope="module")
def skip_llm(no_tokenizer_model):
    arch, path, hf = no_tokenizer_model
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
        block_size=4,
        use_tqdm=False,
    )
    yield arch, llm, hf
    llm.shutdown()


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 9)]


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **kwargs)


def test_missing_tokenizer_is_a_clear_error(no_tokenizer_model):
    _, path, _ = no_tokenizer_model
    # Qwen2 used to load here: transformers builds its tokenizer with an empty vocabulary.
    with pytest.raises(MissingTokenizerError, match=r"tokenizer\.json.*skip_tokenizer_init=True"):
        LLM(str(path), dtype="float32", max_model_len=128, use_tqdm=False)


def test_greedy_token_ids_match_hf(skip_llm):
    arch, llm, hf = skip_llm
    prompts = _prompts(hf.config.vocab_size)
    # a bare list of ids and the dict form
    outs = llm.generate([prompts[0], {"prompt_token_ids": prompts[1]}], _greedy(logprobs=1))
    for prompt, out in zip(prompts, outs):
        assert out.error is None
        assert out.prompt is None and out.prompt_token_ids == prompt
        got = out.outputs[0]
        assert got.token_ids == _hf_greedy(hf, prompt), arch
        assert got.text == ""
        assert got.finish_reason == "length"
        assert len(got.logprobs) == NEW_TOKENS
        for position, token in zip(got.logprobs, got.token_ids):
            assert token in position
            assert all(lp.decoded_token is None for lp in position.values())


def test_prompt_logprobs_and_n_without_tokenizer(skip_llm):
    _, llm, hf = skip_llm
    prompt = _prompts(hf.config.vocab_size)[1]
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=1)
    out = llm.generate([prompt], params)[0]
    assert len(out.outputs) == 2
    assert all(len(o.token_ids) == 4 and o.text == "" for o in out.outputs)
    assert out.prompt_logprobs[0] is None
    assert all(lp.decoded_token is None for p in out.prompt_logprobs[1:] for lp in p.values())


def test_stop_token_ids_still_stop(skip_llm):
    _, llm, hf = skip_llm
    prompt = _prompts(hf.config.vocab_size)[0]
    reference = _hf_greedy(hf, prompt)
    # the first token from the third on that the run has not produced before
    stop_at = next(i for i in range(2, NEW_TOKENS) if reference[i] not in reference[:i])
    stop_id = reference[stop_at]
    out = llm.generate([prompt], _greedy(stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == reference[: stop_at + 1]
    assert out.text == ""


def test_eos_still_stops(skip_llm):
    _, llm, _ = skip_llm
    eos = llm.llm_engine.model_config.eos_token_ids
    assert eos, "the tiny models' config names an eos token"
    # Force the end-of-sequence id first: the request must end there.
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias={eos[0]: 100.0})
    out = llm.generate([[5, 6, 7]], params)[0].outputs[0]
    assert out.token_ids == [eos[0]] and out.finish_reason == "stop" and out.text == ""


def _assert_idle(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert not engine.output_processor.requests
    assert not engine.scheduler.requests


@pytest.mark.parametrize("prompt", ["Hello world", {"prompt": "Hello world"}, ""])
def test_text_prompt_is_refused(skip_llm, prompt):
    _, llm, hf = skip_llm
    ids = _prompts(hf.config.vocab_size)[0]
    with pytest.raises(ValueError, match="text prompt needs a tokenizer.*skip_tokenizer_init"):
        llm.generate([ids, prompt], _greedy())  # the valid prompt is not queued either
    _assert_idle(llm)
    with pytest.raises(ValueError, match="text prompt needs a tokenizer.*skip_tokenizer_init"):
        llm.llm_engine.add_request("text", prompt, _greedy())
    _assert_idle(llm)
    out = llm.generate([ids], _greedy())[0]  # still generates
    assert out.error is None and len(out.outputs[0].token_ids) == NEW_TOKENS


def test_stop_strings_are_refused(skip_llm):
    _, llm, hf = skip_llm
    ids = _prompts(hf.config.vocab_size)[0]
    params = [_greedy(), _greedy(stop=["."])]
    with pytest.raises(ValueError, match=r"^stop: stop strings need a tokenizer"):
        llm.generate([ids, ids], params)
    _assert_idle(llm)
    with pytest.raises(ValueError, match=r"^stop: .*skip_tokenizer_init=True"):
        llm.llm_engine.add_request("stop", ids, _greedy(n=2, stop="x"))
    _assert_idle(llm)
    assert not llm.llm_engine.output_processor.has("stop")  # the id can be used again
    llm.llm_engine.add_request("stop", ids, _greedy())
    outs = []
    while llm.llm_engine.has_unfinished_requests():
        outs += [o for o in llm.llm_engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["stop"]
    assert len(outs[0].outputs[0].token_ids) == NEW_TOKENS


def test_chat_and_get_tokenizer_are_refused(skip_llm):
    _, llm, _ = skip_llm
    with pytest.raises(ValueError, match="chat template.*skip_tokenizer_init=True"):
        llm.chat([{"role": "user", "content": "hi"}], _greedy())
    with pytest.raises(ValueError, match="no tokenizer.*skip_tokenizer_init=True"):
        llm.get_tokenizer()
    _assert_idle(llm)


def test_tokenizer_only_folder_fills_in(tmp_path):
    """The error's other suggestion: a folder holding only tokenizer files, as `tokenizer=`."""
    model_dir, tok_dir = tmp_path / "model", tmp_path / "tok"
    hf = build_tiny_hf_model("llama")
    hf.save_pretrained(model_dir)
    make_tiny_tokenizer(hf.config.vocab_size).save_pretrained(tok_dir)
    llm = LLM(
        str(model_dir), tokenizer=str(tok_dir), dtype="float32", max_model_len=64, use_tqdm=False
    )
    try:
        out = llm.generate(["Hello world"], _greedy())[0].outputs[0]
        assert len(out.token_ids) == NEW_TOKENS and out.text
        assert out.text == llm.get_tokenizer().decode(out.token_ids)
    finally:
        llm.shutdown()


def test_gguf_without_tokenizer_metadata(tmp_path):
    from tests.gguf_helpers import tiny_hf_model, write_gguf

    path = write_gguf(tmp_path / "m.gguf", tiny_hf_model("llama"), with_tokenizer=False)
    with pytest.raises(MissingTokenizerError, match="skip_tokenizer_init=True"):
        LLM(str(path), dtype="float32", max_model_len=64, use_tqdm=False)
    llm = LLM(
        str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=64, use_tqdm=False
    )
    try:
        out = llm.generate([[5, 6, 7]], _greedy())[0].outputs[0]
        assert len(out.token_ids) == NEW_TOKENS and out.text == ""
    finally:
        llm.shutdown()
