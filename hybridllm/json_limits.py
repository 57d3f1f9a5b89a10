"""Bounds on JSON that clients and models send (server, structured outputs): nesting depth
checked without recursion, and strict parsing (no NaN or Infinity)."""

from __future__ import annotations

import json
import math
import re
from array import array
from itertools import accumulate
from typing import Any

# Deeper than any real tool arguments, JSON schema or template kwargs, and far from Python's
# recursion limit (1000 frames), which json.loads, json.dumps and Jinja's tojson all use up one
# or more frames per level of.
MAX_JSON_DEPTH = 128

# A JSON string, possibly unterminated (it then runs to the end of the text).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
# Each bracket as a signed byte: +1 opens, -1 (255) closes.
_STEPS = bytes.maketrans(b"[{]}", bytes([1, 1, 255, 255]))
_CHUNK = 1 << 16  # brackets summed per step, so that a deep text stops early


class JSONTooDeep(ValueError):
    """JSON nested deeper than the limit; a ValueError, so "not valid JSON" handlers catch it."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"nested deeper than {limit} levels")
        self.limit = limit


def text_depth(text: str, limit: int | None = None) -> int:
    """The deepest nesting of arrays and objects in JSON text, found without recursion (and
    without a Python loop over its characters: strings and other characters are removed by
    regular expressions, the brackets summed by itertools in chunks).

    Brackets inside strings do not count. On text that is not JSON the result is at least the
    depth json.loads recurses to before it fails (it stops at the first stray closing bracket,
    and everything before that is counted exactly), so checking first is always safe. With
    `limit`, the scan may stop once the depth exceeds it; the result is then above `limit`.
    """
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).encode("ascii").translate(_STEPS)
    depth = deepest = 0
    for start in range(0, len(brackets), _CHUNK):
        sums = list(accumulate(array("b", brackets[start : start + _CHUNK]), initial=depth))
        deepest, depth = max(deepest, max(sums)), sums[-1]
        if limit is not None and deepest > limit:
            break
    return deepest


def value_depth(value: Any, limit: int | None = None) -> int:
    """The deepest nesting of dicts and lists in an already parsed value, level by level (no
    recursion): a scalar is 0, `[]` and `{}` are 1. With `limit`, stops once the depth exceeds
    it (the result is then limit + 1)."""
    depth = 0
    level = [value] if isinstance(value, (dict, list, tuple)) else []
    while level:
        depth += 1
        if limit is not None and depth > limit:
            break
        level = [
            child
            for item in level
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, (dict, list, tuple))
        ]
    return depth


def check_value_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> Any:
    """`value` itself, or JSONTooDeep (a ValueError: pydantic's AfterValidator makes it a
    validation error naming the field)."""
    if value_depth(value, limit) > limit:
        raise JSONTooDeep(limit)
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: valid JSON, but it would come back out as Infinity
        raise ValueError(f"the number {text} is out of range")
    return value


# json's decoder accepts NaN, Infinity and -Infinity by default; strict JSON does not.
STRICT_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


def loads_strict(text: str, limit: int = MAX_JSON_DEPTH) -> Any:
    """json.loads for untrusted text: JSONTooDeep before parsing when nested deeper than
    `limit`; ValueError for NaN / Infinity, numbers beyond a float's range and anything else
    that is not JSON."""
    if text_depth(text, limit) > limit:
        raise JSONTooDeep(limit)
    return STRICT_DECODER.decode(text)
