"""`LLM`: the offline Python API, shaped like vLLM's (`generate`, `chat`, `get_tokenizer`)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from hybridllm.engine.llm_engine import LLMEngine
from hybridllm.engine.no_tokenizer import (
    check_params_without_tokenizer,
    check_prompt_without_tokenizer,
)
from hybridllm.engine_args import EngineArgs
from hybridllm.outputs import CompletionOutput, RequestOutput
from hybridllm.sampling_params import SamplingParams

PromptType = str | list[int] | dict

logger = logging.getLogger(__name__)


class LLM:
    """Load a model once and run batches of prompts through the engine.

    `LLM()` with no model loads the embedded SmolLM2-135M-Instruct. Keyword arguments are
    the fields of `EngineArgs` (dtype, device, max_model_len, gpu_memory_utilization, ...).
    With `skip_tokenizer_init=True` no tokenizer is loaded: prompts must be token ids, and
    outputs carry token ids with empty text.
    """

    def __init__(self, model: str | None = None, *, use_tqdm: bool | None = None, **kwargs: Any):
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown arguments {unknown}; known: {sorted(known)}")
        self._default_tqdm = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args, show_progress=self._default_tqdm)
        self._counter = itertools.count()
        # In-process CPU workers compute through torch's OpenMP pool, which belongs to the
        # thread that loaded them: stepping from another thread measured half the speed.
        self._loading_thread = threading.get_ident()
        workers = getattr(self.llm_engine.executor, "workers", ())
        self._warn_other_thread = any(w.device.type == "cpu" for w in workers)
        # Free the workers on garbage collection and at interpreter exit.
        self._finalizer = weakref.finalize(self, self.llm_engine.shutdown)

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        A prompt that cannot run (empty, longer than the context) gets a finished output
        with `error` set; the other prompts complete normally.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        # Parameters the model cannot run are the caller's mistake: ValueError naming the
        # field, before anything is queued.
        params = [self.llm_engine.verify_params(p) for p in params]
        for p in params:
            if p.structured_outputs is not None:
                # compiled now (cached): an invalid schema raises here, naming the field
                self.llm_engine.structured_output.compile(p.structured_outputs)
        if self.llm_engine.model_config.skip_tokenizer_init:
            # A batch that needs a tokenizer is a usage error, not a failed prompt: raise
            # before anything is queued.
            for prompt in prompts:
                check_prompt_without_tokenizer(prompt)
            for p in params:
                check_params_without_tokenizer(p)
        if self._warn_other_thread and threading.get_ident() != self._loading_thread:
            self._warn_other_thread = False  # once
            logger.warning(
                "LLM.generate called from another thread than the one that created the LLM: "
                "its CPU workers compute about 2x slower there (torch's OpenMP pool belongs to "
                "the loading thread); create the LLM on the thread that generates"
            )
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        order = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = str(next(self._counter))
                order.append(request_id)
                try:
                    engine.add_request(request_id, prompt, p)
                except ValueError as e:
                    results[request_id] = _error_output(request_id, prompt, str(e))
        except BaseException:
            engine.abort_request([r for r in order if r not in results])
            _drain(engine)
            raise
        show = self._default_tqdm if use_tqdm is None else use_tqdm
        bar = None
        if show and len(prompts) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="Processed prompts", unit="req")
            bar.update(len(results))
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request([r for r in order if r not in results])
            _drain(engine)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in order]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if self.llm_engine.model_config.skip_tokenizer_init:
            raise ValueError(
                "LLM.chat needs a tokenizer to apply the chat template, but this LLM was "
                "created with skip_tokenizer_init=True: use generate() with token ids"
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            token_ids = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                chat_template=chat_template,
            )
            if isinstance(token_ids, dict) or hasattr(token_ids, "input_ids"):
                token_ids = token_ids["input_ids"]
            prompts.append({"prompt_token_ids": list(token_ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        """Free every worker and resource; the object is unusable afterwards. Bounded (the
        executor's `SHUTDOWN_BOUND_S`) whatever became of the workers or a Ray cluster, as are
        the same shutdown on garbage collection and at exit."""
        self._finalizer()


def _drain(engine: LLMEngine) -> None:
    """Step until aborted requests have left the workers and freed their KV blocks."""
    while engine.has_unfinished_requests():
        engine.step()


def _error_output(request_id: str, prompt: PromptType, message: str) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else None
    ids = prompt if isinstance(prompt, list) else []
    return RequestOutput(
        request_id=request_id,
        prompt=text,
        prompt_token_ids=list(ids),
        prompt_logprobs=None,
        outputs=[CompletionOutput(0, "", [], None, None, finish_reason="error")],
        finished=True,
        error=message,
        error_from_request=True,  # add_request refused it
    )
