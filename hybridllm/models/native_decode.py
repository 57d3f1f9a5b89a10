"""A decoder layer's native CPU decode form: the fixed arguments of `hybridllm::decode_layer`.

The op computes a pre-norm layer (RMSNorm, fused-qkv attention with RoPE and optional per-head
q/k norms, RMSNorm, and a dense SiLU MLP when there is one) from GGUF-style blocks. A layer has
this form when it is built from exactly those standard parts; the functions here read them once,
after loading, so a decode step passes plain tuples instead of walking nn.Module attributes.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hybridllm.layers.fused_moe import FusedMoE
from hybridllm.layers.linear import Linear
from hybridllm.layers.mlp import GatedMLP


@dataclass(frozen=True)
class NativeLayer:
    """One layer's arguments to `hybridllm::decode_layer` that do not change from step to step."""

    weights: tuple  # the op's arguments before the rotary angles (norms, projections' blocks)
    attention: tuple  # those after the attention inputs (scale, window, heads, activations)
    # the feed-forward block Python runs on the op's output; None: the op computed the MLP
    mlp: nn.Module | None
    # `DecodeStack.add_moe`'s arguments where the stack can run `mlp` (an expert block) itself
    experts: tuple | None


def native_layer(layer: nn.Module, activations: int) -> NativeLayer | None:
    """The native form of a layer with the standard parts (input_layernorm, self_attn with
    qkv_proj / o_proj / q_norm / k_norm / attn, post_attention_layernorm, mlp), or None where a
    piece lacks one: every linear plain fp32/GGUF blocks, norms compiled and alike, attention
    compiled (no logit soft-capping, no sinks). A dense SiLU MLP joins the op; another block (MoE)
    runs after it.

    The caller vouches that `layer.self_attn` computes what the op does (the Llama attention;
    OLMoE's, say, normalises q and k across heads and clips them).
    """
    attn, mlp = layer.self_attn, layer.mlp
    fused = [attn.qkv_proj]  # blocks in one tensor, or one a shard of differing types
    plain = [attn.o_proj]  # blocks in one tensor
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if attn.q_norm is not None:
        norms += [attn.q_norm, attn.k_norm]
    dense = type(mlp) is GatedMLP and mlp.native and mlp.activation.name == "silu"
    if dense:
        fused.append(mlp.gate_up_proj)
        plain.append(mlp.down_proj)
    if not (
        all(type(linear) is Linear for linear in fused + plain)
        and all(linear.block_shards() is not None for linear in fused)
        and all(linear.qweight is not None for linear in plain)
        and all(linear.bias is None for linear in fused[1:] + plain)  # only qkv may (Qwen2)
        and all(norm.native and norm.eps == norms[0].eps for norm in norms)
        and getattr(attn.attn.backend, "native_ops", False)
        # the op's attention has no soft-capping or sinks
        and getattr(attn.attn, "logit_softcap", None) is None
        and getattr(attn.attn, "sinks", None) is None
    ):
        return None
    down = mlp.down_proj if dense else None
    qkv_weights, qkv_types = attn.qkv_proj.block_shards()
    gate_up_weights, gate_up_types = mlp.gate_up_proj.block_shards() if dense else ([], [])
    weights = (
        layer.input_layernorm.weight,
        layer.post_attention_layernorm.weight,
        layer.input_layernorm.eps,
        qkv_weights,
        qkv_types,
        attn.qkv_proj.bias,
        None if attn.q_norm is None else attn.q_norm.weight,
        None if attn.k_norm is None else attn.k_norm.weight,
        attn.o_proj.qweight,
        attn.o_proj.ggml_type,
        gate_up_weights,
        gate_up_types,
        None if down is None else down.qweight,
        -1 if down is None else down.ggml_type,
    )
    attention = (
        attn.attn.scale,
        attn.attn.sliding_window or 0,
        attn.num_heads,
        attn.num_kv_heads,
        activations,
    )
    return NativeLayer(weights, attention, None if dense else mlp, None if dense else experts(mlp))


def experts(block: nn.Module) -> tuple | None:
    """`DecodeStack.add_moe`'s arguments for an expert block (a router `gate` and `FusedMoE`
    `experts`) the stack can run as the block's forward would: no shared expert, experts on the
    layer's device computing natively from blocks, a bias-free router of blocks; else None."""
    routed, router = getattr(block, "experts", None), getattr(block, "gate", None)
    if (
        not isinstance(routed, FusedMoE)
        or not isinstance(router, Linear)
        or block.experts_device is not None
        or block.shared_expert is not None
        or not routed.native
        or routed.grouping is not None  # DeepSeek's routing is not the stack's
        or not routed.plain  # gpt-oss's expert biases and clamped activation
        or routed.w13.qweight is None
        or routed.w2.qweight is None
        or router.qweight is None
        or router.bias is not None
    ):
        return None
    return (
        router.qweight,
        router.ggml_type,
        routed.top_k,
        routed.scoring == "sigmoid",
        routed.renormalize,
        routed.w13.qweight,
        routed.w13.ggml_type,
        routed.w2.qweight,
        routed.w2.ggml_type,
    )
