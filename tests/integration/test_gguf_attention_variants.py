"""GGUF files of llama.cpp's `gemma2`, `gemma3`, `gpt-oss` and `minimax-m2` architectures, written
by llama.cpp's own convert_hf_to_gguf.py and llama-quantize from tiny random transformers models
(tests/gguf_variant_helpers.py), read as the HF folder they came from: the same config fields,
the same tensors (Gemma's 1 + w norms undone, gpt-oss's separate gate/up stacks and biases), the
same greedy tokens through the engine as transformers', and a quantized file of each (Q8_0;
gpt-oss's experts MXFP4) close to them; Gemma's sentencepiece vocabulary tokenizes as the folder's.

Skips where llama.cpp's converter and tools are not built (see tests/llamacpp_helpers.py); the
files are made once (about a minute) and reused.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors import safe_open

from hybridllm import LLM, SamplingParams
from hybridllm.loader.gguf_file import GGUFFile
from hybridllm.loader.gguf_mapping import GGUF_ARCHS, hf_config_kwargs, hf_tensor_name
from hybridllm.loader.gguf_mapping_variants import layer_types
from hybridllm.loader.gguf_source import GGUFSource
from hybridllm.loader.model_source import ModelLoadError
from tests.gguf_variant_helpers import KINDS, QUANTS, converter_paths, tiny_files
from tests.integration.test_attention_variant_models import (
    ENGINE_KWARGS,
    MAX_TOKENS,
    PARAMS,
    make_prompts,
)
from tests.moe_helpers import hf_greedy

# config.json fields that are no part of the model (or that the GGUF file does not carry)
_NOT_MODEL_FIELDS = {
    "transformers_version", "dtype", "initializer_range", "attention_dropout", "use_cache",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "pad_token_id",
    "use_bidirectional_attention", "_sliding_window_pattern",
}  # fmt: skip

needs_converter = pytest.mark.skipif(
    converter_paths() is None,
    reason="llama.cpp's convert_hf_to_gguf.py and llama-quantize are not built "
    "(../shared/tools/build_llamacpp.sh builds them)",
)


@pytest.fixture(scope="module", params=KINDS)
def files(request):
    """(kind, {"hf", "F32", quant: path}, the folder's transformers model, its greedy tokens)."""
    if converter_paths() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py and llama-quantize are not built")
    kind = request.param
    paths = tiny_files(kind)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        paths["hf"], attn_implementation="eager", dtype=torch.float32
    ).eval()
    return kind, paths, hf, [hf_greedy(hf, p, MAX_TOKENS) for p in make_prompts()]


def _generate(path, params: SamplingParams = PARAMS, **kwargs):
    llm = LLM(str(path), **{**ENGINE_KWARGS, **kwargs})
    try:
        return llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params)
    finally:
        llm.shutdown()


@needs_converter
def test_config_equals_the_hf_folders(files):
    kind, paths, _, _ = files
    hf = json.loads((paths["hf"] / "config.json").read_text())
    fields = {k: v for k, v in hf.items() if k not in _NOT_MODEL_FIELDS}
    for label in ("F32", QUANTS[kind]):
        config = GGUFSource(str(paths[label]), use_cache=False).hf_config.to_dict()
        assert {k: config.get(k, "missing") for k in fields} == fields, label


def _folder_tensor(kind: str, f, name: str) -> torch.Tensor:
    """The folder's tensor that the GGUF file's `name` holds, in the file's layout."""
    prefix, _, rest = name.partition(".mlp.")
    if kind == "gpt_oss" and rest.startswith("experts."):
        gate_up = f.get_tensor(f"{prefix}.mlp.experts.gate_up_proj").transpose(1, 2)  # [E, 2I, H]
        bias = f.get_tensor(f"{prefix}.mlp.experts.gate_up_proj_bias")  # [E, 2I]
        return {
            "experts.gate_proj.weight": gate_up[:, 0::2],
            "experts.up_proj.weight": gate_up[:, 1::2],
            "experts.gate_proj_bias": bias[:, 0::2],
            "experts.up_proj_bias": bias[:, 1::2],
            "experts.down_proj_gguf.weight": f.get_tensor(
                f"{prefix}.mlp.experts.down_proj"
            ).transpose(1, 2),
            "experts.down_proj_bias": f.get_tensor(f"{prefix}.mlp.experts.down_proj_bias"),
        }[rest]
    if kind == "minimax_m2" and rest:
        moe = f"{prefix}.block_sparse_moe."
        if rest.startswith("experts."):  # stacked from Mixtral's per-expert w1 (gate), w3, w2
            w = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[rest.split(".")[1]]
            experts = sorted(
                {int(n.split(".")[5]) for n in f.keys() if n.startswith(moe + "experts.")}
            )
            return torch.stack([f.get_tensor(f"{moe}experts.{e}.{w}.weight") for e in experts])
        return f.get_tensor(moe + rest)
    return f.get_tensor(name)


