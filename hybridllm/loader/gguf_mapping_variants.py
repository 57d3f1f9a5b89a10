"""GGUF files of llama.cpp's `gemma2`, `gemma3`, `gpt-oss` and `minimax-m2` architectures: their
config (sliding-window layers, soft-capping, Gemma 3's two RoPE bases, gpt-oss's YaRN, sinks and
clamp, MiniMax-M2's partial rotation and sigmoid router) and the tensor names that differ from
gguf_mapping's common ones.

What llama.cpp reads from such a file, and so what its converter writes, is less than a
config.json says; where a field is missing this takes what llama.cpp computes with:
- Gemma's attention scale is 1/sqrt(head_dim), but hidden/heads for the 27B shapes (46 layers
  in Gemma 2, 62 in Gemma 3) as in gemma_pytorch; the file has no query_pre_attn_scalar.
- Sliding layers follow `attention.sliding_window_pattern` (a period n: the last of every n
  layers is global; or a flag per layer), else the architecture's period: 2 for Gemma 2 and
  gpt-oss, 6 for Gemma 3. Gemma 3's sliding layers rotate with `rope.freq_base_swa` (10000 when
  absent), unscaled; its global ones with `rope.freq_base` and the file's scaling.
- gpt-oss's swiglu clamp is llama.cpp's constant 7.0 (alpha 1.702). Its YaRN is the released
  checkpoints' (`truncate: false`): llama.cpp rounds the correction range to whole dimensions
  (ggml_rope_yarn_corr_dims), so its tokens from a converted tiny model equal transformers'
  with truncate=True and differ slightly from the checkpoint's own; this follows the checkpoint.
- Gemma's converter stores every norm weight as 1 + w (`GGUFArch.norm_shift`); the source
  subtracts it again, so the tensors read are the checkpoint's and the model adds it as for a
  folder (exact: for a stored value v in [0.5, 2], v - 1 and then + 1 round to v).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hybridllm.loader.model_source import ModelLoadError

SLIDING, FULL = "sliding_attention", "full_attention"

# llama.cpp's default sliding-window period per architecture (load_swa_pattern)
_SWA_PERIOD = {"gemma2": 2, "gemma3_text": 6, "gpt_oss": 2}
# the layer counts at which llama.cpp scales Gemma's queries by hidden/heads (the 27B models)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}
# llama.cpp's gpt-oss swiglu constants (LLM_FFN_SWIGLU_OAI_MOE)
_SWIGLU_ALPHA, _SWIGLU_LIMIT = 1.702, 7.0

# `<gguf kind>.<weight|bias>` inside block N -> the rest of the HF name, per model_type; these
# override gguf_mapping's common names.
VARIANT_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "gemma2": {
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    "gpt_oss": {
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias",
        # separate gate and up stacks [E, I, H] (HF's gate_up_proj interleaves them) and their
        # biases [E, I]; the down stack [E, H, I] is FusedMoE's order, the transpose of HF's
        # float down_proj (and of the same shape in the released models, where H == I), so
        # it has a name of its own
        "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias",
        "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
        "ffn_down_exps.weight": "mlp.experts.down_proj_gguf.weight",
        "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
    },
    "minimax_m2": {"exp_probs_b.bias": "mlp.e_score_correction_bias"},
}
VARIANT_BLOCK_NAMES["gemma3_text"] = VARIANT_BLOCK_NAMES["gemma2"]


def is_variant(model_type: str) -> bool:
    return model_type in ("gemma2", "gemma3_text", "gpt_oss", "minimax_m2")


def variant_kwargs(
    model_type: str,
    get: Callable[..., Any],
    tensor_names: set[str],
    base: dict[str, Any],
    rope_parameters: Callable[[Callable[..., Any]], dict[str, Any]],
    path: str,
) -> dict[str, Any]:
    """The config of a variant file: `base` (gguf_mapping's common Llama-style fields) with the
    architecture's own; `rope_parameters(get)` reads the file's RoPE as transformers 5 says it."""
    out = {**base, "rope_parameters": rope_parameters(get)}
    # float32 in the file: the shortest decimal that reads back as it (1e-06, as config.json)
    out["rms_norm_eps"] = float(str(np.float32(out["rms_norm_eps"])))
    for key in ("rope_theta", "rope_scaling"):
        out.pop(key, None)  # transformers 5 keeps them in rope_parameters
    if model_type == "minimax_m2":
        return _minimax_m2(get, out, path)
    layers = out["num_hidden_layers"]
    window = get("attention.sliding_window", required=model_type == "gpt_oss")
    if window is None and model_type == "gemma2":
        window = 4096  # llama.cpp's default for Gemma 2
    out["sliding_window"] = window or None
    if window:
        pattern = get("attention.sliding_window_pattern")
        out["layer_types"] = layer_types(model_type, pattern, layers)
    else:  # a Gemma 3 file without a window: every layer global
        out["layer_types"] = [FULL] * layers
    if model_type == "gpt_oss":
        return _gpt_oss(get, tensor_names, out)
    return _gemma(model_type, get, out, path)


def layer_types(model_type: str, pattern: Any, num_layers: int) -> list[str]:
    """Each layer's kind from `attention.sliding_window_pattern` as llama.cpp reads it: a flag
    per layer (True: sliding), or a period n (layer i slides unless i % n == n - 1; 0: all
    slide); absent, the architecture's period."""
    if isinstance(pattern, list):
        if len(pattern) < num_layers:
            raise ValueError(f"sliding_window_pattern has {len(pattern)} flags for {num_layers}")
        return [SLIDING if flag else FULL for flag in pattern[:num_layers]]
    period = _SWA_PERIOD[model_type] if pattern is None else int(pattern)
    return [SLIDING if period == 0 or i % period < period - 1 else FULL for i in range(num_layers)]


def _gemma(
    model_type: str, get: Callable[..., Any], out: dict[str, Any], path: str
) -> dict[str, Any]:
    heads, hidden = out["num_attention_heads"], out["hidden_size"]
    gemma2 = model_type == "gemma2"
    if out["num_hidden_layers"] == _GEMMA_27B_LAYERS[model_type]:
        scalar = hidden // heads
    else:
        scalar = out["head_dim"]
    out.update(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=scalar,
        # llama.cpp's defaults where a file lacks them: Gemma 2 caps both (50, 30, as
        # transformers' Gemma2Config), Gemma 3 only final logits and only when given
        final_logit_softcapping=get("final_logit_softcapping", 30.0 if gemma2 else None),
        attn_logit_softcapping=get("attn_logit_softcapping", 50.0) if gemma2 else None,
        attention_bias=False,
    )
    if gemma2:
        if get("rope.freq_base_swa") not in (None, out["rope_parameters"]["rope_theta"]):
            raise ModelLoadError(
                f"{path}: a gemma2 file with a sliding-layer RoPE base is not supported"
            )
        return out
    # Gemma 3: the global layers' RoPE as the file says, the sliding layers' unscaled
    local = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10000.0))}
    out["rope_parameters"] = {FULL: out["rope_parameters"], SLIDING: local}
    return out


