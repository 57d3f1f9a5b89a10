"""`hybridllm bench throughput`: offline, in-process tokens/s for a batch of random prompts."""

from __future__ import annotations

import argparse
import time

from hybridllm.benchmarks.offline import build_llm, random_token_prompts, save_json
from hybridllm.benchmarks.spec_decode_stats import SpecDecodeStats
from hybridllm.sampling_params import SamplingParams


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--num-prompts", type=int, default=100, help="prompts in the batch (default 100)"
    )
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens each (default 128)")
    g.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="tokens generated each; EOS is ignored so all reach it (default 128)",
    )
    g.add_argument("--output-json", default=None, help="write the results to this JSON file")


def main(args: argparse.Namespace) -> int:
    if min(args.num_prompts, args.input_len, args.output_len) < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    llm = build_llm(args)
    try:
        prompts = random_token_prompts(llm, args.num_prompts, args.input_len, args.seed)
        params = SamplingParams(
            temperature=1.0, top_p=1.0, max_tokens=args.output_len, ignore_eos=True
        )
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
        spec = SpecDecodeStats.of_engine(llm)
    finally:
        llm.shutdown()
    failed = [o for o in outputs if o.error]
    if failed:
        raise ValueError(f"{len(failed)} prompts failed, first: {failed[0].error}")
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    record = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
    }
    if args.speculative_config is not None:
        record.update(spec.as_dict())
    print(
        f"Throughput: {record['requests_per_s']:.2f} requests/s, "
        f"{record['total_tokens_per_s']:.2f} total tokens/s, "
        f"{record['output_tokens_per_s']:.2f} output tokens/s "
        f"({len(outputs)} requests in {elapsed:.2f} s)"
    )
    if args.speculative_config is not None:
        print(spec.report())
    save_json(args.output_json, record)
    return 0
