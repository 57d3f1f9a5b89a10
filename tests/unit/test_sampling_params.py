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
        # Hostile values a JSON body or a careless caller can produce.
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", float("nan")),
        ("min_p", float("nan")),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", float("-inf")),
        ("repetition_penalty", float("nan")),
        ("repetition_penalty", float("inf")),
        ("temperature", "0.5"),
        ("temperature", True),
        ("n", True),
        ("n", 1025),
        ("n", 4208393),
        ("top_k", 1.0),
        ("max_tokens", "16"),
        ("seed", 1 << 64),
        ("seed", -(1 << 63) - 1),
        ("seed", True),
        ("stop", 5),
        ("stop", [3]),
        ("stop_token_ids", 7),
        ("stop_token_ids", [True]),
        ("stop_token_ids", ["1"]),
        ("logit_bias", {5: float("nan")}),
        ("logit_bias", {5: float("inf")}),
        ("logit_bias", {"5": 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", [1, 2]),
        ("ignore_eos", "yes"),
        ("logprobs", 1.0),
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
    # Sample 0 keeps the seed (n=1 and n>1 agree on it); the others hash (seed, index), so
    # sample 1 of seed 10 is not sample 0 of seed 11.
    assert clones[0].seed == 10
    assert len({c.seed for c in clones}) == 3 and 11 not in {c.seed for c in clones}
    assert all(0 <= c.seed < 1 << 64 for c in clones)
    again = [params.clone_for_sample(i).seed for i in range(3)]
    assert again == [c.seed for c in clones]  # deterministic
    assert all(c.n == 1 and c.temperature == 0.7 and c.stop == ["x"] for c in clones)
    assert SamplingParams(n=2).clone_for_sample(1).seed is None


def test_extreme_seeds_are_accepted_in_64_bits() -> None:
    assert SamplingParams(seed=(1 << 64) - 1).seed == (1 << 64) - 1
    assert SamplingParams(seed=-(1 << 63)).seed == -(1 << 63)


def test_verify_for_model_checks_token_ids_and_clamps_top_k() -> None:
    vocab = 100
    with pytest.raises(ValueError, match=r"SamplingParams\.stop_token_ids .*100"):
        SamplingParams(stop_token_ids=[100]).verify_for_model(vocab)
    with pytest.raises(ValueError, match=r"SamplingParams\.logit_bias .*1000000000"):
        SamplingParams(logit_bias={10**9: 1.0}).verify_for_model(vocab)
    with pytest.raises(ValueError, match=r"SamplingParams\.logprobs"):
        SamplingParams(logprobs=101).verify_for_model(vocab)
    huge = SamplingParams(top_k=1 << 63).verify_for_model(vocab)
    assert huge.top_k == 0  # at or above the vocabulary: no limit
    assert SamplingParams(top_k=100).verify_for_model(vocab).top_k == 0
    kept = SamplingParams(top_k=99, stop_token_ids=[99], logit_bias={0: -1.0})
    assert kept.verify_for_model(vocab) is kept
