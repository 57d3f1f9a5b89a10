"""Server metrics on prometheus-client, in a registry owned by one ServerMetrics (one per app)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridllm.entrypoints.openai.live_stats import LiveStats

PREFIX = "hybridllm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket bounds in seconds: TTFT spans a cached short prompt to a long CPU prefill; the
# per-token ones span a GPU decode step to a CPU one at large batch.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0)
# Token counts: powers of two up to a 128k context.
LENGTH_BUCKETS = tuple(float(2**i) for i in range(18))

OUTCOMES = ("stop", "length", "abort", "error")


class _EngineStatsCollector(Collector):
    """Engine gauges from the snapshot the /metrics handler fetched just before rendering."""

    def __init__(self) -> None:
        self.stats: Any | None = None
        self.engine_healthy = False
        self.num_in_flight = 0

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            f"{PREFIX}engine_healthy", "1 while the engine thread runs.", self.engine_healthy
        )
        yield GaugeMetricFamily(
            f"{PREFIX}requests_in_flight", "Requests the server is serving.", self.num_in_flight
        )
        stats = self.stats
        if stats is None:  # a dead engine has no stats; the server's own metrics still render
            return
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            (
                "kv_cache_usage_perc",
                "Fraction of KV cache blocks in use (0..1).",
                stats.kv_cache_usage,
            ),
            ("kv_cache_free_blocks", "Free KV cache blocks.", stats.num_free_blocks),
            ("kv_cache_total_blocks", "KV cache blocks in the pool.", stats.num_total_blocks),
        ):
            yield GaugeMetricFamily(f"{PREFIX}{name}", doc, value)
        yield CounterMetricFamily(
            f"{PREFIX}num_preemptions", "Requests preempted for KV space.", stats.num_preemptions
        )
        # speculative decoding, as vLLM's: acceptance rate = accepted / draft tokens, mean
        # accepted length = 1 + accepted / drafts (tokens a verify step yields); 0 without it
        for name, field, doc in (
            (
                "spec_decode_num_drafts",
                "spec_num_steps",
                "Verify steps of a request with drafts (speculative decoding).",
            ),
            ("spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Drafted tokens verified."),
            (
                "spec_decode_num_accepted_tokens",
                "spec_num_accepted_tokens",
                "Drafted tokens accepted.",
            ),
        ):
            yield CounterMetricFamily(f"{PREFIX}{name}", doc, getattr(stats, field, 0))
        busy = CounterMetricFamily(
            f"{PREFIX}worker_busy_seconds",
            "Seconds each worker spent computing.",
            labels=["worker"],
        )
        for worker, seconds in sorted((getattr(stats, "worker_busy_seconds", None) or {}).items()):
            busy.add_metric([str(worker)], seconds)
        yield busy


class ServerMetrics:
    """What the server counts about its requests; updated on the event loop thread only."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(
            f"{PREFIX}request_success",
            "Finished requests by finish reason (stop, length, abort, error).",
            ["finished_reason"],
            registry=reg,
        )
        for outcome in OUTCOMES:  # present at 0 from the start, so rates work from the first scrape
            self.requests.labels(outcome)
        self.http_responses = Counter(
            f"{PREFIX}http_responses", "HTTP responses by status code.", ["status"], registry=reg
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}prompt_tokens", "Prompt tokens of finished requests.", registry=reg
        )
        self.generation_tokens = Counter(
            f"{PREFIX}generation_tokens", "Generated tokens of finished requests.", registry=reg
        )
        self.ttft = Histogram(
            f"{PREFIX}time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Time between generated tokens of a request (a coalesced delta counts each token).",
            buckets=TPOT_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            f"{PREFIX}request_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.",
            buckets=TPOT_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            f"{PREFIX}e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            f"{PREFIX}request_queue_time_seconds",
            "Time from arrival until the engine thread accepted the request.",
            buckets=QUEUE_BUCKETS,
            registry=reg,
        )
        self.prompt_lengths = Histogram(
            f"{PREFIX}request_prompt_tokens",
            "Prompt tokens per finished request.",
            buckets=LENGTH_BUCKETS,
            registry=reg,
        )
        self.generation_lengths = Histogram(
            f"{PREFIX}request_generation_tokens",
            "Generated tokens per finished request.",
            buckets=LENGTH_BUCKETS,
            registry=reg,
        )
        self.tool_call_requests = Counter(
            f"{PREFIX}tool_call_requests",
            "Chat requests that offered tools, by tool_choice (none, auto, required, named).",
            ["tool_choice"],
            registry=reg,
        )
        self.tool_calls = Counter(
            f"{PREFIX}tool_calls",
            "Tool calls returned to clients, by how they were found (parsed or constrained).",
            ["source"],
            registry=reg,
        )
        self._engine = _EngineStatsCollector()
        reg.register(self._engine)
        self.live = LiveStats()  # the same events as a time series, for the web page

    def observe_first_token(self, seconds: float, prompt_tokens: int = 0) -> None:
        self.ttft.observe(seconds)
        self.live.record_first_token(seconds, prompt_tokens)

    def observe_tokens(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` new tokens arrived `seconds` after the previous ones."""
        if num_tokens > 0:
            per_token = seconds / num_tokens
            for _ in range(num_tokens):
                self.itl.observe(per_token)
            self.live.record_tokens(num_tokens, per_token)

    def observe_queued(self, seconds: float) -> None:
        self.queue_time.observe(seconds)

    def observe_finished(
        self,
        outcome: str,
        prompt_tokens: int,
        generation_tokens: int,
        e2e_seconds: float,
        tpot_seconds: float | None,
    ) -> None:
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.e2e.observe(e2e_seconds)
        if outcome in ("stop", "length"):  # aborted and failed requests have no real lengths
            self.prompt_lengths.observe(prompt_tokens)
            self.generation_lengths.observe(generation_tokens)
        if tpot_seconds is not None:
            self.tpot.observe(tpot_seconds)

    def observe_http(self, status: int) -> None:
        self.http_responses.labels(str(status)).inc()

    def observe_tool_choice(self, tool_choice: str) -> None:
        self.tool_call_requests.labels(tool_choice).inc()

    def observe_tool_calls(self, count: int, source: str = "parsed") -> None:
        if count:
            self.tool_calls.labels(source).inc(count)

    def finished(self, outcome: str) -> float:
        """How many requests finished with `outcome` so far."""
        value = self.registry.get_sample_value(
            f"{PREFIX}request_success_total", {"finished_reason": outcome}
        )
        return value or 0.0

    def render(self, stats: Any | None, engine_healthy: bool, num_in_flight: int) -> str:
        """Prometheus text exposition; `stats` is the engine's EngineStats or None (engine dead)."""
        self._engine.stats = stats
        self._engine.engine_healthy = engine_healthy
        self._engine.num_in_flight = num_in_flight
        return generate_latest(self.registry).decode()
