"""Decode speed of two source trees of hybridllm on the same model, in alternating runs.

For a refactor that must not change speed: each round runs `hybridllm bench latency` once from
every tree (a fresh process each, `PYTHONPATH=TREE`), in turn, so both meet the machine's drifts
alike; the best and the median per tree and their ratio are printed (JSON with `--json`).
`bench latency` repeats its prompts, so the prefix cache serves them from its second run on: add
`--fresh-prompts` after `--` to time their prefill too.
A model argument of `1b:TYPE` writes the random 1B-shaped Llama GGUF of bench_cpu_gguf.py.

    python benchmarks/bench_trees.py --tree /work/baseline --tree . --rounds 5 \
        --model embedded --model 1b:Q4_K_M -- --batch-size 1 --input-len 32 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def model_path(spec: str, folder: Path) -> str | None:
    """The model argument for `bench latency` (None: the embedded default)."""
    if spec == "embedded":
        return None
    shape, _, type_name = spec.partition(":")
    if type_name:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from benchmarks.bench_cpu_gguf import write_model

        return str(write_model(folder / f"{shape}-{type_name}.gguf", shape, type_name))
    return spec  # a path


def run_once(tree: str, model: str | None, bench_args: list[str], out: Path) -> float:
    """Seconds of one batch (the bench's average latency), from `tree`."""
    cmd = [sys.executable, "-m", "hybridllm", "bench", "latency", "--output-json", str(out)]
    cmd += ([model] if model else []) + bench_args
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
    subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=tree)
    return float(json.loads(out.read_text())["avg_latency_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="a source tree (twice)")
    parser.add_argument("--model", action="append", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: bench latency's")
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.model or ["embedded"]:
            model = model_path(spec, Path(tmp))
            times: dict[str, list[float]] = {tree: [] for tree in args.tree}
            for _ in range(args.rounds):
                for tree in args.tree:
                    out = Path(tmp) / "latency.json"
                    times[tree].append(run_once(tree, model, bench_args, out))
            row = {"model": spec, "bench_args": bench_args, "seconds": times}
            for tree, values in times.items():
                print(
                    f"{spec:14s} {tree:24s} best {min(values):.4f} s  "
                    f"median {statistics.median(values):.4f} s  ({len(values)} runs)"
                )
            first, *others = args.tree
            for tree in others:
                ratio = min(times[first]) / min(times[tree])
                row[f"speed {tree} / {first}"] = ratio
                print(f"{spec:14s} speed of {tree} relative to {first} (best): {ratio:.3f}x")
            results.append(row)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
