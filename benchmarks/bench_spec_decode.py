"""Speculative decoding (n-gram or a draft model) against plain decoding, side by side, in
alternating rounds.

Three workloads on one model (the embedded SmolLM2 by default), each timed with and without
`speculative_config` in turn within every round, so both meet the machine's drifts alike:

- grounded: batch-1 greedy decode of code-editing prompts (repeat a source file with a change),
  where most of the answer is in the prompt;
- open: batch-1 sampled decode (temperature 0.8, seeded) of open-ended prompts;
- batch: 32 open-ended prompts at once (the batch guard's case).

Prints the median output tokens/s per workload and engine, the median of the rounds' ratios
(each round's two runs meet the same drift), and the drafts' acceptance (JSON with --json).
With `--draft-model PATH` the speculative engine drafts with that model instead of n-grams;
with `--llamacpp-bin DIR` too, llama.cpp's `llama-server` runs the batch-1 workloads in the same
rounds, plain and with the same draft (`-md`, `--spec-type draft-simple`), for GGUF files.

    python benchmarks/bench_spec_decode.py --rounds 3
    python benchmarks/bench_spec_decode.py --model TARGET.gguf --draft-model DRAFT.gguf \
        --dtype bfloat16 --workloads grounded,open --llamacpp-bin DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import urllib.request
from pathlib import Path

from bench_serve_vs_llamacpp import free_port, server

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


class LlamaServer:
    """A running `llama-server` of the target (and its draft): one completion at a time."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stats = SpecDecodeStats()

    def timed(self, prompts, params: SamplingParams, batch: bool) -> tuple[float, int]:
        assert not batch, "llama.cpp runs the batch-1 workloads only"
        start = time.perf_counter()
        tokens = 0
        for prompt in prompts:
            body = {
                "prompt": prompt,
                "n_predict": params.max_tokens,
                "temperature": params.temperature,
                "seed": params.seed if params.seed is not None else -1,
                "cache_prompt": True,  # as hybridllm's prefix cache
            }
            request = urllib.request.Request(
                self.url + "/completion", json.dumps(body).encode(), method="POST"
            )
            with urllib.request.urlopen(request, timeout=600) as response:
                timings = json.load(response)["timings"]
            tokens += timings["predicted_n"]
            drafted = timings.get("draft_n", 0)
            self.stats = SpecDecodeStats(
                self.stats.num_drafts + (1 if drafted else 0),
                self.stats.num_draft_tokens + drafted,
                self.stats.num_accepted_tokens + timings.get("draft_n_accepted", 0),
            )
        return time.perf_counter() - start, tokens