def _gpt_oss(
    get: Callable[..., Any], tensor_names: set[str], out: dict[str, Any]
) -> dict[str, Any]:
    rope = out["rope_parameters"]
    if rope.get("rope_type") == "yarn":
        rope["truncate"] = False
    return {
        **out,
        "intermediate_size": get("expert_feed_forward_length") or out["intermediate_size"],
        "num_local_experts": get("expert_count", required=True),
        "num_experts_per_tok": get("expert_used_count", required=True),
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "swiglu_alpha": _SWIGLU_ALPHA,
        "swiglu_limit": _SWIGLU_LIMIT,
        "hidden_act": "silu",
    }


def _minimax_m2(get: Callable[..., Any], out: dict[str, Any], path: str) -> dict[str, Any]:
    gating = get("expert_gating_func", 2)  # llama.cpp needs it; MiniMax-M2 routes by sigmoid
    if gating != 2:
        raise ModelLoadError(
            f"{path}: minimax-m2 expert_gating_func {gating} is not supported (2: sigmoid)"
        )
    head_dim = out["head_dim"]
    rotary = get("rope.dimension_count", head_dim)
    out["rope_parameters"]["partial_rotary_factor"] = rotary / head_dim
    return {
        **out,
        "intermediate_size": get("expert_feed_forward_length") or out["intermediate_size"],
        "num_local_experts": get("expert_count", required=True),
        "num_experts_per_tok": get("expert_used_count", required=True),
        "rotary_dim": rotary,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
    }
