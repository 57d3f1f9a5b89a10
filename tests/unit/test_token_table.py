"""TokenTable: a token's raw bytes (partial for a piece of a multibyte character) and the
characters-per-token bound used to refuse overlong texts untokenized."""

from __future__ import annotations

import random

import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from hybridllm.entrypoints.openai.token_table import TokenTable
from tests.model_helpers import make_tiny_tokenizer

TEXT = "héllo wörld ✓ 日本語 🙂 The quick fox"


def test_byte_level_tokens_give_their_own_bytes():
    tokenizer = make_tiny_tokenizer(320)
    table = TokenTable.build(tokenizer)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert b"".join(table.raw[i] for i in ids) == TEXT.encode()
    # The tiny vocabulary has no multibyte merges: "✓" is three one-byte tokens whose text is
    # U+FFFD each, but whose bytes are the character's own.
    pieces = [table.raw[i] for i in ids]
    start = pieces.index(b"\xe2")
    assert pieces[start : start + 3] == [b"\xe2", b"\x9c", b"\x93"]
    assert [table.text(i) for i in ids[start : start + 3]] == ["\ufffd"] * 3
    assert [b for i in ids for b in table.token_bytes(i)] == list(TEXT.encode())
    special = tokenizer.convert_tokens_to_ids("</s>")
    assert table.raw[special] == b"</s>" and table.text(special) == "</s>"
    assert table.token_bytes(10_000) == [] and table.text(-1) == ""


def test_the_longest_token_bounds_characters_per_token():
    tokenizer = make_tiny_tokenizer(320)
    table = TokenTable.build(tokenizer)
    assert table.max_token_chars is not None
    rng = random.Random(0)
    alphabet = "abcdefghij klmnop.\n  The quick brown fox 0123456789 ✓日"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400)))
        text += " " * rng.randint(0, 200)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) * table.max_token_chars >= len(text)


def test_sentencepiece_byte_fallback_tokens():
    vocab = {"<unk>": 0, "▁": 1, "h": 2, "i": 3}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    table = TokenTable.build(tokenizer)
    ids = tokenizer("hi ✓", add_special_tokens=False)["input_ids"]
    assert [table.raw[i] for i in ids] == [b" ", b"h", b"i", b" ", b"\xe2", b"\x9c", b"\x93"]
    assert b"".join(table.raw[i] for i in ids).decode() == " hi ✓"
    assert table.max_token_chars == len("<0x00>")


def test_no_bound_when_tokenizing_may_drop_characters():
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()  # whitespace runs vanish
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    assert TokenTable.build(tokenizer).max_token_chars is None
