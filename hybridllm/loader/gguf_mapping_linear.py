"""GGUF files of llama.cpp's `qwen3next` (Qwen3-Next) and `qwen35moe` (Qwen3.5-MoE text) archi-
tectures, hybrids of Gated DeltaNet (linear attention) and gated full attention layers: their
config and the tensors as transformers' Qwen3NextForCausalLM / Qwen3_5MoeForCausalLM hold them.

What llama.cpp's converter (conversion/qwen.py, Qwen3NextModel and _LinearAttentionVReorderBase)
writes, and how it is undone here (gguf_source applies the value transforms):
- `in_proj_qkvz` (Qwen3-Next: per key head [q | k | its value heads' v | their z]) becomes
  `attn_qkv` (every head's q, then k, then v: Qwen3.5's `in_proj_qkv`) and `attn_gate` (z:
  `in_proj_z`). Both are named as Qwen3.5's split projections, also for qwen3_next (rows as they
  are, quantized blocks kept): GatedDeltaNet takes the split names for either model.
  `in_proj_ba` (per key head [b | a]) is kept whole as `ssm_ba`: named `in_proj_ba` again.
  Qwen3.5's `in_proj_b` / `in_proj_a` are `ssm_beta` / `ssm_alpha`.
- `A_log` is stored as A = -exp(A_log) (`blk.N.ssm_a`, no .weight); read back as log(-A) in
  float64. That is not bit-exact for every float32 A_log (exp's rounding merges neighbours when
  |A_log| < 1), but -exp of it, what the model computes, is A again to float32's precision.
- `dt_bias` is `ssm_dt.bias`; `conv1d.weight` [C, 1, K] is squeezed to [C, K] (`ssm_conv1d`,
  reshaped back); `linear_attn.norm` is `ssm_norm`, unchanged; `out_proj` is `ssm_out`.
- Every other norm weight (input / post-attention / final / q_norm / k_norm, which HF applies
  as 1 + w) is stored as 1 + w (GGUFArch.norm_shift, subtracted again; the gated DeltaNet norm
  is excluded by GGUFArch.unshifted_norms).
- Qwen3.5 only (`qwen35moe`), when there are more value heads than key heads: the value heads
  are reordered from grouped by key head [k0: v0..v(r-1), k1: ...] to tiled [v0 of every k,
  v1 of every k, ...] in the v rows of in_proj_qkv, the rows of in_proj_z, in_proj_b,
  in_proj_a, A_log, dt_bias, the v channels of conv1d, and the columns of out_proj. Rows are put
  back in order in the raw (possibly quantized) rows; out_proj's columns by whole quantized
  blocks where a value head spans whole blocks, else it is dequantized (`v_head_order`).
- The multi-token-prediction layer (`mtp.*` in the checkpoint) is written as blocks
  num_hidden_layers.. (`nextn_predict_layers`): skipped, like GLM's.
- `shared_expert_gate.weight` [1, H] may come back from llama-quantize as [H]: reshaped.

Config: llama.cpp reads ssm.conv_kernel, ssm.state_size (key head dim), ssm.group_count (key
heads), ssm.time_step_rank (value heads), ssm.inner_size (value heads * value head dim),
attention.recurrent_layers (else every full_attention_interval-th layer, default 4, is full),
rope.dimension_count (the rotated part of head_dim). Where the file is silent it computes with:
top-k weights renormalised (norm_topk_prob, llama.cpp's build_moe_ffn call for both), softmax
router, silu, no attention bias, every decoder layer MoE (qwen3next has no dense FFN tensors;
a layer without a router is still listed in mlp_only_layers). Qwen3.5's rope.dimension_sections
(M-RoPE) are not carried over: a text-only model's three position streams are equal, so its
interleaved M-RoPE is plain rope, and the converter writes the default sections when a config
gives none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hybridllm.loader.model_source import ModelLoadError

LINEAR_TYPES = ("qwen3_next", "qwen3_5_moe_text")
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
# llama.cpp's default period of full-attention layers (Qwen3-Next's and Qwen3.5's configs)
_FULL_ATTENTION_INTERVAL = 4

# `<gguf kind>.<weight|bias>` (or a bare kind) in block N -> the rest of the HF name
_COMMON_NAMES = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
LINEAR_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "qwen3_next": {**_COMMON_NAMES, "ssm_ba.weight": "linear_attn.in_proj_ba.weight"},
    "qwen3_5_moe_text": {
        **_COMMON_NAMES,
        "ssm_beta.weight": "linear_attn.in_proj_b.weight",
        "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    },
}
# HF names (suffixes) of the norms the converter stores as they are (applied as w, not 1 + w)
UNSHIFTED_NORMS = ("linear_attn.norm.weight",)


def is_linear(model_type: str) -> bool:
    return model_type in LINEAR_TYPES


def linear_kwargs(
    model_type: str,
    get: Callable[..., Any],
    tensor_names: set[str],
    base: dict[str, Any],
    rope_parameters: Callable[[Callable[..., Any]], dict[str, Any]],
    path: str,
) -> dict[str, Any]:
    """The config of a qwen3next / qwen35moe file: `base` (gguf_mapping's common fields) with
    the architecture's own, in transformers 5's form (rope in rope_parameters)."""
    out = {k: v for k, v in base.items() if k not in ("rope_theta", "rope_scaling")}
    num_layers = out["num_hidden_layers"] - (get("nextn_predict_layers", 0) or 0)
    head_dim = out["head_dim"]
    rope = rope_parameters(get)
    rope["partial_rotary_factor"] = get("rope.dimension_count", head_dim) / head_dim
    k_heads, v_heads = (
        get("ssm.group_count", required=True),
        get("ssm.time_step_rank", required=True),
    )
    inner = get("ssm.inner_size", required=True)
    if v_heads % k_heads or inner % v_heads:
        raise ModelLoadError(
            f"{path}: ssm.time_step_rank {v_heads} is not a multiple of ssm.group_count "
            f"{k_heads}, or ssm.inner_size {inner} not of it"
        )
    out.update(
        num_hidden_layers=num_layers,
        rms_norm_eps=float(str(np.float32(out["rms_norm_eps"]))),  # float32 in the file
        rope_parameters=rope,
        hidden_act="silu",
        attention_bias=False,
        layer_types=_layer_types(get, num_layers, path),
        linear_conv_kernel_dim=get("ssm.conv_kernel", required=True),
        linear_key_head_dim=get("ssm.state_size", required=True),
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_value_head_dim=inner // v_heads,
        num_experts=get("expert_count", required=True),
        num_experts_per_tok=get("expert_used_count", required=True),
        moe_intermediate_size=_uniform(get("expert_feed_forward_length", required=True), path),
        shared_expert_intermediate_size=get("expert_shared_feed_forward_length", 0) or 0,
    )
    if model_type == "qwen3_next":
        dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
        out.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=dense)
    return out


def _layer_types(get: Callable[..., Any], num_layers: int, path: str) -> list[str]:
    """Each decoder layer's kind as llama.cpp reads it: `attention.recurrent_layers` (a flag
    per block, MTP blocks included), else every full_attention_interval-th layer is full."""
    flags = get("attention.recurrent_layers")
    if flags is not None:
        if len(flags) < num_layers:
            raise ModelLoadError(f"{path}: recurrent_layers has {len(flags)} flags")
        return [LINEAR_ATTENTION if f else FULL_ATTENTION for f in flags[:num_layers]]
    period = int(get("full_attention_interval", _FULL_ATTENTION_INTERVAL))
    return [
        FULL_ATTENTION if (i + 1) % period == 0 else LINEAR_ATTENTION for i in range(num_layers)
    ]


def _uniform(value: Any, path: str) -> int:
    """A per-layer array llama.cpp allows for some lengths: one value for every layer."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelLoadError(f"{path}: per-layer expert widths {value} are not supported")
        return int(value[0])
    return int(value)


