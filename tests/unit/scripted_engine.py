"""A deterministic stand-in for LLMEngine (same contract) to test the layers above it."""

from __future__ import annotations

import threading
import time

from hybridllm.engine.llm_engine import EngineStats
from hybridllm.outputs import CompletionOutput, RequestOutput
from hybridllm.sampling_params import SamplingParams


class ScriptedEngine:
    """Follows the LLMEngine contract; request k emits token k+1 per step until max_tokens."""

    def __init__(self, step_delay: float = 0.002, fail_at_step: int | None = None) -> None:
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.aborted: list[str] = []
        self.pending: list[RequestOutput] = []
        self.calling_threads: set[int] = set()
        self.num_steps = 0
        self.step_delay = step_delay
        self.fail_at_step = fail_at_step
        self.shut_down = False

    def _touch(self) -> None:
        self.calling_threads.add(threading.get_ident())

    def add_request(self, request_id, prompt, params, arrival_time=None) -> None:
        self._touch()
        if not prompt:
            raise ValueError("prompt is empty")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.requests[request_id] = (list(prompt), params, [])

    def abort_request(self, request_ids) -> None:
        self._touch()
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if rid in self.requests:
                prompt, _, tokens = self.requests.pop(rid)
                self.aborted.append(rid)
                self.pending.append(self._output(rid, prompt, tokens, "abort"))

    def has_unfinished_requests(self) -> bool:
        self._touch()
        return bool(self.requests or self.pending)

    def step(self) -> list[RequestOutput]:
        self._touch()
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("simulated worker crash")
        time.sleep(self.step_delay)
        outputs, self.pending = self.pending, []
        for rid, (prompt, params, tokens) in list(self.requests.items()):
            tokens.append(len(tokens) + 1)
            done = len(tokens) >= params.max_tokens
            if done:
                del self.requests[rid]
            outputs.append(self._output(rid, prompt, tokens, "length" if done else None))
        return outputs

    @staticmethod
    def _output(rid, prompt, tokens, reason) -> RequestOutput:
        text = "".join(f"t{t} " for t in tokens)
        out = CompletionOutput(0, text, tokens, None, None, reason)
        return RequestOutput(rid, None, prompt, None, [out], reason is not None)

    def embed(self, prompts, pooling="last", normalize=True):
        self._touch()
        return [[float(len(p)), 0.0] for p in prompts]

    def check_health(self) -> None:
        self._touch()

    def get_stats(self, include_workers: bool = True) -> EngineStats:
        self._touch()
        busy = {"worker0": 0.0} if include_workers else {}
        return EngineStats(len(self.requests), 0, 0.0, 10, 10, 0, busy)

    def shutdown(self) -> None:
        self._touch()
        self.shut_down = True