@needs_converter
def test_every_tensor_maps_to_the_folders(files):
    """Each GGUF tensor maps to the folder's: bit for bit from the F32 file (Gemma's norms as
    the model holds them, 1 + w: the converter added the 1, the source takes it off), within
    8-bit (Q8_0) or 4-bit (MXFP4) blocks' error from the quantized one."""
    kind, paths, _, _ = files
    with safe_open(str(paths["hf"] / "model.safetensors"), "pt") as f:
        for label in ("F32", QUANTS[kind]):
            source = GGUFSource(str(paths[label]), use_cache=False)
            assert len(source.weight_names()) == len(GGUFFile(str(paths[label])).tensors)
            for name, tensor in source.iter_weights():
                want = _folder_tensor(kind, f, name)
                assert tensor.shape == want.shape, (label, name)
                if label == "F32" and kind.startswith("gemma") and name.endswith("norm.weight"):
                    assert torch.equal(tensor + 1, want + 1), name  # what the model holds
                elif label == "F32":
                    assert torch.equal(tensor, want), name
                else:
                    err = (tensor.float() - want).abs().max() / want.abs().max()
                    assert err < (0.2 if ".experts." in name else 0.01), (label, name, err)


@needs_converter
def test_greedy_tokens_equal_transformers(files):
    """The F32 file through the engine (chunked prefill, prefix caching, windows of 8 tokens),
    with an fp32 KV cache: "auto" gives a GGUF file's CPU worker an fp16 one (for int8
    activations over blocks, though an F32 file keeps none), which flips near-ties."""
    kind, paths, _, want = files
    outs = _generate(paths["F32"], kv_cache_dtype="float32")
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def _as_hf_state(kind: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors (GGUFSource's names, dequantized) in transformers' state dict:
    stacked expert parts joined (gate_up [E, 2I, H], gpt-oss's interleaved and transposed)."""
    state = {}
    for name, tensor in weights.items():
        prefix, _, rest = name.partition(".mlp.experts.")
        if not rest:
            state[name] = tensor.float()
            continue
        experts = f"{prefix}.mlp.experts."

        def part(n: str, experts: str = experts) -> torch.Tensor:
            return weights[experts + n].float()

        if kind == "gpt_oss":  # gate and up interleaved, [E, H, 2I]; down [E, I, H]
            gate_up = torch.stack([part("gate_proj.weight"), part("up_proj.weight")], 2)
            state[experts + "gate_up_proj"] = gate_up.flatten(1, 2).transpose(1, 2)
            biases = torch.stack([part("gate_proj_bias"), part("up_proj_bias")], 2)
            state[experts + "gate_up_proj_bias"] = biases.flatten(1, 2)
            state[experts + "down_proj"] = part("down_proj_gguf.weight").transpose(1, 2)
            state[experts + "down_proj_bias"] = part("down_proj_bias")
        else:  # MiniMax-M2: gate rows then up rows, [E, 2I, H]; down [E, H, I]
            state[experts + "gate_up_proj"] = torch.cat(
                [part("gate_proj.weight"), part("up_proj.weight")], 1
            )
            state[experts + "down_proj"] = part("down_proj.weight")
    return state


@needs_converter
def test_quantized_file_stays_close(files):
    """The quantized file (Q8_0 linears from their blocks, gpt-oss's MXFP4 experts decoded)
    computes what transformers computes with the file's weights: each prompt token's logprob
    within float error of it with fp32 activations, within 0.3 with the default int8 ones
    (the quantization's own error on these random models reaches 0.8 for MXFP4)."""
    kind, paths, hf, _ = files
    source = GGUFSource(str(paths[QUANTS[kind]]), use_cache=False)
    hf_quant = copy.deepcopy(hf)
    state = _as_hf_state(kind, dict(source.iter_weights()))
    if hf_quant.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf_quant.load_state_dict(state, strict=True)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    for tolerance, kwargs in (
        (1e-3, dict(kv_cache_dtype="float32", gguf_activations="fp32")),
        (0.3, {}),
    ):
        outs = _generate(paths[QUANTS[kind]], params, **kwargs)
        for prompt, out in zip(make_prompts(), outs):
            with torch.inference_mode():
                logits = hf_quant(torch.tensor([prompt])).logits[0].float()
            want = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), prompt[1:]]
            got = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])]
            assert (torch.tensor(got) - want).abs().max() < tolerance, (kind, kwargs)


@needs_converter
def test_gemma_sentencepiece_vocabulary_tokenizes_as_the_folder():
    paths = tiny_files("gemma2")
    ours = GGUFSource(str(paths["F32"]), use_cache=False).load_tokenizer()
    folder = transformers.AutoTokenizer.from_pretrained(paths["hf"])
    for text in ("The quick brown fox jumps", "Hello world! 0123", "  Paged  attention\nkeeps"):
        assert ours.encode(text, add_special_tokens=False) == folder.encode(
            text, add_special_tokens=False
        ), text
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)


