"""Single-stream decode with and without the native whole-layer op, and llama.cpp, in one run.

Runs the embedded SmolLM2 (or `--model`) in fresh processes that alternate between
`HYBRIDLLM_NATIVE_DECODE_LAYER=1` (each decoder layer of a decode step in one native call) and
`=0` (the per-op path), `--rounds` times each; every process warms up, then times 128 new
tokens after a 16-token prompt three times and reports its best. With `--llamacpp-bin DIR`,
`llama-bench -n 128 -p 0` on the same GGUF with the same threads, between the rounds.

    python benchmarks/bench_native_layer.py [--model M.gguf] [--rounds 3] [--llamacpp-bin D]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_offline import machine, write_results  # noqa: E402

NEW_TOKENS = 128

CHILD = r"""
import json, sys, time
from hybridllm import LLM, SamplingParams
llm = LLM(sys.argv[1] or None, use_tqdm=False, skip_tokenizer_init=True)
params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
prompt = [{"prompt_token_ids": list(range(100, 116))}]
llm.generate(prompt, params)
best = 0.0
for _ in range(3):
    start = time.perf_counter()
    out = llm.generate(prompt, params)
    assert len(out[0].outputs[0].token_ids) == NEW_TOKENS, out
    best = max(best, NEW_TOKENS / (time.perf_counter() - start))
print(json.dumps(best))
llm.shutdown()
""".replace("NEW_TOKENS", str(NEW_TOKENS))


def hybridllm_rate(model: str, native: bool) -> float:
    env = dict(os.environ, HYBRIDLLM_NATIVE_DECODE_LAYER="1" if native else "0")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def llamacpp_rate(bin_dir: Path, model: str) -> float:
    done = subprocess.run(
        [str(bin_dir / "llama-bench"), "-m", model, "-t", str(os.cpu_count()), "-p", "0",
         "-n", str(NEW_TOKENS), "-r", "3", "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)[0]["avg_ts"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="a GGUF or HF folder (default: embedded)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llamacpp-bin", type=Path, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from hybridllm.loader import default_model_path

    model = args.model or default_model_path()
    rounds: dict[str, list[float]] = {"native layer": [], "per-op": [], "llama.cpp": []}
    for _ in range(args.rounds):
        rounds["native layer"].append(hybridllm_rate(model, True))
        rounds["per-op"].append(hybridllm_rate(model, False))
        if args.llamacpp_bin:
            rounds["llama.cpp"].append(llamacpp_rate(args.llamacpp_bin, model))
    results = {"machine": machine(), "model": os.path.basename(model), "new_tokens": NEW_TOKENS}
    for name, rates in rounds.items():
        if rates:
            results[name] = {
                "decode_tok_s": round(max(rates), 1),
                "rounds": [round(r, 1) for r in rates],
            }
    best = {name: max(rates) for name, rates in rounds.items() if rates}
    results["native_over_per_op"] = round(best["native layer"] / best["per-op"], 2)
    if "llama.cpp" in best:
        results["native_over_llamacpp"] = round(best["native layer"] / best["llama.cpp"], 2)
    write_results(results, args.json)


if __name__ == "__main__":
    main()
