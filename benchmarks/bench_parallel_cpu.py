"""CPU layouts side by side in one run: one worker vs pipeline and tensor parallel workers.

On the embedded SmolLM2 (fp32 activations), every engine alive at once and the rounds
alternating between them: one worker in the engine process on all cores, against
`pipeline_parallel_size=2` and `tensor_parallel_size=2` (`mp`: one process per worker, the cores
split between them). It measures what the parallel machinery costs or gains on one machine:
the shared-memory MessageQueue, the pipeline channel and micro-batches in flight (pipeline),
the shared-memory all-reduce (tensor). Single stream and throughput as bench_offline.py measures
them (fresh 128-token prompts, 128 new tokens; best of 3 single streams, best of 2 rounds of 64
prompts). `--quantization none` (the default) gives every layout fp32 weights; `auto` keeps the
GGUF blocks, tensor-parallel ranks their slices of them.

    python benchmarks/bench_parallel_cpu.py [--layouts single pp2 tp2] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_offline import (  # noqa: E402
    NUM_PROMPTS,
    PROMPT_LEN,
    ROUNDS,
    THROUGHPUT_ROUNDS,
    HybridRunner,
    alternate,
    machine,
    random_prompts,
    write_results,
)

LAYOUTS = {
    "single": {},
    "pp2": {"pipeline_parallel_size": 2},
    "tp2": {"tensor_parallel_size": 2},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--quantization", default="none", choices=["none", "auto"])
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    warmup, *singles = random_prompts(1 + ROUNDS, PROMPT_LEN, seed=1)
    batches = [
        random_prompts(NUM_PROMPTS, PROMPT_LEN, seed=2 + r) for r in range(THROUGHPUT_ROUNDS)
    ]
    runners = {
        name: HybridRunner(warmup, args.quantization, **LAYOUTS[name]) for name in args.layouts
    }
    results: dict = {"machine": machine(), "quantization": args.quantization}
    results.update(alternate(runners, singles, batches))
    for runner in runners.values():
        runner.close()
    write_results(results, args.json)


if __name__ == "__main__":
    main()
