"""Tiny random HF models per architecture and paged-cache step builders for tests."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from hybridllm.engine.kv_cache_groups import kv_cache_groups
from hybridllm.layers.attention_metadata import AttentionMetadata

_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,  # peakier logits than 0.02: greedy ties are unlikely
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# arch name -> (HF config class name, config overrides)
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(_COMMON, tie_word_embeddings=False)),
    "llama3": (
        "LlamaConfig",
        dict(
            _COMMON,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
            # with head_dim 16 and theta 5e5 the bands low / medium / high are all populated
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=1024,
            ),
        ),
    ),
    "mistral": (
        "MistralConfig",
        dict(_COMMON, num_key_value_heads=1, sliding_window=12, tie_word_embeddings=False),
    ),
    "qwen2": ("Qwen2Config", dict(_COMMON, tie_word_embeddings=True)),
    "qwen3": (
        "Qwen3Config",
        dict(_COMMON, head_dim=32, num_hidden_layers=2, tie_word_embeddings=True),
    ),
    # Gemma 2: alternating window-8 and global layers, caps small enough to bite
    "gemma2": (
        "Gemma2Config",
        dict(
            _COMMON,
            head_dim=16,
            num_hidden_layers=4,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=3.0,
            tie_word_embeddings=True,
        ),
    ),
    # Gemma 3: three window-8 layers per global one, each kind with its own RoPE
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            _COMMON,
            head_dim=16,
            num_hidden_layers=4,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
            tie_word_embeddings=True,
        ),
    ),
    # gpt-oss: sinks, alternating window-8 and full layers, 5 biased experts, top-2, the
    # swigluoai clamp low enough to bite
    "gpt_oss": (
        "GptOssConfig",
        dict(
            _COMMON,
            head_dim=16,
            num_hidden_layers=4,
            intermediate_size=40,
            num_local_experts=5,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=0.6,
            tie_word_embeddings=False,
        ),
    ),
    # MiniMax-M2: q/k normed across heads, half of each head rotating, a sigmoid router with
    # a score-correction bias over 5 experts, top-2
    "minimax_m2": (
        "MiniMaxM2Config",
        dict(
            _COMMON,
            head_dim=16,
            rotary_dim=8,
            intermediate_size=40,
            num_local_experts=5,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
    ),
    "opt": (
        "OPTConfig",
        dict(
            vocab_size=320,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            max_position_embeddings=512,
            word_embed_proj_dim=64,
            do_layer_norm_before=True,
            init_std=0.1,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
    ),
    # opt-350m style: post-LN and a narrower embedding behind project_in / project_out
    "opt_post_ln": (
        "OPTConfig",
        dict(
            vocab_size=320,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            word_embed_proj_dim=32,
            do_layer_norm_before=False,
            init_std=0.1,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
    ),
}

ARCHITECTURES: tuple[str, ...] = tuple(TINY_CONFIGS)

# hybrid linear-attention models (Gated DeltaNet layers beside full attention): a state cache
# group besides the paged KV, so they are kept out of ARCHITECTURES' paged-cache-only tests
_LINEAR_SIZES = dict(
    _COMMON,
    num_hidden_layers=4,  # linear, linear, linear, full
    head_dim=16,
    partial_rotary_factor=0.5,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    tie_word_embeddings=False,
)
LINEAR_ATTENTION_CONFIGS: dict[str, tuple[str, dict]] = {
    # Qwen3-Next: fused in_proj_qkvz / in_proj_ba; layer 1 a dense MLP (mlp_only_layers)
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(_LINEAR_SIZES, mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True),
    ),
    # Qwen3.5-MoE text: split in_proj_qkv / z / b / a, every layer MoE
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(_LINEAR_SIZES)),
}


def tiny_config(arch: str) -> transformers.PretrainedConfig:
    """The HF config of the tiny `arch` model (see TINY_CONFIGS)."""
    configs = {**TINY_CONFIGS, **LINEAR_ATTENTION_CONFIGS}
    if arch not in configs:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {', '.join(configs)}")
    class_name, kwargs = configs[arch]
    return getattr(transformers, class_name)(**kwargs)


def build_tiny_hf_model(arch: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A random fp32 HF model, eager attention; norms and biases perturbed so loading them matters."""
    torch.manual_seed(seed)
    config = tiny_config(arch)
    config._attn_implementation = "eager"
    return random_eager_model(config)


