"""OutputProcessor with the embedded SmolLM2 tokenizer: text, stop strings, logprobs, n, finish."""

from __future__ import annotations

import pytest

from hybridllm.engine.no_tokenizer import STOP_NEEDS_TOKENIZER
from hybridllm.engine.output_processor import OutputProcessor
from hybridllm.engine.request import Request, RequestStatus
from hybridllm.engine.scheduler_output import Logprobs
from hybridllm.outputs import Logprob, RequestOutput
from hybridllm.sampling_params import SamplingParams

ARRIVAL = 100.0


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's byte-level BPE tokenizer (through the GGUF loader and its conversion cache)."""
    from hybridllm.loader import default_model_path, open_model_source

    return open_model_source(default_model_path()).load_tokenizer()


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode("User: say something\nAssistant:")


def track(
    processor: OutputProcessor,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
) -> list[Request]:
    """Add a request as LLMEngine does (one child per sample); returns the children."""
    children = [(request_id, params)]
    if params.n > 1:
        children = [(f"{request_id}#{i}", params.clone_for_sample(i)) for i in range(params.n)]
    processor.add(request_id, None, prompt, children, ARRIVAL)
    return [Request(child_id, prompt, p, eos_token_id=2) for child_id, p in children]


def step(
    processor: OutputProcessor,
    tokens: dict[Request, int],
    status: dict[Request, RequestStatus] | None = None,
    logprobs: dict[Request, Logprobs] | None = None,
    now: float = ARRIVAL + 1,
) -> tuple[list[RequestOutput], list[str], list[str]]:
    """One engine step: each request gets its token (and maybe a final status); returns the
    outputs of the touched requests, the children stopped by a string and the failed ones."""
    for request, token_id in tokens.items():
        request.append_output_token_ids(token_id)
    for request, new_status in (status or {}).items():
        request.status = new_status
    by_id = {r.request_id: [lp] for r, lp in (logprobs or {}).items()}
    touched, stopped, failed = processor.process(list(tokens), by_id, now)
    return [processor.make_output(state) for state in touched], stopped, failed


def stream(
    processor: OutputProcessor,
    request: Request,
    token_ids: list[int],
    last_status: RequestStatus | None = RequestStatus.FINISHED_LENGTH,
) -> list[RequestOutput]:
    """Feed `token_ids` one step each, the last with `last_status`; returns every output."""
    outputs = []
    for i, token_id in enumerate(token_ids):
        last = i == len(token_ids) - 1 and last_status is not None
        out, _, _ = step(processor, {request: token_id}, {request: last_status} if last else None)
        outputs += out
    return outputs


# ---- text -----------------------------------------------------------------------------------


def test_each_output_extends_the_last_and_holds_back_unfinished_characters(tokenizer, prompt):
    text = "Say 😀 now, café ✓ done."
    ids = tokenizer.encode(text)
    processor = OutputProcessor(tokenizer)
    (request,) = track(processor, "r", prompt, SamplingParams(max_tokens=len(ids)))
    outputs = stream(processor, request, ids)
    texts = [o.outputs[0].text for o in outputs]
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before)  # streamed text is never taken back
    assert not any("\ufffd" in t for t in texts)  # a part of a character is never shown
    # a byte-level token that starts a multi-byte character adds nothing until it completes
    assert any(after == before for before, after in zip(texts, texts[1:]))
    assert texts[-1] == text == tokenizer.decode(ids)
    assert [o.finished for o in outputs] == [False] * (len(ids) - 1) + [True]
    final = outputs[-1].outputs[0]
    assert final.token_ids == ids and final.finish_reason == "length"
    assert outputs[-1].prompt_token_ids == prompt
    assert not processor.has("r")  # a finished request is forgotten once its output is made


def test_a_character_still_unfinished_at_the_end_is_flushed(tokenizer, prompt):
    ids = tokenizer.encode("Say 😀")
    processor = OutputProcessor(tokenizer)
    (request,) = track(processor, "r", prompt, SamplingParams())
    out = stream(processor, request, ids[:-1])[-1]  # the emoji's last byte never comes
    assert out.finished and out.outputs[0].text == tokenizer.decode(ids[:-1])
    assert out.outputs[0].text.endswith("\ufffd")


