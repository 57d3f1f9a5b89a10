"""llguidance as the grammar engine: constraints -> grammars -> compiled matchers."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from hybridllm.structured.params import StructuredOutputsParams

# JSON is generated with these separators and no other whitespace (see StructuredOutputsParams).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message names the field and the problem."""


def make_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """The llguidance view of the model's tokenizer (about 0.4 s for a 49k vocabulary)."""
    import llguidance.hf

    eos = list(eos_token_ids) or None
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)


def to_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text for a constraint (cheap: compiles nothing)."""
    import llguidance

    kind = params.kind
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(
                params.spec, defaults=dict(_JSON_OPTIONS)
            )
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=dict(_JSON_OPTIONS)
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            # json.dumps quotes and escapes each choice the way Lark string literals read them
            alternatives = " | ".join(json.dumps(c) for c in params.choice)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        grammar = params.grammar
        if "::=" in grammar:  # GBNF (llama.cpp / xgrammar style)
            from llguidance.gbnf_to_lark import gbnf_to_lark

            grammar = gbnf_to_lark(grammar)
        return llguidance.LLMatcher.grammar_from_lark(grammar)
    except GrammarError:
        raise
    except Exception as exc:
        raise GrammarError(f"structured_outputs.{kind} is invalid: {short_error(exc)}") from None


def compile_grammar(params: StructuredOutputsParams, ll_tokenizer: Any) -> Any:
    """A fresh matcher at the start of the grammar, to be copied per request; raises
    GrammarError naming the field when the grammar is invalid or uses what is unsupported.
    Slow for very large grammars (llguidance drops the GIL while it builds)."""
    import llguidance

    grammar = to_grammar(params)
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(
            f"structured_outputs.{params.kind} cannot be used: {short_error(matcher.get_error())}"
        )
    return matcher


def short_error(error: object) -> str:
    """The compiler's message without what it appends (its parser state, the whole grammar,
    a Rust backtrace), at most 500 characters."""
    text = str(error).strip()
    for marker in ("\n<state>", "\n<grammar>", "\n<backtrace>", "\nstack backtrace:"):
        text = text.split(marker)[0]
    if text.startswith("panic: "):  # an assertion inside the compiler: a limit it has
        text = "the grammar exceeds a limit of the grammar compiler (" + text[7:].strip() + ")"
    return text if len(text) <= 500 else text[:497] + "..."
