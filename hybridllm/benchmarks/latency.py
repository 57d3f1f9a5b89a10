"""`hybridllm bench latency`: offline, in-process end-to-end latency of one batch, repeated."""

from __future__ import annotations

import argparse
import statistics
import time

from hybridllm.benchmarks.offline import build_llm, random_token_prompts, save_json
from hybridllm.benchmarks.serve_metrics import percentile
from hybridllm.benchmarks.spec_decode_stats import SpecDecodeStats
from hybridllm.sampling_params import SamplingParams

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--batch-size", type=int, default=8, help="prompts per batch (default 8)")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens each (default 32)")
    g.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="tokens generated each; EOS is ignored (default 128)",
    )
    g.add_argument("--num-iters-warmup", type=int, default=1, help="untimed runs first (default 1)")
    g.add_argument("--num-iters", type=int, default=5, help="timed runs (default 5)")
    g.add_argument(
        "--fresh-prompts",
        action="store_true",
        help="new random prompts every run, so the prefix cache serves none of their tokens "
        "(default: the same prompts every run; from the second on the prefix cache serves "
        "their full blocks, and the runs time mostly decode)",
    )
    g.add_argument("--output-json", default=None, help="write the results to this JSON file")


def main(args: argparse.Namespace) -> int:
    if min(args.batch_size, args.input_len, args.output_len, args.num_iters) < 1:
        raise ValueError("--batch-size, --input-len, --output-len and --num-iters must be >= 1")
    llm = build_llm(args)
    latencies, cached = [], []
    try:
        prompts = random_token_prompts(llm, args.batch_size, args.input_len, args.seed)
        params = SamplingParams(
            temperature=1.0, top_p=1.0, max_tokens=args.output_len, ignore_eos=True
        )
        spec_before = SpecDecodeStats()
        for i in range(args.num_iters_warmup + args.num_iters):
            if i == args.num_iters_warmup:
                spec_before = SpecDecodeStats.of_engine(llm)
            if args.fresh_prompts and i > 0:
                prompts = random_token_prompts(llm, args.batch_size, args.input_len, args.seed + i)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            failed = [o for o in outputs if o.error]
            if failed:
                raise ValueError(f"{len(failed)} prompts failed, first: {failed[0].error}")
            if i >= args.num_iters_warmup:
                latencies.append(elapsed)
                cached.append(sum(o.num_cached_tokens for o in outputs))
        spec = SpecDecodeStats.of_engine(llm).since(spec_before)
    finally:
        llm.shutdown()
    record = {
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "avg_latency_s": statistics.fmean(latencies),
        "latencies_s": latencies,
        "percentiles_s": {str(p): percentile(latencies, p) for p in PERCENTILES},
        "output_tokens_per_s": args.batch_size * args.output_len / statistics.fmean(latencies),
        "fresh_prompts": args.fresh_prompts,
        # prompt tokens of each timed run that the prefix cache served
        "cached_prompt_tokens": cached,
    }
    if args.speculative_config is not None:
        record.update(spec.as_dict())
    print(
        f"Avg latency: {record['avg_latency_s']:.3f} s for a batch of {args.batch_size} "
        f"({args.input_len} in / {args.output_len} out), "
        f"{record['output_tokens_per_s']:.1f} output tokens/s"
    )
    for p, value in record["percentiles_s"].items():
        print(f"{p}% percentile latency: {value:.3f} s")
    print(
        f"Prompt tokens served by the prefix cache: {max(cached)} of "
        f"{args.batch_size * args.input_len} a run at most"
        + ("" if args.fresh_prompts else " (--fresh-prompts draws new prompts every run)")
    )
    if args.speculative_config is not None:
        print(spec.report())
    save_json(args.output_json, record)
    return 0
