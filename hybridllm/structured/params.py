"""`StructuredOutputsParams`: what a request's output must match (vLLM's field names)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from hybridllm.json_limits import value_depth

# Bounds on what one request may ask for; a grammar engine given a 10 MB schema is a DoS.
MAX_SPEC_CHARS = 1 << 20
MAX_CHOICES = 1024
# Inline nesting of a schema object; the grammar compiler's own JSON reader stops at 128.
MAX_SCHEMA_NESTING = 128
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of `json` (a JSON schema, dict or string), `regex`, `choice` (a list of
    strings), `grammar` (a Lark grammar; GBNF with `::=` rules is converted) or
    `json_object=True` (any JSON object). `disable_any_whitespace` is accepted for vLLM
    compatibility: JSON is always generated with single spaces after `,` and `:` (a small model
    given free whitespace can emit newlines until max_tokens).

    Invalid values raise `ValueError` naming the field (`structured_outputs.<field>`).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}"
            )
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(_check_choice(self.choice)))
        if self.json is not None:
            object.__setattr__(self, "json", _check_schema(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
            if value is not None and len(value) > MAX_SPEC_CHARS:
                raise ValueError(f"structured_outputs.{name} is longer than {MAX_SPEC_CHARS}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be true or false")
        object.__setattr__(self, "_spec", self._make_spec())  # a 1 MB schema is dumped once

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one string: with `kind`, the key of the compiled-grammar cache."""
        return self._spec

    @property
    def schema(self) -> Any:
        """The `json` constraint as a parsed object (None for other kinds)."""
        if self.json is None or isinstance(self.json, dict):
            return self.json
        return json.loads(self.json)

    @property
    def digest(self) -> bytes:
        """A short key for (kind, spec): caches hold this, not a spec of up to 1 MB."""
        kind, spec = self.key
        return hashlib.sha256(f"{kind}\0{spec}".encode("utf-8", "surrogatepass")).digest()

    def _make_spec(self) -> str:
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else json.dumps(self.json)
        if kind == "choice":
            return json.dumps(list(self.choice))
        if kind == "json_object":
            return "{}"
        return getattr(self, kind)

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.spec)

    @classmethod
    def from_dict(cls, data: Any) -> StructuredOutputsParams:
        """From a request's `structured_outputs` object; unknown keys are a ValueError."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise ValueError("structured_outputs must be an object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise ValueError(
                f"structured_outputs has unsupported fields {unknown}; supported: {sorted(known)}"
            )
        return cls(**data)


def _check_choice(choice: Any) -> list[str]:
    if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
        raise ValueError("structured_outputs.choice must be a non-empty list of strings")
    if len(choice) > MAX_CHOICES:
        raise ValueError(f"structured_outputs.choice has more than {MAX_CHOICES} entries")
    if any(not isinstance(c, str) or not c for c in choice):
        raise ValueError("structured_outputs.choice entries must be non-empty strings")
    if sum(len(c) for c in choice) > MAX_SPEC_CHARS:
        raise ValueError(f"structured_outputs.choice is longer than {MAX_SPEC_CHARS} characters")
    return list(choice)


def _check_schema(schema: Any) -> dict | str:
    """A schema is a JSON object (dict) or its text; booleans are refused (nothing to follow)."""
    text = schema
    if isinstance(schema, dict):
        if value_depth(schema, MAX_SCHEMA_NESTING) > MAX_SCHEMA_NESTING:
            raise ValueError(
                f"structured_outputs.json nests deeper than {MAX_SCHEMA_NESTING} levels"
            )
        try:
            text = json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ValueError(f"structured_outputs.json is not JSON-serializable: {exc}") from None
    elif isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError("structured_outputs.json must be a JSON object (a schema)")
    else:
        raise ValueError("structured_outputs.json must be a JSON schema object or its JSON text")
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"structured_outputs.json is longer than {MAX_SPEC_CHARS} characters")
    return schema
