"""How far int8 activations move a GGUF model's outputs from the fp32 path (`gguf_linear`).

An engine on the file (the embedded SmolLM2 by default) with prefill chunks of CHUNK tokens
(every linear call takes the int8 path when it is on, at any row count since the int8 GEMM;
before it, chunks had to stay under 24 rows). Teacher-forced: the
prompt logprobs of the prompts (the embedded model: English paragraphs and code; other files:
random token ids), position by position: |difference| of the actual next token's logprob, and
whether the top-1 tokens agree. Greedy: GREEDY_TOKENS generated: how many sequences are
identical, and where the others first differ. The same against a bf16 engine, for scale.

    python benchmarks/int8_agreement.py [--model F.gguf] [--json F]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_offline import write_results  # noqa: E402
from hybridllm.layers import gguf_linear as gguf_linear_module  # noqa: E402

CHUNK = 16  # prefill rows a step (the measurements below were taken with it; any size runs int8)
PROMPT_TOKENS = 256
GREEDY_TOKENS = 64
TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a screw press adapted from wine making. "
    "Within fifty years presses were running in more than two hundred European cities, and the "
    "price of books fell so far that reading spread from monasteries and courts to merchants, "
    "craftsmen and students. Pamphlets carried news and arguments faster than any rider could. ",
    "To make bread, mix flour, water, salt and yeast into a dough, knead it until it is smooth "
    "and elastic, and let it rise in a warm place until it doubles in size. Shape the loaf, let "
    "it rise again, then bake it in a hot oven until the crust is brown and the bottom sounds "
    "hollow when tapped. Cool it on a rack before slicing, or the crumb will be gummy. ",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n"
    "        return self.items.pop()\n\n    def __len__(self):\n        return len(self.items)\n",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant "
    "cells, chlorophyll absorbs red and blue light; the energy splits water molecules, releasing "
    "oxygen, and drives the synthesis of ATP and NADPH. The Calvin cycle then uses them to fix "
    "carbon dioxide into three-carbon sugars, which the plant turns into glucose and starch. ",
]


def set_activations(mode: str) -> None:
    os.environ[gguf_linear_module.ACTIVATIONS_ENV] = mode
    gguf_linear_module.default_activations.cache_clear()


def prompts_for(llm, vocab: int, count: int) -> list[list[int]]:
    tokenizer = llm.get_tokenizer() if hasattr(llm, "get_tokenizer") else None
    if tokenizer is not None and vocab > 1000:  # a real tokenizer: English text and code
        return [tokenizer.encode(text * 4)[:PROMPT_TOKENS] for text in TEXTS[:count]]
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, vocab - 3, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(count)
    ]


def compare(ref, other) -> dict:
    """Teacher-forced logprob differences and top-1 agreement; greedy divergence."""
    deltas, top1_same = [], 0
    for a, b in zip(ref[0], other[0]):
        positions = zip(a.prompt_token_ids[1:], a.prompt_logprobs[1:], b.prompt_logprobs[1:])
        for token, la, lb in positions:
            deltas.append(abs(la[token].logprob - lb[token].logprob))
            top1 = [min(d, key=lambda t: d[t].rank) for d in (la, lb)]
            top1_same += top1[0] == top1[1]
    first_diff = []
    for a, b in zip(ref[1], other[1]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        first_diff.append(next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta)))
    return {
        "teacher_forced_positions": len(deltas),
        "logprob_abs_diff_mean": round(statistics.fmean(deltas), 4),
        "logprob_abs_diff_p99": round(sorted(deltas)[int(0.99 * (len(deltas) - 1))], 4),
        "logprob_abs_diff_max": round(max(deltas), 4),
        "top1_agreement": round(top1_same / len(deltas), 4),
        "greedy_identical": f"{sum(d == GREEDY_TOKENS for d in first_diff)}/{len(first_diff)}",
        "greedy_first_difference": first_diff,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF file (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--prompts", type=int, default=len(TEXTS))
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    from hybridllm import LLM, SamplingParams

    forced = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    greedy = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    runs, prompts = {}, None
    # an engine per mode (the native decode layer keeps the mode it loaded with); bf16 (a bf16
    # engine, fp32 inside the op) as a yardstick: how far the commonest cheaper activation dtype
    # moves the same outputs
    for name, dtype, mode in (("fp32", "float32", "fp32"), ("int8", "float32", "int8"),
                              ("bf16", "bfloat16", "fp32")):  # fmt: skip
        set_activations(mode)
        llm = LLM(
            args.model,
            dtype=dtype,
            use_tqdm=False,
            max_num_batched_tokens=CHUNK,
            enable_prefix_caching=False,  # each mode computes every position itself
            max_model_len=PROMPT_TOKENS + GREEDY_TOKENS + 8,
        )
        if prompts is None:
            vocab = llm.llm_engine.model_config.hf_config.vocab_size
            prompts = prompts_for(llm, vocab, args.prompts)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        runs[name] = (llm.generate(inputs, forced), llm.generate(inputs, greedy))
        llm.shutdown()
    results = {
        "model": Path(args.model).name if args.model else "embedded SmolLM2-135M-Instruct Q4_1"
    }
    for name in ("int8", "bf16"):
        results[f"{name} vs fp32"] = compare(runs["fp32"], runs[name])
    write_results(results, args.json)


if __name__ == "__main__":
    main()
