"""Incremental detokenizer and stop strings, against real byte-level BPE and SentencePiece tokenizers."""

from __future__ import annotations

import random
import string

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from hybridllm.engine.detokenizer import IncrementalDetokenizer, decode_token
from hybridllm.engine.stop_checker import check_stop_strings, stop_string_holdback

TEXTS = [
    "Hello world, how are you today?",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧 done.",
    "中文测试：你好，世界！日本語のテキスト。한국어 문장.",
    "Accents: café naïve résumé Ωμέγα ∑∫√ — “quotes”",
    "mixed😀中a b\u00e9😀😀 end",
]


def smollm2_tokenizer():
    """SmolLM2's byte-level BPE tokenizer, through our GGUF loader and its conversion cache."""
    from hybridllm.loader import default_model_path, open_model_source

    return open_model_source(default_model_path()).load_tokenizer()


def sentencepiece_tokenizer():
    """A tiny Llama-style tokenizer: '▁' word boundaries, byte fallback, leading-space strip."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for char in "▁" + string.ascii_letters + string.digits + ".,!?'-:é":
        vocab.setdefault(char, len(vocab))
    merges = []
    for word in ["▁the", "▁hello", "▁world", "▁how", "▁are", "▁you", "ing", "▁to"]:
        merged = word[0]
        for char in word[1:]:
            merges.append((merged, char))
            merged += char
            vocab.setdefault(merged, len(vocab))
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>")
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module", params=["smollm2", "sentencepiece"])
def tokenizer(request):
    if request.param == "smollm2":
        return smollm2_tokenizer()
    return sentencepiece_tokenizer()


def full_decode(tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(
        token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def expected_text(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:
    """The output's text in context: what it appends to the decoded prompt.

    Equals decoding the output alone for byte-level BPE; for SentencePiece it keeps the
    first token's word-boundary space, which decoding alone would strip.
    """
    prompt_text = full_decode(tokenizer, prompt_ids)
    full_text = full_decode(tokenizer, prompt_ids + output_ids)
    assert full_text.startswith(prompt_text)
    return full_text[len(prompt_text) :]


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], chunk_sizes) -> list[str]:
    chunks, start = [], 0
    while start < len(token_ids):
        size = next(chunk_sizes)
        chunks.append(detokenizer.add_tokens(token_ids[start : start + size]))
        start += size
    return chunks


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunking", ["one", "random"])
def test_incremental_equals_full_decode(tokenizer, text: str, chunking: str) -> None:
    prompt_ids = tokenizer.encode("User: write something.", add_special_tokens=False)
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    sizes = iter(lambda: 1 if chunking == "one" else rng.randint(1, 4), None)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    expected = expected_text(tokenizer, prompt_ids, output_ids)
    chunks = stream(detokenizer, output_ids, sizes)
    emitted = ""
    for chunk in chunks:
        assert "\ufffd" not in chunk  # never a partial character
        emitted += chunk
        assert expected.startswith(emitted)
    detokenizer.flush()
    assert detokenizer.text == emitted == expected
    assert detokenizer.token_ids == output_ids


def test_multibyte_char_split_across_tokens_is_held_back(tokenizer) -> None:
    output_ids = tokenizer.encode(" 😀 done", add_special_tokens=False)
    # The emoji really is split: some token alone decodes to a partial character.
    assert any("\ufffd" in full_decode(tokenizer, [t]) for t in output_ids)
    prompt_ids = tokenizer.encode("Hi", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    held = 0
    for token_id in output_ids:
        chunk = detokenizer.add_tokens([token_id])
        held += chunk == ""
        assert "\ufffd" not in chunk
    assert held >= 1
    assert detokenizer.text == expected_text(tokenizer, prompt_ids, output_ids)


def test_flush_emits_unfinished_character(tokenizer) -> None:
    output_ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    partial = next(
        i
        for i in range(1, len(output_ids))
        if full_decode(tokenizer, output_ids[:i]).endswith("\ufffd")
    )
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    detokenizer.add_tokens(output_ids[:partial])
    assert "\ufffd" not in detokenizer.text
    detokenizer.flush()
    assert detokenizer.text == full_decode(tokenizer, output_ids[:partial])


def test_special_tokens_skipped_or_kept(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    output_ids = [*tokenizer.encode("hello world", add_special_tokens=False), eos]
    for skip in (True, False):
        detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        for token_id in output_ids:
            detokenizer.add_tokens([token_id])
        assert detokenizer.text == full_decode(tokenizer, output_ids, skip_special_tokens=skip)
    assert tokenizer.eos_token in detokenizer.text


class WindowRecorder:
    """Wraps a real tokenizer to record how many ids each decode call gets."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, token_ids, **kwargs):
        self.window_sizes.append(len(token_ids))
        return self.tokenizer.decode(token_ids, **kwargs)


