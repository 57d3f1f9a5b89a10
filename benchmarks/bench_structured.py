"""Per-token cost of structured outputs: constrained vs free decoding, alternating rounds.

Each round decodes `--max-tokens` tokens for a batch of B prompts (B = 1 and 32) on the embedded
SmolLM2, once free (ignore_eos) and once under a JSON schema that cannot complete within
max_tokens (an array of at least 50 objects), so both decode the same number of tokens.
Prints seconds per generated token (median of the rounds) and the constrained overhead.
"""

from __future__ import annotations

import argparse
import statistics
import time

from hybridllm import LLM, SamplingParams, StructuredOutputsParams

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "minItems": 50, "items": ITEM}


def run_round(llm: LLM, batch: int, max_tokens: int, constrained: bool, seed: int) -> float:
    """Seconds per generated token for one batch (prefill included: prompts are ~10 tokens)."""
    structured = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = [
        SamplingParams(
            temperature=0.8,
            seed=seed * 1000 + i,
            max_tokens=max_tokens,
            ignore_eos=True,
            structured_outputs=structured,
        )
        for i in range(batch)
    ]
    prompts = [f"Round {seed}, list {i}: users as JSON:" for i in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if constrained and tokens != batch * max_tokens:
        raise RuntimeError(f"a constrained request ended early ({tokens} tokens)")
    return elapsed / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(max_model_len=512, max_num_seqs=64, use_tqdm=False)
    llm.generate(["warm up"], SamplingParams(max_tokens=8))  # kernels, first compile
    llm.generate(
        ["warm up"],
        SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    )
    for batch in [int(b) for b in args.batches.split(",")]:
        free, constrained = [], []
        for r in range(args.rounds):
            free.append(run_round(llm, batch, args.max_tokens, False, r))
            constrained.append(run_round(llm, batch, args.max_tokens, True, r))
        f, c = statistics.median(free), statistics.median(constrained)
        print(
            f"batch {batch:3d}: free {f * 1e3:.2f} ms/token ({1 / f:.1f} tok/s), constrained "
            f"{c * 1e3:.2f} ms/token ({1 / c:.1f} tok/s), overhead {100 * (c / f - 1):+.1f}%  "
            f"[rounds free {', '.join(f'{x * 1e3:.2f}' for x in free)}; "
            f"constrained {', '.join(f'{x * 1e3:.2f}' for x in constrained)}]"
        )
    llm.shutdown()


if __name__ == "__main__":
    main()
