"""Engine-side structured outputs: compiled-grammar cache, isolated compiles, per-step bitmask."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from hybridllm.structured.backend import GrammarError, compile_grammar, make_tokenizer, to_grammar
from hybridllm.structured.compile_threads import CompileThreads
from hybridllm.structured.isolated_compiler import SMALL_GRAMMAR_CHARS, IsolatedCompiler
from hybridllm.structured.limits import check_lark_depth, check_schema_depth
from hybridllm.structured.params import StructuredOutputsParams
from hybridllm.structured.request_state import GrammarState

MAX_CACHED_GRAMMARS = 256
# The cache's bound in bytes, each grammar counted as COMPILED_BYTES_PER_CHAR of its text
# (a compiled 1 MB regex held 37 bytes a character, 3,000 anyOf branches 62) plus a floor.
MAX_CACHED_GRAMMAR_BYTES = 256 << 20
COMPILED_BYTES_PER_CHAR = 64
COMPILED_BYTES_FLOOR = 64 << 10
MAX_CACHED_FAILURES = 1024  # their digests and short messages, never their text


class StructuredOutputManager:
    """Compiles each distinct (kind, spec) once and builds the step's token bitmask from the
    matchers of the requests that sample.

    A grammar is compiled first in a child process (`IsolatedCompiler`: a compiler crash or
    a compile past `compile_timeout_s` fails that grammar alone, and the child is killed),
    then, once known to compile, on one of this process's large-stack compile threads. The
    cache of compiled grammars is bounded in entries and estimated bytes and keyed by a
    digest; failures are remembered as short messages so a repeated bad grammar costs
    nothing.

    Thread-safe for `check`, `compile_async` and `compile` (the server compiles a request's
    grammar off its event loop before queueing it, so an invalid one is a 400); `new_state`
    and `bitmask` run on the engine thread.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        compile_timeout_s: float = 10.0,
    ):
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[bytes, tuple[Future, int]] = OrderedDict()
        self._cache_bytes = 0
        self._failures: OrderedDict[bytes, str] = OrderedDict()
        self._isolated: IsolatedCompiler | None = None
        # Two in-process compile threads as the children's two lanes: one for small grammars
        # only, so that a large compile never holds one up here either.
        self._threads: tuple[CompileThreads, CompileThreads] | None = None
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
        if params.kind == "json":
            check_schema_depth(params.schema)
        grammar = to_grammar(params)
        if params.kind == "grammar":
            check_lark_depth(grammar)

    def compile_async(self, params: StructuredOutputsParams) -> Future:
        """The (cached) future of the compiled grammar; compiles in the background."""
        digest = params.digest
        with self._lock:
            entry = self._cache.get(digest)
            if entry is not None:
                self._cache.move_to_end(digest)
                return entry[0]
            if digest in self._failures:
                failed: Future = Future()
                failed.set_exception(GrammarError(self._failures[digest]))
                return failed
            if self._closed:
                raise RuntimeError("the structured output manager is shut down")
            isolated, pools = self._start_locked()
            threads = pools[0 if len(params.spec) <= SMALL_GRAMMAR_CHARS else 1]
            future: Future = Future()
            weight = COMPILED_BYTES_FLOOR + COMPILED_BYTES_PER_CHAR * len(params.spec)
            self._cache[digest] = (future, weight)
            self._cache_bytes += weight
            while len(self._cache) > 1 and (
                len(self._cache) > MAX_CACHED_GRAMMARS
                or self._cache_bytes > MAX_CACHED_GRAMMAR_BYTES
            ):  # running requests keep their own reference to what is evicted
                self._cache_bytes -= self._cache.popitem(last=False)[1][1]

        def finish(done: Future) -> None:
            if done.cancelled() or done.exception() is not None:
                self._forget(digest, future, done)
            else:
                future.set_result(done.result())

        def compiled(done: Future) -> None:
            if done.cancelled() or done.exception() is not None:
                self._forget(digest, future, done)
            else:  # known to compile, in bounded time: now for this process
                threads.submit(lambda: self._compile(params)).add_done_callback(finish)

        try:
            isolated.submit(*params.key).add_done_callback(compiled)
        except RuntimeError as exc:  # shut down meanwhile
            future.set_exception(exc)
        return future

    def warm_up(self) -> None:
        """Start the compile children and build the grammar tokenizer now, in the background
        (a server calls this; offline engines start them at their first grammar)."""
        if self._hf_tokenizer is None:
            return
        with self._lock:
            if self._closed:
                return
            isolated, pools = self._start_locked()
        isolated.start_children()
        pools[0].submit(self._ll_tokenizer_or_build)

    def _start_locked(self) -> tuple[IsolatedCompiler, tuple[CompileThreads, CompileThreads]]:
        if self._isolated is None or self._threads is None:
            self._isolated = IsolatedCompiler(
                self._hf_tokenizer, self.vocab_size, self._eos_token_ids, self.compile_timeout_s
            )
            self._threads = (CompileThreads(1), CompileThreads(1))
        return self._isolated, self._threads

    def compile(self, params: StructuredOutputsParams, timeout: float | None = None) -> None:
        """Compile now (or wait for the background compile); raises GrammarError (a ValueError)."""
        self.check(params)
        self.compile_async(params).result(timeout)

    def _forget(self, digest: bytes, future: Future, done: Future) -> None:
        """A failed or cancelled compile leaves the cache; a failure's message is kept."""
        with self._lock:
            entry = self._cache.get(digest)
            if entry is not None and entry[0] is future:
                del self._cache[digest]
                self._cache_bytes -= entry[1]
            if not done.cancelled():
                self._failures[digest] = str(done.exception())
                while len(self._failures) > MAX_CACHED_FAILURES:
                    self._failures.popitem(last=False)
        if done.cancelled():
            future.cancel()
        else:
            future.set_exception(done.exception())

    def _ll_tokenizer_or_build(self) -> Any:
        with self._lock:
            tokenizer = self._ll_tokenizer
        if tokenizer is None:
            tokenizer = make_tokenizer(self._hf_tokenizer, self.vocab_size, self._eos_token_ids)
            with self._lock:
                self._ll_tokenizer = tokenizer
        return tokenizer

    def _compile(self, params: StructuredOutputsParams) -> Any:
        return compile_grammar(params, self._ll_tokenizer_or_build())

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self.compile_async(params))

    def attach_bitmask(self, scheduler_output: Any, requests: dict[str, Any]) -> None:
        """Set the step's `grammar_bitmask` for its constrained requests that sample (those
        whose computed tokens reach all their tokens after the step; chunks mid-prompt do not):
        one row each, and one more per draft a request verifies (the mask after that draft)."""
        drafts_of = scheduler_output.scheduled_spec_decode_tokens
        req_ids, rows = [], []
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None or request.structured_output is None:
                continue
            drafts = drafts_of.get(req_id, ())
            if request.num_computed_tokens + num_new - len(drafts) >= request.num_tokens:
                req_ids.append(req_id)
                rows.append((request.structured_output, drafts))
        if not rows:
            return
        out = np.empty((sum(1 + len(d) for _, d in rows), self.num_words), dtype=np.int32)
        row = 0
        for state, drafts in rows:
            state.fill_bitmasks(out, row, drafts)
            row += 1 + len(drafts)
        scheduler_output.structured_req_ids = req_ids
        scheduler_output.grammar_bitmask = out

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            isolated, self._isolated = self._isolated, None
            threads, self._threads = self._threads, None
        if isolated is not None:
            isolated.shutdown()
        for pool in threads or ():
            pool.shutdown()


__all__ = ["GrammarError", "StructuredOutputManager"]
