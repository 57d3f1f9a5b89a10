"""CPU decode and batch throughput of a random Qwen3-30B-A3B-shaped MoE GGUF (hybridllm side only).

Writes a `qwen3moe` GGUF with Qwen3-30B-A3B's layer shape (hidden 2048, 32 q / 4 kv heads of
128, 128 experts of width 768, top-8) and `--layers` layers, every linear and expert stack in
random Q4_K super-blocks (gguf cannot quantize to K-quants), the router and norms F32, a small
vocabulary (so the decoder layers are nearly all the bytes; the real model's 151k-row head is
not measured). Then measures, on the CPU worker computing from the blocks: decode tokens/s of one
stream (`--output-len` new tokens after a 128-token prompt) and the throughput of
`--num-prompts` prompts of `--input-len` tokens generating `--output-len` each. Each layer's
routed experts are about 340 MB of Q4_K; a decode token reads 8 of 128 of them.

    python benchmarks/bench_moe_cpu.py [--layers 4] [--num-prompts 64] [--json F]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, TOP_K, EXPERT_WIDTH, VOCAB = 128, 8, 768, 2048
Q4_K = gguf.GGMLQuantizationType.Q4_K


def q4_k_blocks(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K super-blocks [*shape[:-1], shape[-1] / 256 * 144] with small positive scales."""
    rows = int(np.prod(shape[:-1]))
    raw = rng.integers(0, 256, size=(rows * shape[-1] // 256, 144), dtype=np.uint8)
    raw[:, :4] = rng.uniform(1e-4, 6e-4, size=(len(raw), 2)).astype(np.float16).view(np.uint8)
    return raw.reshape(*shape[:-1], -1)


def write_model(path: Path, layers: int) -> Path:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(6144)
    w.add_expert_feed_forward_length(EXPERT_WIDTH)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(TOP_K)

    def quantized(name: str, shape: tuple[int, ...]) -> None:
        blocks = q4_k_blocks(shape, rng)
        w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=Q4_K)

    def floats(name: str, shape: tuple[int, ...], scale: float = 1.0) -> None:
        data = rng.standard_normal(shape).astype(np.float32) * scale
        w.add_tensor(name, data + (1.0 if scale == 0.0 else 0.0))

    floats("token_embd.weight", (VOCAB, HIDDEN), 0.02)
    floats("output_norm.weight", (HIDDEN,), 0.0)
    quantized("output.weight", (VOCAB, HIDDEN))
    for i in range(layers):
        floats(f"blk.{i}.attn_norm.weight", (HIDDEN,), 0.0)
        floats(f"blk.{i}.ffn_norm.weight", (HIDDEN,), 0.0)
        floats(f"blk.{i}.attn_q_norm.weight", (HEAD_DIM,), 0.0)
        floats(f"blk.{i}.attn_k_norm.weight", (HEAD_DIM,), 0.0)
        quantized(f"blk.{i}.attn_q.weight", (HEADS * HEAD_DIM, HIDDEN))
        quantized(f"blk.{i}.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        quantized(f"blk.{i}.attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        quantized(f"blk.{i}.attn_output.weight", (HIDDEN, HEADS * HEAD_DIM))
        floats(f"blk.{i}.ffn_gate_inp.weight", (EXPERTS, HIDDEN), 0.02)
        quantized(f"blk.{i}.ffn_gate_exps.weight", (EXPERTS, EXPERT_WIDTH, HIDDEN))
        quantized(f"blk.{i}.ffn_up_exps.weight", (EXPERTS, EXPERT_WIDTH, HIDDEN))
        quantized(f"blk.{i}.ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_WIDTH))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def prompts(n: int, length: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, VOCAB, length).tolist()} for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    from hybridllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(Path(tmp) / "qwen3moe-a3b-layers.gguf", args.layers)
        llm = LLM(
            str(path),
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=args.input_len + args.output_len + 8,
            max_num_seqs=max(args.num_prompts, 1),
            cpu_threads=args.cpu_threads,
            use_tqdm=False,
        )
        try:
            params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            llm.generate(prompts(1, 16, 0), SamplingParams(max_tokens=4))  # warm-up
            one = prompts(1, args.input_len, 1)
            first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(one, first)
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate(one, params)
            decode_tps = (args.output_len - 1) / (time.perf_counter() - start - ttft)
            batch = prompts(args.num_prompts, args.input_len, 2)
            start = time.perf_counter()
            llm.generate(batch, params)
            elapsed = time.perf_counter() - start
        finally:
            llm.shutdown()
    result = {
        "layers": args.layers,
        "batch1_decode_tokens_per_s": round(decode_tps, 2),
        "prompt_128_seconds": round(ttft, 3),
        "num_prompts": args.num_prompts,
        "throughput_output_tokens_per_s": round(args.num_prompts * args.output_len / elapsed, 2),
        "throughput_seconds": round(elapsed, 2),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
