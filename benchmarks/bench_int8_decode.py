"""Batch-1 decode of a GGUF file: hybridllm with fp32 and with int8 activations vs llama-bench.

A hybridllm engine on the file (the embedded SmolLM2 by default) for each activation mode
(`HYBRIDLLM_GGUF_ACTIVATIONS`, read when the engine loads: the native decode layer keeps it)
decodes NEW_TOKENS tokens after a PROMPT_LEN-token prompt, then llama.cpp's
`llama-bench -n NEW_TOKENS -p 0` (its tg test: decode from an empty context) runs on the same
file with as many threads; the three alternate for `--rounds` rounds and each reports its best.
`--prompt N` adds prefill: hybridllm's time to first token of an N-token prompt against
`llama-bench -p N -n 0`. Each round also times `torch.sum` over 1 GiB (this VM's read rate moves
within minutes) and reports the decode floor it implies: the file's bytes read once a token.

    python benchmarks/bench_int8_decode.py [--model F.gguf] [--llama-bench PATH] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_offline import machine, write_results  # noqa: E402
from hybridllm.layers import gguf_linear as gguf_linear_module  # noqa: E402

PROMPT_LEN = 8  # llama-bench's tg starts from an empty context: a short prompt here
NEW_TOKENS = 128


class Hybrid:
    """One engine with one activation mode; each call sets the mode again (the per-op path
    reads it at every call, the native decode layer kept it when the engine loaded)."""

    def __init__(self, model: str | None, mode: str):
        from hybridllm import LLM

        self.mode = mode
        self.set_activations()
        self.llm = LLM(model, dtype="float32", use_tqdm=False)
        self.vocab = self.llm.llm_engine.model_config.hf_config.vocab_size
        self.seed = 0

    def _prompt(self, length: int) -> list[int]:
        self.seed += 1
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, self.vocab - 3, (length,), generator=g).tolist()

    def set_activations(self) -> None:
        os.environ[gguf_linear_module.ACTIVATIONS_ENV] = self.mode
        gguf_linear_module.default_activations.cache_clear()

    def run(self, prompt_len: int, new_tokens: int) -> tuple[float, float]:
        """(time to first token, decode tokens/s after it), the engine stepped by hand."""
        from hybridllm import SamplingParams

        self.set_activations()
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        engine = self.llm.llm_engine
        t0 = time.perf_counter()
        engine.add_request(f"r{t0}", {"prompt_token_ids": self._prompt(prompt_len)}, params)
        ttft = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if ttft is None and out.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
        return ttft, (new_tokens - 1) / (time.perf_counter() - t0 - ttft)


def llama_bench(binary: str, model: str, threads: int, prompt: int, new: int) -> float:
    """llama-bench's tokens/s for one repetition of its pp (prompt) or tg (new) test."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(binary).parent)}
    cmd = [binary, "-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(new)]
    out = subprocess.run(cmd + ["-r", "1", "-o", "json"], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)[0]["avg_ts"]


def read_rate(buffer: torch.Tensor) -> float:
    """GB/s of `torch.sum` over `buffer`, the best of three: the memory's read rate this moment."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF file (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench binary (else hybridllm only)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=0, help="also time an N-token prefill")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    from hybridllm.loader import default_model_path

    model = args.model or str(default_model_path())
    threads = torch.get_num_threads()
    engines = {mode: Hybrid(args.model, mode) for mode in ("fp32", "int8")}
    for hybrid in engines.values():
        hybrid.run(PROMPT_LEN, 16)  # warm-up: pages faulted in
    rounds: dict[str, list[float]] = {}
    prefill: dict[str, list[float]] = {}
    rates: list[float] = []
    buffer = torch.ones(1 << 28)  # 1 GiB of fp32
    for _ in range(args.rounds):
        rates.append(read_rate(buffer))
        for mode, hybrid in engines.items():
            rounds.setdefault(f"hybridllm {mode}", []).append(hybrid.run(PROMPT_LEN, NEW_TOKENS)[1])
            if args.prompt:
                ttft, _ = hybrid.run(args.prompt, 1 + 1)
                prefill.setdefault(f"hybridllm {mode}", []).append(args.prompt / ttft)
        if args.llama_bench:
            tg = llama_bench(args.llama_bench, model, threads, 0, NEW_TOKENS)
            rounds.setdefault("llama.cpp", []).append(tg)
            if args.prompt:
                pp = llama_bench(args.llama_bench, model, threads, args.prompt, 0)
                prefill.setdefault("llama.cpp", []).append(pp)
    for hybrid in engines.values():
        hybrid.llm.shutdown()
    file_gb = Path(model).stat().st_size / 1e9
    results = {
        "machine": machine(),
        "model": Path(model).name,
        "threads": threads,
        # an upper bound on a token's bytes (the embedding table is read a row at a time)
        "memory": {
            "sum_gb_s_rounds": [round(r, 1) for r in rates],
            "file_gb": round(file_gb, 3),
            "floor_tok_s_rounds": [round(r / file_gb, 1) for r in rates],
        },
    }
    for name, values in rounds.items():
        results[name] = {"decode_tok_s": max(values), "rounds": [round(v, 1) for v in values]}
        if name in prefill:
            results[name]["prefill_tok_s"] = max(prefill[name])
            results[name]["prefill_rounds"] = [round(v, 1) for v in prefill[name]]
    write_results(results, args.json)


if __name__ == "__main__":
    main()
