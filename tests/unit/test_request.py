"""Request state: status mapping, token bookkeeping, and incremental block hashes."""

import pytest

from hybridllm.engine.kv_cache_utils import hash_block_tokens
from hybridllm.engine.request import Request, RequestStatus
from hybridllm.sampling_params import SamplingParams


def make_request(prompt, request_id="r0", **params) -> Request:
    return Request(request_id, prompt, SamplingParams(**params), eos_token_id=2)


def test_status_finished_and_finish_reason():
    unfinished = [RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED]
    for status in unfinished:
        assert not status.is_finished
        assert status.finish_reason is None
    expected = {
        RequestStatus.FINISHED_STOPPED: "stop",
        RequestStatus.FINISHED_LENGTH: "length",
        RequestStatus.FINISHED_ABORTED: "abort",
        RequestStatus.FINISHED_ERROR: "error",
    }
    for status, reason in expected.items():
        assert status.is_finished
        assert status.finish_reason == reason
    assert set(RequestStatus) == set(unfinished) | set(expected)


def test_token_counts_and_append():
    request = make_request([5, 6, 7])
    assert request.status == RequestStatus.WAITING and not request.is_finished()
    assert (request.num_tokens, request.num_prompt_tokens, request.num_output_tokens) == (3, 3, 0)
    assert request.num_computed_tokens == 0 and request.num_cached_tokens == 0
    view = request.all_token_ids
    request.append_output_token_ids(8)
    request.append_output_token_ids([9, 10])
    assert request.output_token_ids == [8, 9, 10]
    assert request.all_token_ids == [5, 6, 7, 8, 9, 10]
    assert view is request.all_token_ids  # grown in place, never rebuilt per step
    assert request.prompt_token_ids == [5, 6, 7]
    assert (request.num_tokens, request.num_output_tokens) == (6, 3)
    request.status = RequestStatus.FINISHED_LENGTH
    assert request.is_finished() and request.get_finish_reason() == "length"


def test_prompt_is_copied():
    prompt = [1, 2, 3]
    request = make_request(prompt)
    prompt.append(4)
    request.append_output_token_ids(9)
    assert request.prompt_token_ids == [1, 2, 3] and prompt == [1, 2, 3, 4]


def test_empty_prompt_rejected():
    with pytest.raises(ValueError, match="must not be empty"):
        make_request([])


def test_block_hashes_are_incremental_and_chained():
    request = make_request([1, 2, 3, 4, 5, 6])
    hashes = request.update_block_hashes(block_size=4)
    assert len(hashes) == 1  # the partial second block is not hashed
    first = hashes[0]
    assert first == hash_block_tokens(None, [1, 2, 3, 4])
    request.append_output_token_ids([7, 8, 9])
    hashes = request.update_block_hashes(block_size=4)
    assert len(hashes) == 2 and hashes[0] is first  # earlier hashes are not recomputed
    assert hashes[1] == hash_block_tokens(first, [5, 6, 7, 8])
    # Same tokens after a different first block: a different hash.
    other = make_request([0, 2, 3, 4, 5, 6, 7, 8], request_id="r1").update_block_hashes(4)
    assert other[1] != hashes[1] and other[1].token_ids == hashes[1].token_ids
