"""GGUF files of llama.cpp's `deepseek2` (DeepSeek-V2, DeepSeek-V3) and `glm4moe` (GLM-4.5)
architectures, written by llama.cpp's own convert_hf_to_gguf.py and llama-quantize from tiny
random transformers models (tests/gguf_deepseek_helpers.py), read as the HF folder they came
from: the same config fields, the same tensors (kv_b_proj reassembled from attn_k_b and
attn_v_b, GLM's multi-token-prediction layer skipped), the same greedy tokens.

Skips where llama.cpp's converter and tools are not built (see tests/llamacpp_helpers.py); the
files are made once (about 30 s) and reused.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from hybridllm import LLM, SamplingParams
from hybridllm.loader.gguf_file import GGUFFile
from hybridllm.loader.gguf_mapping import (
    GGUF_ARCHS,
    gguf_arch,
    hf_config_kwargs,
    hf_tensor_name,
    kv_b_from_parts,
)
from hybridllm.loader.gguf_source import GGUFSource
from hybridllm.loader.model_source import ModelLoadError
from tests.gguf_deepseek_helpers import KINDS, converter_paths, tiny_files

QUANT = "Q8_0"
# config.json fields that are no part of the model (or that the GGUF file does not carry)
_NOT_MODEL_FIELDS = {
    "transformers_version", "dtype", "initializer_range", "attention_dropout", "use_cache",
    "output_router_logits", "pretraining_tp", "mlp_bias", "pad_token_id", "eos_token_id",
}  # fmt: skip

needs_converter = pytest.mark.skipif(
    converter_paths() is None,
    reason="llama.cpp's convert_hf_to_gguf.py and llama-quantize are not built "
    "(../shared/tools/build_llamacpp.sh builds them)",
)


@pytest.fixture(scope="module", params=KINDS)
def files(request):
    if converter_paths() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py and llama-quantize are not built")
    return request.param, tiny_files(request.param, quant=QUANT)


def _folder_weights(folder):
    return safe_open(str(folder / "model.safetensors"), "pt")


def _folder_tensor(f, name: str, experts: int | None) -> torch.Tensor:
    """The folder's tensor `name`; a stacked expert name from the per-expert tensors."""
    prefix, sep, proj = name.partition(".mlp.experts.")
    if sep and name not in f.keys():
        return torch.stack(
            [f.get_tensor(f"{prefix}.mlp.experts.{e}.{proj}") for e in range(experts)]
        )
    return f.get_tensor(name)


@needs_converter
@pytest.mark.parametrize("type_name", ["F32", QUANT])
def test_config_equals_the_hf_folders(files, type_name):
    kind, paths = files
    hf = json.loads((paths["hf"] / "config.json").read_text())
    config = GGUFSource(str(paths[type_name]), use_cache=False).hf_config.to_dict()
    fields = {k: v for k, v in hf.items() if k not in _NOT_MODEL_FIELDS}
    assert {k: config.get(k, "missing") for k in fields} == fields
    eos = config["eos_token_id"]
    assert (eos[0] if isinstance(eos, list) else eos) == hf["eos_token_id"]


@needs_converter
@pytest.mark.parametrize("type_name", ["F32", QUANT])
def test_every_tensor_maps_to_the_folders(files, type_name):
    """Each GGUF tensor is a parameter of the folder, equal to it (bit for bit from F32 files,
    kv_b_proj included), or a part of GLM's MTP layer, which is skipped."""
    kind, paths = files
    source = GGUFSource(str(paths[type_name]), use_cache=False)
    config = source.hf_config
    gguf_names = list(GGUFFile(str(paths[type_name])).tensors)
    skipped = [n for n in gguf_names if source._hf_name(n) is None]
    assert not [
        n
        for n in skipped
        if not (n.endswith(".attn_v_b.weight") or n.startswith(f"blk.{config.num_hidden_layers}."))
    ]
    if kind == "glm4_moe":  # the MTP layer and its nextn tensors
        assert any(".nextn." in n for n in skipped)
    with _folder_weights(paths["hf"]) as f:
        mtp = f"model.layers.{config.num_hidden_layers}."  # GLM's, in the folder
        folder_names = {
            re.sub(r"\.mlp\.experts\.\d+\.", ".mlp.experts.", n)  # stacked in GGUF
            for n in f.keys()
            if not n.startswith(mtp)
        }
        names = source.weight_names()
        assert sorted(names) == sorted(folder_names)
        assert any(n.endswith("kv_b_proj.weight") for n in names) == (kind != "glm4_moe")
        for name, tensor in source.iter_weights():
            want = _folder_tensor(f, name, config.n_routed_experts)
            assert tensor.shape == want.shape, name
            if type_name == "F32":
                assert torch.equal(tensor, want), name
            else:  # Q8_0: 8-bit blocks of 32
                err = (tensor.float() - want).abs().max() / want.abs().max()
                assert err < 0.01, (name, err)


