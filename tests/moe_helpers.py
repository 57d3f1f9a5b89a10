"""Tiny random mixture-of-experts HF models and GGUF files of them, for tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

from tests.gguf_helpers import gguf_name, llama_cpp_permute, random_k_quant_blocks
from tests.model_helpers import make_tiny_tokenizer, random_eager_model

_COMMON = dict(
    vocab_size=320,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,  # peaky logits and router scores: greedy and top-k ties unlikely
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# arch -> (HF config class, overrides): odd sizes (head_dim 24 or 20, expert counts 5-7),
# top-k 1 to 4, norm_topk_prob both ways, a dense layer among Qwen2-MoE's sparse ones
MOE_CONFIGS: dict[str, tuple[str, dict]] = {
    "mixtral": (
        "MixtralConfig",
        dict(_COMMON, hidden_size=96, head_dim=24, intermediate_size=40, num_local_experts=5,
             num_experts_per_tok=2, tie_word_embeddings=False),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(_COMMON, hidden_size=96, head_dim=24, intermediate_size=72, moe_intermediate_size=40,
             shared_expert_intermediate_size=56, num_experts=7, num_experts_per_tok=3,
             mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=True),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(_COMMON, hidden_size=96, head_dim=24, intermediate_size=72, moe_intermediate_size=40,
             num_experts=6, num_experts_per_tok=4, norm_topk_prob=True, tie_word_embeddings=False),
    ),
    "olmoe": (
        "OlmoeConfig",
        dict(_COMMON, hidden_size=80, intermediate_size=40, num_experts=5, num_experts_per_tok=1,
             clip_qkv=3.0, norm_topk_prob=False, tie_word_embeddings=False),
    ),
}  # fmt: skip
MOE_ARCHITECTURES: tuple[str, ...] = tuple(MOE_CONFIGS)


def tiny_moe_config(arch: str, **overrides) -> transformers.PretrainedConfig:
    class_name, kwargs = MOE_CONFIGS[arch]
    return getattr(transformers, class_name)(**{**kwargs, **overrides})


def build_tiny_moe_model(arch: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random fp32 HF MoE model (eager attention); norms and biases perturbed."""
    torch.manual_seed(seed)
    return random_eager_model(tiny_moe_config(arch, **overrides))


def make_tiny_moe_model(arch: str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random MoE model (config, safetensors in the checkpoint's per-expert names,
    tokenizer) under `path`."""
    path = Path(path)
    model = build_tiny_moe_model(arch, seed, **overrides)
    model.save_pretrained(path)
    make_tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_tokens,
        )
    return out[0, len(prompt) :].tolist()


_GGUF_ARCH = {
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
}
_MOE_NAMES = (
    ("mlp.gate.weight", "ffn_gate_inp.weight"),
    ("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
    ("mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"),
    ("mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"),
    ("mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"),
)


def _moe_tensors(model: transformers.PreTrainedModel) -> dict[str, np.ndarray]:
    """GGUF name -> fp32 array of every tensor, experts stacked as llama.cpp writes them."""
    cfg, out = model.config, {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] -> gate, up [E, I, H]
            gate, up = np.split(data, 2, axis=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"] = gate
            out[f"blk.{layer}.ffn_up_exps.weight"] = up
            continue
        if name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            out[f"blk.{layer}.ffn_down_exps.weight"] = data
            continue
        for hf_suffix, gguf_suffix in _MOE_NAMES:
            if name.endswith(hf_suffix):
                out[f"blk.{layer}.{gguf_suffix}"] = data
                break
        else:
            if model.config.model_type == "mixtral" and ".q_proj." in name:
                data = llama_cpp_permute(data, cfg.num_attention_heads)
            elif model.config.model_type == "mixtral" and ".k_proj." in name:
                data = llama_cpp_permute(data, cfg.num_key_value_heads)
            out[gguf_name(name)] = data
    return out


def write_moe_gguf(
    path: Path,
    model: transformers.PreTrainedModel,
    quantize: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """`model` as llama.cpp's converter writes it (stacked experts, MoE metadata), without a
    tokenizer. `quantize` maps a GGUF tensor kind ("ffn_up_exps") to a block type for every
    layer's tensor of that kind; K-quants get random blocks (another model than `model`)."""
    cfg = model.config
    arch = _GGUF_ARCH[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if cfg.model_type in ("qwen2_moe", "qwen3_moe"):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    if cfg.model_type == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if getattr(cfg, "clip_qkv", None) is not None:
        writer.add_clamp_kqv(cfg.clip_qkv)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    quantize = quantize or {}
    for name, data in _moe_tensors(model).items():
        qtype = quantize.get(name.split(".")[2]) if name.startswith("blk.") else None
        if qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(data))
            continue
        rows = data.reshape(-1, data.shape[-1])  # [E * rows, cols]: blocks run along a row
        if qtype.name in ("Q4_K", "Q5_K", "Q6_K"):
            packed = random_k_quant_blocks(rows.shape, qtype, seed=len(name))
        else:
            packed = gguf.quants.quantize(rows, qtype)
        packed = packed.reshape(*data.shape[:-1], -1)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
