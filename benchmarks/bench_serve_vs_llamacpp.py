"""Serving benchmark, side by side in one run: `hybridllm serve` vs llama-cpp-python's OpenAI server.

Both serve the same embedded SmolLM2 GGUF and read its quantized blocks (hybridllm's CPU worker
computes from them in fp32). Each server runs alone while it is measured; `hybridllm bench serve` drives both with
random 128-token prompts and 128 output tokens (ignore_eos) at several concurrencies.

    python benchmarks/bench_serve_vs_llamacpp.py --llamacpp-python /path/to/venv/bin/python \
        [--concurrency 1 8 32] [--num-prompts 200] [--out bench_results]

llama-cpp-python is an optional benchmark dependency: `pip install 'llama-cpp-python[server]'`
(it compiles llama.cpp from source) into any Python, named by --llamacpp-python.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

from hybridllm.loader import default_model_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout} s")


@contextmanager
def server(cmd: list[str], ready_url: str, log_path: str):
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(ready_url, proc)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_bench(
    base_url: str, model: str, concurrency: int, num_prompts: int, out: str, name: str
) -> dict:
    filename = f"{name}-c{concurrency}.json"
    cmd = [
        sys.executable, "-m", "hybridllm", "bench", "serve",
        "--base-url", base_url, "--model", model, "--tokenizer", default_model_path(),
        "--num-prompts", str(num_prompts), "--random-input-len", "128",
        "--random-output-len", "128", "--max-concurrency", str(concurrency),
        "--ignore-eos", "--temperature", "0", "--disable-tqdm",
        # llama-cpp-python has no ignore_eos: a -100 bias on EOS makes both run full length.
        "--extra-body", json.dumps({"logit_bias": {str(eos_token_id()): -100}}),
        "--save-result", "--result-dir", out, "--result-filename", filename,
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    with open(os.path.join(out, filename)) as f:
        return json.load(f)


def eos_token_id() -> int:
    from hybridllm.loader import open_model_source

    return int(open_model_source(default_model_path()).generation_config["eos_token_id"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llamacpp-python", required=True, help="Python with llama-cpp-python[server]")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument(
        "--num-prompts",
        type=int,
        nargs="+",
        default=[200],
        help="one per concurrency, or one for all",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="bench_results")
    ap.add_argument(
        "--engines",
        nargs="+",
        default=["hybridllm", "llama.cpp"],
        choices=["hybridllm", "llama.cpp"],
        help="which servers to measure",
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    prompts = (
        args.num_prompts * len(args.concurrency) if len(args.num_prompts) == 1 else args.num_prompts
    )
    gguf = default_model_path()
    keys = ["output_throughput", "completed", "failed", "duration_s", "ttft", "tpot", "itl"]

    results: dict[str, dict[int, dict]] = {}
    port = free_port()
    hybrid_cmd = [
        sys.executable,
        "-m",
        "hybridllm",
        "serve",
        "--port",
        str(port),
        "--served-model-name",
        "smollm2",
        "--log-level",
        "warning",
    ]
    llama_cmd = [
        args.llamacpp_python,
        "-m",
        "llama_cpp.server",
        "--model",
        gguf,
        "--model_alias",
        "smollm2",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--n_ctx",
        "2048",
        "--n_threads",
        str(args.threads),
        "--n_threads_batch",
        str(args.threads),
    ]
    for name, cmd, ready in (
        ("hybridllm", hybrid_cmd, "/health"),
        ("llama.cpp", llama_cmd, "/v1/models"),
    ):
        if name not in args.engines:
            continue
        base = f"http://127.0.0.1:{port}"
        with server(cmd, base + ready, os.path.join(args.out, f"{name}-server.log")):
            results[name] = {}
            for c, n in zip(args.concurrency, prompts):
                r = run_bench(base, "smollm2", c, n, args.out, name)
                results[name][c] = {k: r.get(k) for k in keys} | {"num_prompts": n}
    print(json.dumps(results, indent=2))
    with open(os.path.join(args.out, "serve_vs_llamacpp.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
