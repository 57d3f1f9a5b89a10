"""What the offline benchmarks share: engine flags -> `LLM`, random token prompts, JSON output."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
from typing import Any

from hybridllm.engine_args import EngineArgs


def build_llm(args: argparse.Namespace) -> Any:
    from hybridllm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    kwargs = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(EngineArgs)}
    model = kwargs.pop("model")
    return LLM(model, use_tqdm=False, **kwargs)


def random_token_prompts(
    llm: Any, num_prompts: int, input_len: int, seed: int
) -> list[dict[str, list[int]]]:
    """Prompts as token ids, so every one is exactly `input_len` tokens long."""
    tokenizer = llm.get_tokenizer()
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.choice(vocab) for _ in range(input_len)]}
        for _ in range(num_prompts)
    ]


def save_json(path: str | None, record: dict[str, Any]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    print(f"results saved to {path}")
