"""LLMEngine: tokenizer -> scheduler -> executor -> output processor; add / step / abort."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hybridllm.config import EngineConfig
from hybridllm.engine.errors import EngineDeadError
from hybridllm.engine.input_validation import InputValidator
from hybridllm.engine.kv_cache_groups import kv_cache_groups
from hybridllm.engine.output_processor import OutputProcessor
from hybridllm.engine.request import Request, RequestStatus
from hybridllm.engine.scheduler import Scheduler
from hybridllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from hybridllm.engine_args import EngineArgs
from hybridllm.outputs import RequestOutput
from hybridllm.sampling_params import SamplingParams
from hybridllm.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    worker_busy_seconds: dict[str, float] = field(default_factory=dict)
    # speculative decoding (all 0 without it): steps that verified drafts, drafts, accepted
    spec_num_steps: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


class LLMEngine:
    """Synchronous engine core. Not thread-safe: one thread calls add/abort/step/embed.

    With pipeline_parallel_size P > 1 up to P steps are in flight: each `step` schedules
    and submits new micro-batches while earlier ones are still in the pipeline, then
    collects the oldest, so the stages work on different micro-batches at once.
    """

    def __init__(self, config: EngineConfig, show_progress: bool = False):
        # Deferred: executors import torch; the engine package itself stays torch-free.
        from hybridllm.executor.executor import create_executor
        from hybridllm.loader import load_tokenizer

        self.config = config
        self.model_config = config.model_config
        # None with skip_tokenizer_init: token ids in and out (see engine/no_tokenizer.py).
        self.tokenizer = None
        if not config.model_config.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(
                config.model_config.tokenizer or config.model_config.model
            )
        self.executor = create_executor(config, show_progress=show_progress)
        try:
            # one block count per KV cache group (kv_cache_groups of the model's config)
            self.num_blocks_per_group = self.executor.initialize()
        except BaseException:
            self.executor.shutdown()
            raise
        # The checks the server makes too (engine/input_validation.py); the scheduler repeats
        # them for a request added to it directly.
        self.validator = InputValidator(
            config.model_config.max_model_len, config.model_config.vocab_size
        )
        self.num_blocks = sum(self.num_blocks_per_group)
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            self.num_blocks_per_group,
            self.validator,
            kv_cache_groups(config.model_config.hf_config),
            num_lookahead_tokens=_lookahead_tokens(config),
        )
        self.structured_output = StructuredOutputManager(
            self.tokenizer, config.model_config.vocab_size, config.model_config.eos_token_ids
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        try:
            self.drafter = _create_drafter(config)  # speculative decoding's, when configured
        except BaseException:
            self.executor.shutdown()
            raise
        self._pending_outputs: list[RequestOutput] = []  # aborted requests, reported next step
        self._closed = False
        self._max_in_flight = config.plan.pipeline_parallel_size
        # (step, executor handle) of steps still in the pipeline, oldest first
        self._in_flight: deque[tuple[SchedulerOutput, Any]] = deque()
        self._dead: EngineDeadError | None = None
        logger.info(
            "engine ready: %s (%s) on %s, KV blocks of %d tokens per group: %s",
            config.model_config.model,
            config.model_config.dtype,
            config.device_config.device,
            config.cache_config.block_size,
            list(self.num_blocks_per_group),
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs, show_progress: bool = False) -> LLMEngine:
        return cls(args.create_engine_config(), show_progress=show_progress)

    def get_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(
                "this engine has no tokenizer: it was created with skip_tokenizer_init=True"
            )
        return self.tokenizer

    # ---- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; raises ValueError (and queues nothing) when it cannot run."""
        if self._dead is not None:
            raise self._dead
        if self.output_processor.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        params = self.verify_params(params)
        if params.structured_outputs is not None:
            # Cheap checks only: the grammar compiles on a background thread while the
            # request waits (LLM.generate and the server compile first, to raise/400).
            self.structured_output.check(params.structured_outputs)
        text, token_ids = self._tokenize(prompt)
        self.validator.check_prompt(token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = [(request_id, params)]
        if params.n > 1:
            children = [(f"{request_id}#{i}", params.clone_for_sample(i)) for i in range(params.n)]
        self.output_processor.add(request_id, text, token_ids, children, arrival)
        eos = self.model_config.eos_token_ids
        for child_id, child_params in children:
            if len(eos) > 1 and not child_params.ignore_eos:
                # Every end-of-sequence id of the generation config stops the request.
                extra = [t for t in eos[1:] if t not in child_params.stop_token_ids]
                child_params = dataclasses.replace(
                    child_params, stop_token_ids=child_params.stop_token_ids + extra
                )
            request = Request(child_id, token_ids, child_params, eos[0] if eos else None, arrival)
            if child_params.structured_outputs is not None:
                request.structured_output = self.structured_output.new_state(
                    child_params.structured_outputs
                )
            self.scheduler.add_request(request)

    def verify_params(self, params: SamplingParams) -> SamplingParams:
        """Check `params` against the loaded model (ValueError naming the field); returns
        the params to run, which may differ (a top_k above the vocabulary means no limit)."""
        return self.validator.check_params(params)

    def _tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and token ids, not yet checked."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
                if not isinstance(token_ids, (list, tuple)):
                    raise ValueError("prompt_token_ids must be a list of integer token ids")
                text = prompt.get("prompt")
                return text if isinstance(text, str) else None, list(token_ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                from hybridllm.engine.no_tokenizer import check_prompt_without_tokenizer

                check_prompt_without_tokenizer(prompt)  # raises: text needs a tokenizer
            # Not tokenized: some tokenizers add a BOS token to an empty text.
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(
            f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            children = self.output_processor.child_ids(request_id)
            if not children:
                continue
            self.scheduler.abort_requests(children)
            state = self.output_processor.abort(request_id)
            self._pending_outputs.append(self.output_processor.make_output(state))

    def has_unfinished_requests(self) -> bool:
        if self._dead is not None:
            return bool(self._pending_outputs)
        return (
            bool(self._pending_outputs)
            or bool(self._in_flight)
            or self.scheduler.has_unfinished_requests()
        )

    # ---- one step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; raises EngineDeadError (requests then finish with an error) when a
        worker died. A dead engine still hands out its pending outputs, then raises again."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if self._dead is not None:
            if outputs:
                return outputs
            raise self._dead
        try:
            if self._max_in_flight == 1:
                return outputs + self._step_one()
            return outputs + self._step_pipelined()
        except EngineDeadError as e:
            self._pending_outputs = outputs + self._pending_outputs + self._fail_all(e)
            raise

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next step, with the grammar bitmask of its constrained rows."""
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running, self.scheduler.in_flight)
        scheduler_output = self.scheduler.schedule()
        self.structured_output.attach_bitmask(scheduler_output, self.scheduler.requests)
        if scheduler_output.is_empty and self.scheduler.waiting and not self.scheduler.running:
            time.sleep(0.001)  # only requests whose grammars compile: do not spin a core
        return scheduler_output

    def _step_one(self) -> list[RequestOutput]:
        scheduler_output = self._schedule()
        if _nothing_to_run(scheduler_output):
            # Requests finished by the scheduler without running (e.g. larger than the pool).
            return self._apply(scheduler_output, None)
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except EngineDeadError:
            raise
        except Exception as exc:
            if is_device_failure(exc):
                raise EngineDeadError(f"the device failed: {type(exc).__name__}: {exc}") from exc
            # In-process workers keep no state of a failed step that the next one relies on
            # (its requests are dropped by `finished_req_ids`): fail its requests, go on.
            logger.exception(
                "a step of %d requests failed; they finish with an error, the engine goes on",
                len(scheduler_output.num_scheduled_tokens),
            )
            error = f"internal error in the model step ({type(exc).__name__})"
            return self._process(self.scheduler.fail_step(scheduler_output, error), {}, {})
        return self._apply(scheduler_output, runner_output)

    def _step_pipelined(self) -> list[RequestOutput]:
        """Fill the pipeline up to its depth, then collect the oldest micro-batch."""
        while len(self._in_flight) < self._max_in_flight:
            # Requests already in flight are skipped: this schedules other work, if any.
            scheduler_output = self._schedule()
            if _nothing_to_run(scheduler_output):
                # kept as pending until the end: a dead worker below must not lose them
                self._pending_outputs += self._apply(scheduler_output, None)
                break
            # An empty step that only drops finished requests still travels: workers
            # must forget them in order with the steps around it.
            handle = _pipelined(self.executor.execute_model_async, scheduler_output)
            self._in_flight.append((scheduler_output, handle))
        results: list[RequestOutput] = []
        if self._in_flight:
            scheduler_output, handle = self._in_flight.popleft()
            results = self._apply(scheduler_output, _pipelined(self.executor.get_output, handle))
        results, self._pending_outputs = self._pending_outputs + results, []
        return results

    def _fail_all(self, error: EngineDeadError) -> list[RequestOutput]:
        """Finish every unfinished request with the engine's error; returns their outputs."""
        self._dead = error
        self._in_flight.clear()
        requests = list(self.scheduler.requests.values())
        for request in requests:
            request.error = str(error)
        self.scheduler.finish_requests(
            [r.request_id for r in requests], RequestStatus.FINISHED_ERROR
        )
        return self._process(requests, {}, {})

    def _apply(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput | None
    ) -> list[RequestOutput]:
        """Feed one finished step back to the scheduler and turn its tokens into outputs."""
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.drafter is not None:
            self.drafter.observe(runner_output, self.scheduler.requests)
        if runner_output is None:
            return self._process(updated, {}, {})
        logprobs = dict(zip(runner_output.req_ids, runner_output.logprobs, strict=True))
        return self._process(updated, logprobs, runner_output.prompt_logprobs)

    def _process(self, updated: list[Request], logprobs, prompt_logprobs) -> list[RequestOutput]:
        for child_id, entries in prompt_logprobs.items():
            # A request aborted while its step was in flight is gone already.
            if child_id in self.output_processor.child_to_parent:
                self.output_processor.add_prompt_logprobs(child_id, entries)
        touched, stopped, failed = self.output_processor.process(
            updated, logprobs, time.monotonic()
        )
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if failed:
            self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        return [self.output_processor.make_output(state) for state in touched]

    # ---- other work ---------------------------------------------------------------------------

    def embed(
        self, prompts: list[list[int]], pooling: str = "last", normalize: bool = True
    ) -> list[list[float]]:
        if self._dead is not None:
            raise self._dead
        for token_ids in prompts:
            self.validator.check_prompt(token_ids)
        return self.executor.embed(prompts, pooling, normalize)

    def check_health(self) -> None:
        """Raise EngineDeadError when the engine can no longer run (a worker died)."""
        if self._dead is not None:
            raise self._dead
        self.executor.check_health()

    def get_stats(self, include_workers: bool = True) -> EngineStats:
        """`include_workers=False`: the scheduler's counts only, no call to the workers (the
        server's once-a-second sampling)."""
        bm = self.scheduler.block_manager
        busy = self.executor.collective_rpc("get_busy_seconds") if include_workers else []
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=self.num_blocks,
            num_preemptions=getattr(self.scheduler, "num_preemptions", 0),
            worker_busy_seconds={f"worker{i}": s for i, s in enumerate(busy)},
            spec_num_steps=self.scheduler.spec_num_steps,
            spec_num_draft_tokens=self.scheduler.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.scheduler.spec_num_accepted_tokens,
        )

    def shutdown(self) -> None:
        """Stop the workers (within the executor's shutdown bound), then the grammar compiler."""
        if self._closed:
            return
        self._closed = True
        try:
            # first: worker processes and shared memory outlive us if this is cut short
            self.executor.shutdown()
        finally:
            self.structured_output.shutdown()
            if self.drafter is not None:
                self.drafter.shutdown()


def _lookahead_tokens(config: EngineConfig) -> int:
    """Slots a request holds past its scheduled tokens: chained MTP drafts (k > 1) write the
    MTP layer's KV up to k - 1 positions past the step's last token."""
    spec = config.speculative_config
    if spec is None or spec.method != "mtp":
        return 0
    return spec.num_speculative_tokens - 1


def _create_drafter(config: EngineConfig) -> Any:
    """The drafter of `config.speculative_config` (spec_decode/), or None without one."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        from hybridllm.spec_decode.ngram_drafter import NgramDrafter

        return NgramDrafter(spec)
    if spec.method == "mtp":  # the last stage's MTP layer drafts; the drafter hands them on
        from hybridllm.spec_decode.mtp_drafter import MtpDrafter

        return MtpDrafter(spec)
    # Deferred: the draft model runs on torch, which the engine package does not import.
    from hybridllm.plan.draft_memory import draft_max_seqs
    from hybridllm.spec_decode.draft_model_drafter import DraftModelDrafter
    from hybridllm.worker.draft_runner import DraftModelRunner

    # the draft only runs for batches below disable_by_batch_size: KV for that many sequences
    max_seqs = draft_max_seqs(spec, config.scheduler_config.max_num_seqs)
    runner = DraftModelRunner(
        spec.draft_config, spec.num_speculative_tokens, max_seqs, config.model_config.vocab_size
    )
    return DraftModelDrafter(spec, runner)


def _pipelined(call: Any, *args: Any) -> Any:
    """`call(*args)` on a pipelined executor: any failure but a dead worker is fatal too, since
    the other stages hold later micro-batches of a pipeline now out of step."""
    try:
        return call(*args)
    except EngineDeadError:
        raise
    except Exception as exc:
        raise EngineDeadError(f"a pipelined step failed: {type(exc).__name__}: {exc}") from exc


def is_device_failure(exc: BaseException) -> bool:
    """A CUDA error leaves the device unusable (a sticky error); the engine cannot go on.

    By name, since this package does not import torch: torch raises AcceleratorError (or a
    RuntimeError saying "CUDA error") for them.
    """
    return type(exc).__name__ == "AcceleratorError" or "CUDA error" in str(exc)


def _nothing_to_run(scheduler_output: SchedulerOutput) -> bool:
    """No tokens to compute and no finished requests for the workers to drop."""
    return scheduler_output.is_empty and not scheduler_output.finished_req_ids
