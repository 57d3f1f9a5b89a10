"""Continuous-batching scheduler: one token budget per step, chunked prefill, preemption."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from hybridllm.config import CacheConfig, SchedulerConfig
from hybridllm.engine.input_validation import InputValidator
from hybridllm.engine.kv_cache_groups import KVCacheGroupSpec
from hybridllm.engine.kv_cache_manager import FULL_ATTENTION, GroupBlockIds, KVCacheManager
from hybridllm.engine.request import Request, RequestStatus
from hybridllm.engine.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


class Scheduler:
    """Decides each step which requests compute how many tokens (vLLM v1 style).

    There are no prefill/decode phases: every request's `num_computed_tokens` catches
    up with its `num_tokens`. Running requests go first, in arrival order, then waiting
    ones FCFS. Invariant: `running` is in arrival order and every waiting request arrived
    after every running one (admission never skips the queue head, and preemption takes
    the latest arrival and puts it back at the head), so the latest arrival is running[-1].
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int | Sequence[int],
        validator: InputValidator | None = None,
        kv_cache_groups: Sequence[KVCacheGroupSpec] = FULL_ATTENTION,
        num_lookahead_tokens: int = 0,
    ) -> None:
        """`num_lookahead_tokens`: slots each scheduled request also holds past its step's last
        token, where the step may write ahead (speculative decoding's chained MTP drafts)."""
        self.scheduler_config = scheduler_config
        self.num_lookahead_tokens = num_lookahead_tokens
        # The engine's (it knows the vocabulary); alone, the context length is all there is.
        self.validator = (
            validator if validator is not None else InputValidator(scheduler_config.max_model_len)
        )
        self.cache_config = cache_config
        # one count per KV cache group (an int: every group has that many)
        if isinstance(num_blocks, int):
            num_blocks = [num_blocks] * len(kv_cache_groups)
        self.block_manager = KVCacheManager(
            kv_cache_groups, num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        # A request can grow while the pool can hold all but its next sampled token.
        capacity = self.block_manager.capacity_tokens
        self.max_len = scheduler_config.max_model_len
        if capacity is not None:
            self.max_len = min(self.max_len, capacity + 1)

        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._num_tokens_sent: dict[str, int] = {}  # tokens the workers hold, per running req
        self._in_flight: set[str] = set()  # scheduled, waiting for update_from_output
        self._deferred_free: dict[str, Request] = {}  # finished while in flight
        self._finished_req_ids: set[str] = set()  # for the next SchedulerOutput
        self._finished_unreported: list[Request] = []  # finished without running (errors)

        # Counters for metrics.
        self.num_preemptions = 0
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0
        # speculative decoding: steps that verified drafts, drafts verified, drafts accepted
        self.spec_num_steps = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0

    def _allocate(
        self, request: Request, num_new: int, computed_blocks: Sequence = ()
    ) -> list[int] | None:
        """Slots for `num_new` more tokens, and the lookahead ones past them where the pool
        has room (without them a step only writes what it schedules)."""
        if self.num_lookahead_tokens:
            ahead = num_new + self.num_lookahead_tokens
            ids = self.block_manager.allocate_slots(request, ahead, computed_blocks)
            if ids is not None:
                return ids
        return self.block_manager.allocate_slots(request, num_new, computed_blocks)

    # ----- requests in and out -----
    def add_request(self, request: Request) -> None:
        """Queue a request; one that can never run is finished at once with FINISHED_ERROR."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        error = self._admission_error(request)
        if error is not None:
            request.status = RequestStatus.FINISHED_ERROR
            request.error = error
            request.error_from_request = True
            self._finished_unreported.append(request)
            return
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _admission_error(self, request: Request) -> str | None:
        # The engine checked already; the same checks again (cheap) so that a request added
        # here directly fails alone instead of failing the step it would run in.
        try:
            request.sampling_params = self.validator.check_params(request.sampling_params)
            self.validator.check_prompt(request.prompt_token_ids)
        except (TypeError, ValueError) as exc:
            return str(exc)
        config = self.scheduler_config
        chunk = config.max_num_batched_tokens if config.enable_chunked_prefill else None
        num_prompt = request.num_prompt_tokens
        return self.block_manager.blocks_short(num_prompt, chunk or num_prompt)

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        status: RequestStatus,
        stop_reason: int | str | None = None,
    ) -> None:
        """End requests early (abort, or a stop string seen by the engine); unknown ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a FINISHED_* status, got {status.name}")
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        requests = [self.requests[i] for i in ids if i in self.requests]
        if not requests:
            return
        was_waiting = any(r.status != RequestStatus.RUNNING for r in requests)
        for request in requests:
            if stop_reason is not None:
                request.stop_reason = stop_reason
            self._finish(request, status)
        # One O(queue) rebuild per call rather than one list removal per request.
        if was_waiting:
            self.waiting = deque(r for r in self.waiting if not r.is_finished())
        self.running = [r for r in self.running if not r.is_finished()]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        req_id = request.request_id
        del self.requests[req_id]
        self._num_tokens_sent.pop(req_id, None)
        if req_id in self._in_flight:
            # Workers may still be writing its KV this step: free once the step reports back.
            self._deferred_free[req_id] = request
        else:
            self.block_manager.free(request)
        self._finished_req_ids.add(req_id)

    # ----- stats -----
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def in_flight(self) -> frozenset[str]:
        """Ids of the requests scheduled and not yet reported back."""
        return frozenset(self._in_flight)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        """True while requests run or wait, or finished ones still await update_from_output."""
        return bool(self.requests) or bool(self._finished_unreported)

    # ----- one step -----
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV blocks.

        Requests already scheduled and not yet reported back (`update_from_output`) are
        skipped, so no tokens are ever scheduled twice even with several steps in flight.
        """
        config = self.scheduler_config
        budget = config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached_reqs: list[CachedRequestData] = []
        new_reqs: list[NewRequestData] = []
        preempted = False

        spec_tokens: dict[str, list[int]] = {}
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = request.num_tokens - request.num_computed_tokens
            if request.request_id in self._in_flight or num_new <= 0:
                index += 1
                continue
            if num_new > budget and not config.enable_chunked_prefill:
                index += 1  # a whole prompt or nothing; a later, shorter one may fit
                continue
            num_new = min(num_new, budget)
            drafts = self._drafts_to_verify(request, num_new, budget)
            new_block_ids = self._allocate(request, num_new + len(drafts))
            if new_block_ids is None and drafts:
                drafts = []  # short of blocks: verify nothing rather than preempt for drafts
                new_block_ids = self._allocate(request, num_new)
            while new_block_ids is None:
                victim = self._latest_preemptable()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_block_ids = self.block_manager.allocate_slots(request, num_new)
            if new_block_ids is None:
                break  # it preempted itself: all requests after it are in flight
            cached_reqs.append(self._cached_request_data(request, new_block_ids, drafts))
            if drafts:
                spec_tokens[request.request_id] = drafts
                num_new += len(drafts)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            index += 1

        # Admitting new work in a step that had to preempt would only thrash.
        compiling: list[Request] = []  # grammars still compiling: later requests go ahead
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < config.max_num_seqs
        ):
            request = self.waiting[0]
            grammar = request.structured_output
            if grammar is not None and not grammar.is_ready(request.output_token_ids):
                compiling.append(self.waiting.popleft())
                continue
            if grammar is not None and grammar.error is not None:
                self.waiting.popleft()
                self._fail_unscheduled(request, grammar.error)
                continue
            computed_blocks, num_hit = self.block_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget and not config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            new_block_ids = self._allocate(request, num_new, computed_blocks)
            if new_block_ids is None:
                break  # FCFS: no later request jumps the queue head
            self.waiting.popleft()
            self._admit(request, num_hit)
            new_reqs.append(self._new_request_data(request))
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))

        self._in_flight.update(num_scheduled)
        finished_req_ids, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=config.max_num_batched_tokens - budget,
            finished_req_ids=finished_req_ids,
            scheduled_spec_decode_tokens=spec_tokens,
        )

    def _drafts_to_verify(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The request's drafts this step can verify: only after its last known token, within
        the token budget, and never past the context length (the last accepted draft's KV and
        the token after it must fit). Takes them off the request either way."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or num_new != 1:
            return []
        room = min(budget - 1, self.max_len - request.num_tokens - 1)
        return drafts[: max(room, 0)]

    def _fail_unscheduled(self, request: Request, error: str) -> None:
        """Finish a waiting request that never ran (no blocks, no worker state) with `error`."""
        request.status = RequestStatus.FINISHED_ERROR
        request.error = error
        del self.requests[request.request_id]
        self._finished_unreported.append(request)

    def _admit(self, request: Request, num_hit: int) -> None:
        if request.status == RequestStatus.WAITING:  # first time, not a resume
            request.num_cached_tokens = num_hit
        if self.cache_config.enable_prefix_caching:
            self.prefix_cache_queried_tokens += request.num_tokens
            self.prefix_cache_hit_tokens += num_hit
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _latest_preemptable(self) -> Request:
        # The caller is running and not in flight, so this always finds one.
        for request in reversed(self.running):
            if request.request_id not in self._in_flight:
                return request
        raise AssertionError("no preemptable running request")

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop its KV, keep its tokens, requeue it at the head."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._num_tokens_sent.pop(request.request_id, None)
        self._finished_req_ids.add(request.request_id)  # workers drop their copy
        self.waiting.appendleft(request)

    def _new_request_data(self, request: Request) -> NewRequestData:
        self._num_tokens_sent[request.request_id] = request.num_tokens
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=self.block_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
        )

    def _cached_request_data(
        self, request: Request, new_block_ids: GroupBlockIds, drafts: list[int]
    ) -> CachedRequestData:
        num_sent = self._num_tokens_sent[request.request_id]
        self._num_tokens_sent[request.request_id] = request.num_tokens
        return CachedRequestData(
            req_id=request.request_id,
            new_token_ids=request.all_token_ids[num_sent:],  # O(tokens sampled since)
            new_block_ids=new_block_ids,
            num_computed_tokens=request.num_computed_tokens,
            spec_token_ids=drafts,
        )

    # ----- results of one step -----
    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput | None = None,
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens, and apply stop checks.

        Returns the requests that got a new token (finished ones with their final
        status), plus any request finished without running (FINISHED_ERROR at
        admission): call it for every step, empty ones too (`model_runner_output`
        may be None when nothing was scheduled).
        """
        updated, self._finished_unreported = self._finished_unreported, []
        if model_runner_output is None:
            model_runner_output = ModelRunnerOutput()
        sampled = dict(
            zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True)
        )
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        any_finished = False
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            self._in_flight.discard(req_id)
            finished_in_flight = self._deferred_free.pop(req_id, None)
            if finished_in_flight is not None:
                self.block_manager.free(finished_in_flight)
                continue
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if req_id in model_runner_output.failed:
                request.error = model_runner_output.failed[req_id]
                request.error_from_request = True  # its sampling parameters failed
                self._finish(request, RequestStatus.FINISHED_ERROR)
                any_finished = True
                updated.append(request)
                continue
            drafts = spec_tokens.get(req_id, ())
            request.num_computed_tokens += num_tokens - len(drafts)
            token_ids = sampled.get(req_id)
            if request.num_computed_tokens < request.num_tokens:
                self.block_manager.cache_computed_blocks(request)
                if token_ids is not None:
                    raise RuntimeError(
                        f"model runner sampled for request {req_id!r} mid-prefill "
                        f"({request.num_computed_tokens}/{request.num_tokens} tokens computed)"
                    )
                continue
            if not token_ids or len(token_ids) > len(drafts) + 1:
                raise RuntimeError(
                    f"request {req_id!r} computed all {request.num_tokens} tokens and "
                    f"{len(drafts)} drafts but the model runner output has "
                    f"{token_ids!r} for it, not 1 to {len(drafts) + 1} tokens"
                )
            if drafts:
                # every token but the last confirms a draft whose KV is now kept
                self._count_drafts(request, len(drafts), len(token_ids) - 1)
                request.num_computed_tokens += len(token_ids) - 1
            status = None
            for token_id in token_ids:
                request.append_output_token_ids(token_id)
                status = self._check_stop(request, token_id)
                if status is None:
                    status = self._advance_grammar(request, token_id)
                if status is not None:
                    # later tokens (accepted drafts) come after the end: dropped, with their KV
                    request.num_computed_tokens = min(
                        request.num_computed_tokens, request.num_tokens
                    )
                    break
            self.block_manager.cache_computed_blocks(request)
            if status is not None:
                self._finish(request, status)
                any_finished = True
            # A rejected draft's slots stay with the request, past its computed tokens: never
            # read (contexts end before them), never cached, overwritten by its next tokens.
            updated.append(request)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished()]
        return updated

    def _count_drafts(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        self.spec_num_steps += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted

    def _advance_grammar(self, request: Request, token_id: int) -> RequestStatus | None:
        """Move the request's grammar matcher (if any) past `token_id`: the status it ends
        with, or None."""
        grammar = request.structured_output
        if grammar is None:
            return None
        # The matcher follows the output tokens (the mask made this one allowed).
        if not grammar.accept(token_id):
            # The client's grammar, not the engine, failed: a 400 / an error event.
            request.error = grammar.rejection(token_id)
            request.error_from_request = True
            return RequestStatus.FINISHED_ERROR
        if grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED
        return None

    def fail_step(self, scheduler_output: SchedulerOutput, error: str) -> list[Request]:
        """A step that raised: finish every request it scheduled with `error` and free
        their blocks, so that the requests outside it go on. Returns the finished ones
        (with any that finished without running), as `update_from_output` would."""
        updated, self._finished_unreported = self._finished_unreported, []
        for req_id in scheduler_output.num_scheduled_tokens:
            self._in_flight.discard(req_id)
            finished_in_flight = self._deferred_free.pop(req_id, None)
            if finished_in_flight is not None:
                self.block_manager.free(finished_in_flight)
                continue
            request = self.requests.get(req_id)
            if request is None:
                continue
            request.error = error
            self._finish(request, RequestStatus.FINISHED_ERROR)
            updated.append(request)
        self.waiting = deque(r for r in self.waiting if not r.is_finished())
        self.running = [r for r in self.running if not r.is_finished()]
        return updated

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        # Stop tokens count only once min_tokens are out; they win over a length cap
        # reached by the same token (the model did choose to stop).
        if request.num_output_tokens >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_len:
            return RequestStatus.FINISHED_LENGTH
        return None