@needs_converter
def test_greedy_tokens_equal_the_hf_folders(files, tmp_path, monkeypatch):
    kind, paths = files
    monkeypatch.setenv("HYBRIDLLM_CACHE_DIR", str(tmp_path / "cache"))
    prompt = {"prompt_token_ids": [5, 17, 42, 99, 7, 63, 12, 1000, 31000]}
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=3
    )
    results = {}
    # the Q8_0 file runs on its blocks (kv_b_proj dequantized); DeepSeek-V2's 27 layers are slow
    labels = ("F32", "hf") if kind == "deepseek_v2" else ("F32", "hf", QUANT)
    for label in labels:
        llm = LLM(str(paths[label]), dtype="float32", use_tqdm=False, max_model_len=64)
        try:
            results[label] = llm.generate(prompt, params)[0]
        finally:
            llm.shutdown()
    gguf, folder = results["F32"], results["hf"]
    assert gguf.outputs[0].token_ids == folder.outputs[0].token_ids
    pairs = list(zip(gguf.outputs[0].logprobs, folder.outputs[0].logprobs))
    pairs += list(zip(gguf.prompt_logprobs[1:], folder.prompt_logprobs[1:]))
    for a, b in pairs:
        assert a.keys() == b.keys()
        for tid in a:
            assert abs(a[tid].logprob - b[tid].logprob) < 1e-4
    if QUANT in results:  # each prompt token's logprob near the folder's
        quant = results[QUANT]
        for tid, a, b in zip(
            prompt["prompt_token_ids"][1:], quant.prompt_logprobs[1:], folder.prompt_logprobs[1:]
        ):
            assert abs(a[tid].logprob - b[tid].logprob) < 0.3


# ---- mapping units (no converter needed) --------------------------------------------------------


def test_kv_b_from_parts_inverts_the_converters_split():
    heads, nope, v, rank = 3, 5, 4, 7
    kv_b = torch.randn(heads * (nope + v), rank)
    # convert_hf_to_gguf.py's DeepseekV2Model.modify_tensors
    k_b, v_b = torch.split(kv_b.view(heads, nope + v, rank), [nope, v], dim=1)
    assert torch.equal(kv_b_from_parts(k_b.transpose(1, 2), v_b), kv_b)
    with pytest.raises(ModelLoadError, match="attn_k_b"):
        kv_b_from_parts(k_b, v_b)  # not transposed: [heads, nope, rank]


def test_deepseek2_variants_and_refusals():
    base = {"general.architecture": "deepseek2"}
    assert gguf_arch(base, "f").hf_architecture == "DeepseekV2ForCausalLM"
    sigmoid = {**base, "deepseek2.expert_gating_func": 2}
    assert gguf_arch(sigmoid, "f").hf_architecture == "DeepseekV3ForCausalLM"
    glm = {**sigmoid, "tokenizer.ggml.pre": "glm4"}
    assert gguf_arch(glm, "f").hf_architecture == "Glm4MoeLiteForCausalLM"
    # GLM-4.7-Flash's files name no gating function (llama.cpp knows it by its shape)
    assert gguf_arch({**base, "tokenizer.ggml.pre": "glm4"}, "f").model_type == "glm4_moe_lite"
    flash = {**base, "deepseek2.block_count": 48, "deepseek2.nextn_predict_layers": 1}
    assert gguf_arch({**flash, "deepseek2.vocab_size": 154880}, "f").model_type == "glm4_moe_lite"
    assert gguf_arch({**flash, "deepseek2.vocab_size": 1000}, "f").model_type == "deepseek_v2"
    with pytest.raises(ModelLoadError, match="expert_gating_func 3"):
        gguf_arch({**base, "deepseek2.expert_gating_func": 3}, "f")
    assert GGUF_ARCHS["glm4moe"].hf_architecture == "Glm4MoeForCausalLM"
    with pytest.raises(ModelLoadError, match="blk.0.attn_kv_a_something"):
        hf_tensor_name("blk.0.attn_kv_a_something.weight", "f")
    v3 = GGUF_ARCHS["deepseek2"]
    assert hf_tensor_name("blk.1.ffn_up_shexp.weight", "f", v3) == (
        "model.layers.1.mlp.shared_experts.up_proj.weight"
    )
    assert hf_tensor_name("blk.1.ffn_up_shexp.weight", "f", GGUF_ARCHS["qwen2moe"]) == (
        "model.layers.1.mlp.shared_expert.up_proj.weight"
    )
    assert hf_tensor_name("blk.1.exp_probs_b.bias", "f", v3) == (
        "model.layers.1.mlp.gate.e_score_correction_bias"
    )
    assert hf_tensor_name("blk.3.nextn.eh_proj.weight", "f", v3) is None
    assert hf_tensor_name("blk.3.attn_q_a.weight", "f", v3, num_layers=3) is None
    assert hf_tensor_name("blk.2.attn_v_b.weight", "f", v3, num_layers=3) is None


