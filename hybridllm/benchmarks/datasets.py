"""Benchmark prompts: random token sequences of a given length, or prompts read from a file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send, with its length in tokens and the output length to ask for."""

    prompt: str
    prompt_len: int
    output_len: int


def sample_lengths(rng: random.Random, mean: int, range_ratio: float, count: int) -> list[int]:
    """`count` lengths uniform in [mean * (1 - r), mean * (1 + r)], at least 1."""
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def random_requests(
    tokenizer: Any,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts of random ordinary tokens whose text re-tokenizes to (about) `input_len` tokens."""
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    input_lens = sample_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)
    requests = []
    for n_in, n_out in zip(input_lens, output_lens):
        ids = [rng.choice(vocab) for _ in range(n_in)]
        text = tokenizer.decode(ids)
        # Decoding then encoding can merge or split tokens: trim or pad until it round-trips.
        for _ in range(10):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == n_in:
                break
            ids = ids[:n_in] + [rng.choice(vocab) for _ in range(n_in - len(ids))]
            text = tokenizer.decode(ids)
        prompt_len = len(tokenizer.encode(text, add_special_tokens=False))
        requests.append(BenchRequest(text, prompt_len, n_out))
    return requests


def file_requests(
    path: str, tokenizer: Any, num_prompts: int, output_len: int, seed: int = 0
) -> list[BenchRequest]:
    """Prompts from a file, cycled or sampled to `num_prompts`.

    Formats: ShareGPT JSON (a list of {"conversations": [{"from", "value"}, ...]}: the first
    human turn is the prompt, the reply's length the output length), JSON lines with "prompt"
    (and optionally "output_len"), or plain text with one prompt per line.
    """
    pairs = _read_pairs(path)
    if not pairs:
        raise ValueError(f"{path} holds no prompts")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    requests = []
    for i in range(num_prompts):
        prompt, reply = pairs[i % len(pairs)]
        if isinstance(reply, str):
            n_out = len(tokenizer.encode(reply, add_special_tokens=False))
        else:
            n_out = reply if reply is not None else output_len
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        requests.append(BenchRequest(prompt, prompt_len, max(1, n_out)))
    return requests


def _read_pairs(path: str) -> list[tuple[str, str | int | None]]:
    """(prompt, reference reply text or output length or None) per record."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        pairs = []
        for item in json.loads(text):
            turns = item.get("conversations") or item.get("conversation") or []
            if len(turns) >= 2 and turns[0].get("value"):
                pairs.append((turns[0]["value"], turns[1].get("value") or None))
        return pairs
    pairs = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if path.endswith(".jsonl"):
            record = json.loads(line)
            pairs.append((record["prompt"], record.get("output_len")))
        else:
            pairs.append((line, None))
    return pairs
