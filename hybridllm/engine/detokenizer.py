"""Incremental detokenization: token ids in, newly completed text out (no torch import)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# How many prompt tokens seed the decode window, so the first output token gets the
# spacing it would have in context (SentencePiece drops a leading space at text start).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
_SENTENCEPIECE_SPACE = "\u2581"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text as they arrive.

    Decoding a token alone loses context (SentencePiece drops the leading space of the
    first token; byte-level BPE and byte-fallback tokens may hold part of a UTF-8 char),
    so each call decodes a short window `[prefix_offset, len(tokens))` and emits what it
    adds beyond the already-emitted part `[prefix_offset, read_offset)`. Text ending in
    U+FFFD is an unfinished character and is held back until a later token completes it.
    The window only spans the tokens since the last emission, so a call costs
    O(new tokens), not O(all tokens).

    `.text` is what the output appends to the prompt's text: decoding never cleans up
    tokenization spaces, and the first output token keeps the spacing it has after the
    prompt. For byte-level BPE that equals `tokenizer.decode(output_ids,
    clean_up_tokenization_spaces=False)`; for SentencePiece a leading word-boundary space
    is kept (decoding the output alone would strip it). `tokenizer` is any Hugging Face
    tokenizer (only its `decode` is used), or None (skip_tokenizer_init): the token ids are
    kept and the text stays "".
    """

    def __init__(
        self,
        tokenizer: Any | None,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._all_token_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._num_context_tokens = len(self._all_token_ids)
        self._prefix_offset = 0  # start of the decode window in _all_token_ids
        self._read_offset = self._num_context_tokens  # end of the text already emitted
        self._text_chunks: list[str] = []
        self._output_token_ids: list[int] = []

    @property
    def token_ids(self) -> list[int]:
        """The output token ids added so far (the detokenizer's own list: do not mutate)."""
        return self._output_token_ids

    @property
    def text(self) -> str:
        """All output text emitted so far (a held-back partial character is not included)."""
        if len(self._text_chunks) > 1:
            self._text_chunks = ["".join(self._text_chunks)]
        return self._text_chunks[0] if self._text_chunks else ""

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete ('' while a character is unfinished)."""
        self._output_token_ids.extend(new_token_ids)
        if self.tokenizer is None:
            return ""
        self._all_token_ids.extend(new_token_ids)
        if not new_token_ids:
            return ""
        return self._advance(hold_partial_char=True)

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished character decodes to U+FFFD).

        Call when the request finishes so `.text` matches decoding all output tokens.
        """
        if self.tokenizer is None:
            return ""
        return self._advance(hold_partial_char=False)

    def _advance(self, hold_partial_char: bool) -> str:
        prefix_text = self._decode(self._all_token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._all_token_ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text):
            return ""  # nothing visible yet, e.g. a skipped special token
        if hold_partial_char and window_text.endswith(_REPLACEMENT_CHAR):
            return ""  # a multi-byte character is still in progress
        new_text = window_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._all_token_ids)
        self._text_chunks.append(new_text)
        return new_text


def decode_token(tokenizer: Any | None, token_id: int) -> str | None:
    """One token's text for logprob display, with its leading space where it has one.

    Decoding a SentencePiece token alone drops its word-boundary space ("▁the" -> "the");
    that space is restored. A token holding part of a UTF-8 character decodes to U+FFFD.
    None without a tokenizer (skip_tokenizer_init).
    """
    if tokenizer is None:
        return None
    text = tokenizer.decode(
        [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if (
        isinstance(piece, str)
        and piece.startswith(_SENTENCEPIECE_SPACE)
        and not text.startswith(" ")
    ):
        text = " " + text
    return text
