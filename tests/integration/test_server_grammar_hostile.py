"""Hostile grammars against a real server: each fails its own request with a 400 (or an
error event), and an ordinary request is served right after."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.openai_server import RemoteServer
from tests.unit.test_grammar_limits import lark_chain, ref_chain

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    with RemoteServer(["--max-model-len", "512", "--max-num-seqs", "8"]) as srv:
        # The compile children start with the server; the first grammar may wait for them.
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        r = httpx.post(
            f"{srv.base_url}/chat/completions",
            json=body | {"structured_outputs": {"regex": "a+"}},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        yield srv


def post(server: RemoteServer, body: dict, timeout: float = 120) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Hi"}], **body}
    return httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=timeout)


def assert_still_serving(server: RemoteServer) -> None:
    """An ordinary constrained request is answered in seconds (a couple on a quiet machine;
    the bound leaves room for a loaded CI box but not for waiting behind the large compiles,
    which queue for tens of seconds)."""
    start = time.monotonic()
    r = post(server, {"max_tokens": 4, "structured_outputs": {"regex": "[0-9]{3}"}})
    assert r.status_code == 200, r.text
    assert time.monotonic() - start < 10
    assert "Traceback" not in server.log_tail(20000)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_chained_refs_are_a_400_not_a_crash(server):
    schema = ref_chain(1000)
    assert 70_000 < len(json.dumps(schema)) < 100_000  # about the reported 75 KB request
    r = post(server, {"max_tokens": 8, "response_format": schema_format(schema)})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "$refs followed" in error["message"] and error["param"] == "response_format"
    assert_still_serving(server)


def test_chained_refs_in_a_named_tools_parameters(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": ref_chain(1000)}}
    r = post(
        server,
        {
            "max_tokens": 8,
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
    )
    assert r.status_code == 400, r.text
    assert "$refs followed" in r.json()["error"]["message"]
    assert_still_serving(server)


def test_chained_lark_rules(server):
    r = post(server, {"max_tokens": 8, "structured_outputs": {"grammar": lark_chain(3000)}})
    assert r.status_code == 400, r.text
    assert "chains" in r.json()["error"]["message"]
    assert_still_serving(server)


def test_a_grammar_failing_while_generating_is_a_400_and_an_error_event(server):
    anyof = {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
            for i in range(3000)
        ]
    }
    body = {"max_tokens": 16, "response_format": schema_format(anyof)}
    r = post(server, body)
    assert r.status_code == 400, r.text
    assert "the grammar failed while generating" in r.json()["error"]["message"]
    with httpx.stream(
        "POST",
        f"{server.base_url}/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            **body,
            "stream": True,
        },
        timeout=120,
    ) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    errors = [json.loads(e[6:])["error"] for e in events[:-1] if '"error"' in e]
    assert errors and errors[0]["code"] != "internal_error", events
    assert "the grammar failed while generating" in errors[0]["message"]
    assert events[-1] == "data: [DONE]"
    assert_still_serving(server)


def test_large_schemas_do_not_starve_a_small_one(server):
    """Distinct large schemas (seconds each to compile) queue behind one another; a small
    grammar goes ahead of them through the small-grammar lane."""

    def large(i: int) -> httpx.Response:  # about 2.5 s each to compile, twice
        props = {f"s{i}p{j}": {"type": "integer"} for j in range(4000)}
        schema = {"type": "object", "properties": props}
        return post(server, {"max_tokens": 2, "response_format": schema_format(schema)}, 60)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(large, i) for i in range(6)]
        time.sleep(1.0)
        assert_still_serving(server)
        assert not all(f.done() for f in futures)
        for f in futures:  # each compiles, or fails at its deadline: never a 5xx
            assert f.result().status_code in (200, 400)
    assert_still_serving(server)
