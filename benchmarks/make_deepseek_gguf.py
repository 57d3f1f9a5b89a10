"""Real GGUF files of DeepSeek-V3-shaped layers, made by llama.cpp's own converter and quantizer.

DeepSeek-V3's layers at their real sizes (hidden 7168, 128 heads, MLA ranks 1536 / 512, rope 64,
nope 128, v 128, routed expert width 2048, top-8, one shared expert, a dense first layer of
width 18432, YaRN x40) with fewer routed experts and layers than the real 256 x 61, so that the
files and either engine's memory fit this 24 GiB machine: `--layers` (default 4: one dense, three
sparse) and `--experts` (default 32, in 8 groups with 4 kept, as V3's 256 in 8 with 4). Random
seeded weights (N(0, 1/fan_in), the residual projections scaled down), SmolLM2's tokenizer and its
49,152-token vocabulary, the checkpoint's per-expert tensor names. The folder is written
tensor by tensor (no model in memory), converted to BF16 GGUF by `convert_hf_to_gguf.py`, then
quantized by `llama-quantize` to each `--types` (default Q4_K_M and Q2_K).

    .venv/bin/python benchmarks/make_deepseek_gguf.py [--out /work/gguf-files/deepseek]
        [--layers 4] [--experts 32] [--types Q4_K_M Q2_K] [--llamacpp-bin DIR]

Idempotent, as make_gguf_files.py: each step is skipped when its output exists.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.make_gguf_files import (  # noqa: E402
    IMATRIX_CHUNKS,
    IMATRIX_CTX,
    find_llamacpp_bin,
    imatrix_text,
    llamacpp_source,
    log,
    run_tool,
    smollm2_tokenizer,
)

HIDDEN, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V = 7168, 128, 1536, 512, 128, 64, 128
DENSE_WIDTH, EXPERT_WIDTH, TOP_K = 18432, 2048, 8


def config(layers: int, experts: int, vocab: int, bos: int, eos: int):
    from transformers import DeepseekV3Config

    c = DeepseekV3Config(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=DENSE_WIDTH,
        moe_intermediate_size=EXPERT_WIDTH, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, n_shared_experts=1, n_routed_experts=experts,
        routed_scaling_factor=2.5, kv_lora_rank=KV_RANK, q_lora_rank=Q_RANK,
        qk_rope_head_dim=ROPE, v_head_dim=V, qk_nope_head_dim=NOPE, n_group=8, topk_group=4,
        num_experts_per_tok=TOP_K, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=bos, eos_token_id=eos, torch_dtype="bfloat16",
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                             original_max_position_embeddings=4096, mscale=1.0,
                             mscale_all_dim=1.0, beta_fast=32, beta_slow=1),
    )  # fmt: skip
    c.architectures = ["DeepseekV3ForCausalLM"]
    # as DeepSeek-V3's config.json has them: the converter writes expert_gating_func = sigmoid
    # from scoring_func (without it llama.cpp, and a reader of the file, route by softmax)
    c.scoring_func, c.topk_method = "sigmoid", "noaux_tc"
    return c


class RandomLayer:
    """Seeded bf16 tensors of one random layer, drawn from `g` in call order: linears
    N(0, 1/fan_in), the projections back into the residual stream scaled down by
    sqrt(2 * layers), norms `norm_offset` + N(0, 0.1) (1 for a norm applied as w, 0 as 1 + w).
    `tensors` collects them by checkpoint name."""

    def __init__(self, g, hidden: int, layers: int, norm_offset: float = 1.0):
        self.g, self.hidden, self.norm_offset = g, hidden, norm_offset
        self.resid = 1.0 / math.sqrt(2 * layers)
        self.tensors: dict = {}

    def randn(self, rows: int, cols: int, std: float):
        import torch

        return (torch.randn(rows, cols, generator=self.g) * std).to(torch.bfloat16)

    def linear(self, rows: int, cols: int):
        return self.randn(rows, cols, 1 / math.sqrt(cols))

    def residual(self, rows: int, cols: int):
        return self.randn(rows, cols, self.resid / math.sqrt(cols))

    def norm(self, n: int):
        import torch

        return (self.norm_offset + 0.1 * torch.randn(n, generator=self.g)).to(torch.bfloat16)

    def mlp(self, prefix: str, width: int) -> None:
        """A gated MLP's gate, up and down projections under `prefix`."""
        self.tensors[prefix + "gate_proj.weight"] = self.linear(width, self.hidden)
        self.tensors[prefix + "up_proj.weight"] = self.linear(width, self.hidden)
        self.tensors[prefix + "down_proj.weight"] = self.residual(self.hidden, width)


def layer_tensors(i: int, layers: int, experts: int, g):
    """Layer `i`'s tensors, name -> bf16, in the checkpoint's names."""
    import torch

    rl = RandomLayer(g, HIDDEN, layers)
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    rl.tensors.update({
        p + "input_layernorm.weight": rl.norm(HIDDEN),
        p + "post_attention_layernorm.weight": rl.norm(HIDDEN),
        a + "q_a_proj.weight": rl.linear(Q_RANK, HIDDEN),
        a + "q_a_layernorm.weight": rl.norm(Q_RANK),
        a + "q_b_proj.weight": rl.linear(HEADS * (NOPE + ROPE), Q_RANK),
        a + "kv_a_proj_with_mqa.weight": rl.linear(KV_RANK + ROPE, HIDDEN),
        a + "kv_a_layernorm.weight": rl.norm(KV_RANK),
        a + "kv_b_proj.weight": rl.linear(HEADS * (NOPE + V), KV_RANK),
        a + "o_proj.weight": rl.residual(HIDDEN, HEADS * V),
    })  # fmt: skip
    t = rl.tensors
    if i == 0:
        rl.mlp(p + "mlp.", DENSE_WIDTH)
        return t
    t[p + "mlp.gate.weight"] = rl.linear(experts, HIDDEN)
    t[p + "mlp.gate.e_score_correction_bias"] = (0.01 * torch.randn(experts, generator=g)).float()
    rl.mlp(p + "mlp.shared_experts.", EXPERT_WIDTH)
    for e in range(experts):
        rl.mlp(f"{p}mlp.experts.{e}.", EXPERT_WIDTH)
    return t


