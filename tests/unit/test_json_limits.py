"""json_limits: nesting depth of JSON text and values without recursion, and strict parsing."""

from __future__ import annotations

import json
import random
import sys

import pytest

from hybridllm.json_limits import (
    MAX_JSON_DEPTH,
    JSONTooDeep,
    check_value_depth,
    loads_strict,
    text_depth,
    value_depth,
)

DEEP = 100_000  # far past Python's recursion limit: a recursive scanner would raise here


def nested(depth: int, kinds: str = "[{") -> str:
    opens = "".join('{"k": ' if kinds[i % len(kinds)] == "{" else "[" for i in range(depth))
    closes = "".join("}" if kinds[i % len(kinds)] == "{" else "]" for i in reversed(range(depth)))
    return opens + "1" + closes


@pytest.mark.parametrize(
    "text,depth",
    [
        ("1", 0),
        ('"[[[{{{"', 0),  # brackets inside a string do not count
        ('"a\\"[["', 0),  # nor after an escaped quote
        ("[]", 1),
        ('{"a": [1, {"b": []}], "c": {}}', 4),
        ('[["]"], [[]]]', 3),  # a closing bracket inside a string closes nothing
        ("[[]]]]][[[", 2),  # json.loads stops at the first stray closer: what follows is moot
        ('["unterminated [[[[', 1),  # an open string runs to the end
        ('"\\', 0),  # a lone backslash at the end
    ],
)
def test_text_depth(text, depth):
    assert text_depth(text) == depth


def test_text_depth_agrees_with_parsed_values():
    rng = random.Random(0)
    for _ in range(200):
        value = _random_value(rng, rng.randint(0, 12))
        text = json.dumps(value)
        assert text_depth(text) == value_depth(value) == value_depth(json.loads(text)), text


def _random_value(rng: random.Random, budget: int):
    if budget == 0:
        return rng.choice([1, "x", '"[{', "\\", None, True, 2.5])
    children = [_random_value(rng, rng.randint(0, budget - 1)) for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.5:
        return children
    return {f"k{i}]": child for i, child in enumerate(children)}


def test_deep_text_and_values_without_recursion():
    text = nested(DEEP)
    assert text_depth(text) == DEEP
    assert MAX_JSON_DEPTH < text_depth(text, limit=MAX_JSON_DEPTH) < DEEP  # stops early
    value: list = []
    for _ in range(DEEP):
        value = [value]
    assert value_depth(value) == DEEP + 1
    assert value_depth(value, limit=10) == 11
    assert value_depth({"a": "[[[", "b": [1, 2]}) == 2 and value_depth("x") == 0


def test_limit_is_exact():
    assert loads_strict(nested(MAX_JSON_DEPTH)) is not None
    with pytest.raises(JSONTooDeep, match=f"deeper than {MAX_JSON_DEPTH} levels"):
        loads_strict(nested(MAX_JSON_DEPTH + 1))
    ok = json.loads(nested(MAX_JSON_DEPTH))
    assert check_value_depth(ok) is ok
    with pytest.raises(ValueError, match="deeper than"):
        check_value_depth(json.loads(nested(MAX_JSON_DEPTH + 1)))


@pytest.mark.parametrize("text", [nested(DEEP), "[" * DEEP, '{"a":' * DEEP])
def test_loads_strict_refuses_deep_text_before_parsing(text):
    assert len(text) > sys.getrecursionlimit()
    with pytest.raises(JSONTooDeep):
        loads_strict(text)


@pytest.mark.parametrize(
    "text",
    ["NaN", '{"a": NaN}', "[Infinity]", '{"a": -Infinity}', "[1e999]", "{'a': 1}", "", "[1,]"],
)
def test_loads_strict_refuses_what_is_not_json(text):
    with pytest.raises(ValueError):
        loads_strict(text)


def test_loads_strict_reads_json():
    assert loads_strict(' {"a": [1, 2.5e3, "NaN", null, true]} ') == {
        "a": [1, 2500.0, "NaN", None, True]
    }
