"""Engine-side structured outputs: compiled-grammar cache, compile thread, per-step bitmask."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from hybridllm.structured.backend import GrammarError, compile_grammar, make_tokenizer, to_grammar
from hybridllm.structured.params import StructuredOutputsParams
from hybridllm.structured.request_state import GrammarState

MAX_CACHED_GRAMMARS = 256


class StructuredOutputManager:
    """Compiles each distinct (kind, spec) once, on a background thread, and builds the step's
    token bitmask from the matchers of the requests that sample.

    Thread-safe for `check`, `compile_async` and `compile` (the server compiles a request's
    grammar off its event loop before queueing it, so an invalid one is a 400); `new_state`
    and `bitmask` run on the engine thread.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def num_words(self) -> int:
        """int32 words per bitmask row: one bit per token of the vocabulary."""
        return (self.vocab_size + 31) // 32

    def check(self, params: StructuredOutputsParams) -> None:
        """Cheap checks at add time (ValueError naming the field); compiles nothing."""
        if self._hf_tokenizer is None:
            raise ValueError(
                "structured_outputs needs the model's tokenizer; this engine was created "
                "with skip_tokenizer_init=True"
            )
        to_grammar(params)

    def compile_async(self, params: StructuredOutputsParams) -> Future:
        """The (cached) future of the compiled grammar; compiles on the background thread."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._closed:
                raise RuntimeError("the structured output manager is shut down")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
            future = self._executor.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)  # running requests keep their own reference
            return future

    def compile(self, params: StructuredOutputsParams, timeout: float | None = None) -> None:
        """Compile now (or wait for the background compile); raises GrammarError (a ValueError)."""
        self.check(params)
        self.compile_async(params).result(timeout)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        with self._lock:
            tokenizer = self._ll_tokenizer
        if tokenizer is None:
            tokenizer = make_tokenizer(self._hf_tokenizer, self.vocab_size, self._eos_token_ids)
            with self._lock:
                self._ll_tokenizer = tokenizer
        return compile_grammar(params, tokenizer)

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self.compile_async(params))

    def bitmask(self, states: Sequence[GrammarState]) -> np.ndarray:
        """int32 [len(states), num_words]: bit t of a row is set iff token t is allowed next."""
        out = np.empty((len(states), self.num_words), dtype=np.int32)
        for row, state in enumerate(states):
            state.fill_bitmask(out, row)
        return out

    def attach_bitmask(self, scheduler_output: Any, requests: dict[str, Any]) -> None:
        """Set the step's `grammar_bitmask` for its constrained requests that sample (those
        whose computed tokens reach all their tokens after the step; chunks mid-prompt do not)."""
        req_ids, states = [], []
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None or request.structured_output is None:
                continue
            if request.num_computed_tokens + num_new >= request.num_tokens:
                req_ids.append(req_id)
                states.append(request.structured_output)
        if states:
            scheduler_output.structured_req_ids = req_ids
            scheduler_output.grammar_bitmask = self.bitmask(states)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


__all__ = ["GrammarError", "StructuredOutputManager"]
