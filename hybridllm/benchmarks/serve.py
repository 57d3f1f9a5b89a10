"""`hybridllm bench serve`: load an OpenAI-compatible server with timed requests and report."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import sys
import time
from datetime import datetime
from typing import Any

import aiohttp

from hybridllm import envs
from hybridllm.benchmarks.datasets import BenchRequest, file_requests, random_requests
from hybridllm.benchmarks.serve_client import ENDPOINTS, RequestResult, ServerTarget, send_request
from hybridllm.benchmarks.serve_metrics import compute_metrics, format_report
from hybridllm.benchmarks.spec_decode_stats import SpecDecodeStats


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("target")
    g.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root URL (default http://127.0.0.1:8000)",
    )
    g.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=ENDPOINTS,
        help="API to call (default /v1/completions); /v1/chat/completions sends each prompt "
        "as one user message",
    )
    g.add_argument(
        "--keep-alive",
        action="store_true",
        help="reuse connections between requests; a request sent on a connection the server "
        "has just closed fails (reported, never retried). Default: a fresh connection per "
        "request, which a server closing its connections (llama-server) cannot break",
    )
    g.add_argument(
        "--model",
        default=None,
        help="model name to send (default: the first of the server's /v1/models)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="bearer token (default: $HYBRIDLLM_API_KEY or $OPENAI_API_KEY)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer (HF folder or .gguf) for prompt lengths; default: --model if "
        "it is a local path, else the embedded SmolLM2",
    )
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--dataset-path",
        default=None,
        help="prompts file: ShareGPT .json, .jsonl with 'prompt', or text lines "
        "(default: random prompts)",
    )
    g.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    g.add_argument(
        "--random-input-len",
        type=int,
        default=128,
        help="prompt tokens of random prompts (default 128)",
    )
    g.add_argument(
        "--random-output-len",
        type=int,
        default=128,
        help="max_tokens per request (default 128; a file's replies set their own)",
    )
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="draw lengths uniformly in len * [1 - r, 1 + r] (default 0)",
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight at once (default: no limit)",
    )
    g.add_argument(
        "--extra-body",
        type=_json_object,
        default={},
        help='JSON object merged into every request, e.g. \'{"logit_bias": {"2": -100}}\' '
        "to keep a server without ignore_eos from stopping early",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask the server to generate exactly max_tokens (vLLM's ignore_eos)",
    )
    g.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default 0)"
    )
    g.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="non-streaming requests (TTFT then equals the whole latency; no ITL)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default 0)")
    g = parser.add_argument_group("report")
    g.add_argument(
        "--percentiles",
        default="99",
        help="comma-separated latency percentiles to report (default 99)",
    )
    g.add_argument("--save-result", action="store_true", help="write the results as JSON")
    g.add_argument("--result-dir", default=".", help="folder of the JSON result (default .)")
    g.add_argument(
        "--result-filename",
        default=None,
        help="JSON file name (default: bench-serve-<model>-<time>.json)",
    )
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


async def run_benchmark(
    target: ServerTarget,
    requests: list[BenchRequest],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    show_progress: bool = True,
    keep_alive: bool = False,
) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals at `request_rate`); returns results and seconds."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = None
    if show_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="bench serve", unit="req")
    # The connection pool must not be the bottleneck: one connection per possible in-flight request.
    # A pooled connection can be closed by the server between two requests (llama-server closes
    # them after a response while announcing keep-alive); a POST written to it fails, and once its
    # bytes went to the socket the client cannot tell whether the server read them, so it cannot
    # be resent safely. A fresh connection per request (`Connection: close`) leaves no such race;
    # it costs a TCP handshake inside each request's TTFT (measured in docs/benchmarks.md).
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=not keep_alive)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)

    async def one(session: aiohttp.ClientSession, request: BenchRequest) -> RequestResult:
        if limit is None:
            result = await send_request(session, target, request)
        else:
            async with limit:
                result = await send_request(session, target, request)
        if bar is not None:
            bar.update(1)
        return result

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.ensure_future(one(session, request)))
            if request_rate != math.inf:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(results), duration


def main(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    percentiles = tuple(float(p) for p in args.percentiles.split(",") if p.strip())
    base_url = args.base_url.rstrip("/")
    api_key = args.api_key or envs.read(envs.API_KEY) or os.environ.get("OPENAI_API_KEY")
    model = args.model or asyncio.run(_first_model(base_url, api_key))
    tokenizer = _load_tokenizer(args.tokenizer, model)
    if args.dataset_path:
        requests = file_requests(
            args.dataset_path, tokenizer, args.num_prompts, args.random_output_len, args.seed
        )
    else:
        requests = random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    target = ServerTarget(
        url=base_url + args.endpoint,
        model=model,
        api_key=api_key,
        stream=args.stream,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=tuple(args.extra_body.items()),
    )
    # One short request first: a wrong URL, model or key fails here, not 500 times.
    probe = dataclasses.replace(requests[0], output_len=min(4, requests[0].output_len))
    probe_results, _ = asyncio.run(
        run_benchmark(target, [probe], show_progress=False, keep_alive=args.keep_alive)
    )
    if not probe_results[0].success:
        print(f"bench serve: the test request failed: {probe_results[0].error}", file=sys.stderr)
        return 1
    print(
        f"model {model} at {target.url}: {len(requests)} requests, rate {args.request_rate} "
        f"req/s, max concurrency {args.max_concurrency or 'unlimited'}",
        file=sys.stderr,
    )
    spec_before = asyncio.run(_spec_decode_stats(base_url, api_key))
    results, duration = asyncio.run(
        run_benchmark(
            target,
            requests,
            args.request_rate,
            args.max_concurrency,
            args.seed,
            show_progress=not args.disable_tqdm,
            keep_alive=args.keep_alive,
        )
    )
    metrics = compute_metrics(results, duration, percentiles)
    print(format_report(metrics))
    spec_after = asyncio.run(_spec_decode_stats(base_url, api_key))
    spec = None
    if spec_before is not None and spec_after is not None:
        spec = spec_after.since(spec_before)
        if spec.num_draft_tokens:
            print(spec.report())
    if args.save_result:
        path = _save(args, model, target, metrics, results, spec)
        print(f"results saved to {path}", file=sys.stderr)
    return 0 if metrics.completed else 1


async def _spec_decode_stats(base_url: str, api_key: str | None) -> SpecDecodeStats | None:
    """The server's speculative decoding counters from its /metrics (None: it has none, or
    the page cannot be read: the benchmark goes on without them)."""
    url = base_url.removesuffix("/v1") + "/metrics"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(url, headers=headers) as response:
                if response.status != 200:
                    return None
                return SpecDecodeStats.of_prometheus(await response.text())
    except (aiohttp.ClientError, OSError):
        return None


async def _first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base_url}/v1/models", headers=headers) as resp:
            if resp.status != 200:
                raise ValueError(f"GET {base_url}/v1/models answered {resp.status}; pass --model")
            data = (await resp.json()).get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


def _load_tokenizer(tokenizer: str | None, model: str) -> Any:
    from hybridllm.loader import default_model_path, open_model_source

    path = tokenizer or (model if os.path.exists(model) else default_model_path())
    return open_model_source(path).load_tokenizer()


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _save(
    args: argparse.Namespace,
    model: str,
    target: ServerTarget,
    metrics: Any,
    results: list[RequestResult],
    spec: SpecDecodeStats | None,
) -> str:
    name = args.result_filename or (
        f"bench-serve-{os.path.basename(model)}-{datetime.now():%Y%m%d-%H%M%S}.json"
    )
    path = os.path.join(args.result_dir, name)
    os.makedirs(args.result_dir, exist_ok=True)
    record = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if args.request_rate != math.inf else "inf",
        "max_concurrency": args.max_concurrency,
        "stream": target.stream,
        "ignore_eos": target.ignore_eos,
        "keep_alive": args.keep_alive,
        **dataclasses.asdict(metrics),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "errors": [r.error for r in results],
    }
    if spec is not None and spec.num_draft_tokens:
        record.update(spec.as_dict())
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    return path
