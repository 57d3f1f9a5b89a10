"""Real GGUF files of Qwen3-30B-A3B-shaped layers, made by llama.cpp's own converter, importance
matrix and quantizer.

Qwen3-30B-A3B's layers at their real sizes (hidden 2048; 32 query and 4 KV heads of 128 with
q/k norms; 128 routed experts of width 768, top-8, no shared expert), `--layers` of them (default
6, so that the BF16 intermediate, the folder and either engine fit this 24 GiB machine: the real
model has 48). Random seeded weights (N(0, 1/fan_in), the residual projections scaled down),
SmolLM2's tokenizer and its 49,152-token vocabulary, an untied head, the checkpoint's per-expert
tensor names. Converted to BF16 GGUF by `convert_hf_to_gguf.py`; `llama-imatrix` makes an
importance matrix over this repository's documentation (the IQ1 / IQ2 types need one) and
`llama-quantize` makes each `--types` (default Q2_K and IQ2_XXS, the issue's expert types).

    .venv/bin/python benchmarks/make_qwen3moe_gguf.py [--out /work/gguf-files/qwen3moe]
        [--layers 6] [--types Q2_K IQ2_XXS] [--llamacpp-bin DIR]

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

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, TOP_K, EXPERT_WIDTH = 128, 8, 768


def config(layers: int, vocab: int, bos: int, eos: int):
    from transformers import Qwen3MoeConfig

    c = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=6144, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_WIDTH,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=bos, eos_token_id=eos, torch_dtype="bfloat16",
        rope_parameters=dict(rope_type="default", rope_theta=1e6),
    )  # fmt: skip
    c.architectures = ["Qwen3MoeForCausalLM"]
    return c


def layer_tensors(i: int, layers: int, g):
    """Layer `i`'s tensors, name -> bf16, in the checkpoint's names."""
    rl = RandomLayer(g, HIDDEN, layers)
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    rl.tensors.update({
        p + "input_layernorm.weight": rl.norm(HIDDEN),
        p + "post_attention_layernorm.weight": rl.norm(HIDDEN),
        a + "q_proj.weight": rl.linear(HEADS * HEAD_DIM, HIDDEN),
        a + "k_proj.weight": rl.linear(KV_HEADS * HEAD_DIM, HIDDEN),
        a + "v_proj.weight": rl.linear(KV_HEADS * HEAD_DIM, HIDDEN),
        a + "o_proj.weight": rl.residual(HIDDEN, HEADS * HEAD_DIM),
        a + "q_norm.weight": rl.norm(HEAD_DIM),
        a + "k_norm.weight": rl.norm(HEAD_DIM),
        p + "mlp.gate.weight": rl.linear(EXPERTS, HIDDEN),
    })  # fmt: skip
    for e in range(EXPERTS):
        rl.mlp(f"{p}mlp.experts.{e}.", EXPERT_WIDTH)
    return rl.tensors


def make_folder(folder: Path, layers: int, seed: int = 0) -> Path:
    return write_random_folder(
        folder,
        f"Qwen3-30B-A3B-shaped model ({layers} layers)",
        lambda vocab, bos, eos: config(layers, vocab, bos, eos),
        lambda i, g: layer_tensors(i, layers, g),
        layers,
        HIDDEN,
        final_norm_offset=1.0,
        seed=seed,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/work/gguf-files/qwen3moe"))
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--types", nargs="+", default=["Q2_K", "IQ2_XXS"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp-bin", type=Path)
    args = ap.parse_args()
    bin_dir = find_llamacpp_bin(args.llamacpp_bin)
    if bin_dir is None:
        sys.exit("llama.cpp's tools are not built (../shared/tools/build_llamacpp.sh)")
    args.out.mkdir(parents=True, exist_ok=True)
    prefix = f"qwen3moe-30b-a3b-shape-{args.layers}l"
    folder = make_folder(args.out / f"{prefix}-hf", args.layers)
    convert_and_quantize(
        folder, args.out, prefix, args.types, bin_dir, args.threads, importance_matrix=True
    )


if __name__ == "__main__":
    main()
