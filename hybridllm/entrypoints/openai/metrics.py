"""Server metrics (counters, histograms) and their rendering in the Prometheus text format."""

from __future__ import annotations

import bisect
import math
from collections import Counter
from typing import Any

# Bucket bounds in seconds: TTFT spans a cached short prompt to a long CPU prefill; TPOT spans
# a GPU decode step to a CPU one at large batch.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

OUTCOMES = ("stop", "length", "abort", "error")


class Histogram:
    """Cumulative-bucket histogram, as Prometheus exposes it."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last: +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            cumulative += count
            le = "+Inf" if bound == math.inf else repr(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        lines.append(f"{name}_sum {self.total}")
        lines.append(f"{name}_count {self.count}")
        return lines


class ServerMetrics:
    """What the server counts about its requests; updated on the event loop thread only."""

    def __init__(self) -> None:
        self.requests_by_outcome: Counter[str] = Counter({o: 0 for o in OUTCOMES})
        self.http_responses_by_status: Counter[int] = Counter()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_finished(
        self,
        outcome: str,
        prompt_tokens: int,
        generation_tokens: int,
        e2e_seconds: float,
        tpot_seconds: float | None,
    ) -> None:
        self.requests_by_outcome[outcome] += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        self.e2e.observe(e2e_seconds)
        if tpot_seconds is not None:
            self.tpot.observe(tpot_seconds)

    def observe_http(self, status: int) -> None:
        self.http_responses_by_status[status] += 1

    def render(self, stats: Any | None, engine_healthy: bool, num_in_flight: int) -> str:
        """Prometheus text exposition; `stats` is the engine's EngineStats or None (engine dead)."""
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[str]) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(samples)

        metric(
            "hybridllm_requests_total",
            "counter",
            "Finished requests by outcome.",
            [
                f'hybridllm_requests_total{{outcome="{o}"}} {n}'
                for o, n in sorted(self.requests_by_outcome.items())
            ],
        )
        metric(
            "hybridllm_http_responses_total",
            "counter",
            "HTTP responses by status code.",
            [
                f'hybridllm_http_responses_total{{status="{s}"}} {n}'
                for s, n in sorted(self.http_responses_by_status.items())
            ],
        )
        metric(
            "hybridllm_prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests.",
            [f"hybridllm_prompt_tokens_total {self.prompt_tokens}"],
        )
        metric(
            "hybridllm_generation_tokens_total",
            "counter",
            "Generated tokens of finished requests.",
            [f"hybridllm_generation_tokens_total {self.generation_tokens}"],
        )
        metric(
            "hybridllm_time_to_first_token_seconds",
            "histogram",
            "Time from arrival to the first generated token.",
            self.ttft.render("hybridllm_time_to_first_token_seconds"),
        )
        metric(
            "hybridllm_time_per_output_token_seconds",
            "histogram",
            "Mean time between generated tokens after the first, per request.",
            self.tpot.render("hybridllm_time_per_output_token_seconds"),
        )
        metric(
            "hybridllm_e2e_request_latency_seconds",
            "histogram",
            "Time from arrival to the last token.",
            self.e2e.render("hybridllm_e2e_request_latency_seconds"),
        )
        metric(
            "hybridllm_engine_healthy",
            "gauge",
            "1 while the engine thread runs.",
            [f"hybridllm_engine_healthy {int(engine_healthy)}"],
        )
        metric(
            "hybridllm_requests_in_flight",
            "gauge",
            "Requests the server is serving.",
            [f"hybridllm_requests_in_flight {num_in_flight}"],
        )
        if stats is not None:
            _render_engine_stats(stats, metric)
        return "\n".join(out) + "\n"


def _render_engine_stats(stats: Any, metric: Any) -> None:
    metric(
        "hybridllm_num_requests_running",
        "gauge",
        "Requests in the running batch.",
        [f"hybridllm_num_requests_running {stats.num_running}"],
    )
    metric(
        "hybridllm_num_requests_waiting",
        "gauge",
        "Requests waiting to be scheduled.",
        [f"hybridllm_num_requests_waiting {stats.num_waiting}"],
    )
    metric(
        "hybridllm_kv_cache_usage_perc",
        "gauge",
        "Fraction of KV cache blocks in use (0..1).",
        [f"hybridllm_kv_cache_usage_perc {stats.kv_cache_usage}"],
    )
    metric(
        "hybridllm_kv_cache_free_blocks",
        "gauge",
        "Free KV cache blocks.",
        [f"hybridllm_kv_cache_free_blocks {stats.num_free_blocks}"],
    )
    metric(
        "hybridllm_kv_cache_total_blocks",
        "gauge",
        "KV cache blocks in the pool.",
        [f"hybridllm_kv_cache_total_blocks {stats.num_total_blocks}"],
    )
    metric(
        "hybridllm_num_preemptions_total",
        "counter",
        "Requests preempted for KV space.",
        [f"hybridllm_num_preemptions_total {stats.num_preemptions}"],
    )
    busy = getattr(stats, "worker_busy_seconds", None) or {}
    metric(
        "hybridllm_worker_busy_seconds_total",
        "counter",
        "Seconds each worker spent computing.",
        [
            f'hybridllm_worker_busy_seconds_total{{worker="{w}"}} {s}'
            for w, s in sorted(busy.items())
        ],
    )
