"""Tiny GGUF files written from tiny random HF models, the way llama.cpp's converter writes them."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or", "l d"]

_HF_TO_GGUF = [
    (r"^model\.embed_tokens\.", "token_embd."),
    (r"^model\.norm\.", "output_norm."),
    (r"^lm_head\.", "output."),
    (r"^model\.layers\.(\d+)\.", r"blk.\1."),
    (r"\.self_attn\.q_proj\.", ".attn_q."),
    (r"\.self_attn\.k_proj\.", ".attn_k."),
    (r"\.self_attn\.v_proj\.", ".attn_v."),
    (r"\.self_attn\.o_proj\.", ".attn_output."),
    (r"\.self_attn\.q_norm\.", ".attn_q_norm."),
    (r"\.self_attn\.k_norm\.", ".attn_k_norm."),
    (r"\.mlp\.gate_proj\.", ".ffn_gate."),
    (r"\.mlp\.up_proj\.", ".ffn_up."),
    (r"\.mlp\.down_proj\.", ".ffn_down."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
]


def gguf_name(hf_name: str) -> str:
    for pattern, replacement in _HF_TO_GGUF:
        hf_name = re.sub(pattern, replacement, hf_name)
    return hf_name


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama q/k rows (its `permute`)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tokenizer_vocab() -> list[str]:
    """Byte-level BPE vocabulary: the 256 byte symbols, one token per merge, then specials."""
    tokens = list(bytes_to_unicode().values())
    tokens += [m.replace(" ", "") for m in MERGES]
    return tokens + SPECIAL_TOKENS


def add_test_tokenizer(writer: gguf.GGUFWriter) -> list[str]:
    """Writes the test BPE tokenizer (tokenizer_vocab, MERGES) into `writer`; returns its vocab."""
    vocab = tokenizer_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_merges(MERGES)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in vocab])
    return vocab


def tiny_hf_model(
    arch: str = "llama",
    tie_word_embeddings: bool = False,
    seed: int = 0,
    rope_parameters: dict | None = None,
):
    """A tiny random HF model whose vocabulary matches `tokenizer_vocab()`."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tokenizer_vocab()),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters=rope_parameters or dict(rope_type="default", rope_theta=50000.0),
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=len(tokenizer_vocab()) - 2,
        eos_token_id=len(tokenizer_vocab()) - 1,
    )
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=32, **common)).eval()
    raise ValueError(arch)


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The `rope_freqs` divisors llama.cpp's converter writes for Llama 3.1 rope scaling."""
    base = rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    factors = []
    for wavelen in 2 * np.pi * base:
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (
                rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]
            ) / (rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def random_k_quant_blocks(
    shape: tuple[int, int],
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q4_K,
    seed: int = 0,
) -> np.ndarray:
    """Random Q4_K, Q5_K or Q6_K super-blocks [rows, cols / 256 * bytes]: small positive fp16 d
    (and Q4_K's or Q5_K's dmin; weights within about +-1), every other byte random."""
    rows, cols = shape
    rng = np.random.default_rng(seed)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // 256, type_size), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:  # d last; int8 scales up to 127, |q - 32| <= 32
        raw[:, -2:] = (
            rng.uniform(1e-5, 1.5e-4, size=(len(raw), 1)).astype(np.float16).view(np.uint8)
        )
    else:
        raw[:, :4] = rng.uniform(1e-4, 6e-4, size=(len(raw), 2)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    arch: str = "llama",
    quantize: dict[str, gguf.GGMLQuantizationType] | None = None,
    with_tokenizer: bool = True,
) -> Path:
    """Write `model` as llama.cpp would: GGUF names, permuted llama q/k, metadata, tokenizer.

    `quantize` maps HF names to a ggml block type for those tensors (others stay F32). Types
    gguf cannot quantize (Q4_K, Q5_K, Q6_K) get random blocks of that type instead: the file then
    holds another model than `model` (for kernels and benchmarks, not for comparisons with HF).
    """
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "llama3":  # no scaling metadata: a rope_freqs tensor instead
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, head_dim))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if with_tokenizer:
        vocab = add_test_tokenizer(writer)
        writer.add_bos_token_id(cfg.bos_token_id)
        writer.add_eos_token_id(cfg.eos_token_id)
        writer.add_pad_token_id(vocab.index("<|endoftext|>"))
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    quantize = quantize or {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        qtype = quantize.get(name)
        if qtype is None:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(data))
        else:
            if qtype.name in ("Q4_K", "Q5_K", "Q6_K"):
                packed = random_k_quant_blocks(data.shape, qtype, seed=len(name))
            else:
                packed = gguf.quants.quantize(data, qtype)
            writer.add_tensor(gguf_name(name), packed, raw_shape=packed.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_k_m_like_gguf(path: Path, base: gguf.GGMLQuantizationType) -> Path:
    """A small random Llama as a Q4_K_M-like (base Q4_K) or Q5_K_M-like (Q5_K) file: v and down
    Q6_K, every other q/k/o and gate/up linear `base` (random super-blocks: gguf cannot quantize
    to K-quants), hidden 256 so rows are whole super-blocks, the tests' tokenizer, tied head."""
    vocab = len(tokenizer_vocab())
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=vocab - 2, eos_token_id=vocab - 1, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    Q = gguf.GGMLQuantizationType
    quantize = {
        name: Q.Q6_K if name.endswith(("v_proj.weight", "down_proj.weight")) else base
        for name in model.state_dict()
        if name.endswith("proj.weight")  # every q/k/v/o and gate/up/down
    }
    return write_gguf(path, model, quantize=quantize)
