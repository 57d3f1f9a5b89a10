"""Per-token text and raw bytes read once from the tokenizer, for logprobs and length checks."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's byte tokens
# Tokenizer parts that never delete input characters: with only these, a text of C characters
# needs at least C / (longest token string) tokens.
_KEEPING_NORMALIZERS = {"Sequence", "Prepend", "Replace", "ByteLevel"}
_KEEPING_PRE_TOKENIZERS = {"Sequence", "ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"}


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


@dataclass(frozen=True)
class TokenTable:
    """What the server needs per token id without touching the (single-threaded) tokenizer."""

    texts: tuple[str, ...]  # tokenizer.decode([id]), as logprobs' `token` has always been
    raw: tuple[bytes, ...]  # the token's own bytes: a piece of a multibyte char stays partial
    max_token_chars: int | None  # longest token string; None when no length bound holds

    @classmethod
    def build(cls, tokenizer: Any) -> TokenTable:
        size = len(tokenizer)
        ids = list(range(size))
        texts = tuple(tokenizer.batch_decode([[i] for i in ids]))
        pieces = tokenizer.convert_ids_to_tokens(ids)
        added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        kind = _decoder_kind(tokenizer)
        table = byte_level_decoder() if kind == "byte_level" else {}
        raw = []
        for i, (piece, text) in enumerate(zip(pieces, texts)):
            if i in added:
                raw.append(added[i].encode())
            elif piece is None:
                raw.append(text.encode())
            elif kind == "byte_level" and all(c in table for c in piece):
                raw.append(bytes(table[c] for c in piece))
            elif kind == "sentencepiece":
                match = _BYTE_FALLBACK.match(piece)
                raw.append(
                    bytes([int(match.group(1), 16)])
                    if match
                    else piece.replace("\u2581", " ").encode()
                )
            else:
                raw.append(text.encode())
        lengths = [len(p) for p in pieces if p is not None] + [len(c) for c in added.values()]
        longest = max(lengths, default=0)
        bounded = longest > 0 and _keeps_every_character(tokenizer)
        return cls(texts, tuple(raw), longest if bounded else None)

    def text(self, token_id: int) -> str:
        return self.texts[token_id] if 0 <= token_id < len(self.texts) else ""

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.raw[token_id]) if 0 <= token_id < len(self.raw) else []


def _state(component: Any) -> dict:
    if component is None:
        return {}
    try:
        return json.loads(component.__getstate__())
    except Exception:  # an unknown component: treat as unknown type
        return {"type": "?"}


def _types(state: Any) -> list[dict]:
    """Every typed node of a serialized tokenizer component (Sequences nest)."""
    found = []
    if isinstance(state, dict):
        if "type" in state:
            found.append(state)
        for value in state.values():
            found += _types(value)
    elif isinstance(state, list):
        for value in state:
            found += _types(value)
    return found


def _decoder_kind(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    types = {node["type"] for node in _types(_state(getattr(backend, "decoder", None)))}
    if "ByteLevel" in types:
        return "byte_level"
    if "ByteFallback" in types or "Metaspace" in types:
        return "sentencepiece"
    return "other"


def _keeps_every_character(tokenizer: Any) -> bool:
    """True when tokenizing deletes no input characters and never folds a run of unknown ones
    into one token, so that the longest token bounds the characters per token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    model = backend.model
    if type(model).__name__ != "BPE":
        return False  # WordPiece and Unigram fold unknown words or runs into one token
    if getattr(model, "fuse_unk", False) and not getattr(model, "byte_fallback", False):
        return False
    for node in _types(_state(backend.normalizer)):
        if node["type"] not in _KEEPING_NORMALIZERS:
            return False
        if node["type"] == "Replace" and not node.get("content"):
            return False
    for node in _types(_state(backend.pre_tokenizer)):
        if node["type"] not in _KEEPING_PRE_TOKENIZERS or node.get("behavior") == "Removed":
            return False
    return True
