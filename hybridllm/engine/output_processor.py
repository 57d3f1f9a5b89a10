"""Turns sampled token ids into user-visible RequestOutputs: detokenize, stop strings, n samples."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from hybridllm.engine.detokenizer import IncrementalDetokenizer, decode_token
from hybridllm.engine.no_tokenizer import check_params_without_tokenizer
from hybridllm.engine.request import Request, RequestStatus
from hybridllm.engine.scheduler_output import Logprobs
from hybridllm.engine.stop_checker import check_stop_strings, stop_string_holdback
from hybridllm.outputs import CompletionOutput, Logprob, RequestOutput
from hybridllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class SampleState:
    """One of a request's `n` samples (one engine-core Request)."""

    index: int
    child_id: str
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""  # detokenized output, truncated at a stop string
    new_text_len: int = 0  # length of the text the last step added (stop-string search window)


@dataclass
class RequestState:
    """A user request: prompt, its samples, prompt logprobs, and timing."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    error: str | None = None
    error_from_request: bool = False
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    """Engine-side bookkeeping of every live request; no torch.

    With `tokenizer` None (skip_tokenizer_init) outputs carry token ids only: text is "",
    logprobs' decoded_token None, and requests with stop strings are refused.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, tuple[RequestState, SampleState]] = {}

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        child_params: list[tuple[str, SamplingParams]],
        arrival_time: float,
    ) -> None:
        """Track a new request; raises ValueError (tracking nothing) when it needs a tokenizer
        this processor lacks."""
        if self.tokenizer is None:
            for _, params in child_params:
                check_params_without_tokenizer(params)
        samples = []
        for index, (child_id, params) in enumerate(child_params):
            samples.append(
                SampleState(
                    index=index,
                    child_id=child_id,
                    params=params,
                    detokenizer=IncrementalDetokenizer(
                        self.tokenizer, prompt_token_ids, params.skip_special_tokens
                    ),
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                )
            )
        want_prompt_lp = child_params[0][1].prompt_logprobs is not None
        state = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            samples,
            [] if want_prompt_lp else None,
            arrival_time=arrival_time,
        )
        self.requests[request_id] = state
        for s in samples:
            self.child_to_parent[s.child_id] = (state, s)

    def has(self, request_id: str) -> bool:
        return request_id in self.requests

    def child_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return [s.child_id for s in state.samples] if state else []

    def add_prompt_logprobs(self, child_id: str, entries: list[Logprobs | None]) -> None:
        state, sample = self.child_to_parent[child_id]
        if state.prompt_logprobs is None or sample.index != 0:
            return
        state.prompt_logprobs.extend(None if e is None else self._to_dict(e) for e in entries)

    def process(
        self, updated: list[Request], logprobs: dict[str, list[Logprobs] | None], now: float
    ) -> tuple[list[RequestState], list[str], list[str]]:
        """Apply one step's new tokens; returns touched requests, children stopped by a stop
        string, and children whose output could not be processed (finished with an error:
        one request's detokenization or stop check failing must not take the others down)."""
        touched: dict[str, RequestState] = {}
        stopped_by_string: list[str] = []
        failed: list[str] = []
        for req in updated:
            pair = self.child_to_parent.get(req.request_id)
            if pair is None:
                continue
            state, sample = pair
            touched[state.request_id] = state
            if state.first_token_time is None and req.num_output_tokens:
                state.first_token_time = now
            state.num_cached_tokens = max(state.num_cached_tokens, req.num_cached_tokens)
            if req.status == RequestStatus.FINISHED_ERROR:
                state.error = req.error or "request failed"
                state.error_from_request = req.error_from_request
                sample.finish_reason = "error"
                continue
            try:
                if self._append_tokens(req, sample, logprobs.get(req.request_id)):
                    stopped_by_string.append(sample.child_id)
                elif req.is_finished():
                    sample.text += sample.detokenizer.flush()
                    sample.finish_reason = req.get_finish_reason()
                    sample.stop_reason = req.stop_reason
            except Exception as exc:
                logger.exception("request %s: its output could not be processed", req.request_id)
                state.error = f"internal error processing the output ({type(exc).__name__})"
                sample.finish_reason = "error"
                if not req.is_finished():
                    failed.append(sample.child_id)
        return list(touched.values()), stopped_by_string, failed

    def _append_tokens(self, req: Request, sample: SampleState, lps: list[Logprobs] | None) -> bool:
        """Detokenize the request's new output tokens one at a time (a step with accepted
        drafts brings several), checking stop strings after each as if it had come alone: True
        when one ended the sample, the tokens after it dropped."""
        new_ids = req.output_token_ids[len(sample.detokenizer.token_ids) :]
        for i, token_id in enumerate(new_ids):
            new_text = sample.detokenizer.add_tokens([token_id])
            sample.text += new_text
            sample.new_text_len = len(new_text)
            if sample.logprobs is not None and lps is not None and i < len(lps):
                sample.logprobs.append(self._to_dict(lps[i]))
                sample.cumulative_logprob += lps[i].logprobs[0]
            if i == len(new_ids) - 1 and req.is_finished():
                return False  # its last token ended it: no stop string is looked for
            if sample.params.stop and self._hit_stop_string(sample):
                return True
        return False

    def _hit_stop_string(self, sample: SampleState) -> bool:
        match = check_stop_strings(
            sample.text,
            sample.new_text_len,
            sample.params.stop,
            sample.params.include_stop_str_in_output,
        )
        if match is None:
            return False
        stop_str, truncate_to = match
        sample.text = sample.text[:truncate_to]
        sample.finish_reason = "stop"
        sample.stop_reason = stop_str
        return True

    def abort(self, request_id: str) -> RequestState | None:
        state = self.requests.get(request_id)
        if state is None:
            return None
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"
        return state

    def make_output(self, state: RequestState) -> RequestOutput:
        outputs = []
        finished = state.finished
        for s in state.samples:
            text = s.text
            if s.finish_reason is None and s.params.stop:
                # Hold back text that may be the start of a stop string: it may never be shown.
                hold = stop_string_holdback(text, s.params.stop)
                text = text[: len(text) - hold] if hold else text
            outputs.append(
                CompletionOutput(
                    index=s.index,
                    text=text,
                    token_ids=list(s.detokenizer.token_ids),
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=s.logprobs,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        metrics = {"arrival_time": state.arrival_time}
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        if finished:
            self.requests.pop(state.request_id, None)
            for s in state.samples:
                self.child_to_parent.pop(s.child_id, None)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=outputs,
            finished=finished,
            error=state.error,
            error_from_request=state.error_from_request,
            num_cached_tokens=state.num_cached_tokens,
            metrics=metrics,
        )

    def _to_dict(self, lp: Logprobs) -> dict[int, Logprob]:
        out: dict[int, Logprob] = {}
        for tid, value, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
            if tid not in out:
                out[tid] = Logprob(value, rank, decode_token(self.tokenizer, tid))
        return out
