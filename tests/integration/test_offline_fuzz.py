"""Property-based fuzzing of `SamplingParams` through the offline `LLM`: every value either
raises ValueError naming a field (queueing nothing) or generates; the engine never breaks."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridllm import LLM, SamplingParams
from tests.model_helpers import make_tiny_model

BIG = 1 << 70
VOCAB = 320  # the tiny models' vocabulary (tests/model_helpers.py)
HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-BIG, max_value=BIG),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(min_value=-BIG, max_value=BIG), max_size=3),
    st.dictionaries(st.integers(min_value=-BIG, max_value=BIG), st.floats(), max_size=2),
)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(valid, valid, HOSTILE)


TOKEN = st.integers(min_value=0, max_value=VOCAB + 2)
FIELDS = {
    "n": field(st.integers(min_value=1, max_value=3)),
    "temperature": field(st.floats(min_value=0, max_value=3)),
    "top_p": field(st.floats(min_value=0.01, max_value=1)),
    "top_k": field(st.sampled_from([-1, 0, 1, 7, VOCAB, 1 << 63, 1 << 64])),
    "min_p": field(st.floats(min_value=0, max_value=1)),
    "seed": field(st.integers(min_value=-(1 << 64), max_value=1 << 65)),
    "presence_penalty": field(st.floats(min_value=-2, max_value=2)),
    "frequency_penalty": field(st.floats(min_value=-2, max_value=2)),
    "repetition_penalty": field(st.floats(min_value=0.1, max_value=3)),
    "stop": field(st.lists(st.text(max_size=3), max_size=2)),
    "stop_token_ids": field(st.lists(TOKEN, max_size=3)),
    "ignore_eos": field(st.booleans()),
    "max_tokens": field(st.integers(min_value=1, max_value=4)),
    "min_tokens": field(st.integers(min_value=0, max_value=5)),
    "logprobs": field(st.integers(min_value=0, max_value=VOCAB + 1)),
    "prompt_logprobs": field(st.integers(min_value=0, max_value=5)),
    "skip_special_tokens": field(st.booleans()),
    "include_stop_str_in_output": field(st.booleans()),
    "logit_bias": field(
        st.dictionaries(TOKEN, st.floats(min_value=-100, max_value=100), max_size=3)
    ),
}
FIELD_NAME = re.compile(r"SamplingParams\.(\w+)")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    llm = LLM(str(path), dtype="float32", max_model_len=64, block_size=4, use_tqdm=False)
    assert llm.llm_engine.model_config.vocab_size == VOCAB
    yield llm
    llm.shutdown()


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.fixed_dictionaries({}, optional=FIELDS))
def test_fuzzed_sampling_params_raise_or_generate(llm, kwargs):
    engine = llm.llm_engine
    prompts = [{"prompt_token_ids": [5, 17, 42]}, "Hello world"]
    try:
        params = SamplingParams(**kwargs)
        outs = llm.generate(prompts, params)
    except ValueError as exc:
        named = FIELD_NAME.search(str(exc))
        assert named and named.group(1) in FIELDS, str(exc)
    else:
        # Accepted values are ones the sampler can hold: finite numbers, 64-bit seeds.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
            value = getattr(params, name)
            assert not isinstance(value, bool) and math.isfinite(value), (name, value)
        assert params.seed is None or -(1 << 63) <= params.seed < 1 << 64
        for out in outs:
            assert out.finished and out.error is None, out
            assert len(out.outputs) == params.n
            limit = params.max_tokens or engine.model_config.max_model_len  # None: the length
            for sample in out.outputs:
                assert 1 <= len(sample.token_ids) <= limit
                assert all(0 <= t < VOCAB for t in sample.token_ids)
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