def make_folder(folder: Path, layers: int, experts: int, seed: int = 0) -> Path:
    return write_random_folder(
        folder,
        f"DeepSeek-V3-shaped model ({layers} layers, {experts} experts)",
        lambda vocab, bos, eos: config(layers, experts, vocab, bos, eos),
        lambda i, g: layer_tensors(i, layers, experts, g),
        layers,
        HIDDEN,
        final_norm_offset=1.0,
        seed=seed,
    )


def write_random_folder(
    folder: Path,
    description: str,
    make_config: Callable[[int, int, int], Any],
    make_layer: Callable[[int, Any], dict],
    layers: int,
    hidden: int,
    final_norm_offset: float,
    seed: int = 0,
) -> Path:
    """A Hugging Face folder of random seeded weights written shard by shard (no model in
    memory): SmolLM2's tokenizer, `make_config(vocab, bos, eos)`'s config, the embedding, head
    and final norm (`final_norm_offset` + N(0, 0.1): 1 for a norm applied as w, 0 as 1 + w),
    then `make_layer(i, generator)`'s tensors for each layer. Kept when it exists."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from safetensors.torch import save_file

    log(f"random {description} -> {folder}")
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = smollm2_tokenizer()
    tok.save_pretrained(tmp)
    vocab = len(tok)
    make_config(vocab, tok.bos_token_id, tok.eos_token_id).save_pretrained(tmp)
    g = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict) -> None:
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    std = 2.0 / math.sqrt(hidden)
    shard("embed.safetensors", {
        "model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=g) * std).bfloat16(),
        "lm_head.weight": (torch.randn(vocab, hidden, generator=g) * std).bfloat16(),
        "model.norm.weight": (
            final_norm_offset + 0.1 * torch.randn(hidden, generator=g)
        ).bfloat16(),
    })  # fmt: skip
    for i in range(layers):
        shard(f"layer-{i:02d}.safetensors", make_layer(i, g))
    with open(tmp / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    tmp.rename(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/work/gguf-files/deepseek"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--types", nargs="+", default=["Q4_K_M", "Q2_K"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp-bin", type=Path)
    args = ap.parse_args()
    bin_dir = find_llamacpp_bin(args.llamacpp_bin)
    if bin_dir is None:
        sys.exit("llama.cpp's tools are not built (../shared/tools/build_llamacpp.sh)")
    args.out.mkdir(parents=True, exist_ok=True)
    prefix = f"deepseek-v3-{args.layers}l-{args.experts}e"
    folder = make_folder(args.out / f"{prefix}-hf", args.layers, args.experts)
    convert_and_quantize(folder, args.out, prefix, args.types, bin_dir, args.threads)


def convert_and_quantize(
    folder: Path,
    out: Path,
    prefix: str,
    types: list[str],
    bin_dir: Path,
    threads: int,
    convert_args: tuple[str, ...] = (),
    importance_matrix: bool = False,
) -> None:
    """`folder` -> `out/prefix.BF16.gguf` (convert_hf_to_gguf.py) -> `out/prefix.TYPE.gguf`
    for each of `types` (llama-quantize, with `llama-imatrix`'s importance matrix of the BF16
    file where `importance_matrix`); a step whose output exists is skipped."""
    bf16 = out / f"{prefix}.BF16.gguf"
    if not bf16.is_file():
        log(f"convert_hf_to_gguf.py -> {bf16}")
        tmp = bf16.with_suffix(".tmp")
        script = llamacpp_source(bin_dir) / "convert_hf_to_gguf.py"
        cmd = [sys.executable, script, folder, "--outtype", "bf16", "--outfile", tmp, *convert_args]
        run_tool(cmd, bin_dir, out / "convert.log")
        tmp.rename(bf16)
    imatrix = out / f"{prefix}.imatrix.gguf"
    if importance_matrix and not imatrix.is_file():
        text = imatrix_text(out / "imatrix-text.txt", IMATRIX_CHUNKS * IMATRIX_CTX * 6)
        log(f"llama-imatrix ({IMATRIX_CHUNKS} chunks of {IMATRIX_CTX}) -> {imatrix}")
        tmp = imatrix.with_name(imatrix.name + ".tmp.gguf")
        cmd = [bin_dir / "llama-imatrix", "-m", bf16, "-f", text, "-o", tmp, "-c", IMATRIX_CTX]
        cmd += ["--chunks", IMATRIX_CHUNKS, "-t", threads, "--no-ppl"]
        run_tool(cmd, bin_dir, out / "imatrix.log")
        tmp.rename(imatrix)
    for type_name in types:
        path = out / f"{prefix}.{type_name}.gguf"
        if path.is_file():
            continue
        log(f"llama-quantize {type_name} -> {path}")
        tmp = path.with_name(path.name + ".tmp")
        cmd = [bin_dir / "llama-quantize"]
        cmd += ["--imatrix", imatrix] if importance_matrix else []
        cmd += [bf16, tmp, type_name, threads]
        run_tool(cmd, bin_dir, out / f"quantize-{type_name}.log")
        tmp.rename(path)
        log(f"{path}: {path.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