def start_llamacpp(stack, bin_dir: str, model: str, draft: str | None, k: int) -> LlamaServer:
    """llama-server of `model` on every CPU (with `draft` drafting k tokens, if given)."""
    port = free_port()
    cmd = [os.path.join(bin_dir, "llama-server"), "-m", model, "-t", str(os.cpu_count())]
    cmd += ["-c", "4096", "--port", str(port), "-np", "1"]
    if draft is not None:
        cmd += ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(k)]
    env_path = os.environ.get("LD_LIBRARY_PATH", "")
    os.environ["LD_LIBRARY_PATH"] = f"{bin_dir}:{env_path}" if env_path else bin_dir
    name = "draft" if draft else "plain"
    stack.enter_context(
        server(cmd, f"http://127.0.0.1:{port}/health", f"/tmp/llama-server-{name}.log")
    )
    return LlamaServer(f"http://127.0.0.1:{port}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--workloads", default="grounded,open,batch", help="comma-separated subset to run"
    )
    parser.add_argument("--draft-model", default=None, help="draft with this model, not n-grams")
    parser.add_argument("--dtype", default="auto", help="the engines' dtype")
    parser.add_argument("--llamacpp-bin", default=None, help="llama.cpp's bin folder")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--spec-extra",
        type=json.loads,
        default={},
        help="more speculative_config keys, as JSON (e.g. '{\"prompt_lookup_min\": 1}')",
    )
    args = parser.parse_args()

    spec_config = {"method": "ngram", "num_speculative_tokens": args.k}
    spec = "ngram"
    if args.draft_model:
        spec_config = {"model": args.draft_model, "num_speculative_tokens": args.k}
        spec = "draft"
    spec_config.update(args.spec_extra)
    kwargs = {"use_tqdm": False, "max_model_len": 2048, "dtype": args.dtype}
    engines = {
        "plain": LLM(args.model, **kwargs),
        spec: LLM(args.model, **kwargs, speculative_config=spec_config),
    }
    tokenizer = engines["plain"].get_tokenizer()
    stack = contextlib.ExitStack()
    if args.llamacpp_bin:
        target = args.model or engines["plain"].llm_engine.model_config.model
        engines["llama.cpp plain"] = start_llamacpp(stack, args.llamacpp_bin, target, None, args.k)
        engines[f"llama.cpp {spec}"] = start_llamacpp(
            stack, args.llamacpp_bin, target, args.draft_model, args.k
        )
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
    names = {w: [n for n in engines if not (batch and n.startswith("llama.cpp"))]
             for w, (_, _, batch) in workloads.items()}  # fmt: skip
    rates = {w: {e: [] for e in names[w]} for w in workloads}
    spec_stats = {w: {e: SpecDecodeStats() for e in names[w]} for w in workloads}
    for workload, (prompts, _, batch) in workloads.items():  # warm-up: kernels, prefix caches
        for name in names[workload]:
            timed_on(engines[name], prompts, SamplingParams(temperature=0, max_tokens=8), batch)
    for round_index in range(args.rounds):
        for workload, (prompts, params, batch) in workloads.items():
            for name in names[workload]:
                engine = engines[name]
                before = stats_of(engine)
                seconds, tokens = timed_on(engine, prompts, params, batch)
                rates[workload][name].append(tokens / seconds)
                got = stats_of(engine).since(before)
                total = spec_stats[workload][name]
                spec_stats[workload][name] = SpecDecodeStats(
                    total.num_drafts + got.num_drafts,
                    total.num_draft_tokens + got.num_draft_tokens,
                    total.num_accepted_tokens + got.num_accepted_tokens,
                )
                print(f"round {round_index} {workload} {name}: {tokens / seconds:.1f} tok/s")
    record = {}
    print(
        "\n| workload | engine | tok/s (median) | ratio to plain (median of rounds) "
        "| rounds' ratios | acceptance | mean accepted length |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for workload in workloads:
        plain_rates = rates[workload]["plain"]
        record[workload] = {}
        for name in names[workload]:
            # each round's runs met the same drift: the per-round ratio is the robust one
            ratios = [b / a for a, b in zip(plain_rates, rates[workload][name])]
            stats = spec_stats[workload][name]
            rate = statistics.median(rates[workload][name])
            record[workload][name] = {
                "tok_s": rate,
                "ratio": statistics.median(ratios),
                "round_ratios": ratios,
                **stats.as_dict(),
            }
            drafted = stats.num_draft_tokens > 0
            # llama-server reports its drafts per request, not per step: no mean length there
            per_step = drafted and not name.startswith("llama.cpp")
            print(
                f"| {workload} | {name} | {rate:.1f} | {statistics.median(ratios):.2f}x | "
                f"{' '.join(f'{r:.2f}' for r in ratios)} | "
                f"{f'{stats.acceptance_rate:.0%}' if drafted else '-'} | "
                f"{f'{stats.mean_accepted_length:.2f}' if per_step else '-'} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
    for engine in engines.values():
        if isinstance(engine, LLM):
            engine.shutdown()
    stack.close()


def timed_on(engine, prompts, params: SamplingParams, batch: bool) -> tuple[float, int]:
    if isinstance(engine, LlamaServer):
        return engine.timed(prompts, params, batch)
    return timed(engine, prompts, params, batch)


def stats_of(engine) -> SpecDecodeStats:
    if isinstance(engine, LlamaServer):
        return engine.stats
    return SpecDecodeStats.of_engine(engine)


if __name__ == "__main__":
    main()
