"""CPU decode and batch throughput of a random Qwen3-30B-A3B-shaped MoE GGUF, hybridllm vs llama.cpp.

Writes a `qwen3moe` GGUF with Qwen3-30B-A3B's layer shape (hidden 2048, 32 q / 4 kv heads of
128, 128 experts of width 768, top-8) and `--layers` layers, every linear and expert stack in
random Q4_K super-blocks (gguf cannot quantize to K-quants), the router and norms F32, the
tests' 266-token tokenizer (so the decoder layers are nearly all the bytes; the real model's
151k-row head is not measured). Then measures, on the CPU worker computing from the blocks:
decode tokens/s of one stream (`--output-len` new tokens after a 128-token prompt) and the
throughput of `--num-prompts` prompts of `--input-len` tokens generating `--output-len` each
(output tokens over the whole run's time). Each layer's routed experts are about 340 MB of
Q4_K; a decode token reads 8 of 128 of them.

With `--llamacpp-bin DIR` (built by ../shared/tools/build_llamacpp.sh), the same file through
llama.cpp in the same run: `llama-bench -n OUT -p 0` for one stream's decode and
`llama-batched-bench -npp IN -ntg OUT -npl N` for the batch, whose figure is computed the same
way (B x OUT over its total time T). `--num-prompts 0` measures one stream only (quick enough for
files of many layers). `--kv-cache-dtype auto float32` runs hybridllm once per KV cache dtype
(auto is float16 here, as llama.cpp's f16 cache).

    python benchmarks/bench_moe_cpu.py [--layers 4] [--num-prompts 64] [--llamacpp-bin D] [--json F]
        [--kv-cache-dtype auto [float32 ...]]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.gguf_helpers import MERGES, SPECIAL_TOKENS, tokenizer_vocab  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, TOP_K, EXPERT_WIDTH = 128, 8, 768
VOCAB = len(tokenizer_vocab())
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
    vocab = tokenizer_vocab()  # llama.cpp needs a tokenizer in the file
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_merges(MERGES)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in vocab])
    w.add_bos_token_id(VOCAB - 2)
    w.add_eos_token_id(VOCAB - 1)
    w.add_add_bos_token(False)

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
    return [{"prompt_token_ids": rng.integers(0, VOCAB - 3, length).tolist()} for _ in range(n)]


def llamacpp(bin_dir: Path, model: Path, args: argparse.Namespace) -> dict:
    """llama.cpp on the same file: one stream's decode and the batched run's output tokens/s."""
    threads = str(args.cpu_threads or os.cpu_count())
    bench = subprocess.run(
        [str(bin_dir / "llama-bench"), "-m", str(model), "-t", threads, "-p", "0",
         "-n", str(args.output_len), "-r", "3", "-o", "json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    decode = json.loads(bench.stdout)[0]["avg_ts"]
    if not args.num_prompts:
        return {"batch1_decode_tokens_per_s": round(decode, 2)}
    context = args.num_prompts * (args.input_len + args.output_len) + 256
    batched = subprocess.run(
        [str(bin_dir / "llama-batched-bench"), "-m", str(model), "-t", threads,
         "-c", str(context), "-b", "2048", "-ub", "512", "-npp", str(args.input_len),
         "-ntg", str(args.output_len), "-npl", str(args.num_prompts), "--output-format", "jsonl"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    row = json.loads([line for line in batched.stdout.splitlines() if line.startswith("{")][-1])
    return {
        "batch1_decode_tokens_per_s": round(decode, 2),
        "throughput_output_tokens_per_s": round(args.num_prompts * args.output_len / row["t"], 2),
        "throughput_seconds": round(row["t"], 2),
        "batched_decode_tokens_per_s": round(row["speed_tg"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=64, help="0: batch 1 only")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--llamacpp-bin", type=Path, default=None, help="llama.cpp's bin folder")
    parser.add_argument("--tmp-dir", default=None, help="where the GGUF is written")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto"],
        choices=("auto", "float32", "float16", "bfloat16"),
        help="hybridllm's KV cache dtype(s), one run each",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
        path = write_model(Path(tmp) / "qwen3moe-a3b-layers.gguf", args.layers)
        result = {"layers": args.layers, "num_prompts": args.num_prompts}
        names = []
        for kv_dtype in args.kv_cache_dtype:
            name = "hybridllm" if kv_dtype == "auto" else f"hybridllm_kv_{kv_dtype}"
            result[name] = hybridllm(path, args, kv_dtype)
            names.append(name)
            print(json.dumps(result, indent=1), flush=True)
        if args.llamacpp_bin:
            theirs = result["llama.cpp"] = llamacpp(args.llamacpp_bin, path, args)
            for name in names:
                ours, suffix = result[name], name.removeprefix("hybridllm")
                result[f"ratio_batch1{suffix}"] = round(
                    ours["batch1_decode_tokens_per_s"] / theirs["batch1_decode_tokens_per_s"], 2
                )
                if args.num_prompts:
                    result[f"ratio_throughput{suffix}"] = round(
                        ours["throughput_output_tokens_per_s"]
                        / theirs["throughput_output_tokens_per_s"],
                        2,
                    )
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def check(outputs: list, output_len: int) -> None:
    """Every request generated all its tokens (a failed one would inflate the rate)."""
    for out in outputs:
        if len(out.outputs[0].token_ids) != output_len:
            raise RuntimeError(f"request {out.request_id} ended early: {out.outputs[0]}")


def hybridllm(path: Path, args: argparse.Namespace, kv_cache_dtype: str = "auto") -> dict:
    """One stream's time to first token and decode rate, then the batch's output tokens/s."""
    from hybridllm import LLM, SamplingParams

    llm = LLM(
        str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=args.input_len + args.output_len + 8,
        max_num_seqs=max(args.num_prompts, 1),
        cpu_threads=args.cpu_threads,
        kv_cache_dtype=kv_cache_dtype,
        use_tqdm=False,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        # warm-up with a full-length prompt: its prefill reads every expert once
        llm.generate(prompts(1, args.input_len, 0), SamplingParams(max_tokens=4))
        # two prompts of one length: the first times the prefill, the second (not in the
        # prefix cache) the whole request, whose decode is the difference
        first, second = prompts(2, args.input_len, 1)
        start = time.perf_counter()
        llm.generate([first], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        check(llm.generate([second], params), args.output_len)
        decode_tps = (args.output_len - 1) / (time.perf_counter() - start - ttft)
        if not args.num_prompts:  # --num-prompts 0: one stream only
            return {"batch1_decode_tokens_per_s": round(decode_tps, 2), "prompt_seconds": ttft}
        batch = prompts(args.num_prompts, args.input_len, 2)
        start = time.perf_counter()
        check(llm.generate(batch, params), args.output_len)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    return {
        "batch1_decode_tokens_per_s": round(decode_tps, 2),
        "prompt_seconds": round(ttft, 3),
        "throughput_output_tokens_per_s": round(args.num_prompts * args.output_len / elapsed, 2),
        "throughput_seconds": round(elapsed, 2),
    }


if __name__ == "__main__":
    main()
