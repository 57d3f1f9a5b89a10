"""What a CPU worker keeps of a checkpoint as GGUF blocks, sized before the plan exists.

The planner budgets memory and predicts speed from these sizes, so config building counts them
from the file's tensor table (or, for on-load quantization, from the config) without loading a
weight or importing the layers that later compute from the blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hybridllm.loader.gguf_kernel_types import kept_as_blocks
from hybridllm.loader.model_source import ModelSource
from hybridllm.loader.mxfp4_blocks import is_mxfp4_quant
from hybridllm.loader.onload_quant import HEAD_TYPE, ONLOAD_TYPES, bytes_per_param
from hybridllm.plan.model_size import GGUFBlockSizes, model_size

# GGUF tensors stacked into one Linear: kept as blocks when the op reads each one's type.
_ATTENTION = (("attn_q", "attn_k", "attn_v"), ("attn_output",))
# A layer's MLP: dense, or routed experts (stacked [E, rows, cols]; a stack stays blocks only when
# its parts share one type, see expert_weights.py) and perhaps a shared expert beside them.
_DENSE_MLP = (("ffn_gate", "ffn_up"), ("ffn_down",))
_EXPERTS = (("ffn_gate_exps", "ffn_up_exps"), ("ffn_down_exps",))
_SHARED_EXPERT = (("ffn_gate_shexp", "ffn_up_shexp"), ("ffn_down_shexp",))


def gguf_block_sizes(source: ModelSource, num_layers: int) -> GGUFBlockSizes | None:
    """What a CPU worker with the native op keeps of `source` as GGUF blocks (all layers,
    unsharded), for the budgets and cost model; None for other formats or an unknown layout."""
    tensor_infos = getattr(source, "tensor_infos", None)
    if tensor_infos is None:
        return None
    infos = tensor_infos()
    kept_params = kept_bytes = total_params = 0
    for layer in range(num_layers):
        stacks = _mla_attention(infos, layer) or _linear_attention(infos, layer) or list(_ATTENTION)
        # floats: MLA's up-projections, Qwen3-Next's per-key-head interleaved ssm_ba
        for name in ("attn_k_b", "attn_v_b", "attn_kv_b", "ssm_ba"):
            info = infos.get(f"blk.{layer}.{name}.weight")
            total_params += math.prod(info.shape) if info is not None else 0
        if f"blk.{layer}.ffn_gate_exps.weight" in infos:
            stacks += _EXPERTS
            if f"blk.{layer}.ffn_gate_shexp.weight" in infos:
                stacks += _SHARED_EXPERT
        else:
            stacks += _DENSE_MLP
        for stack in stacks:
            members = [infos.get(f"blk.{layer}.{name}.weight") for name in stack]
            if any(m is None for m in members):
                return None
            kept = all(kept_as_blocks(m.ggml_type, m.shape[-1]) for m in members)
            if stack[0].endswith("_exps"):
                kept = kept and len({m.ggml_type for m in members}) == 1
            for m in members:
                total_params += math.prod(m.shape)
                if kept:
                    kept_params += math.prod(m.shape)
                    kept_bytes += m.nbytes

    def kept_nbytes(name: str) -> int | None:
        info = infos.get(name)
        kept = info is not None and kept_as_blocks(info.ggml_type, info.shape[-1])
        return info.nbytes if kept else None

    embedding = kept_nbytes("token_embd.weight")
    head = kept_nbytes("output.weight") if "output.weight" in infos else embedding
    return GGUFBlockSizes(kept_params, kept_bytes, total_params, head, embedding)


def _linear_attention(infos: dict, layer: int) -> list[tuple[str, ...]] | None:
    """A Gated DeltaNet layer's linears kept as blocks (None: not one): q|k|v and z into one
    Linear, the output; Qwen3.5's separate beta and alpha into another."""
    if f"blk.{layer}.ssm_out.weight" not in infos:
        return None
    stacks = [("attn_qkv", "attn_gate"), ("ssm_out",)]
    if f"blk.{layer}.ssm_beta.weight" in infos:
        stacks.append(("ssm_beta", "ssm_alpha"))
    return stacks


def _mla_attention(infos: dict, layer: int) -> list[tuple[str, ...]] | None:
    """A multi-head latent attention layer's linears kept as blocks (None: not MLA)."""
    if f"blk.{layer}.attn_kv_a_mqa.weight" not in infos:
        return None
    low_rank = f"blk.{layer}.attn_q_a.weight" in infos
    queries = [("attn_q_a",), ("attn_q_b",)] if low_rank else [("attn_q",)]
    return queries + [("attn_kv_a_mqa",), ("attn_output",)]


def cpu_block_sizes(
    source: ModelSource, hf_config: Any, quantization: str, kernels: Callable[[], bool]
) -> GGUFBlockSizes | None:
    """What a CPU worker keeps as blocks under `--quantization`: a GGUF file's kept blocks, or
    (q8_0/q4_0/q4_1 on float checkpoints) the linears it quantizes at load; None: floats.

    `kernels`: () -> whether CPU workers have the native op (without it every weight is float),
    asked only when there are blocks to keep: it may build the kernels, minutes on a first run.
    """
    if quantization == "none":
        return None
    sizes = gguf_block_sizes(source, hf_config.num_hidden_layers)
    if sizes is None and quantization not in ONLOAD_TYPES:
        return mxfp4_expert_sizes(hf_config) if kernels() else None
    if not kernels():
        return None
    if sizes is not None:
        return sizes
    size = model_size(hf_config, "float32")
    layers = range(size.num_layers)
    # every decoder-layer linear, routed and shared experts included, is quantized at load
    total = kept = sum(size.layer_matmul_params(i) for i in layers)
    head = round(size.vocab_size * size.hidden_size * bytes_per_param(HEAD_TYPE))
    return GGUFBlockSizes(
        kept_params=kept,
        kept_bytes=round(kept * bytes_per_param(ONLOAD_TYPES[quantization])),
        total_params=total,
        lm_head_bytes=head,
        embedding_bytes=head if size.tied_embeddings else None,  # a tied table is the head's
    )


def mxfp4_expert_sizes(hf_config: Any) -> GGUFBlockSizes | None:
    """An MXFP4 folder's (gpt-oss's) routed experts, kept as their 17-byte blocks of 32 weights;
    every other linear loads as floats. None for other checkpoints."""
    if not is_mxfp4_quant(hf_config):
        return None
    size = model_size(hf_config, "float32")
    layers = range(size.num_layers)
    experts = sum(
        size.layer_matmul_params(i) - size.layer_matmul_params(i, routed=False) for i in layers
    )
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType.MXFP4]
    return GGUFBlockSizes(
        kept_params=experts,
        kept_bytes=experts * type_size // block,
        total_params=sum(size.layer_matmul_params(i) for i in layers),
        lm_head_bytes=None,
    )
