"""Structured outputs without a model: params, the grammar mask, the manager and the scheduler."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
import torch

from hybridllm.config import CacheConfig, SchedulerConfig
from hybridllm.engine.request import Request, RequestStatus
from hybridllm.engine.scheduler import Scheduler
from hybridllm.engine.scheduler_output import ModelRunnerOutput
from hybridllm.entrypoints.openai.errors import OpenAIError
from hybridllm.entrypoints.openai.protocol import ChatCompletionRequest
from hybridllm.sample.grammar_mask import grammar_masked, with_grammar_mask
from hybridllm.sample.sampling_metadata import SamplingMetadata
from hybridllm.sampling_params import SamplingParams
from hybridllm.structured import StructuredOutputsParams
from hybridllm.structured.request_state import GrammarState


def test_params_validation_names_the_field():
    assert StructuredOutputsParams(choice=["a", "b"]).kind == "choice"
    assert StructuredOutputsParams(json='{"type": "object"}').key == ("json", '{"type": "object"}')
    cases = [
        ({}, "exactly one"),
        ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
        ({"json": "[1, 2]"}, "structured_outputs.json"),
        ({"json": 5}, "structured_outputs.json"),
        ({"json": {"x": float("nan")}}, "structured_outputs.json"),
        ({"choice": "yes"}, "structured_outputs.choice"),
        ({"choice": ["", "b"]}, "structured_outputs.choice"),
        ({"regex": 3}, "structured_outputs.regex"),
        ({"grammar": ""}, "structured_outputs.grammar"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="unsupported fields"):
        StructuredOutputsParams.from_dict({"xml": "a"})
    params = SamplingParams(n=2, seed=1, structured_outputs={"regex": "[ab]+"})
    assert params.clone_for_sample(1).structured_outputs == params.structured_outputs


def test_grammar_mask_sets_forbidden_logits_to_minus_inf():
    vocab = 70  # not a multiple of 32: the last word is partial
    bitmask = np.zeros((2, 3), dtype=np.int32)
    bitmask[0, 0] = 0b101  # request "a": tokens 0 and 2
    bitmask[1, 2] = 1 << 5  # request "c": token 69
    params = [SamplingParams(temperature=0)] * 3
    md = SamplingMetadata.build(params, [[1]] * 3, [[]] * 3, "cpu")
    keys = [("a", 0), ("b", 0), ("c", 0)]
    md = with_grammar_mask(md, keys, ["a", "c"], bitmask, {}, vocab, torch.device("cpu"))
    logits = torch.randn(3, vocab)
    masked = grammar_masked(logits, md)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.equal(masked[1], logits[1])  # the free row is untouched
    assert torch.isfinite(masked[2]).nonzero().flatten().tolist() == [69]
    all_rows = with_grammar_mask(
        SamplingMetadata.build(params[:2], [[1]] * 2, [[]] * 2, "cpu"),
        [("a", 0), ("c", 0)],
        ["a", "c"],
        bitmask,
        {},
        vocab,
        torch.device("cpu"),
    )
    assert torch.equal(grammar_masked(logits[[0, 2]], all_rows), masked[[0, 2]])


class _Matcher:
    """Accepts tokens 5 then 6, then is done."""

    def __init__(self):
        self.seen = []

    def deep_copy(self):
        return _Matcher()

    def consume_token(self, token):
        self.seen.append(token)
        return token == [5, 6][len(self.seen) - 1]

    def consume_tokens(self, tokens):
        return all(self.consume_token(t) for t in tokens)

    def is_error(self):
        return False

    def is_stopped(self):
        return self.seen == [5, 6]


def _scheduler() -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        32,
    )


def test_request_waits_for_its_grammar_and_stops_when_complete():
    scheduler = _scheduler()
    compiled: Future = Future()
    constrained = Request("g", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_id=0)
    constrained.structured_output = GrammarState(compiled)
    scheduler.add_request(constrained)
    scheduler.add_request(Request("free", [4, 5], SamplingParams(max_tokens=10), eos_token_id=0))
    step = scheduler.schedule()
    assert list(step.num_scheduled_tokens) == ["free"]  # the compiling one does not block it
    scheduler.update_from_output(step, ModelRunnerOutput(req_ids=["free"], sampled_token_ids=[[9]]))
    compiled.set_result(_Matcher())
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"free", "g"}
    scheduler.update_from_output(
        step, ModelRunnerOutput(req_ids=["free", "g"], sampled_token_ids=[[9], [5]])
    )
    step = scheduler.schedule()
    updated = scheduler.update_from_output(
        step, ModelRunnerOutput(req_ids=["free", "g"], sampled_token_ids=[[9], [6]])
    )
    done = {r.request_id: r for r in updated}["g"]
    assert done.status == RequestStatus.FINISHED_STOPPED
    assert done.output_token_ids == [5, 6]


def test_failed_compile_finishes_the_request_with_its_error():
    scheduler = _scheduler()
    compiled: Future = Future()
    compiled.set_exception(ValueError("structured_outputs.json cannot be used: bad"))
    request = Request("g", [1, 2], SamplingParams(), eos_token_id=0)
    request.structured_output = GrammarState(compiled)
    scheduler.add_request(request)
    step = scheduler.schedule()
    assert step.is_empty
    (failed,) = scheduler.update_from_output(step, None)
    assert failed.status == RequestStatus.FINISHED_ERROR
    assert "structured_outputs.json" in failed.error


def test_server_request_fields_become_params():
    def params(**body):
        request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)
        return request.to_sampling_params(8, 100).structured_outputs

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = params(response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert got.json == schema
    assert params(response_format={"type": "json_object"}).json_object is True
    assert params(response_format={"type": "text"}) is None
    assert params(structured_outputs={"choice": ["x", "y"]}).choice == ("x", "y")
    bad = [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, None),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
    ]
    for body, param in bad:
        with pytest.raises(OpenAIError) as info:
            params(**body)
        if param is not None:
            assert info.value.param == param


def test_tool_choice_enforcer_constrains_to_the_reply_schema():
    from hybridllm.entrypoints.openai.structured_outputs import enforce_tool_choice

    class Constraint:
        def reply_schema(self):
            return {"type": "object", "properties": {"name": {"const": "f"}}}

    params = enforce_tool_choice(Constraint(), SamplingParams(max_tokens=8))
    assert params.structured_outputs.json == Constraint().reply_schema()
    with pytest.raises(OpenAIError) as info:
        enforce_tool_choice(Constraint(), params)
    assert info.value.param == "tool_choice"
