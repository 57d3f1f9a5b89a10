"""Real GGUF files of Qwen3-Next-80B-A3B-shaped layers, made by llama.cpp's own converter and
quantizer.

Qwen3-Next-80B-A3B's layers at their real sizes (hidden 2048; Gated DeltaNet with 16 key and 32
value heads of 128, conv kernel 4; gated attention of 16 heads and 2 KV heads of 256 rotating a
quarter; 512 routed experts of width 512, top-10, a gated shared expert of 512), `--layers` of
them (default 4: three linear-attention layers and a full-attention one, the model's 3:1
pattern, so the file and either engine's memory fit this 24 GiB machine: the real model has 48).
Random seeded weights (N(0, 1/fan_in), the residual projections scaled down), SmolLM2's tokenizer
and its 49,152-token vocabulary, the checkpoint's names (fused in_proj_qkvz / in_proj_ba,
per-expert tensors; no MTP layer). Written tensor by tensor, converted to BF16 GGUF by `convert_hf_to_gguf.py`,
quantized by `llama-quantize` to each `--types` (default Q4_K_M).

    .venv/bin/python benchmarks/make_qwen3next_gguf.py [--out /work/gguf-files/qwen3next]
        [--layers 4] [--types Q4_K_M] [--llamacpp-bin DIR]

Idempotent: each step is skipped when its output exists.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.make_deepseek_gguf import (  # noqa: E402
    RandomLayer,
    convert_and_quantize,
    write_random_folder,
)
from benchmarks.make_gguf_files import find_llamacpp_bin  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 16, 2, 256
K_HEADS, V_HEADS, K_DIM, V_DIM, CONV = 16, 32, 128, 128, 4
EXPERTS, TOP_K, EXPERT_WIDTH, SHARED_WIDTH = 512, 10, 512, 512


def config(layers: int, vocab: int, bos: int, eos: int):
    from transformers import Qwen3NextConfig

    c = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=5120, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        linear_num_key_heads=K_HEADS, linear_num_value_heads=V_HEADS,
        linear_key_head_dim=K_DIM, linear_value_head_dim=V_DIM, linear_conv_kernel_dim=CONV,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_WIDTH,
        shared_expert_intermediate_size=SHARED_WIDTH, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, max_position_embeddings=262144, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos, torch_dtype="bfloat16",
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
    )  # fmt: skip
    c.architectures = ["Qwen3NextForCausalLM"]
    return c


def layer_tensors(i: int, layers: int, g):
    """Layer `i`'s tensors, name -> bf16, in the checkpoint's names."""
    import torch

    rl = RandomLayer(g, HIDDEN, layers, norm_offset=0.0)  # norms applied as 1 + w
    p = f"model.layers.{i}."
    t = rl.tensors
    t.update({
        p + "input_layernorm.weight": rl.norm(HIDDEN),
        p + "post_attention_layernorm.weight": rl.norm(HIDDEN),
    })  # fmt: skip
    if (i + 1) % 4:  # Gated DeltaNet
        a = p + "linear_attn."
        key, value = K_HEADS * K_DIM, V_HEADS * V_DIM
        t.update({
            a + "in_proj_qkvz.weight": rl.linear(2 * key + 2 * value, HIDDEN),
            a + "in_proj_ba.weight": rl.linear(2 * V_HEADS, HIDDEN),
            a + "conv1d.weight": (torch.randn(2 * key + value, 1, CONV, generator=g) * 0.5).bfloat16(),
            a + "A_log": torch.log(torch.empty(V_HEADS).uniform_(1, 16, generator=g)).bfloat16(),
            a + "dt_bias": torch.ones(V_HEADS, dtype=torch.bfloat16),
            a + "norm.weight": (1.0 + 0.1 * torch.randn(V_DIM, generator=g)).bfloat16(),
            a + "out_proj.weight": rl.residual(HIDDEN, value),
        })  # fmt: skip
    else:  # gated full attention: q_proj gives each head's query and output gate
        a = p + "self_attn."
        t.update({
            a + "q_proj.weight": rl.linear(2 * HEADS * HEAD_DIM, HIDDEN),
            a + "k_proj.weight": rl.linear(KV_HEADS * HEAD_DIM, HIDDEN),
            a + "v_proj.weight": rl.linear(KV_HEADS * HEAD_DIM, HIDDEN),
            a + "o_proj.weight": rl.residual(HIDDEN, HEADS * HEAD_DIM),
            a + "q_norm.weight": rl.norm(HEAD_DIM),
            a + "k_norm.weight": rl.norm(HEAD_DIM),
        })  # fmt: skip
    t[p + "mlp.gate.weight"] = rl.linear(EXPERTS, HIDDEN)
    t[p + "mlp.shared_expert_gate.weight"] = rl.linear(1, HIDDEN)
    rl.mlp(p + "mlp.shared_expert.", SHARED_WIDTH)
    for e in range(EXPERTS):
        rl.mlp(f"{p}mlp.experts.{e}.", EXPERT_WIDTH)
    return t


def make_folder(folder: Path, layers: int, seed: int = 0) -> Path:
    return write_random_folder(
        folder,
        f"Qwen3-Next-80B-A3B-shaped model ({layers} layers)",
        lambda vocab, bos, eos: config(layers, vocab, bos, eos),
        lambda i, g: layer_tensors(i, layers, g),
        layers,
        HIDDEN,
        final_norm_offset=0.0,  # applied as 1 + w
        seed=seed,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/work/gguf-files/qwen3next"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--types", nargs="+", default=["Q4_K_M"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp-bin", type=Path)
    args = ap.parse_args()
    bin_dir = find_llamacpp_bin(args.llamacpp_bin)
    if bin_dir is None:
        sys.exit("llama.cpp's tools are not built (../shared/tools/build_llamacpp.sh)")
    args.out.mkdir(parents=True, exist_ok=True)
    prefix = f"qwen3next-80b-shape-{args.layers}l"
    folder = make_folder(args.out / f"{prefix}-hf", args.layers)
    # the folder has no multi-token-prediction layer (the real checkpoints' is not used here)
    convert = ("--no-mtp",)
    convert_and_quantize(folder, args.out, prefix, args.types, bin_dir, args.threads, convert)


if __name__ == "__main__":
    main()
