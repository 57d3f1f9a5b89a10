"""Depth bounds checked before a grammar is compiled: the compiler recurses once per level."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable, Iterable
from typing import Any
from urllib.parse import unquote

# llguidance's compiler recurses once per nesting level of a schema (with every `$ref`
# followed) and once per rule of a Lark rule chain: about 9 KB and 3 KB of stack a level,
# measured on x86-64 (a 16 MB stack held 1,805 chained `$ref`s and 5,320 chained rules).
# Inline JSON nesting alone stops at serde's 128 levels, but references and rules do not, so
# 1,000 chained `$ref`s (75 KB) overflowed an 8 MB thread stack and killed the server.
# Compiles run on threads with COMPILE_STACK_BYTES of stack: 1,000 levels leave a 25x margin
# at the deepest per-level cost measured, and real schemas and grammars stay far below.
MAX_GRAMMAR_DEPTH = 1000
COMPILE_STACK_BYTES = 256 << 20


def check_schema_depth(schema: Any, field: str = "structured_outputs.json") -> None:
    """ValueError when `schema`, with every local `$ref` followed (a cycle counts once),
    nests deeper than MAX_GRAMMAR_DEPTH objects and arrays. Never recurses itself."""

    def children(node: Any) -> Iterable[Any]:
        if isinstance(node, dict):
            for value in node.values():
                if isinstance(value, (dict, list)):
                    yield value
            ref = node.get("$ref")
            if isinstance(ref, str):
                target = _resolve_pointer(schema, ref)
                if isinstance(target, (dict, list)):
                    yield target
        elif isinstance(node, list):
            for value in node:
                if isinstance(value, (dict, list)):
                    yield value

    depth = _longest_path([schema], id, children)
    if depth > MAX_GRAMMAR_DEPTH:
        raise ValueError(
            f"{field} nests {depth} levels deep with its $refs followed; "
            f"at most {MAX_GRAMMAR_DEPTH} are supported"
        )


def check_lark_depth(grammar: str, field: str = "structured_outputs.grammar") -> None:
    """ValueError when a chain of rules (each using the next) is longer than
    MAX_GRAMMAR_DEPTH; `%json` schemas inside the grammar are checked like `json`."""
    rules = _lark_rules(grammar)
    for name, body in rules.items():
        for schema in _embedded_json(body):
            check_schema_depth(schema, f"{field} (the %json of rule {name!r})")

    def children(name: str) -> Iterable[str]:
        body = _strip_literals(rules[name])
        return {word for word in _IDENT.findall(body) if word in rules and word != name}

    edges = {name: children(name) for name in rules}
    depth = _longest_path(list(rules), lambda n: n, edges.__getitem__)
    if depth > MAX_GRAMMAR_DEPTH:
        raise ValueError(
            f"{field} chains {depth} rules, each using the next; at most "
            f"{MAX_GRAMMAR_DEPTH} are supported"
        )


def _longest_path(
    roots: list[Any], key: Callable[[Any], Hashable], children: Callable[[Any], Iterable[Any]]
) -> int:
    """The number of nodes on the longest path from any of `roots` (an edge back into the
    path being walked is a cycle and ends it), with an explicit stack and memoised heights."""
    height: dict[Hashable, int] = {}
    on_path: set[Hashable] = set()
    stack: list[tuple[Any, Any]] = [(root, None) for root in reversed(roots)]
    while stack:
        node, pending = stack[-1]
        k = key(node)
        if pending is None:
            if k in height:
                stack.pop()
                continue
            on_path.add(k)
            pending = iter(list(children(node)))
            stack[-1] = (node, pending)
        child = next(pending, None)
        if child is not None:
            ck = key(child)
            if ck not in height and ck not in on_path:
                stack.append((child, None))
            continue
        stack.pop()
        on_path.discard(k)
        best = 0
        for c in children(node):
            best = max(best, height.get(key(c), 0))
        height[k] = best + 1
    return max((height.get(key(root), 0) for root in roots), default=0)


def _resolve_pointer(root: Any, ref: str) -> Any:
    """The node a local `#/a/b` reference names, or None (remote or missing references are
    the compiler's to report)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in unquote(ref[1:]).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RULE_HEAD = re.compile(r"^\??([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?\s*:(?!:)", re.M)
# String literals and /regex/ literals, whose words are not rule names.
_LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|/(?:[^/\\\n]|\\.)+/[imslux]*')


def _lark_rules(grammar: str) -> dict[str, str]:
    """Rule (and terminal) name -> its body, over continuation lines."""
    heads = list(_RULE_HEAD.finditer(grammar))
    rules: dict[str, str] = {}
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(grammar)
        rules[head.group(1)] = rules.get(head.group(1), "") + grammar[head.end() : end]
    return rules


def _strip_literals(body: str) -> str:
    body = re.sub(r"%json\s*\{.*", "", body, flags=re.S)  # the schema is checked on its own
    return _LITERAL.sub(" ", re.sub(r"//[^\n]*", " ", body))


def _embedded_json(body: str) -> Iterable[Any]:
    for match in re.finditer(r"%json\s*(\{)", body):
        try:
            schema, _ = json.JSONDecoder().raw_decode(body, match.start(1))
        except (ValueError, RecursionError):
            continue  # not JSON: the compiler says so
        yield schema
