"""Structured outputs on the OpenAI-compatible server with the official `openai` client."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest

from tests.integration.openai_server import RemoteServer

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 10},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=50_000_000)


@pytest.fixture(scope="module")
def server():
    with RemoteServer(["--max-model-len", "512", "--max-num-seqs", "16"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _ask(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def test_json_schema_samples_validate(client, model):
    reply = client.chat.completions.create(
        model=model,
        messages=_ask("Make up a user profile as JSON."),
        n=8,
        temperature=0.9,
        seed=11,
        max_tokens=150,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    assert len(reply.choices) == 8
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_streamed_on_completions(client, model):
    stream = client.completions.create(
        model=model,
        prompt="A user profile in JSON:",
        temperature=0.8,
        seed=3,
        max_tokens=150,
        stream=True,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
    )
    text, finish = "", None
    for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object(client, model):
    reply = client.chat.completions.create(
        model=model,
        messages=_ask("Give a JSON object with the keys 'city' and 'country' for Paris."),
        temperature=0,
        max_tokens=100,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_choice_and_regex_extension(client, model):
    options = ["positive", "negative", "neutral"]
    reply = client.chat.completions.create(
        model=model,
        messages=_ask("Sentiment of 'I love this!'?"),
        max_tokens=10,
        temperature=1.0,
        extra_body={"structured_outputs": {"choice": options}},
    )
    assert reply.choices[0].message.content in options
    completion = client.completions.create(
        model=model,
        prompt="The date today is ",
        max_tokens=16,
        n=3,
        temperature=1.0,
        extra_body={"structured_outputs": {"regex": DATE}},
    )
    for choice in completion.choices:
        assert re.fullmatch(DATE, choice.text), choice.text
        assert choice.finish_reason == "stop"


def test_parse_returns_pydantic_object(client, model):
    parsed = client.beta.chat.completions.parse(
        model=model,
        messages=_ask("Describe the city of Paris."),
        response_format=City,
        max_tokens=100,
        temperature=0,
    )
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
        ({"structured_outputs": {"choice": "yes"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs"),
        ({"structured_outputs": {"json": {"a": 1}, "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
    ],
)
def test_invalid_constraint_is_400(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=_ask("hi"), max_tokens=4, extra_body=extra
        )
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
    # the server goes on
    ok = client.completions.create(
        model=model,
        prompt="x",
        max_tokens=4,
        extra_body={"structured_outputs": {"choice": ["fine"]}},
    )
    assert ok.choices[0].text == "fine"


def test_free_requests_unchanged_beside_constrained_ones(client, model):
    def free():
        reply = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=24, temperature=0
        )
        return reply.choices[0].text

    def constrained(seed):
        return client.completions.create(
            model=model,
            prompt="A profile:",
            max_tokens=120,
            temperature=0.9,
            seed=seed,
            extra_body={"structured_outputs": {"json": PERSON}},
        )

    alone = free()
    with ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(constrained, seed) for seed in range(2)]
        mixed = [pool.submit(free) for _ in range(2)]
        assert [f.result() for f in mixed] == [alone, alone]
        for f in busy:
            jsonschema.validate(json.loads(f.result().choices[0].text), PERSON)
