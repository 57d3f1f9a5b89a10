"""Speculative decoding's pure parts: n-gram lookup, the acceptance guard, the acceptance rule."""

from __future__ import annotations

import pytest

from hybridllm.config import SpeculativeConfig
from hybridllm.engine.request import Request
from hybridllm.sample.draft_acceptance import accepted_length
from hybridllm.sampling_params import SamplingParams
from hybridllm.spec_decode.acceptance_guard import AcceptanceGuard
from hybridllm.spec_decode.ngram_drafter import NgramDrafter
from hybridllm.spec_decode.ngram_index import NgramIndex


def test_ngram_index_follows_the_latest_longest_match():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # the suffix [5, 2, 3] never occurred; [2, 3] last ended before 7
    assert index.propose(tokens, 3) == [7, 8, 5]
    tokens += [7]  # now [2, 3, 7] recurs: its last occurrence is followed by 8, 5, 2
    assert index.propose(tokens, 3) == [8, 5, 2]
    assert index.propose(tokens, 0) == []
    assert NgramIndex(2, 3).propose([4, 5, 6, 7], 2) == []  # nothing recurs
    # the suffix never finds itself, and a match near the end gives fewer than k tokens
    assert NgramIndex(1, 1).propose([6, 6], 4) == [6]


def test_ngram_index_grown_step_by_step_equals_one_built_at_once():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]
    grown = NgramIndex(2, 4)
    for end in range(1, len(tokens) + 1):
        assert grown.propose(tokens[:end], 3) == NgramIndex(2, 4).propose(tokens[:end], 3)


