"""Many prompts at once on one GGUF file, hybridllm against `llama-batched-bench`, in one run.

`--prompts` N prompts of `--prompt-len` random tokens (fresh ones each round: no prefix-cache
hits), `--new-tokens` greedy tokens each, EOS ignored: hybridllm's `LLM.generate` over all of them
(continuous batching, its default scheduler), timed from the call to the last output, against
`llama-batched-bench -npp P -ntg G -npl N` (N sequences decoding together, one prefill of all
prompts first) on the same file and threads. Rounds alternate (hybridllm, then llama.cpp); the
best of each is reported with every round. Compared: all tokens/s, prompt + generated over the
whole time (llama-batched-bench's `S`); also printed, hybridllm's generated tokens over the whole
time and llama.cpp's decode phase alone (`S_TG`).

    python benchmarks/bench_batch_gguf.py FILE.gguf [--prompts 64] [--prompt-len 128]
        [--new-tokens 32] [--rounds 2] [--threads 2] [--llamacpp-bin DIR]
"""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.make_gguf_files import find_llamacpp_bin, llamacpp_env  # noqa: E402


def run_llamacpp(bin_dir: Path, path: Path, args: argparse.Namespace) -> dict[str, float]:
    """llama-batched-bench's row for N sequences: generated tok/s (S_TG) and all tok/s (S)."""
    ctx = args.prompts * (args.prompt_len + args.new_tokens) + 256
    cmd = [
        str(bin_dir / "llama-batched-bench"), "-m", str(path), "-t", str(args.threads),
        "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(args.prompt_len),
        "-ntg", str(args.new_tokens), "-npl", str(args.prompts),
    ]  # fmt: skip
    out = subprocess.run(cmd, env=llamacpp_env(bin_dir), capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"llama-batched-bench failed:\n{out.stderr[-2000:]}")
    # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[2]) and int(cells[2]) == args.prompts:
            return {"decode_phase_tok_s": float(cells[7]), "all_tok_s": float(cells[9])}
    raise RuntimeError(f"no row for B={args.prompts} in:\n{out.stdout[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp-bin", type=Path)
    args = ap.parse_args()
    bin_dir = find_llamacpp_bin(args.llamacpp_bin)

    from hybridllm import LLM, SamplingParams

    llm = LLM(
        str(args.file),
        max_model_len=args.prompt_len + args.new_tokens + 16,
        max_num_seqs=args.prompts,
        skip_tokenizer_init=True,
        use_tqdm=False,
    )
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    rng = random.Random(0)
    ours, theirs = [], []
    for _ in range(args.rounds):
        prompts = [
            {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.prompt_len)]}
            for _ in range(args.prompts)
        ]
        start = time.perf_counter()
        llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        generated = args.prompts * args.new_tokens
        ours.append(
            {
                "gen_tok_s": generated / seconds,
                "all_tok_s": (generated + args.prompts * args.prompt_len) / seconds,
            }
        )
        if bin_dir is not None:
            theirs.append(run_llamacpp(bin_dir, args.file, args))
        print(f"round: hybridllm {ours[-1]}, llama.cpp {theirs[-1] if theirs else '-'}")
    llm.shutdown()
    best = max(ours, key=lambda r: r["all_tok_s"])
    line = f"{args.prompts} x {args.prompt_len} + {args.new_tokens}: hybridllm {best}"
    if theirs:
        their_best = max(theirs, key=lambda r: r["all_tok_s"])
        ratio = best["all_tok_s"] / their_best["all_tok_s"]
        line += f", llama.cpp {their_best}, all-tokens ratio {ratio:.2f}x"
    print(line)


if __name__ == "__main__":
    main()
