"""CPU decode of a larger Llama-shaped GGUF than the embedded model, hybridllm vs llama.cpp in one run.

Writes a random LlamaForCausalLM of the chosen shape as a GGUF the way llama.cpp's converter does
(tests/gguf_helpers.py: permuted q/k, the tests' small tokenizer, so the LM head is tiny and the
decoder layers are nearly all the bytes), every linear in one block type (K-quants: random
super-blocks, since gguf cannot quantize to them; Q4_K_M/Q5_K_M: v and down Q6_K, the rest
Q4_K/Q5_K), and measures hybridllm (the CPU worker computing from the blocks) and llama.cpp
(llama-cpp-python's `Llama`, same threads) on it: time to first token of a 128-token prompt and
decode tokens/s of 128 new tokens after it, best of 3 (`--rounds`) alternating rounds with a
fresh prompt each, and the bandwidth floor of hybridllm's weight bytes a token. `--prompt-len N`
sets the prompt (and so the TTFT) length. With `--llamacpp-bin DIR` (a build of llama.cpp's
tools, ../shared/tools/build_llamacpp.sh), `llama-bench` takes its turn in every round on the
same file, a fresh process for each of `-p N` (the prompt) and `-n 128 -d N` (decoding after a
context as long), so that both engines meet the shared machine's drifts alike; the ratios
against it are reported. `--hf-twin` also saves the model as a Hugging Face folder and runs it
with on-load quantization into the same type (`--quantization q4_1`, say) beside its GGUF twin.

    python benchmarks/bench_cpu_gguf.py --llamacpp-python PY [--shape 1b|3b] [--type Q4_1] [--json F]
    python benchmarks/bench_cpu_gguf.py --type Q5_K_M --prompt-len 512 --llamacpp-bin DIR
    python benchmarks/bench_cpu_gguf.py --type Q4_1 --hf-twin
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_offline import (  # noqa: E402
    NEW_TOKENS,
    HybridRunner,
    LlamaCppRunner,
    alternate,
    machine,
    memory_bandwidth_gbs,
    write_results,
)
from tests.gguf_helpers import tokenizer_vocab, write_gguf  # noqa: E402

# Llama-3.2-1B's and 3B's decoders (their 128k vocabulary aside; the 3B's heads are 128 wide);
# "small" checks the script in seconds.
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
}  # fmt: skip
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Q4_K_M / Q5_K_M as llama.cpp's quantizer makes them, simplified: v and down Q6_K in every
# layer (it picks about half of them), the rest Q4_K / Q5_K.
K_M_PROJECTIONS = {"v_proj": "Q6_K", "down_proj": "Q6_K"}


def random_llama(shape: str):
    """A random fp32 LlamaForCausalLM of `shape` with the tests' vocabulary (seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = len(tokenizer_vocab())
    config = LlamaConfig(
        vocab_size=vocab, max_position_embeddings=4096, rms_norm_eps=1e-5,
        bos_token_id=vocab - 2, eos_token_id=vocab - 1, tie_word_embeddings=True, **SHAPES[shape],
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def write_model(path: Path, shape: str, type_name: str, hf_folder: Path | None = None) -> Path:
    model = random_llama(shape)
    config = model.config
    if hf_folder is not None:
        model.save_pretrained(hf_folder)

    def block_type(proj: str) -> GGMLQuantizationType:
        if type_name.endswith("_K_M"):
            return GGMLQuantizationType[K_M_PROJECTIONS.get(proj, type_name[:-2])]
        return GGMLQuantizationType[type_name]

    quantize = {
        f"model.layers.{i}.{part}.{proj}.weight": block_type(proj)
        for i in range(config.num_hidden_layers)
        for part, projs in (("self_attn", PROJECTIONS[:4]), ("mlp", PROJECTIONS[4:]))
        for proj in projs
    }
    return write_gguf(path, model, quantize=quantize)


def prompts(n: int, vocab: int, length: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab - 3, (length,), generator=g).tolist() for _ in range(n)]


class LlamaBenchRunner:
    """llama.cpp's `llama-bench` on the same file and threads as a runner of `alternate`'s
    rounds: a round's prompt tokens/s at the prompt's length (its own random tokens), and its
    decode tokens/s of NEW_TOKENS after a context as long (`-d`), as hybridllm decodes."""

    def __init__(self, bin_dir: Path, model: str):
        self.command = [str(bin_dir / "llama-bench"), "-m", model,
                        "-t", str(torch.get_num_threads()), "-r", "1", "-o", "json"]  # fmt: skip

    def tokens_per_s(self, *args: str) -> float:
        run = subprocess.run([*self.command, *args], check=True, capture_output=True, text=True)
        return json.loads(run.stdout)[0]["avg_ts"]

    def single(self, prompt: list[int]) -> tuple[float, float]:
        n = str(len(prompt))
        prefill = self.tokens_per_s("-p", n, "-n", "0")
        decode = self.tokens_per_s("-p", "0", "-n", str(NEW_TOKENS), "-d", n)
        return len(prompt) / prefill, decode

    def close(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--llamacpp-python", help="a Python with llama-cpp-python (else hybridllm only)"
    )
    ap.add_argument("--shape", default="1b", choices=list(SHAPES))
    ap.add_argument(
        "--type",
        default="Q4_1",
        choices=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M", "Q5_K_M"],
    )
    ap.add_argument(
        "--hf-twin",
        action="store_true",
        help="also run the model's HF folder quantized at load into --type (Q8_0, Q4_0, Q4_1)",
    )
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (TTFT's length)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (best of them)")
    ap.add_argument("--llamacpp-bin", type=Path, help="llama.cpp's tools: add `llama-bench`")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        hf_folder = Path(tmp) / "hf" if args.hf_twin else None
        path = str(write_model(Path(tmp) / "model.gguf", args.shape, args.type, hf_folder))
        warmup, *fresh = prompts(1 + args.rounds, len(tokenizer_vocab()), args.prompt_len)
        runners = {"hybridllm": HybridRunner(warmup, "auto", path)}
        if hf_folder is not None:
            quantization = args.type.lower()
            name = f"hybridllm HF folder --quantization {quantization}"
            runners[name] = HybridRunner(warmup, quantization, str(hf_folder), tokenizer=path)
        if args.llamacpp_python:
            runners["llama.cpp"] = LlamaCppRunner(args.llamacpp_python, warmup, path)
        if args.llamacpp_bin:
            runners["llama-bench"] = LlamaBenchRunner(args.llamacpp_bin, path)
        results = {"machine": machine(), "shape": args.shape, "type": args.type}
        results["prompt_len"] = args.prompt_len
        results.update(alternate(runners, fresh, batches=[]))
        if args.llamacpp_bin:
            ours, theirs = results["hybridllm"], results["llama-bench"]
            theirs["prefill_tok_s"] = args.prompt_len / theirs["ttft_s"]
            results["against llama-bench"] = {
                "decode": round(ours["decode_tok_s"] / theirs["decode_tok_s"], 2),
                "ttft": round(theirs["ttft_s"] / ours["ttft_s"], 2),
            }
        bandwidth = memory_bandwidth_gbs()
        weight_bytes = runners["hybridllm"].weight_bytes
        results.update(memory_bandwidth_gbs=bandwidth, weight_bytes_per_token=weight_bytes)
        results["bandwidth_floor_tok_s"] = bandwidth * 1e9 / weight_bytes
        for runner in runners.values():
            runner.close()
    write_results(results, args.json)


if __name__ == "__main__":
    main()