def test_accepted_length_keeps_drafts_while_the_samples_agree():
    assert accepted_length([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_length([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_length([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accepted_length([], [4]) == 0
    with pytest.raises(ValueError, match="need 3 sampled"):
        accepted_length([5, 6], [5])


def test_guard_pauses_a_request_whose_drafts_fail_and_lets_it_retry():
    guard = AcceptanceGuard(min_rate=0.3, first_pause=2, max_pause=8)
    drafted = accepted = 0
    assert guard.should_draft()
    drafted += 4  # all rejected: the rate falls to 0.5 (still above 0.3)
    guard.observe(drafted, accepted)
    assert guard.should_draft()
    drafted += 4  # 0.25: pause 2 steps
    guard.observe(drafted, accepted)
    assert [guard.should_draft() for _ in range(3)] == [False, False, True]
    drafted += 4  # rejected again right after the pause: twice as long
    guard.observe(drafted, accepted)
    assert [guard.should_draft() for _ in range(5)] == [False] * 4 + [True]
    drafted, accepted = drafted + 4, accepted + 4  # a good step: drafting goes on
    guard.observe(drafted, accepted)
    assert guard.should_draft() and guard.rate > 0.3
    guard.observe(drafted, accepted)  # no new drafts: nothing changes
    assert guard.should_draft()
    # fewer drafts while the rate is low, all of them while it is high
    assert AcceptanceGuard().draft_length(4) == 4
    guard.rate = 0.3
    assert guard.draft_length(4) == 3 and guard.draft_length(1) == 1
    guard.rate = 0.0
    assert guard.draft_length(4) == 1


def test_drafter_respects_max_tokens_the_batch_limit_and_in_flight_requests():
    config = SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_min=1, disable_by_batch_size=4
    )
    drafter = NgramDrafter(config)

    def decoding(req_id: str, max_tokens: int) -> Request:
        request = Request(
            req_id, [1, 2, 3, 4, 5, 1, 2], SamplingParams(max_tokens=max_tokens), None
        )
        request.append_output_token_ids(3)
        request.num_computed_tokens = request.num_tokens - 1
        return request

    a, b, c = decoding("a", 10), decoding("b", 3), decoding("c", 10)
    drafter.propose([a, b, c], skip={"c"})
    assert a.spec_token_ids == [4, 5, 1, 2]
    assert b.spec_token_ids == [4]  # 1 output, max 3: this step's token and one draft
    assert c.spec_token_ids == []
    d = decoding("d", 10)
    drafter.propose([a, b, c, d])  # as many running as disable_by_batch_size: no drafts
    assert a.spec_token_ids == b.spec_token_ids == d.spec_token_ids == []


def test_speculative_config_defaults_one_lookup_bound_from_the_other():
    config = SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_max": 6})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 6)
    config = SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_min": 5})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    with pytest.raises(ValueError, match="JSON object"):
        SpeculativeConfig.from_dict(["ngram"])
    assert (
        SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 1}).method == "mtp"
    )
    with pytest.raises(ValueError, match="num_speculative_tokens must be at most 8"):
        SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 9})
    with pytest.raises(ValueError, match="integer in"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": True})


def test_speculative_config_a_model_means_the_draft_model_method():
    config = SpeculativeConfig.from_dict({"model": "/d", "num_speculative_tokens": 3})
    assert (config.method, config.model, config.quantization) == ("draft_model", "/d", None)
    config = SpeculativeConfig.from_dict(
        {
            "method": "draft_model",
            "model": "/d",
            "num_speculative_tokens": 3,
            "quantization": "q4_0",
        }
    )
    assert config.quantization == "q4_0"
    for bad, error in [
        ({"method": "ngram", "model": "/d"}, "'model' \\(a path\\) goes with method"),
        ({"method": "draft_model"}, "'model' \\(a path\\) goes with method"),
        ({"model": 3}, "'model' \\(a path\\) goes with method"),
        ({"model": "/d", "quantization": "q3_k"}, "quantization must be one of"),
        ({"method": "ngram", "quantization": "q4_0"}, "goes with a draft 'model'"),
    ]:
        with pytest.raises(ValueError, match=error):
            SpeculativeConfig.from_dict({**bad, "num_speculative_tokens": 2})


def test_drafter_keeps_copying_from_the_passage_it_follows():
    # The request copies the passage at the start of its prompt; "12 13" also occurs later,
    # followed by 99. Once it has copied "12 13" from the passage, its next draft is the
    # passage's 14, not what followed the latest "12 13".
    config = SpeculativeConfig(num_speculative_tokens=1, prompt_lookup_min=2, prompt_lookup_max=2)
    drafter = NgramDrafter(config)
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 50, 12, 13, 99]
    request = Request("r", prompt, SamplingParams(max_tokens=50), None)
    request.append_output_token_ids([10, 11])
    request.num_computed_tokens = request.num_tokens - 1
    drafter.propose([request])
    assert request.spec_token_ids == [12]
    # the draft accepted, 13 sampled after it
    request.append_output_token_ids([12, 13])
    request.num_computed_tokens = request.num_tokens - 1
    request.num_draft_tokens, request.num_accepted_tokens = 1, 1
    drafter.propose([request])
    assert request.spec_token_ids == [14]
    assert NgramIndex(2, 2).propose(request.all_token_ids, 1) == [99]  # the latest occurrence
    # the request leaves the passage: the drafts come from the index again
    request.append_output_token_ids([77, 10, 11])
    request.num_computed_tokens = request.num_tokens - 1
    drafter.propose([request])
    assert request.spec_token_ids == [12]


class CountingRunner:
    """A draft runner that drafts `[7] * k` and counts what it would run (the drafter's own
    arithmetic under test, not a model)."""

    def __init__(self) -> None:
        self.num_tokens_run = 0
        self.retained: set[str] = set()

    def propose(self, batch):
        self.num_tokens_run += sum(k for _, _, k in batch)
        return [[7] * k for _, _, k in batch]

    def retain(self, req_ids):
        self.retained = set(req_ids)

    def shutdown(self):
        pass


def test_draft_model_drafter_drafts_only_what_pays_for_its_forwards():
    from hybridllm.spec_decode.draft_model_drafter import DraftModelDrafter

    config = SpeculativeConfig(method="draft_model", model="/d", num_speculative_tokens=4)
    drafter = DraftModelDrafter(config, CountingRunner())
    guard = AcceptanceGuard()
    # unmeasured: drafts are free, all k of them
    assert drafter.draft_length(guard, 4) == 4 and guard.min_rate == 0.4
    # a draft forward at 0.7 of a step: one draft breaks even at a 70% acceptance; the guard
    # wants 15 points more
    drafter.draft_seconds, drafter.plain_seconds = 0.007, 0.010
    guard.rate = 0.98
    assert drafter.draft_length(guard, 4) == 4 and guard.min_rate == pytest.approx(0.85)
    guard.rate = 0.75
    assert drafter.draft_length(guard, 4) == 1  # more drafts would cost more than they add
    # below the break-even rate the guard pauses the request
    guard.observe(4, 1)
    assert not guard.should_draft()
    # a verify step 2 ms dearer a draft than a plain step: one draft costs 0.9 of a step
    drafter.verify_seconds, drafter.verify_drafts = 0.018, 4
    assert drafter.cost_ratio == pytest.approx(0.9)
    drafter.draft_length(guard, 4)
    assert guard.min_rate == pytest.approx(0.95)  # 0.9 + 0.15, capped
    # a draft as slow as a step cannot pay even when always right: nothing is drafted
    drafter.draft_seconds = 0.010
    assert drafter.cost_ratio > 1 and drafter.draft_length(guard, 4) == 0
    # a cheap draft (and verify) pays for more drafts at the same rate
    drafter.draft_seconds, drafter.verify_seconds = 0.001, 0.010
    guard.rate = 0.75
    assert drafter.draft_length(guard, 4) == 4 and guard.min_rate == 0.4
    # requests that left the running set are handed to the runner to forget
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=6), None)
    request.append_output_token_ids(3)
    request.num_computed_tokens = request.num_tokens - 1
    drafter.propose([request])
    assert drafter.runner.retained == {"a"} and request.spec_token_ids == [7] * 4


def test_mtp_drafter_hands_on_only_drafts_that_follow_the_request_s_tokens():
    from hybridllm.engine.scheduler_output import ModelRunnerOutput
    from hybridllm.spec_decode.mtp_drafter import MtpDrafter

    drafter = MtpDrafter(SpeculativeConfig(method="mtp", num_speculative_tokens=1))
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=8), None)
    b = Request("b", [4, 5], SamplingParams(max_tokens=8), None)
    requests = {"a": a, "b": b}
    drafter.observe(ModelRunnerOutput(draft_token_ids={"a": [7], "b": [8]}), requests)
    b.append_output_token_ids([9])  # b moved on after its draft was made: stale
    assert drafter.draft([(a, 1), (b, 1)]) == [[7], []]
    drafter.observe(None, {"b": b})  # a finished: its draft is dropped
    assert "a" not in drafter._drafts