# ---- tensor transforms (gguf_source applies them) -----------------------------------------------


def v_head_order(num_k_heads: int, num_v_heads: int, unit: int) -> np.ndarray | None:
    """The order undoing the converter's grouped -> tiled value heads along one axis of
    num_v_heads * unit entries (unit: a head's rows, columns or quantized blocks):
    `hf = gguf[order]`; None when there is nothing to undo (as many value heads as key heads)."""
    if num_v_heads == num_k_heads:
        return None
    per_k = num_v_heads // num_k_heads
    # gguf entry (r, k, u) is hf entry (k, r, u)
    return (
        np.arange(num_v_heads * unit).reshape(per_k, num_k_heads, unit).transpose(1, 0, 2).ravel()
    )


def linear_row_order(model_type: str, hf_name: str, config: Any) -> np.ndarray | None:
    """For a qwen35moe tensor whose rows (or entries, 1-D) hold value heads, the order putting
    them back: `hf_rows = gguf_rows[order]`; None for any other tensor."""
    if model_type != "qwen3_5_moe_text" or ".linear_attn." not in hf_name:
        return None
    k, v = config.linear_num_key_heads, config.linear_num_value_heads
    kind = hf_name.rsplit(".linear_attn.", 1)[1]
    if kind in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
        return v_head_order(k, v, 1)
    if kind == "in_proj_z.weight":
        return v_head_order(k, v, config.linear_value_head_dim)
    if kind in ("in_proj_qkv.weight", "conv1d.weight"):  # q | k channels, then v's
        order = v_head_order(k, v, config.linear_value_head_dim)
        qk = 2 * k * config.linear_key_head_dim
        return None if order is None else np.concatenate([np.arange(qk), qk + order])
    return None


def out_proj_column_order(model_type: str, hf_name: str, config: Any) -> np.ndarray | None:
    """For a qwen35moe out_proj, the column order putting its value heads back (per column)."""
    if model_type != "qwen3_5_moe_text" or not hf_name.endswith(".linear_attn.out_proj.weight"):
        return None
    k, v = config.linear_num_key_heads, config.linear_num_value_heads
    return v_head_order(k, v, config.linear_value_head_dim)


def linear_hf_shape(hf_name: str, gguf_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape HF gives a tensor that the converter squeezed: conv1d [C, K] -> [C, 1, K],
    shared_expert_gate [H] -> [1, H]."""
    if hf_name.endswith(".linear_attn.conv1d.weight") and len(gguf_shape) == 2:
        return (gguf_shape[0], 1, gguf_shape[1])
    if hf_name.endswith(".mlp.shared_expert_gate.weight") and len(gguf_shape) == 1:
        return (1, gguf_shape[0])
    return gguf_shape


def is_a_log(hf_name: str) -> bool:
    """Whether the tensor is A_log, which the file holds as A = -exp(A_log)."""
    return hf_name.endswith(".linear_attn.A_log")
