"""llama.cpp's side of bench_offline.py, run in a Python that has llama-cpp-python.

Loads one GGUF with `llama_cpp.Llama` and answers JSON lines on stdin, one JSON line each on
stdout: {"single": [ids], "new_tokens": n} -> {"ttft_s", "decode_tok_s"};
{"throughput": [[ids], ...], "new_tokens": n} -> {"tok_s"} (prompts one after another: the
library generates one sequence at a time). Generation is greedy and does not stop at EOS (the
raw `generate` loop leaves stopping to its caller), like the other engines' ignore_eos.

    python benchmarks/llamacpp_worker.py MODEL.gguf THREADS CONTEXT
"""

from __future__ import annotations

import json
import sys
import time

from llama_cpp import Llama


def generate(llm: Llama, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(seconds to the first new token, seconds to the last)."""
    start = time.perf_counter()
    first = None
    count = 0
    for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        count += 1
        if first is None:
            first = time.perf_counter() - start
        if count == new_tokens:
            break
    return first, time.perf_counter() - start


def main() -> None:
    path, threads, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = Llama(model_path=path, n_threads=threads, n_ctx=context, n_batch=context, verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        n = request["new_tokens"]
        if "single" in request:
            ttft, total = generate(llm, request["single"], n)
            reply = {"ttft_s": ttft, "decode_tok_s": (n - 1) / (total - ttft)}
        else:
            start = time.perf_counter()
            for prompt in request["throughput"]:
                generate(llm, prompt, n)
            reply = {"tok_s": n * len(request["throughput"]) / (time.perf_counter() - start)}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
