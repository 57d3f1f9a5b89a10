"""Serving benchmark, side by side in one run: `hybridllm serve` vs llama.cpp's server.

Both serve the same embedded SmolLM2 GGUF and read its quantized blocks (hybridllm's CPU worker
computes from them in fp32). Each server runs alone while it is measured; `hybridllm bench serve`
drives both with random prompts (default 128 tokens in, 128 out, ignore_eos) at several
concurrencies, on one endpoint, with fresh connections or keep-alive (`--connections`).

    python benchmarks/bench_serve_vs_llamacpp.py --llama-server /path/to/bin/llama-server \
        [--concurrency 1 8 32] [--num-prompts 24 48 96] [--output-len 64] \
        [--endpoint /v1/chat/completions] [--connections fresh keep-alive] [--out bench_results]

llama.cpp is an optional benchmark dependency, one of:
- `--llama-server BIN`: llama.cpp's own server (`bash ../shared/tools/build_llamacpp.sh` builds
  it), run with `-np --parallel -c --ctx` slots;
- `--llamacpp-python PY`: a Python with `llama-cpp-python[server]` (one request at a time).
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
    base_url: str, args: argparse.Namespace, concurrency: int, num_prompts: int, name: str
) -> dict:
    filename = f"{name}-c{concurrency}.json"
    cmd = [
        sys.executable, "-m", "hybridllm", "bench", "serve",
        "--base-url", base_url, "--model", "smollm2", "--tokenizer", default_model_path(),
        "--endpoint", args.endpoint,
        "--num-prompts", str(num_prompts), "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--max-concurrency", str(concurrency),
        "--ignore-eos", "--temperature", "0", "--disable-tqdm",
        # llama-cpp-python has no ignore_eos: a -100 bias on EOS makes both run full length.
        "--extra-body", json.dumps({"logit_bias": {str(eos_token_id()): -100}}),
        "--save-result", "--result-dir", args.out, "--result-filename", filename,
    ]  # fmt: skip
    if name.endswith("keep-alive"):
        cmd.append("--keep-alive")
    # No check: a run whose requests all failed exits 1 and still wrote its failure report.
    subprocess.run(cmd)
    path = os.path.join(args.out, filename)
    if not os.path.exists(path):
        raise RuntimeError(f"bench serve wrote no result for {name} at concurrency {concurrency}")
    with open(path) as f:
        return json.load(f)


def eos_token_id() -> int:
    from hybridllm.loader import open_model_source

    return int(open_model_source(default_model_path()).generation_config["eos_token_id"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    ap.add_argument("--llamacpp-python", default=None, help="Python with llama-cpp-python[server]")
    ap.add_argument("--parallel", type=int, default=32, help="llama-server slots (-np)")
    ap.add_argument("--ctx", type=int, default=16384, help="llama-server context, all slots (-c)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument(
        "--num-prompts",
        type=int,
        nargs="+",
        default=[200],
        help="one per concurrency, or one for all",
    )
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens (default 128)")
    ap.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=["/v1/completions", "/v1/chat/completions"],
    )
    ap.add_argument(
        "--connections",
        nargs="+",
        default=["fresh"],
        choices=["fresh", "keep-alive"],
        help="a fresh connection per request, reused ones (--keep-alive), or both in turn",
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
    if "llama.cpp" in args.engines and not (args.llama_server or args.llamacpp_python):
        ap.error("measuring llama.cpp needs --llama-server or --llamacpp-python")
    os.makedirs(args.out, exist_ok=True)
    prompts = (
        args.num_prompts * len(args.concurrency) if len(args.num_prompts) == 1 else args.num_prompts
    )
    gguf = default_model_path()
    keys = [
        "output_throughput",
        "completed",
        "failed",
        "failure_reasons",
        "duration_s",
        "ttft",
        "tpot",
        "itl",
        "e2el",
    ]

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
    if args.llama_server:
        llama_cmd = [
            args.llama_server,
            "-m", gguf, "--alias", "smollm2", "--host", "127.0.0.1", "--port", str(port),
            "-np", str(args.parallel), "-c", str(args.ctx), "-t", str(args.threads),
        ]  # fmt: skip
        llama_ready = "/health"
    else:
        llama_cmd = [
            str(args.llamacpp_python),
            "-m", "llama_cpp.server", "--model", gguf, "--model_alias", "smollm2",
            "--port", str(port), "--host", "127.0.0.1", "--n_ctx", "2048",
            "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
        ]  # fmt: skip
        llama_ready = "/v1/models"
    for name, cmd, ready in (
        ("hybridllm", hybrid_cmd, "/health"),
        ("llama.cpp", llama_cmd, llama_ready),
    ):
        if name not in args.engines:
            continue
        base = f"http://127.0.0.1:{port}"
        with server(cmd, base + ready, os.path.join(args.out, f"{name}-server.log")):
            for mode in args.connections:
                key = f"{name} {mode}"
                results[key] = {}
                for c, n in zip(args.concurrency, prompts):
                    r = run_bench(base, args, c, n, f"{name}-{mode}")
                    results[key][c] = {k: r.get(k) for k in keys} | {"num_prompts": n}
    print(json.dumps(results, indent=2))
    with open(os.path.join(args.out, "serve_vs_llamacpp.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