# ---- mapping units (no converter needed) --------------------------------------------------------


def test_sliding_layers_follow_llama_cpps_patterns():
    s, f = "sliding_attention", "full_attention"
    assert layer_types("gemma2", None, 4) == [s, f, s, f]
    assert layer_types("gemma3_text", None, 7) == [s] * 5 + [f, s]
    assert layer_types("gemma3_text", 4, 4) == [s, s, s, f]
    assert layer_types("gpt_oss", [True, False, False], 3) == [s, f, f]
    assert layer_types("gemma3_text", 0, 2) == [s, s]


def _metadata(arch: str, **keys):
    p = f"{arch}."
    base = {
        "general.architecture": arch, p + "block_count": 62, p + "embedding_length": 5376,
        p + "feed_forward_length": 21504, p + "attention.head_count": 32,
        p + "attention.head_count_kv": 16, p + "attention.key_length": 128,
        p + "vocab_size": 1000, p + "attention.layer_norm_rms_epsilon": 1e-6,
    }  # fmt: skip
    return {**base, **{p + k: v for k, v in keys.items()}}


def test_gemma3_config_of_a_27b_shaped_file():
    """62 layers: queries scaled by hidden/heads (168), as llama.cpp and gemma-3-27b do; the
    sliding layers' RoPE unscaled at the swa base, the global ones' linear."""
    metadata = _metadata(
        "gemma3", **{"attention.sliding_window": 1024, "rope.freq_base": 1e6,
                     "rope.scaling.type": "linear", "rope.scaling.factor": 8.0},
    )  # fmt: skip
    arch, kwargs = hf_config_kwargs(metadata, set(), "f")
    assert arch.norm_shift == 1.0 and kwargs["architectures"] == ["Gemma3ForCausalLM"]
    assert kwargs["query_pre_attn_scalar"] == 168 and kwargs["tie_word_embeddings"]
    rope = kwargs["rope_parameters"]
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert rope["full_attention"]["rope_type"] == "linear"
    assert kwargs["layer_types"][5] == "full_attention" and kwargs["sliding_window"] == 1024
    # without a window every layer is global (llama.cpp's non-SWA Gemma 3)
    no_window = dict(metadata)
    del no_window["gemma3.attention.sliding_window"]
    _, kwargs = hf_config_kwargs(no_window, set(), "f")
    assert set(kwargs["layer_types"]) == {"full_attention"} and kwargs["sliding_window"] is None


def test_gemma2_config_where_the_file_says_little():
    """llama.cpp's Gemma 2 defaults: windows of 4096 on every other layer, attention capped at
    50 and logits at 30; 46 layers (gemma-2-27b) scale queries by hidden/heads (144)."""
    metadata = _metadata("gemma2", block_count=46, embedding_length=4608)
    arch, kwargs = hf_config_kwargs(metadata, set(), "f")
    assert arch.model_type == "gemma2" and kwargs["query_pre_attn_scalar"] == 144
    assert (kwargs["attn_logit_softcapping"], kwargs["final_logit_softcapping"]) == (50.0, 30.0)
    assert kwargs["sliding_window"] == 4096 and kwargs["layer_types"][:2] == [
        "sliding_attention",
        "full_attention",
    ]
    with pytest.raises(ModelLoadError, match="sliding-layer RoPE base"):
        hf_config_kwargs({**metadata, "gemma2.rope.freq_base_swa": 5.0}, set(), "f")


def test_variant_tensor_names_and_refusals():
    oss, gemma = GGUF_ARCHS["gpt-oss"], GGUF_ARCHS["gemma2"]
    assert hf_tensor_name("blk.2.attn_sinks.weight", "f", oss) == "model.layers.2.self_attn.sinks"
    assert hf_tensor_name("blk.0.ffn_up_exps.bias", "f", oss) == (
        "model.layers.0.mlp.experts.up_proj_bias"
    )
    assert hf_tensor_name("blk.0.ffn_up_exps.weight", "f", oss) == (
        "model.layers.0.mlp.experts.up_proj.weight"
    )
    assert hf_tensor_name("blk.1.ffn_norm.weight", "f", gemma) == (
        "model.layers.1.pre_feedforward_layernorm.weight"
    )
    assert hf_tensor_name("blk.1.ffn_norm.weight", "f", GGUF_ARCHS["llama"]) == (
        "model.layers.1.post_attention_layernorm.weight"
    )
    softmax = _metadata("minimax-m2", expert_count=4, expert_used_count=2, expert_gating_func=1)
    with pytest.raises(ModelLoadError, match="expert_gating_func 1"):
        hf_config_kwargs(softmax, set(), "f")
    with pytest.raises(ModelLoadError, match="sliding_window"):
        hf_config_kwargs(_metadata("gpt-oss", expert_count=4, expert_used_count=2), set(), "f")
