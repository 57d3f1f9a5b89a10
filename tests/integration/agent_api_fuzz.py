"""Fuzz helpers for the server tests: hostile values, body strategies, posting, settings."""

from __future__ import annotations

import json
import math

import httpx
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

MODEL = "SmolLM2-135M-Instruct"
BIG = 1 << 70
CITY_SCHEMA = {  # the get_weather tool's arguments, for both APIs' tool tests
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


# Values any field may get: wrong types, extremes, non-finite floats, deep nesting.
HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-BIG, max_value=BIG),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 1.5]),
    st.text(max_size=8),
    st.lists(st.integers(min_value=-BIG, max_value=BIG), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.sampled_from([nested(70), nested(400), {"type": "object", "properties": nested(80)}]),
)
TEXT = st.text(min_size=1, max_size=12)
FUNCTION_NAME = st.sampled_from(["get_weather", "f-1", "no such name!"])
SCHEMA = st.one_of(
    st.just({"type": "object", "properties": {"city": {"type": "string"}}}),
    st.just({"type": "array"}),
    st.dictionaries(st.sampled_from(["type", "properties", "required"]), HOSTILE, max_size=2),
)

FUZZ = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,  # the same requests every run: a failure reproduces
    phases=(Phase.explicit, Phase.generate),  # no shrinking: a server round trip each
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


@st.composite
def bodies(draw, fields: dict, required: dict, hostile: st.SearchStrategy = HOSTILE) -> dict:
    """A body with a random subset of `fields` (the required ones usually present), valid in a
    third of the bodies, else with one to three fields (present or not) made `hostile`."""
    optional = {name: value for name, value in fields.items() if name not in required}
    body = draw(st.fixed_dictionaries(required, optional=optional))
    if draw(st.sampled_from([False, False, False, False, False, True])):
        body.pop(draw(st.sampled_from(sorted(required))))
    num_hostile = draw(st.sampled_from([0, 0, 1, 1, 2, 3]))
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=num_hostile)):
        body[name] = draw(hostile)
    return body


def post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    # json.dumps writes NaN and Infinity literals, as a hostile client may.
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event; name "" when the event has none."""
    events = []
    for block in text.split("\n\n"):
        name, data = "", None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
        if data is not None:
            events.append((name, data))
    return events


def check_status(response: httpx.Response, body: dict) -> str:
    """A 200 or a 4xx, never a 5xx or a dropped connection; returns a context for asserts."""
    context = f"{response.status_code} for {body!r}: {response.text[:500]}"
    assert response.status_code == 200 or 400 <= response.status_code < 500, context
    return context


# ---- /v1/messages ----

TEXT_BLOCK = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
BLOCK = st.one_of(
    TEXT_BLOCK,
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": TEXT,
            "name": FUNCTION_NAME,
            "input": st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": TEXT,
            "content": st.one_of(TEXT, st.lists(TEXT_BLOCK, max_size=2)),
        },
        optional={"is_error": st.booleans()},
    ),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": TEXT, "signature": TEXT}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", ""]), "source": HOSTILE}),
    HOSTILE,
)
MESSAGES_FIELDS = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(min_value=1, max_value=4),
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "assistant", "user", "system"]),
                "content": st.one_of(TEXT, st.lists(BLOCK, max_size=3)),
            }
        ),
        min_size=1,
        max_size=3,
    ),
    "system": st.one_of(TEXT, st.lists(TEXT_BLOCK, max_size=2)),
    "stop_sequences": st.lists(TEXT, max_size=3),
    "temperature": st.floats(min_value=0, max_value=1),
    "top_p": st.floats(min_value=0.01, max_value=1),
    "top_k": st.integers(min_value=0, max_value=50),
    "metadata": st.fixed_dictionaries({"user_id": TEXT}),
    "tools": st.lists(
        st.fixed_dictionaries(
            {"name": FUNCTION_NAME, "input_schema": SCHEMA},
            optional={"description": TEXT, "type": st.sampled_from(["custom", "bash_20250124"])},
        ),
        max_size=2,
    ),
    "tool_choice": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none"])}),
        st.fixed_dictionaries({"type": st.just("tool"), "name": FUNCTION_NAME}),
    ),
    "stream": st.booleans(),
}


# ---- /v1/responses ----

PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": TEXT}
)
ITEM = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
            "content": st.one_of(TEXT, st.lists(PART, max_size=2)),
        },
        optional={"type": st.just("message")},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": TEXT,
            "name": FUNCTION_NAME,
            "arguments": st.sampled_from(['{"city": "Paris"}', "{bad", "[1]"]),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": TEXT, "output": TEXT}
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference"]), "id": TEXT}),
    HOSTILE,
)
TEXT_FORMAT = st.sampled_from(
    [
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "name": "x", "schema": {"type": "object"}},
        {"type": "json_schema", "schema": {"type": "nonsense"}},
    ]
)


def responses_fields(stored_id: str) -> dict:
    """Strategies of each /v1/responses field; `stored_id` a response the server has stored."""
    return {
        "model": st.just(MODEL),
        "input": st.one_of(TEXT, st.lists(ITEM, max_size=3)),
        "instructions": TEXT,
        "max_output_tokens": st.integers(min_value=1, max_value=4),
        "temperature": st.floats(min_value=0, max_value=2),
        "top_p": st.floats(min_value=0.01, max_value=1),
        "tools": st.lists(
            st.fixed_dictionaries(
                {
                    "type": st.sampled_from(["function", "function", "web_search"]),
                    "name": FUNCTION_NAME,
                },
                optional={"description": TEXT, "parameters": SCHEMA, "strict": st.booleans()},
            ),
            max_size=2,
        ),
        "tool_choice": st.one_of(
            st.sampled_from(["none", "auto", "required"]),
            st.fixed_dictionaries({"type": st.just("function"), "name": FUNCTION_NAME}),
        ),
        "text": st.fixed_dictionaries({"format": TEXT_FORMAT}),
        "stream": st.booleans(),
        "store": st.booleans(),
        "previous_response_id": st.sampled_from([stored_id, "resp_unknown"]),
        "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
        "parallel_tool_calls": st.booleans(),
    }
