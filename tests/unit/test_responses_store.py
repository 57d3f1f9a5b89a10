"""ResponseStore: the previous_response_id conversations, bounded in entries and bytes (LRU)."""

from __future__ import annotations

import json

import pytest

from hybridllm.entrypoints.openai.responses_store import ResponseStore


def turn(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_stores_and_returns_conversations():
    store = ResponseStore()
    store.put("resp_a", turn("hello"))
    assert store.get("resp_a") == turn("hello")
    assert store.get("resp_unknown") is None


def test_the_least_recently_used_goes_first_past_the_entry_bound():
    store = ResponseStore(max_responses=2)
    store.put("a", turn("a"))
    store.put("b", turn("b"))
    assert store.get("a") is not None  # a is now more recent than b
    store.put("c", turn("c"))
    assert store.get("b") is None
    assert store.get("a") == turn("a") and store.get("c") == turn("c")
    assert len(store) == 2


def test_the_byte_bound_holds():
    size = len(json.dumps(turn("x" * 100)))
    store = ResponseStore(max_bytes=3 * size)
    for i in range(10):
        store.put(f"r{i}", turn(str(i) * 100))
        assert store.num_bytes <= 3 * size
    assert len(store) == 3
    assert [store.get(f"r{i}") is not None for i in range(10)] == [False] * 7 + [True] * 3


def test_a_conversation_over_the_byte_bound_is_not_stored():
    store = ResponseStore(max_bytes=100)
    store.put("small", turn("x"))
    store.put("huge", turn("x" * 1000))
    assert store.get("huge") is None
    assert store.get("small") == turn("x")  # nothing was evicted for it


@pytest.mark.parametrize("kwargs", [{"max_responses": 0}, {"max_bytes": 0}])
def test_bounds_must_be_positive(kwargs):
    with pytest.raises(ValueError):
        ResponseStore(**kwargs)