def test_glm4_moe_lite_config_from_metadata():
    """A GLM-4.7-Flash-like deepseek2 file (GLM tokenizer, no gating function: a sigmoid
    router, an MTP layer)."""
    p = "deepseek2."
    metadata = {
        "general.architecture": "deepseek2", "tokenizer.ggml.pre": "glm4",
        p + "block_count": 4, p + "nextn_predict_layers": 1,
        p + "attention.head_count": 4, p + "attention.head_count_kv": 1,
        p + "embedding_length": 64, p + "feed_forward_length": 96, p + "vocab_size": 100,
        p + "expert_count": 8, p + "expert_used_count": 2, p + "expert_shared_count": 1,
        p + "expert_feed_forward_length": 32, p + "leading_dense_block_count": 1,
        p + "attention.q_lora_rank": 48, p + "attention.kv_lora_rank": 32,
        p + "attention.key_length": 40, p + "attention.value_length": 32,
        p + "attention.key_length_mla": 24, p + "attention.value_length_mla": 20,
        p + "rope.dimension_count": 8, p + "expert_weights_scale": 1.8,
        p + "expert_weights_norm": True,
    }  # fmt: skip
    arch, kwargs = hf_config_kwargs(metadata, {"output.weight"}, "f")
    assert (arch.model_type, kwargs["architectures"]) == (
        "glm4_moe_lite",
        ["Glm4MoeLiteForCausalLM"],
    )
    assert kwargs["num_hidden_layers"] == 3 and kwargs["num_nextn_predict_layers"] == 1
    assert kwargs["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    assert (kwargs["qk_nope_head_dim"], kwargs["qk_rope_head_dim"], kwargs["v_head_dim"]) == (
        16,
        8,
        20,
    )
    assert kwargs["num_key_value_heads"] == 4 and kwargs["routed_scaling_factor"] == 1.8
    assert (kwargs["n_group"], kwargs["topk_group"], kwargs["scoring_func"]) == (1, 1, "sigmoid")


def test_deepseek2_config_of_older_files():
    """Older deepseek2 files: one attn_kv_b, key/value lengths the model's own (no *_mla)."""
    p = "deepseek2."
    metadata = {
        "general.architecture": "deepseek2", p + "block_count": 27,
        p + "attention.head_count": 4, p + "attention.head_count_kv": 4,
        p + "embedding_length": 64, p + "feed_forward_length": 96, p + "vocab_size": 100,
        p + "expert_count": 8, p + "expert_used_count": 2, p + "expert_shared_count": 2,
        p + "expert_feed_forward_length": 32, p + "leading_dense_block_count": 1,
        p + "attention.kv_lora_rank": 32, p + "attention.key_length": 24,
        p + "attention.value_length": 20, p + "rope.dimension_count": 8,
        p + "expert_group_count": 4, p + "expert_group_used_count": 2,
    }  # fmt: skip
    arch, kwargs = hf_config_kwargs(metadata, set(), "f")
    assert arch.model_type == "deepseek_v2" and kwargs["q_lora_rank"] is None
    assert (kwargs["qk_nope_head_dim"], kwargs["v_head_dim"], kwargs["topk_method"]) == (
        16,
        20,
        "group_limited_greedy",
    )
    assert kwargs["scoring_func"] == "softmax" and kwargs["tie_word_embeddings"]
    assert hf_tensor_name("blk.0.attn_kv_b.weight", "f", arch) == (
        "model.layers.0.self_attn.kv_b_proj.weight"
    )