def test_special_tokens_are_left_out_of_the_text_unless_asked_for(tokenizer, prompt):
    ids = tokenizer.encode("Hi there") + [tokenizer.eos_token_id]
    for skip, text in ((True, "Hi there"), (False, "Hi there" + tokenizer.eos_token)):
        processor = OutputProcessor(tokenizer)
        (request,) = track(processor, "r", prompt, SamplingParams(skip_special_tokens=skip))
        out = stream(processor, request, ids, RequestStatus.FINISHED_STOPPED)[-1].outputs[0]
        assert out.text == text and out.token_ids == ids
        assert out.finish_reason == "stop" and out.stop_reason is None


def test_a_stop_token_is_the_stop_reason(tokenizer, prompt):
    ids = tokenizer.encode("Hello world")
    processor = OutputProcessor(tokenizer)
    (request,) = track(processor, "r", prompt, SamplingParams(stop_token_ids=[ids[-1]]))
    request.stop_reason = ids[-1]  # as the scheduler sets it
    out = stream(processor, request, ids, RequestStatus.FINISHED_STOPPED)[-1].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", ids[-1])


# ---- stop strings ---------------------------------------------------------------------------

STOP_TEXT = " The end. STOP here"  # tokens: " The", " end", ".", " ST", "OP", " here"


@pytest.mark.parametrize(("include", "text"), [(False, " The end. "), (True, " The end. STOP")])
def test_a_stop_string_split_across_tokens_is_held_back_then_cut(tokenizer, prompt, include, text):
    ids = tokenizer.encode(STOP_TEXT)
    assert [tokenizer.decode([i]) for i in ids[3:5]] == [" ST", "OP"]
    params = SamplingParams(stop=["STOP"], include_stop_str_in_output=include)
    processor = OutputProcessor(tokenizer)
    (request,) = track(processor, "r", prompt, params)
    outputs = stream(processor, request, ids[:4], last_status=None)
    # " ST" may begin the stop string: it is not shown yet
    assert [o.outputs[0].text for o in outputs] == [" The", " The end", " The end.", " The end. "]
    assert not any(o.finished for o in outputs)
    (out,), stopped, failed = step(processor, {request: ids[4]})
    assert stopped == ["r"] and failed == []  # the engine then finishes it in the scheduler
    assert out.finished and not processor.has("r")
    completion = out.outputs[0]
    assert completion.text == text
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "STOP")
    assert completion.token_ids == ids[:5]  # the tokens stay, only the text is cut


def test_held_back_text_is_shown_once_it_cannot_be_a_stop_string(tokenizer, prompt):
    ids = tokenizer.encode(STOP_TEXT)
    processor = OutputProcessor(tokenizer)
    (request,) = track(processor, "r", prompt, SamplingParams(stop=[". Done"]))
    outputs = stream(processor, request, ids[:4], last_status=None)
    texts = [o.outputs[0].text for o in outputs]
    assert texts == [" The", " The end", " The end", " The end. ST"]  # "." held, then shown


def test_held_back_text_is_shown_when_the_request_ends_without_the_stop_string(tokenizer, prompt):
    ids = tokenizer.encode(STOP_TEXT)
    processor = OutputProcessor(tokenizer)
    (request,) = track(processor, "r", prompt, SamplingParams(stop=["STOP!"]))
    outputs = stream(processor, request, ids[:5])
    assert outputs[-2].outputs[0].text == " The end. "
    assert outputs[-1].outputs[0].text == " The end. STOP"
    assert outputs[-1].outputs[0].finish_reason == "length"


def test_a_stop_string_ending_inside_a_multibyte_character(tokenizer, prompt):
    ids = tokenizer.encode("Say 😀 now")
    processor = OutputProcessor(tokenizer)
    (request,) = track(processor, "r", prompt, SamplingParams(stop=["😀"]))
    outputs = stream(processor, request, ids[:2], last_status=None)
    assert outputs[-1].outputs[0].text == "Say" and not outputs[-1].finished
    (out,), stopped, _ = step(processor, {request: ids[2]})
    assert stopped == ["r"] and out.outputs[0].text == "Say "
    assert out.outputs[0].stop_reason == "😀"


def test_the_earliest_of_several_stop_strings_wins(tokenizer, prompt):
    ids = tokenizer.encode(STOP_TEXT)
    processor = OutputProcessor(tokenizer)
    (request,) = track(processor, "r", prompt, SamplingParams(stop=["here", "nd."]))
    outputs = stream(processor, request, ids, last_status=None)
    # "nd." completes with the third token: no later token is looked at
    assert outputs[-1].finished and len(outputs) == 3
    assert outputs[-1].outputs[0].text == " The e"
    assert outputs[-1].outputs[0].stop_reason == "nd."


