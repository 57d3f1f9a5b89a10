"""Depth bounds checked before compiling: chained `$ref`s, nesting and Lark rule chains."""

from __future__ import annotations

import pytest

from hybridllm.structured.limits import MAX_GRAMMAR_DEPTH, check_lark_depth, check_schema_depth
from hybridllm.structured.params import StructuredOutputsParams


def ref_chain(n: int) -> dict:
    """n definitions, each an object whose property refers to the next (75 KB at 1,000)."""
    defs = {
        f"d{i}": {
            "type": "object",
            "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}},
            "required": ["a"],
        }
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(n: int) -> str:
    rules = [f"r{i}: r{i + 1}" for i in range(n)] + [f'r{n}: "x"']
    return "start: r0\n" + "\n".join(rules) + "\n"


def test_ref_chain_depth_is_counted_through_refs():
    check_schema_depth(ref_chain(100))
    with pytest.raises(ValueError, match="nests .* levels deep with its \\$refs followed"):
        check_schema_depth(ref_chain(1000))


def test_recursive_and_shared_refs_are_not_a_chain():
    recursive = {
        "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
        "$ref": "#/$defs/node",
    }
    check_schema_depth(recursive)
    # 2,000 properties all pointing at one definition: wide, not deep
    shared = {
        "$defs": {"leaf": {"type": "string"}},
        "type": "object",
        "properties": {f"p{i}": {"$ref": "#/$defs/leaf"} for i in range(2000)},
    }
    check_schema_depth(shared)


def test_escaped_pointer_and_missing_targets():
    schema = {"$defs": {"a/b": {"type": "string"}}, "$ref": "#/$defs/a~1b"}
    check_schema_depth(schema)
    check_schema_depth({"$ref": "#/$defs/missing"})
    check_schema_depth({"$ref": "https://example.com/schema.json"})


def test_lark_rule_chains():
    check_lark_depth(lark_chain(200))
    with pytest.raises(ValueError, match="chains .* rules"):
        check_lark_depth(lark_chain(MAX_GRAMMAR_DEPTH + 10))
    # words inside string and regex literals are not rule names
    literal = 'start: a\na: "b c d" | /b+/\nb: a\nc: b\nd: c\n'
    check_lark_depth(literal)
    # a recursive grammar is not a chain
    check_lark_depth('start: item+\nitem: "(" item* ")" | "x"\n')


def test_lark_embedded_json_schema_is_checked():
    import json

    grammar = "start: obj\nobj: %json " + json.dumps(ref_chain(1200)) + "\n"
    with pytest.raises(ValueError, match="%json of rule 'obj'"):
        check_lark_depth(grammar)


def test_inline_nesting_is_refused_without_recursion():
    schema: dict = {"type": "string"}
    for _ in range(100_000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match="nests deeper than 128 levels"):
        StructuredOutputsParams(json=schema)


def test_digest_is_short_and_distinguishes_kinds():
    a = StructuredOutputsParams(regex="x+")
    b = StructuredOutputsParams(grammar="x+")
    assert len(a.digest) == 32 and a.digest != b.digest
    assert a.digest == StructuredOutputsParams(regex="x+").digest
