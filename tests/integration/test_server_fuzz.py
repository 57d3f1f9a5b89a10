"""Property-based fuzzing of the request schema against a real server process.

Every generated request, valid or hostile in any field, must get a 200 or a 4xx with an
OpenAI error body, never a 5xx or a dropped connection; a normal request must succeed after
each batch, so no request can have broken the engine.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.integration.agent_api_fuzz import FUZZ as AGENT_FUZZ
from tests.integration.agent_api_fuzz import bodies as fuzz_bodies
from tests.integration.agent_api_fuzz import post
from tests.integration.openai_server import RemoteServer

MAX_MODEL_LEN = 256
CHECK_EVERY = 25  # a normal request after this many fuzzed ones
BIG = 1 << 70

# Values any field may get: wrong types, extremes, non-finite floats. The field strategies
# below give valid values; `bodies` makes some of a body's fields hostile.
HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-BIG, max_value=BIG),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, -1e-308]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(min_value=-BIG, max_value=BIG), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.sampled_from(["{{ ''.__class__.__mro__ }}", "{% for %}", "no-such-model"]),
    st.fixed_dictionaries({"include_usage": st.booleans()}),
    st.dictionaries(
        st.sampled_from(["tokenize", "chat_template", "conversation", "tools"]),
        st.text(max_size=8),
        max_size=2,
    ),
)


TOKEN = st.integers(min_value=0, max_value=49151)
TEXT = st.text(min_size=1, max_size=12)
SAMPLING_FIELDS = {
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.01, max_value=1),
    "top_k": st.sampled_from([-1, 0, 1, 5, 50, 49152, 1 << 63]),
    "min_p": st.floats(min_value=0, max_value=1),
    "seed": st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    "n": st.integers(min_value=1, max_value=3),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "frequency_penalty": st.floats(min_value=-2, max_value=2),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
    "stop_token_ids": st.lists(TOKEN, max_size=3),
    "logit_bias": st.dictionaries(
        TOKEN.map(str), st.floats(min_value=-100, max_value=100), max_size=3
    ),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(min_value=0, max_value=1),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "stream": st.booleans(),
    "user": TEXT,
    "model": st.just("SmolLM2-135M-Instruct"),
}
COMPLETION_FIELDS = {
    **SAMPLING_FIELDS,
    "prompt": st.one_of(
        TEXT,
        st.lists(TOKEN, min_size=1, max_size=8),
        st.lists(TEXT, min_size=1, max_size=3),
        st.lists(st.lists(TOKEN, min_size=1, max_size=5), min_size=1, max_size=3),
    ),
    "max_tokens": st.integers(min_value=1, max_value=4),
    "logprobs": st.integers(min_value=0, max_value=5),
    "echo": st.booleans(),
    # also sent, but only hostile: best_of (must equal n), suffix (unsupported),
    # stream_options (needs stream)
    "best_of": st.none(),
    "suffix": st.none(),
    "stream_options": st.none(),
}
FUNCTION_NAME = st.sampled_from(["get_weather", "search", "f-1"])
ARGUMENTS = st.one_of(
    st.just('{"city": "Paris"}'), st.just("{}"), st.just("[1]"), st.just("{bad"), TEXT
)
TOOL_CALL = st.fixed_dictionaries(
    {
        "id": TEXT,
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": FUNCTION_NAME, "arguments": ARGUMENTS}),
    }
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.one_of(
            TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}))
        ),
    },
    optional={"tool_calls": st.lists(TOOL_CALL, max_size=2), "tool_call_id": TEXT},
)
SCHEMA = st.one_of(
    st.just({"type": "object", "properties": {"city": {"type": "string"}}}),
    st.just({"type": "array"}),
    st.dictionaries(st.sampled_from(["type", "properties", "required"]), HOSTILE, max_size=2),
)
TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.one_of(FUNCTION_NAME, TEXT)},
            optional={"description": TEXT, "parameters": SCHEMA, "strict": st.booleans()},
        ),
    }
)
CHAT_FIELDS = {
    **SAMPLING_FIELDS,
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "max_tokens": st.integers(min_value=1, max_value=4),
    "max_completion_tokens": st.integers(min_value=1, max_value=4),
    "logprobs": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.just("foo"), st.integers(), max_size=1),
    # only hostile: top_logprobs (needs logprobs), a client chat_template (refused without
    # the server flag), continue_final_message (needs a final assistant message)
    "top_logprobs": st.none(),
    "chat_template": st.none(),
    "continue_final_message": st.just(False),
    "tools": st.lists(TOOL, max_size=3),
    "tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required"]),
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries({"name": FUNCTION_NAME}),
            }
        ),
    ),
}
TOKENIZE_FIELDS = {
    "model": st.just("SmolLM2-135M-Instruct"),
    "prompt": TEXT,
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "add_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "return_token_strs": st.booleans(),
    "tools": st.lists(TOOL, max_size=2),
    "chat_template_kwargs": st.dictionaries(st.just("foo"), st.integers(), max_size=1),
}
DETOKENIZE_FIELDS = {
    "model": st.just("SmolLM2-135M-Instruct"),
    "tokens": st.lists(st.integers(min_value=-5, max_value=49160), max_size=8),
}


def bodies(fields: dict, required: dict) -> st.SearchStrategy:
    return fuzz_bodies(fields, required, HOSTILE)


@pytest.fixture(scope="module")
def server():
    args = ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    with RemoteServer(["--max-model-len", str(MAX_MODEL_LEN), *args]) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def _check(response: httpx.Response, body: dict) -> None:
    """200, or a 4xx with an OpenAI error body; a 200 stream carries no error."""
    context = f"{response.status_code} for {body!r}: {response.text[:500]}"
    assert response.status_code == 200 or 400 <= response.status_code < 500, context
    if response.status_code != 200:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], context
        assert error["type"] == "invalid_request_error" or response.status_code in (401, 404)
        return
    if body.get("stream") is True:
        lines = [line for line in response.text.splitlines() if line]
        assert lines[-1] == "data: [DONE]", context
        for line in lines[:-1]:
            # Requests are validated before the 200: no error may come after it.
            assert "error" not in json.loads(line.removeprefix("data: ")), context
    else:
        assert response.json()["choices"] is not None, context


class _Health:
    """Sends a normal request every CHECK_EVERY fuzzed ones: the engine still serves."""

    def __init__(self, http: httpx.Client, server: RemoteServer) -> None:
        self.http = http
        self.server = server
        self.count = 0
        self.statuses: dict[int, int] = {}

    def tick(self, status: int) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.count += 1
        if self.count % CHECK_EVERY == 0:
            self.check()

    def check(self) -> None:
        body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
        response = post(self.http, "/completions", body)
        assert response.status_code == 200, response.text
        assert httpx.get(f"{self.server.root}/health", timeout=10).status_code == 200


FUZZ = settings(AGENT_FUZZ, max_examples=150)


def test_fuzzed_completions_never_fail_the_server(http, server):
    health = _Health(http, server)

    @FUZZ
    @given(bodies(COMPLETION_FIELDS, {"prompt": COMPLETION_FIELDS["prompt"]}))
    def run(body):
        response = post(http, "/completions", body)
        _check(response, body)
        health.tick(response.status_code)

    run()
    health.check()
    # The fuzz reaches the engine: a good share of the requests generated.
    assert health.statuses.get(200, 0) >= 20, health.statuses


def test_fuzzed_chat_completions_never_fail_the_server(http, server):
    health = _Health(http, server)

    @FUZZ
    # max_tokens usually present: without it a reply may fill the whole context
    @given(bodies(CHAT_FIELDS, {k: CHAT_FIELDS[k] for k in ("messages", "max_tokens")}))
    def run(body):
        response = post(http, "/chat/completions", body)
        _check(response, body)
        health.tick(response.status_code)

    run()
    health.check()
    assert health.statuses.get(200, 0) >= 20, health.statuses


def test_fuzzed_tokenize_and_detokenize_never_fail_the_server(http, server):
    root = httpx.Client(base_url=server.root, timeout=60)
    statuses: dict[int, int] = {}

    @settings(FUZZ, max_examples=100)
    @given(
        st.one_of(
            st.tuples(st.just("/tokenize"), bodies(TOKENIZE_FIELDS, {"prompt": TEXT})),
            st.tuples(
                st.just("/tokenize"),
                bodies(TOKENIZE_FIELDS, {"messages": TOKENIZE_FIELDS["messages"]}),
            ),
            st.tuples(
                st.just("/detokenize"),
                bodies(DETOKENIZE_FIELDS, {"tokens": DETOKENIZE_FIELDS["tokens"]}),
            ),
        )
    )
    def run(case):
        path, body = case
        response = post(root, path, body)
        context = f"{response.status_code} for {path} {body!r}: {response.text[:500]}"
        assert response.status_code == 200 or 400 <= response.status_code < 500, context
        if response.status_code != 200:
            assert response.json()["error"]["message"], context
        elif path == "/tokenize":
            assert response.json()["count"] == len(response.json()["tokens"]), context
        else:
            assert isinstance(response.json()["prompt"], str), context
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    with root:
        run()
    assert statuses.get(200, 0) >= 20, statuses
    _Health(http, server).check()