# ---- logprobs -------------------------------------------------------------------------------


def test_sampled_logprobs_are_decoded_and_summed(tokenizer, prompt):
    ids = tokenizer.encode("Hello world")
    other = tokenizer.encode(" there")[0]
    processor = OutputProcessor(tokenizer)
    (request,) = track(processor, "r", prompt, SamplingParams(logprobs=1))
    # first position: the sampled token is also the top one (listed twice: kept once)
    step(
        processor,
        {request: ids[0]},
        logprobs={request: Logprobs([ids[0], ids[0]], [-0.25, -0.25], [1, 1])},
    )
    (out,), _, _ = step(
        processor,
        {request: ids[1]},
        {request: RequestStatus.FINISHED_LENGTH},
        {request: Logprobs([ids[1], other], [-1.5, -0.5], [2, 1])},
    )  # fmt: skip
    completion = out.outputs[0]
    assert completion.logprobs == [
        {ids[0]: Logprob(-0.25, 1, "Hello")},
        {ids[1]: Logprob(-1.5, 2, " world"), other: Logprob(-0.5, 1, " there")},
    ]
    assert completion.cumulative_logprob == pytest.approx(-1.75)


def test_logprobs_not_asked_for_are_not_kept(tokenizer, prompt):
    token = tokenizer.encode("Hello")[0]
    processor = OutputProcessor(tokenizer)
    (request,) = track(processor, "r", prompt, SamplingParams())
    lp = Logprobs([token], [-0.1], [1])
    (out,), _, _ = step(processor, {request: token}, logprobs={request: lp})
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert out.prompt_logprobs is None


def test_prompt_logprobs_come_in_chunks_and_only_from_the_first_sample(tokenizer, prompt):
    processor = OutputProcessor(tokenizer)
    requests = track(processor, "r", prompt, SamplingParams(n=2, prompt_logprobs=0))
    first, second = (r.request_id for r in requests)
    entry = Logprobs([prompt[1]], [-2.0], [3])
    processor.add_prompt_logprobs(first, [None, entry])  # the first prompt token has none
    processor.add_prompt_logprobs(second, [None, entry])  # the same prompt: not twice
    processor.add_prompt_logprobs(first, [Logprobs([prompt[2]], [-1.0], [1])])
    out = processor.make_output(processor.requests["r"])
    assert out.prompt_logprobs == [
        None,
        {prompt[1]: Logprob(-2.0, 3, tokenizer.decode([prompt[1]]))},
        {prompt[2]: Logprob(-1.0, 1, tokenizer.decode([prompt[2]]))},
    ]


# ---- n samples, abort, errors ---------------------------------------------------------------


def test_n_samples_are_one_output_finished_when_all_are(tokenizer, prompt):
    a, b = tokenizer.encode(" yes")[0], tokenizer.encode(" no")[0]
    processor = OutputProcessor(tokenizer)
    first, second = track(processor, "r", prompt, SamplingParams(n=2, max_tokens=2))
    assert processor.child_ids("r") == ["r#0", "r#1"]
    (out,), _, _ = step(processor, {first: a, second: b})  # one output for both children
    assert [(c.index, c.text) for c in out.outputs] == [(0, " yes"), (1, " no")]
    (out,), _, _ = step(processor, {first: b}, {first: RequestStatus.FINISHED_LENGTH})
    assert not out.finished and processor.has("r")
    assert [c.finish_reason for c in out.outputs] == ["length", None]
    assert out.outputs[1].text == " no"  # the sample that did not step keeps its text
    (out,), _, _ = step(processor, {second: a}, {second: RequestStatus.FINISHED_LENGTH})
    assert out.finished and [c.text for c in out.outputs] == [" yes no", " no yes"]
    assert not processor.has("r") and not processor.child_to_parent


def test_one_sample_stopped_by_a_string_while_the_other_goes_on(tokenizer, prompt):
    stop, go = tokenizer.encode(" yes")[0], tokenizer.encode(" go")[0]
    processor = OutputProcessor(tokenizer)
    first, second = track(processor, "r", prompt, SamplingParams(n=2, stop=["yes"]))
    (out,), stopped, _ = step(processor, {first: stop, second: go})
    assert stopped == ["r#0"] and not out.finished
    assert [(c.text, c.finish_reason) for c in out.outputs] == [(" ", "stop"), (" go", None)]