def random_eager_model(config: transformers.PretrainedConfig) -> transformers.PreTrainedModel:
    """A random fp32 HF model of `config` with eager attention; norms and biases perturbed so
    that loading them matters; no eos, so greedy runs always produce max_new_tokens."""
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer, zeros in a fresh model
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.generation_config.eos_token_id = None
    return model.eval()


def make_tiny_model(arch: str, path: str | Path, seed: int = 0) -> Path:
    """Save a tiny random `arch` model (config.json, model.safetensors, tokenizer) under `path`."""
    path = Path(path)
    model = build_tiny_hf_model(arch, seed)
    model.save_pretrained(path)
    make_tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


_TOKENIZER_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello world! "
    "Paged attention keeps the KV cache in fixed-size blocks. "
    "Continuous batching schedules new requests every step. 0123456789 "
)


def make_tiny_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids, trained here (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny configs' pad/bos/eos
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TOKENIZER_CORPUS] * 50, trainer=trainer)
    # Pad with unused merges-free tokens so every model id decodes to something.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<extra_{i}>" for i in range(missing)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return fast


@dataclass
class StepSequence:
    """One sequence of a model step: the tokens it computes now and where its KV lives."""

    token_ids: list[int]  # this step's query tokens
    num_computed_tokens: int  # tokens of this sequence already in the KV cache
    block_table: list[int]


def make_step(
    seqs: list[StepSequence],
    block_size: int,
    device: str | torch.device = "cpu",
    num_groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, AttentionMetadata) for `seqs`, decodes (one token) first; with
    `num_groups` KV cache groups (sliding-window layers beside full ones) every group gets the
    same block tables (each layer has a cache of its own, so the ids may repeat across groups)."""
    num_decodes = 0
    while num_decodes < len(seqs) and len(seqs[num_decodes].token_ids) == 1:
        num_decodes += 1
    input_ids, positions, slots, starts, seq_lens = [], [], [], [0], []
    for seq in seqs:
        seq_len = seq.num_computed_tokens + len(seq.token_ids)
        if -(-seq_len // block_size) > len(seq.block_table):
            raise ValueError(f"block table {seq.block_table} too short for {seq_len} tokens")
        for pos in range(seq.num_computed_tokens, seq_len):
            positions.append(pos)
            slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
        input_ids.extend(seq.token_ids)
        starts.append(starts[-1] + len(seq.token_ids))
        seq_lens.append(seq_len)
    width = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    meta = AttentionMetadata(
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    meta.other_groups = tuple(dataclasses.replace(meta) for _ in range(num_groups - 1))
    ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
    return ids, torch.tensor(positions, dtype=torch.int64, device=device), meta


def scattered_block_tables(
    num_seqs: int, blocks_per_seq: int, num_blocks: int, seed: int = 0
) -> list[list[int]]:
    """Disjoint, shuffled (non-contiguous, non-monotonic) block tables."""
    if num_seqs * blocks_per_seq > num_blocks:
        raise ValueError(f"{num_seqs} x {blocks_per_seq} blocks do not fit in {num_blocks}")
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    return [ids[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(num_seqs)]


def allocate_kv_caches(model, num_blocks: int, block_size: int) -> list[torch.Tensor]:
    """One zeroed paged KV cache per layer of `model`'s stage."""
    shape = model.kv_cache_shape(num_blocks, block_size)
    return [
        torch.zeros(shape, dtype=model.dtype, device=model.device)
        for _ in range(model.num_layers_in_stage)
    ]


def load_our_model(hf_model, dtype=torch.float32, start_layer=0, end_layer=None):
    """Our implementation of `hf_model`'s architecture, loaded from its state dict."""
    from hybridllm.models.registry import get_model_class

    cls = get_model_class(type(hf_model).__name__)
    model = cls(hf_model.config, dtype, torch.device("cpu"), start_layer, end_layer)
    state = hf_model.state_dict()
    loaded = model.load_weights((n, t) for n, t in state.items() if model.owns_weight(n))
    missing = model.expected_weight_names() - loaded
    if missing:
        raise AssertionError(f"weights not loaded: {sorted(missing)}")
    return model


def num_kv_groups(model) -> int:
    """How many KV cache groups the model's layers read (sliding windows beside full ones)."""
    return len(kv_cache_groups(model.hf_config))