def test_cost_per_call_does_not_grow(tokenizer) -> None:
    output_ids = tokenizer.encode(" ".join(TEXTS * 20), add_special_tokens=False)
    prompt_ids = tokenizer.encode(" ".join(TEXTS), add_special_tokens=False)
    recorder = WindowRecorder(tokenizer)
    detokenizer = IncrementalDetokenizer(recorder, prompt_ids)
    for token_id in output_ids:
        detokenizer.add_tokens([token_id])
    assert len(output_ids) > 500
    assert max(recorder.window_sizes) <= 12
    assert detokenizer.text == expected_text(tokenizer, prompt_ids, output_ids)


def test_decode_token_keeps_word_space(tokenizer) -> None:
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert decode_token(tokenizer, ids[-1]) == " world"
    assert decode_token(tokenizer, tokenizer.eos_token_id) == tokenizer.eos_token


def stream_with_stops(
    tokenizer, text: str, stop: list[str], include: bool
) -> tuple[str, str, str | None]:
    """Stream `text` token by token as the engine would: (streamed, final text, stop hit)."""
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    streamed = ""
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        new_text = detokenizer.add_tokens([token_id])
        full = detokenizer.text
        hit = check_stop_strings(full, len(new_text), stop, include)
        if hit is not None:
            stop_str, truncate_to = hit
            return streamed, full[:truncate_to], stop_str
        visible = len(full) - stop_string_holdback(full, stop)
        assert visible >= len(streamed)
        streamed = full[:visible]
    return streamed, detokenizer.text, None


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tokenizer, include: bool) -> None:
    text = "the answer is: ###END### and more"
    stop = ["###END", "never"]
    streamed, final, hit = stream_with_stops(tokenizer, text, stop, include)
    assert hit == "###END"
    assert final == ("the answer is: ###END" if include else "the answer is: ")
    assert "#" not in streamed  # a possible stop string start is never streamed early
    assert final.startswith(streamed)


def test_stop_string_earliest_and_tail_only() -> None:
    assert check_stop_strings("abcSTOPxyz", 3, ["STOP"], False) is None  # already searched
    assert check_stop_strings("abcSTOPxyz", 7, ["STOP"], False) == ("STOP", 3)
    assert check_stop_strings("abcSTOPxyz", 5, ["STOP"], True) == ("STOP", 7)
    assert check_stop_strings("a, b. c", 6, [".", ","], False) == (",", 1)
    assert check_stop_strings("xxab", 1, ["ab", "b"], False) == ("ab", 2)
    assert check_stop_strings("text", 0, ["t"], False) is None


def test_stop_string_holdback() -> None:
    assert stop_string_holdback("hello ST", ["STOP"]) == 2
    assert stop_string_holdback("hello STOX", ["STOP"]) == 0
    assert stop_string_holdback("a<", ["<|end|>", "<<"]) == 1
    assert stop_string_holdback("ab", ["abc", "bcd"]) == 2
    assert stop_string_holdback("anything", []) == 0
