"""Structured outputs through `LLM.generate` on the embedded model: JSON schema, choice, regex,
Lark, n > 1, preemption, prefix caching, pipeline parallelism, and bad constraints."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from hybridllm import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"


def _params(**kwargs) -> SamplingParams:
    structured = StructuredOutputsParams(**kwargs.pop("so"))
    return SamplingParams(structured_outputs=structured, **kwargs)


@pytest.fixture(scope="module")
def llm():
    engine = LLM(max_model_len=256, use_tqdm=False)
    yield engine
    engine.shutdown()


def test_json_choice_regex_grammar(llm):
    outs = llm.generate(
        ["A person as JSON:", "Is water wet? Answer:", "Today's date is", "Pick a fruit:"],
        [
            _params(so={"json": SCHEMA}, n=3, temperature=0.9, seed=1, max_tokens=64),
            _params(so={"choice": ["yes", "no", 'a "quoted" one']}, max_tokens=16),
            _params(so={"regex": DATE}, temperature=1.0, seed=3, max_tokens=16),
            _params(so={"grammar": 'start: "apple" | "pear" | "plum"'}, max_tokens=8),
        ],
    )
    assert len(outs[0].outputs) == 3
    for sample in outs[0].outputs:
        assert sample.finish_reason == "stop", sample
        jsonschema.validate(json.loads(sample.text), SCHEMA)
    assert outs[1].outputs[0].text in ("yes", "no", 'a "quoted" one')
    assert re.fullmatch(DATE, outs[2].outputs[0].text)
    assert outs[3].outputs[0].text in ("apple", "pear", "plum")
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_bad_constraints_raise_naming_the_field(llm):
    bad = [
        ({"json": {"type": "nope"}}, "structured_outputs.json"),
        ({"regex": "(("}, "structured_outputs.regex"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"json": "{not json"}, "structured_outputs.json"),
    ]
    for so, field in bad:
        with pytest.raises(ValueError, match=re.escape(field)):
            llm.generate(["x"], _params(so=so, max_tokens=4))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=42)
    # the engine goes on
    out = llm.generate(["x"], _params(so={"choice": ["ok"]}, max_tokens=4))
    assert out[0].outputs[0].text == "ok"


def test_free_rows_unchanged_beside_constrained_ones(llm):
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate(["The capital of France is"], free)[0].outputs[0].token_ids
    mixed = llm.generate(
        ["A person as JSON:", "The capital of France is", "Date:"],
        [
            _params(so={"json": SCHEMA}, temperature=0.7, seed=5, max_tokens=48),
            free,
            _params(so={"regex": DATE}, max_tokens=16),
        ],
    )
    assert mixed[1].outputs[0].token_ids == alone
    assert re.fullmatch(DATE, mixed[2].outputs[0].text)


def test_preemption_and_prefix_caching_keep_the_grammar():
    # 12 blocks of 4 tokens for 4 sequences of ~45 tokens: requests are preempted, recomputed
    # from their output tokens (served from the prefix cache where blocks survive), resumed.
    llm = LLM(max_model_len=96, block_size=4, num_gpu_blocks_override=12, use_tqdm=False)
    try:
        prompt = "Describe a new person as a JSON object:"
        outs = llm.generate(
            [prompt] * 4,
            [
                _params(so={"json": SCHEMA}, temperature=0.8, seed=i, max_tokens=48)
                for i in range(4)
            ],
        )
        assert llm.llm_engine.get_stats().num_preemptions > 0
    finally:
        llm.shutdown()
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_pipeline_parallel_two_stages():
    llm = LLM(max_model_len=128, pipeline_parallel_size=2, use_tqdm=False)
    try:
        outs = llm.generate(
            ["Date:", "A person as JSON:", "Free text:"],
            [
                _params(so={"regex": DATE}, temperature=1.0, seed=2, max_tokens=16),
                _params(so={"json": SCHEMA}, n=2, temperature=0.8, seed=4, max_tokens=48),
                SamplingParams(temperature=0, max_tokens=8),
            ],
        )
    finally:
        llm.shutdown()
    assert re.fullmatch(DATE, outs[0].outputs[0].text)
    for sample in outs[1].outputs:
        jsonschema.validate(json.loads(sample.text), SCHEMA)
    assert outs[2].outputs[0].finish_reason == "length"
