"""GGUF metadata and tensor names mapped to their Hugging Face equivalents (Llama/Qwen families,
MoEs, DeepSeek-V2/V3 and GLM-4.5 / GLM-4.7-Flash; Gemma 2/3, gpt-oss and MiniMax-M2 in
gguf_mapping_variants; Qwen3-Next and Qwen3.5-MoE in gguf_mapping_linear)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridllm.loader.gguf_mapping_linear import (
    LINEAR_BLOCK_NAMES,
    UNSHIFTED_NORMS,
    is_linear,
    linear_kwargs,
)
from hybridllm.loader.gguf_mapping_variants import VARIANT_BLOCK_NAMES, is_variant, variant_kwargs
from hybridllm.loader.model_source import ModelLoadError


@dataclass(frozen=True)
class GGUFArch:
    """How one llama.cpp architecture maps onto a transformers model class."""

    model_type: str  # transformers config model_type
    hf_architecture: str  # config.architectures[0]
    rope_permuted: bool  # llama.cpp's converter interleaved q/k rows for its rope layout
    norm_shift: float = 0.0  # what the converter added to every norm weight (Gemma's 1 + w)
    unshifted_norms: tuple[str, ...] = ()  # HF name suffixes of norms it did not add it to


GGUF_ARCHS = {
    "llama": GGUFArch("llama", "LlamaForCausalLM", rope_permuted=True),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM", rope_permuted=False),
    "qwen3": GGUFArch("qwen3", "Qwen3ForCausalLM", rope_permuted=False),
    "qwen2moe": GGUFArch("qwen2_moe", "Qwen2MoeForCausalLM", rope_permuted=False),
    "qwen3moe": GGUFArch("qwen3_moe", "Qwen3MoeForCausalLM", rope_permuted=False),
    "olmoe": GGUFArch("olmoe", "OlmoeForCausalLM", rope_permuted=False),
    # DeepSeek-V2 (softmax router); a sigmoid router's file is DeepSeek-V3 or GLM-4.7-Flash,
    # see gguf_arch. Neither llama.cpp's converter nor HF permutes their rows: both rotate the
    # rope part of q and kv_a as interleaved pairs (HF's rope_interleave), GLM-4.5 rotate-half.
    "deepseek2": GGUFArch("deepseek_v2", "DeepseekV2ForCausalLM", rope_permuted=False),
    "glm4moe": GGUFArch("glm4_moe", "Glm4MoeForCausalLM", rope_permuted=False),
    "gemma2": GGUFArch("gemma2", "Gemma2ForCausalLM", rope_permuted=False, norm_shift=1.0),
    "gemma3": GGUFArch("gemma3_text", "Gemma3ForCausalLM", rope_permuted=False, norm_shift=1.0),
    "gpt-oss": GGUFArch("gpt_oss", "GptOssForCausalLM", rope_permuted=False),
    "minimax-m2": GGUFArch("minimax_m2", "MiniMaxM2ForCausalLM", rope_permuted=False),
    # hybrids of Gated DeltaNet and full attention (gguf_mapping_linear); 1 + w norms but the
    # DeltaNet's gated one
    "qwen3next": GGUFArch(
        "qwen3_next", "Qwen3NextForCausalLM", False, norm_shift=1.0, unshifted_norms=UNSHIFTED_NORMS
    ),
    "qwen35moe": GGUFArch(
        "qwen3_5_moe_text",
        "Qwen3_5MoeForCausalLM",
        False,
        norm_shift=1.0,
        unshifted_norms=UNSHIFTED_NORMS,
    ),
}
# llama.cpp writes Mixtral as a `llama` file with experts (`llama.expert_count` > 0)
MIXTRAL_ARCH = GGUFArch("mixtral", "MixtralForCausalLM", rope_permuted=True)
DEEPSEEK_V3_ARCH = GGUFArch("deepseek_v3", "DeepseekV3ForCausalLM", rope_permuted=False)
GLM4_MOE_LITE_ARCH = GGUFArch("glm4_moe_lite", "Glm4MoeLiteForCausalLM", rope_permuted=False)
# The MLA architectures (llama.cpp's `deepseek2` files)
_MLA_TYPES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
# llama.cpp's expert_gating_func values (LLAMA_EXPERT_GATING_FUNC_TYPE_*) -> HF scoring_func
_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}
# Whether the top-k expert weights are renormalised when the file does not say
# (`{arch}.expert_weights_norm`): what llama.cpp does for each architecture.
_NORM_TOPK_DEFAULT = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False}

# Tensors outside the transformer blocks.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors inside block N: `blk.N.<gguf>` -> `model.layers.N.<hf>`.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # GLM-4.5's (llama.cpp's ATTN_POST_NORM)
    # multi-head latent attention (DeepSeek-V2/V3): q straight (`attn_q`) or through a low-rank
    # q_a / q_a_norm / q_b; the compressed kv and its rope key; `attn_kv_b` in older files,
    # `attn_k_b` + `attn_v_b` (KV_B_PARTS) in newer ones
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.kv_b_proj",
    # mixture of experts: the router, every expert's projection stacked [E, rows, cols], and
    # Qwen2-MoE's shared expert with its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    # DeepSeek-V3 / GLM-4.5's router correction bias (`blk.N.exp_probs_b.bias`, see
    # _BLOCK_FULL_NAMES) and shared experts (plural: `shared_experts`, not Qwen's
    # `shared_expert`, see _SHARED_EXPERTS)
}
# Block tensors whose whole HF name differs from the `<gguf>.<weight|bias>` pattern.
_BLOCK_FULL_NAMES = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
# The DeepSeek-style MoE architectures' shared experts.
_SHARED_EXPERTS = {
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_DEEPSEEK_STYLE = (*_MLA_TYPES, "glm4_moe")
# `blk.N.attn_k_b` and `blk.N.attn_v_b`: llama.cpp's converter splits HF's kv_b_proj
# [heads * (qk_nope + v_head), kv_lora] per head into the key rows, stored transposed
# ([heads, kv_lora, qk_nope]), and the value rows ([heads, v_head, kv_lora]). attn_k_b names
# the reassembled kv_b_proj (kv_b_from_parts); attn_v_b is read with it.
KV_B_PARTS = ("attn_k_b", "attn_v_b")
# Present in some files but not model parameters (llama 3.1 stores its rope factors as a tensor).
ROPE_FREQS_TENSOR = "rope_freqs.weight"  # per-frequency divisors (Llama 3.1+ rope scaling)
_IGNORED_TENSORS = {ROPE_FREQS_TENSOR}  # read into the config, not a weight
# `blk.N.<kind>.<weight|bias>`, or `blk.N.<kind>` (qwen3next's ssm_a)
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)(?:\.(weight|bias))?$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")
_NEXTN_RE = re.compile(r"^blk\.\d+\.nextn\.")


def gguf_arch(metadata: dict[str, Any], path: str) -> GGUFArch:
    name = metadata.get("general.architecture")
    arch = GGUF_ARCHS.get(name)  # type: ignore[arg-type]
    if arch is None:
        raise ModelLoadError(
            f"{path}: GGUF architecture {name!r} is not supported (supported: {', '.join(GGUF_ARCHS)})"
        )
    if name == "llama" and metadata.get("llama.expert_count"):
        return MIXTRAL_ARCH
    if name == "deepseek2":
        return _deepseek2_arch(metadata, path)
    return arch


def _deepseek2_arch(metadata: dict[str, Any], path: str) -> GGUFArch:
    """Which model a `deepseek2` file holds. DeepSeek-V2's router is a softmax (what llama.cpp
    assumes when the file names no gating function), DeepSeek-V3's and GLM-4.7-Flash's a
    sigmoid with a correction bias. GLM's files carry GLM's tokenizer (pre-tokenizer `glm4`);
    the converter writes no gating function for GLM-4.7-Flash, which llama.cpp recognises by
    its 47 layers and 154,880 tokens."""
    gating = metadata.get("deepseek2.expert_gating_func")
    if gating is not None and gating not in _GATING_FUNCS:
        raise ModelLoadError(
            f"{path}: deepseek2 expert_gating_func {gating} is not supported "
            f"(supported: {', '.join(f'{k} ({v})' for k, v in _GATING_FUNCS.items())})"
        )
    layers = (metadata.get("deepseek2.block_count") or 0) - (
        metadata.get("deepseek2.nextn_predict_layers") or 0
    )
    vocab = metadata.get("deepseek2.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
    glm = metadata.get("tokenizer.ggml.pre") == "glm4" or (layers == 47 and vocab == 154880)
    if glm and gating in (None, 2):
        return GLM4_MOE_LITE_ARCH
    if gating == 2:
        return DEEPSEEK_V3_ARCH
    return GGUF_ARCHS["deepseek2"]


def hf_tensor_name(
    gguf_name: str, path: str, arch: GGUFArch | None = None, num_layers: int | None = None
) -> str | None:
    """The HF parameter name of a GGUF tensor; None for tensors that are not parameters.

    `arch` picks the architecture's own names where they differ (DeepSeek's and GLM's
    `shared_experts`, gguf_mapping_variants' VARIANT_BLOCK_NAMES); with `num_layers` (the
    model's decoder layers), blocks after them are skipped (None): llama.cpp's converter
    writes the multi-token-prediction layers of GLM-4.5 and GLM-4.7-Flash as `blk.N.*` and
    `blk.N.nextn.*` with N >= num_layers, which no HF causal LM loads (`nextn.*` is skipped in
    any block). `blk.N.attn_v_b` is None too: it is read with `blk.N.attn_k_b` into kv_b_proj
    (kv_b_from_parts).
    """
    if gguf_name in _IGNORED_TENSORS or _NEXTN_RE.match(gguf_name):
        return None
    m = _BLOCK_RE.match(gguf_name)
    if m:
        block, kind, suffix = m.groups()
        if (num_layers is not None and int(block) >= num_layers) or kind == KV_B_PARTS[1]:
            return None
        names = {**VARIANT_BLOCK_NAMES, **LINEAR_BLOCK_NAMES}
        variant = names.get(arch.model_type, {}) if arch is not None else {}
        key = kind if suffix is None else f"{kind}.{suffix}"
        if key in variant:
            return f"model.layers.{block}.{variant[key]}"
        if suffix is None:
            raise ModelLoadError(
                f"{path}: GGUF tensor {gguf_name!r} has no Hugging Face equivalent"
            )
        if kind in _SHARED_EXPERTS and arch is not None and arch.model_type in _DEEPSEEK_STYLE:
            return f"model.layers.{block}.{_SHARED_EXPERTS[kind]}.{suffix}"
        if kind in _BLOCK_NAMES:
            return f"model.layers.{block}.{_BLOCK_NAMES[kind]}.{suffix}"
        if f"{kind}.{suffix}" in _BLOCK_FULL_NAMES:
            return f"model.layers.{block}.{_BLOCK_FULL_NAMES[f'{kind}.{suffix}']}"
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(f"{path}: GGUF tensor {gguf_name!r} has no Hugging Face equivalent")


# llama.cpp's names of an MTP layer's own tensors (`blk.N.nextn.<kind>.weight`), as HF's
_NEXTN_NAMES = {
    "eh_proj": "eh_proj",
    "enorm": "enorm",
    "hnorm": "hnorm",
    "shared_head_norm": "shared_head.norm",
    "shared_head_head": "shared_head.head",
    "embed_tokens": "embed_tokens",
}
_NEXTN_TENSOR_RE = re.compile(r"^blk\.(\d+)\.nextn\.(\w+)\.weight$")


def mtp_tensor_name(
    gguf_name: str, path: str, arch: GGUFArch | None, num_layers: int
) -> str | None:
    """The HF name of a tensor of the MTP layers llama.cpp's converter keeps after the decoder
    layers (GLM-4.5's: `blk.N.*` with N >= num_layers, and `blk.N.nextn.*`); None for every
    other tensor."""
    m = _NEXTN_TENSOR_RE.match(gguf_name)
    if m:
        block, kind = m.groups()
        if kind not in _NEXTN_NAMES:
            raise ModelLoadError(
                f"{path}: GGUF tensor {gguf_name!r} has no Hugging Face equivalent"
            )
        return f"model.layers.{block}.{_NEXTN_NAMES[kind]}.weight"
    m = _BLOCK_RE.match(gguf_name)
    if m is None or int(m.group(1)) < num_layers:
        return None
    return hf_tensor_name(gguf_name, path, arch)


def kv_b_from_parts(k_b: torch.Tensor, v_b: torch.Tensor, path: str = "") -> torch.Tensor:
    """HF's kv_b_proj.weight [heads * (qk_nope + v_head), kv_lora] from llama.cpp's `attn_k_b`
    [heads, kv_lora, qk_nope] (each head's key rows, transposed) and `attn_v_b`
    [heads, v_head, kv_lora]: per head its qk_nope key rows, then its v_head value rows."""
    shapes_fit = k_b.dim() == v_b.dim() == 3 and k_b.shape[0] == v_b.shape[0]
    if not shapes_fit or k_b.shape[1] != v_b.shape[2]:
        raise ModelLoadError(
            f"{path}: attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} are not "
            "[heads, kv_lora, qk_nope] and [heads, v_head, kv_lora]"
        )
    kv_b = torch.cat([k_b.transpose(1, 2), v_b.to(k_b.dtype)], dim=1)
    return kv_b.reshape(-1, k_b.shape[1]).contiguous()


def kv_b_shape(k_b_shape: tuple[int, ...], v_b_shape: tuple[int, ...]) -> tuple[int, int]:
    """The shape of kv_b_from_parts' result for parts of these shapes."""
    heads, kv_lora, qk_nope = k_b_shape
    return heads * (qk_nope + v_b_shape[1]), kv_lora


def rope_row_order(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order that inverts llama.cpp's q/k permutation: `hf_rows = gguf_rows[order]`.

    llama.cpp's converter turns each head's rows [first half, second half] (the rotate-half
    pairs of HF's rope) into interleaved pairs (a0, b0, a1, b1, ...) for its own rope kernel.
    Permuting whole rows commutes with dequantization (blocks run along a row), so this can be
    applied to the raw quantized rows, the cheapest place.
    """
    half = num_rows // num_heads // 2
    # gguf row (h, j, i) -> hf row (h, i, j), i in {0, 1}, j in [0, head_dim / 2)
    return np.arange(num_rows).reshape(num_heads, half, 2).transpose(0, 2, 1).reshape(-1)


def hf_config_kwargs(
    metadata: dict[str, Any], tensor_names: set[str], path: str
) -> tuple[GGUFArch, dict[str, Any]]:
    """The HF config.json fields (transformers' names) that this file's metadata gives."""
    arch = gguf_arch(metadata, path)
    prefix = metadata["general.architecture"]

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = metadata.get(f"{prefix}.{key}", default)
        if required and value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {prefix}.{key}")
        return value

    num_heads = get("attention.head_count", required=True)
    hidden_size = get("embedding_length", required=True)
    vocab_size = get("vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
    if not vocab_size:
        raise ModelLoadError(f"{path}: GGUF metadata gives no vocab size")
    if arch.model_type in _DEEPSEEK_STYLE:
        return arch, _deepseek_style_kwargs(arch, get, tensor_names, metadata, vocab_size, path)
    kwargs: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": get("feed_forward_length", required=True),
        "num_hidden_layers": get("block_count", required=True),
        "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv", num_heads),
        "head_dim": get("attention.key_length", hidden_size // num_heads),
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        **generation_config_from_metadata(metadata),
    }
    if is_linear(arch.model_type):
        kwargs = linear_kwargs(arch.model_type, get, tensor_names, kwargs, _rope_parameters, path)
        return arch, kwargs
    if is_variant(arch.model_type):
        kwargs = variant_kwargs(arch.model_type, get, tensor_names, kwargs, _rope_parameters, path)
        return arch, kwargs
    if arch.model_type == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch.model_type in _NORM_TOPK_DEFAULT:
        kwargs.update(_moe_kwargs(arch, get, tensor_names, kwargs))
    rope_scaling = _rope_scaling(get)
    if rope_scaling:
        kwargs["rope_scaling"] = rope_scaling
    return arch, kwargs


def _moe_kwargs(
    arch: GGUFArch, get: Any, tensor_names: set[str], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The expert fields of an MoE architecture's config."""
    experts, top_k = get("expert_count", required=True), get("expert_used_count", required=True)
    width = get("expert_feed_forward_length") or kwargs["intermediate_size"]
    norm = bool(get("expert_weights_norm", _NORM_TOPK_DEFAULT[arch.model_type]))
    if arch.model_type == "mixtral":
        return {"num_local_experts": experts, "num_experts_per_tok": top_k}
    out = {"num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": norm}
    if arch.model_type == "olmoe":
        return {**out, "intermediate_size": width, "clip_qkv": get("attention.clamp_kqv")}
    # Qwen-MoE: a layer without a router is dense (transformers' mlp_only_layers)
    layers = range(kwargs["num_hidden_layers"])
    dense = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    out.update(moe_intermediate_size=width, mlp_only_layers=dense, decoder_sparse_step=1)
    if arch.model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length") or 0
        out["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names
    return out


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that reads back as it (1e-05, not
    9.999999747378752e-06): what the HF config had before the converter stored it."""
    return float(str(np.float32(value)))


def _deepseek_style_kwargs(
    arch: GGUFArch,
    get: Any,
    tensor_names: set[str],
    metadata: dict[str, Any],
    vocab_size: int,
    path: str,
) -> dict[str, Any]:
    """The config of a `deepseek2` (DeepSeek-V2/V3, GLM-4.7-Flash) or `glm4moe` (GLM-4.5) file,
    in the fields and form of transformers 5's config.json for the model."""
    num_heads = get("attention.head_count", required=True)
    # the multi-token-prediction layers: counted in block_count, not decoder layers
    nextn = get("nextn_predict_layers", 0) or 0
    num_layers = get("block_count", required=True) - nextn
    dense = get("leading_dense_block_count", 0)
    # the router's function where the file does not say: softmax for DeepSeek-V2 (llama.cpp's
    # default), sigmoid for the architectures picked by their sigmoid (gguf_arch) and GLM's
    sigmoid = arch.model_type in ("deepseek_v3", "glm4_moe_lite", "glm4_moe")
    gating = _GATING_FUNCS.get(get("expert_gating_func", 2 if sigmoid else 1))
    if gating is None:
        raise ModelLoadError(
            f"{path}: {metadata['general.architecture']}.expert_gating_func "
            f"{get('expert_gating_func')} is not supported"
        )
    n_group = get("expert_group_count")
    kwargs: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "vocab_size": vocab_size,
        "hidden_size": get("embedding_length", required=True),
        "intermediate_size": get("feed_forward_length", required=True),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        # experts
        "n_routed_experts": get("expert_count", required=True),
        "num_experts_per_tok": get("expert_used_count", required=True),
        "n_shared_experts": get("expert_shared_count", 0),
        "moe_intermediate_size": get("expert_feed_forward_length", required=True),
        "first_k_dense_replace": dense,
        "routed_scaling_factor": _f32(get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "n_group": n_group,
        "topk_group": get("expert_group_used_count"),
        "scoring_func": gating,
        "rope_parameters": _rope_parameters(get),
        **generation_config_from_metadata(metadata),
    }
    if arch.model_type == "glm4_moe":
        if gating != "sigmoid":
            raise ModelLoadError(f"{path}: a glm4moe file with a {gating} router is not supported")
        head_dim = get("attention.key_length", required=True)
        rotary = get("rope.dimension_count", head_dim)
        kwargs["rope_parameters"]["partial_rotary_factor"] = rotary / head_dim
        return {
            **kwargs,
            "num_key_value_heads": get("attention.head_count_kv", num_heads),
            "head_dim": head_dim,
            "partial_rotary_factor": rotary / head_dim,
            "attention_bias": "blk.0.attn_q.bias" in tensor_names,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in tensor_names,
            "n_group": n_group or 1,
            "topk_group": kwargs["topk_group"] or 1,
            "num_nextn_predict_layers": nextn,
        }
    # MLA. llama.cpp's deepseek2 key/value lengths are those of its MQA form (kv_lora_rank +
    # rope, kv_lora_rank); *_mla are the model's own. Older files (one attn_kv_b) have only the
    # model's own in key_length/value_length.
    rope_dim = get("rope.dimension_count", required=True)
    key_length = get("attention.key_length_mla") or get("attention.key_length", required=True)
    v_head_dim = get("attention.value_length_mla") or get("attention.value_length", required=True)
    kwargs.update(
        # HF's MLA attends with every head's own keys and values
        num_key_value_heads=num_heads,
        q_lora_rank=get("attention.q_lora_rank"),
        kv_lora_rank=get("attention.kv_lora_rank", required=True),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=key_length - rope_dim,
        qk_head_dim=key_length,
        v_head_dim=v_head_dim,
        head_dim=rope_dim,
        rope_interleave=True,
        attention_bias=False,
    )
    if arch.model_type == "deepseek_v2":
        # softmax router; groups limit the choice when there are several (V2, not V2-Lite)
        grouped = n_group is not None and n_group > 1
        kwargs["topk_method"] = "group_limited_greedy" if grouped else "greedy"
        return kwargs
    kwargs.update(
        topk_method="noaux_tc",
        n_group=n_group or 1,
        topk_group=kwargs["topk_group"] or 1,
        num_nextn_predict_layers=nextn,
    )
    if arch.model_type == "glm4_moe_lite":
        kwargs["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (num_layers - dense)
    return kwargs


def _rope_parameters(get: Any) -> dict[str, Any]:
    """transformers 5's rope_parameters (rope_theta and any scaling).

    DeepSeek's yarn: llama.cpp's converter keeps factor, original context and beta_fast/slow,
    and of mscale / mscale_all_dim only 0.1 * mscale_all_dim (as yarn_log_multiplier).
    DeepSeek's configs have mscale == mscale_all_dim (0.707 in V2, 1.0 in V3), so that HF's
    yarn attention factor, mscale(mscale) / mscale(mscale_all_dim), is 1, which is what
    llama.cpp computes; mscale is taken to equal mscale_all_dim.
    """
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": get("rope.freq_base", 10000.0)}
    scaling = _rope_scaling(get)
    if scaling is None:
        return params
    params.update(scaling)
    if scaling["rope_type"] != "yarn":
        return params
    for key, hf_key in (
        ("rope.scaling.yarn_beta_fast", "beta_fast"),
        ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ("rope.scaling.yarn_ext_factor", "extrapolation_factor"),
        ("rope.scaling.yarn_attn_factor", "attention_factor"),
    ):
        if get(key) is not None:
            params[hf_key] = _f32(get(key))
    log_mul = get("rope.scaling.yarn_log_multiplier")
    if log_mul is not None:
        mscale_all_dim = round(float(log_mul) / 0.1, 6)
        params.update(mscale=mscale_all_dim, mscale_all_dim=mscale_all_dim)
    return params


def _rope_scaling(get: Any) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(get("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = get("rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise ModelLoadError(f"GGUF rope scaling type {kind!r} is not supported")


def generation_config_from_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """bos/eos/pad token ids from the tokenizer metadata; end-of-turn ids join the eos list."""
    out: dict[str, Any] = {}
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{gguf_key}" in metadata:
            out[key] = int(metadata[f"tokenizer.ggml.{gguf_key}"])
    eos_ids: list[int] = []
    for gguf_key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = metadata.get(f"tokenizer.ggml.{gguf_key}")
        if token_id is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))
    if eos_ids:
        out["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return out
