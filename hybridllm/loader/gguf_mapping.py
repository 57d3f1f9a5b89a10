"""GGUF metadata and tensor names mapped to their Hugging Face equivalents (Llama/Qwen families, MoEs)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridllm.loader.model_source import ModelLoadError


@dataclass(frozen=True)
class GGUFArch:
    """How one llama.cpp architecture maps onto a transformers model class."""

    model_type: str  # transformers config model_type
    hf_architecture: str  # config.architectures[0]
    rope_permuted: bool  # llama.cpp's converter interleaved q/k rows for its rope layout


GGUF_ARCHS = {
    "llama": GGUFArch("llama", "LlamaForCausalLM", rope_permuted=True),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM", rope_permuted=False),
    "qwen3": GGUFArch("qwen3", "Qwen3ForCausalLM", rope_permuted=False),
    "qwen2moe": GGUFArch("qwen2_moe", "Qwen2MoeForCausalLM", rope_permuted=False),
    "qwen3moe": GGUFArch("qwen3_moe", "Qwen3MoeForCausalLM", rope_permuted=False),
    "olmoe": GGUFArch("olmoe", "OlmoeForCausalLM", rope_permuted=False),
}
# llama.cpp writes Mixtral as a `llama` file with experts (`llama.expert_count` > 0)
MIXTRAL_ARCH = GGUFArch("mixtral", "MixtralForCausalLM", rope_permuted=True)
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
}
# Present in some files but not model parameters (llama 3.1 stores its rope factors as a tensor).
ROPE_FREQS_TENSOR = "rope_freqs.weight"  # per-frequency divisors (Llama 3.1+ rope scaling)
_IGNORED_TENSORS = {ROPE_FREQS_TENSOR}  # read into the config, not a weight
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def gguf_arch(metadata: dict[str, Any], path: str) -> GGUFArch:
    name = metadata.get("general.architecture")
    arch = GGUF_ARCHS.get(name)  # type: ignore[arg-type]
    if arch is None:
        raise ModelLoadError(
            f"{path}: GGUF architecture {name!r} is not supported (supported: {', '.join(GGUF_ARCHS)})"
        )
    if name == "llama" and metadata.get("llama.expert_count"):
        return MIXTRAL_ARCH
    return arch


def hf_tensor_name(gguf_name: str, path: str) -> str | None:
    """The HF parameter name of a GGUF tensor; None for tensors that are not parameters."""
    if gguf_name in _IGNORED_TENSORS:
        return None
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(f"{path}: GGUF tensor {gguf_name!r} has no Hugging Face equivalent")


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