def test_abort_finishes_the_unfinished_samples(tokenizer, prompt):
    token = tokenizer.encode(" yes")[0]
    processor = OutputProcessor(tokenizer)
    first, second = track(processor, "r", prompt, SamplingParams(n=2))
    step(processor, {first: token, second: token}, {first: RequestStatus.FINISHED_LENGTH})
    state = processor.abort("r")
    out = processor.make_output(state)
    assert out.finished and [c.finish_reason for c in out.outputs] == ["length", "abort"]
    assert [c.text for c in out.outputs] == [" yes", " yes"]
    assert not processor.has("r") and processor.child_ids("r") == []
    # a step that was in flight when it was aborted: its tokens are dropped
    assert step(processor, {second: token}) == ([], [], [])
    assert processor.abort("r") is None


def test_a_failed_request_carries_its_error(tokenizer, prompt):
    processor = OutputProcessor(tokenizer)
    (request,) = track(processor, "r", prompt, SamplingParams())
    request.status = RequestStatus.FINISHED_ERROR
    request.error, request.error_from_request = "the prompt does not fit", True
    (out,) = [processor.make_output(s) for s in processor.process([request], {}, 5.0)[0]]
    assert out.finished and out.error == "the prompt does not fit" and out.error_from_request
    assert out.outputs[0].finish_reason == "error"
    assert "first_token_time" not in out.metrics  # it produced no token
    (request,) = track(processor, "s", prompt, SamplingParams())
    request.status = RequestStatus.FINISHED_ERROR
    (out,) = [processor.make_output(s) for s in processor.process([request], {}, 5.0)[0]]
    assert out.error == "request failed" and not out.error_from_request


def test_an_output_that_cannot_be_processed_fails_only_its_request(tokenizer, prompt):
    processor = OutputProcessor(tokenizer)
    (bad,) = track(processor, "bad", prompt, SamplingParams())
    (good,) = track(processor, "good", prompt, SamplingParams())
    token = tokenizer.encode("Hello")[0]
    outputs, stopped, failed = step(processor, {bad: 2**40, good: token})  # 2**40: no u32
    assert failed == ["bad"] and stopped == []  # the engine finishes it in the scheduler
    by_id = {o.request_id: o for o in outputs}
    assert by_id["bad"].finished and by_id["bad"].outputs[0].finish_reason == "error"
    assert by_id["bad"].error == "internal error processing the output (OverflowError)"
    assert not by_id["bad"].error_from_request
    assert by_id["good"].outputs[0].text == "Hello" and not by_id["good"].finished
    assert by_id["good"].error is None


def test_first_token_time_and_cached_tokens(tokenizer, prompt):
    processor = OutputProcessor(tokenizer)
    (request,) = track(processor, "r", prompt, SamplingParams())
    request.num_cached_tokens = 4
    (state,), _, _ = processor.process([request], {}, ARRIVAL + 1)  # a prefill chunk: no token
    assert state.first_token_time is None
    token = tokenizer.encode("Hello")[0]
    request.num_cached_tokens = 0  # the largest count reported is kept
    (out,), _, _ = step(processor, {request: token}, now=ARRIVAL + 2)
    (out,), _, _ = step(processor, {request: token}, now=ARRIVAL + 3)
    assert out.metrics == {"arrival_time": ARRIVAL, "first_token_time": ARRIVAL + 2}
    assert out.num_cached_tokens == 4


# ---- without a tokenizer --------------------------------------------------------------------


def test_without_a_tokenizer_outputs_carry_token_ids_only(prompt):
    processor = OutputProcessor(None)
    with pytest.raises(ValueError, match="stop strings need a tokenizer") as info:
        track(processor, "r", prompt, SamplingParams(n=2, stop=["x"]))
    assert str(info.value) == STOP_NEEDS_TOKENIZER
    assert not processor.has("r") and not processor.child_to_parent  # nothing tracked
    (request,) = track(processor, "r", prompt, SamplingParams(logprobs=0))
    lp = Logprobs([7], [-0.5], [1])
    (out,), _, _ = step(
        processor, {request: 7}, {request: RequestStatus.FINISHED_LENGTH}, {request: lp}
    )
    completion = out.outputs[0]
    assert completion.text == "" and completion.token_ids == [7]
    assert completion.logprobs == [{7: Logprob(-0.5, 1, None)}]
