"""SamplingParams: validation errors name the field; normalization and per-sample clones."""

from __future__ import annotations

import pytest

from hybridllm.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("prompt_logprobs", -1),
        ("seed", 1.5),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
    ],
)
def test_invalid_value_names_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=5).min_tokens == 5


def test_normalization() -> None:
    params = SamplingParams(stop="###", top_k=-1, stop_token_ids=None)
    assert params.stop == ["###"]
    assert params.top_k == 0
    assert params.stop_token_ids == []


def test_greedy_and_penalty_flags() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams().needs_penalties
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams(presence_penalty=-0.5).needs_penalties


def test_clone_for_sample() -> None:
    params = SamplingParams(n=3, seed=10, temperature=0.7, stop=["x"])
    clones = [params.clone_for_sample(i) for i in range(3)]
    assert [c.seed for c in clones] == [10, 11, 12]
    assert all(c.n == 1 and c.temperature == 0.7 and c.stop == ["x"] for c in clones)
    assert SamplingParams(n=2).clone_for_sample(1).seed is None
