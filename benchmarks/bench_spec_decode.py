"""Speculative decoding (n-gram) against plain decoding, side by side, in alternating rounds.

Three workloads on one model (the embedded SmolLM2 by default), each timed with and without
`speculative_config` in turn within every round, so both meet the machine's drifts alike:

- grounded: batch-1 greedy decode of code-editing prompts (repeat a source file with a change),
  where most of the answer is in the prompt;
- open: batch-1 sampled decode (temperature 0.8, seeded) of open-ended prompts;
- batch: 32 open-ended prompts at once (the batch guard's case).

Prints the median output tokens/s per workload and engine, the median of the rounds' ratios
(each round's two runs meet the same drift), and the drafts' acceptance (JSON with --json).

    python benchmarks/bench_spec_decode.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from hybridllm import LLM, SamplingParams
from hybridllm.benchmarks.spec_decode_stats import SpecDecodeStats

REPO = Path(__file__).resolve().parents[1]
EDIT_FILES = [
    "hybridllm/engine/block_pool.py",
    "hybridllm/engine/stop_checker.py",
    "hybridllm/sample/penalties.py",
    "hybridllm/spec_decode/ngram_index.py",
]
OPEN_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of inflation, and how do central banks respond?",
    "Describe a day in the life of a honeybee.",
    "Give me some ideas for a birthday party for a ten-year-old.",
]


def grounded_prompts(tokenizer, max_prompt_tokens: int) -> list[str]:
    """Chat prompts asking to repeat a source file with one small change."""
    prompts = []
    for name in EDIT_FILES:
        code = (REPO / name).read_text()
        ids = tokenizer.encode(code)[:max_prompt_tokens]
        code = tokenizer.decode(ids)
        message = (
            "Here is a Python file:\n\n```python\n" + code + "\n```\n\n"
            "Rewrite the whole file exactly as it is, but rename the first class to "
            "`Renamed`. Reply with the code only."
        )
        prompts.append(chat(tokenizer, message))
    return prompts


def chat(tokenizer, message: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )


def timed(llm: LLM, prompts, params, batch: bool) -> tuple[float, int]:
    """Seconds and output tokens of the prompts, one at a time or as one batch."""
    start = time.perf_counter()
    groups = [prompts] if batch else [[p] for p in prompts]
    tokens = 0
    for group in groups:
        for out in llm.generate(group, params, use_tqdm=False):
            tokens += sum(len(c.token_ids) for c in out.outputs)
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--workloads", default="grounded,open,batch", help="comma-separated subset to run"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    spec_config = {"method": "ngram", "num_speculative_tokens": args.k}
    engines = {
        "plain": LLM(args.model, use_tqdm=False, max_model_len=2048),
        "ngram": LLM(
            args.model, use_tqdm=False, max_model_len=2048, speculative_config=spec_config
        ),
    }
    tokenizer = engines["plain"].get_tokenizer()
    workloads = {
        "grounded": (
            grounded_prompts(tokenizer, 700),
            SamplingParams(temperature=0, max_tokens=args.output_len),
            False,
        ),
        "open": (
            [chat(tokenizer, p) for p in OPEN_PROMPTS],
            SamplingParams(temperature=0.8, seed=1, max_tokens=args.output_len),
            False,
        ),
        "batch": (
            [chat(tokenizer, OPEN_PROMPTS[i % 4]) for i in range(32)],
            SamplingParams(temperature=0.8, max_tokens=args.output_len),
            True,
        ),
    }
    workloads = {w: workloads[w] for w in args.workloads.split(",")}
    rates: dict[str, dict[str, list[float]]] = {w: {e: [] for e in engines} for w in workloads}
    spec_stats: dict[str, SpecDecodeStats] = {w: SpecDecodeStats() for w in workloads}
    for llm in engines.values():  # warm-up: kernels, prefix caches of the prompts
        for prompts, _, batch in workloads.values():
            timed(llm, prompts[:2], SamplingParams(temperature=0, max_tokens=8), batch)
    for round_index in range(args.rounds):
        for workload, (prompts, params, batch) in workloads.items():
            for name, llm in engines.items():
                before = SpecDecodeStats.of_engine(llm)
                seconds, tokens = timed(llm, prompts, params, batch)
                rates[workload][name].append(tokens / seconds)
                if name == "ngram":
                    got = SpecDecodeStats.of_engine(llm).since(before)
                    total = spec_stats[workload]
                    spec_stats[workload] = SpecDecodeStats(
                        total.num_drafts + got.num_drafts,
                        total.num_draft_tokens + got.num_draft_tokens,
                        total.num_accepted_tokens + got.num_accepted_tokens,
                    )
                print(f"round {round_index} {workload} {name}: {tokens / seconds:.1f} tok/s")
    record = {}
    print(
        "\n| workload | plain tok/s | ngram tok/s | ratio (median of rounds) | rounds' ratios "
        "| acceptance | mean accepted length |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for workload in workloads:
        plain = statistics.median(rates[workload]["plain"])
        ngram = statistics.median(rates[workload]["ngram"])
        # each round's two runs met the same drift: their ratio is the robust one
        ratios = [b / a for a, b in zip(rates[workload]["plain"], rates[workload]["ngram"])]
        ratio = statistics.median(ratios)
        stats = spec_stats[workload]
        record[workload] = {
            "plain": plain,
            "ngram": ngram,
            "ratio": ratio,
            "round_ratios": ratios,
            **stats.as_dict(),
        }
        print(
            f"| {workload} | {plain:.1f} | {ngram:.1f} | {ratio:.2f}x | "
            f"{' '.join(f'{r:.2f}' for r in ratios)} | "
            f"{stats.acceptance_rate:.0%} | {stats.mean_accepted_length:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
