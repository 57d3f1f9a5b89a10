"""The GGUF loader and the HF-folder loader give the same logits for the same weights."""

from __future__ import annotations

import pytest

from hybridllm import LLM, SamplingParams
from hybridllm.loader import open_model_source
from tests.gguf_helpers import tiny_hf_model, write_gguf
from tests.model_helpers import tiny_config

# The tiny llama3's rope scaling with a short original context, so that it moves most
# frequencies within the prompt: GGUF files carry it as a rope_freqs tensor, HF folders as
# rope_parameters.
LLAMA3_ROPE = dict(tiny_config("llama3").rope_parameters, original_max_position_embeddings=16)


@pytest.mark.parametrize(
    ("arch", "rope"),
    [("llama", None), ("llama", LLAMA3_ROPE), ("qwen3", None)],
    ids=["llama", "llama3.1-rope", "qwen3"],
)
def test_same_logits_from_gguf_and_hf_folder(tmp_path, monkeypatch, arch, rope):
    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_hf_model(arch, tie_word_embeddings=(arch == "qwen3"), rope_parameters=rope)
    gguf_path = write_gguf(tmp_path / "tiny.gguf", model, arch=arch)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    open_model_source(str(gguf_path)).load_tokenizer().save_pretrained(folder)

    prompt = {"prompt_token_ids": [5, 17, 42, 99, 7, 63, 12]}
    params = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, logprobs=3, prompt_logprobs=3
    )
    results = []
    for path in (gguf_path, folder):
        llm = LLM(str(path), dtype="float32", use_tqdm=False, max_model_len=128)
        try:
            results.append(llm.generate(prompt, params)[0])
        finally:
            llm.shutdown()
    from_gguf, from_folder = results
    assert from_gguf.outputs[0].token_ids == from_folder.outputs[0].token_ids
    pairs = list(zip(from_gguf.outputs[0].logprobs, from_folder.outputs[0].logprobs))
    pairs += list(zip(from_gguf.prompt_logprobs[1:], from_folder.prompt_logprobs[1:]))
    for a, b in pairs:
        assert a.keys() == b.keys()
        for tid in a:
            assert abs(a[tid].logprob - b[tid].logprob) < 1e-5
