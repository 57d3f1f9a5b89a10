"""CPU layouts side by side in one run: one worker vs pipeline and tensor parallel workers.

On the embedded SmolLM2 (fp32 activations), every engine alive at once and the rounds
alternating between them: one worker in the engine process on all cores, against
`pipeline_parallel_size=2` and `tensor_parallel_size=2` (`mp`: one process per worker, the cores
split between them). It measures what the parallel machinery costs or gains on one machine:
the shared-memory MessageQueue, the pipeline channel and micro-batches in flight (pipeline),
the shared-memory all-reduce (tensor). Single stream: 128 new tokens after a fresh 128-token
prompt, best of 3 rounds; throughput: 64 fresh prompts x 128 tokens, best of 2 rounds.
Tensor parallelism dequantizes GGUF blocks at load, so every layout runs `quantization="none"`
(fp32 weights) by default; `--quantization auto` keeps the blocks where a layout can.

    python benchmarks/bench_parallel_cpu.py [--layouts single pp2 tp2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hybridllm import LLM, SamplingParams

PROMPT_LEN = 128
NEW_TOKENS = 128
NUM_PROMPTS = 64
ROUNDS = 3
THROUGHPUT_ROUNDS = 2
LAYOUTS = {
    "single": {},
    "pp2": {"pipeline_parallel_size": 2},
    "tp2": {"tensor_parallel_size": 2},
}


def random_prompts(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    # ordinary vocabulary ids (SmolLM2's specials sit below 100)
    return [
        {"prompt_token_ids": torch.randint(1000, 40000, (PROMPT_LEN,), generator=g).tolist()}
        for _ in range(n)
    ]


def single_stream(llm: LLM, prompt: dict, params: SamplingParams) -> tuple[float, float]:
    """(time to first token, decode tokens/s after it), the engine stepped by hand."""
    engine = llm.llm_engine
    start = time.perf_counter()
    engine.add_request(f"single-{start}", prompt, params)
    ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.outputs[0].token_ids:
                ttft = time.perf_counter() - start
    return ttft, (NEW_TOKENS - 1) / (time.perf_counter() - start - ttft)


def throughput(llm: LLM, prompts: list[dict], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--quantization", default="none", choices=["none", "auto"])
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    warmup, *singles = random_prompts(1 + ROUNDS, seed=1)
    engines = {}
    for name in args.layouts:
        llm = LLM(dtype="float32", quantization=args.quantization, use_tqdm=False, **LAYOUTS[name])
        llm.generate([warmup], params)
        engines[name] = llm
    results: dict = {
        "machine": f"{torch.get_num_threads()} threads, torch {torch.__version__}",
        "quantization": args.quantization,
    }
    rounds = {name: [] for name in engines}
    for prompt in singles:
        for name, llm in engines.items():
            rounds[name].append(single_stream(llm, prompt, params))
    batches = {name: [] for name in engines}
    for r in range(THROUGHPUT_ROUNDS):
        prompts = random_prompts(NUM_PROMPTS, seed=2 + r)
        for name, llm in engines.items():
            batches[name].append(throughput(llm, prompts, params))
    for name, llm in engines.items():
        results[name] = {
            "ttft_s": min(t for t, _ in rounds[name]),
            "decode_tok_s": max(d for _, d in rounds[name]),
            "decode_tok_s_rounds": [round(d, 1) for _, d in rounds[name]],
            "throughput_tok_s": max(batches[name]),
            "throughput_tok_s_rounds": [round(t, 1) for t in batches[name]],
        }
        llm.shutdown()
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
