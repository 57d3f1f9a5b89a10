"""Prometheus rendering of the server metrics, and the bench serve statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridllm.benchmarks.serve_client import RequestResult
from hybridllm.benchmarks.serve_metrics import compute_metrics, format_report, percentile
from hybridllm.entrypoints.openai.metrics import ServerMetrics


@dataclass
class Stats:
    num_running: int = 2
    num_waiting: int = 1
    kv_cache_usage: float = 0.25
    num_free_blocks: int = 30
    num_total_blocks: int = 40
    num_preemptions: int = 0
    worker_busy_seconds: dict = field(default_factory=lambda: {"worker0": 1.5, "worker1": 0.5})


def samples(text: str) -> dict[str, float]:
    """Parsed with prometheus_client's own text parser: {'name{label="v"}': value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def test_server_metrics_render():
    m = ServerMetrics()
    m.observe_first_token(0.2)
    m.observe_tokens(0.3, 3)
    m.observe_queued(0.001)
    m.observe_finished("length", 5, 8, 1.0, 0.1)
    m.observe_finished("abort", 0, 0, 0.5, None)
    m.observe_http(200)
    m.observe_http(400)
    m.observe_tool_choice("auto")
    m.observe_tool_calls(2)
    text = m.render(Stats(), engine_healthy=True, num_in_flight=3)
    assert "# TYPE hybridllm:inter_token_latency_seconds histogram" in text
    s = samples(text)
    assert s['hybridllm:request_success_total{finished_reason="length"}'] == 1
    assert s['hybridllm:request_success_total{finished_reason="abort"}'] == 1
    assert s['hybridllm:request_success_total{finished_reason="error"}'] == 0
    assert m.finished("length") == 1
    assert s['hybridllm:http_responses_total{status="400"}'] == 1
    assert s["hybridllm:prompt_tokens_total"] == 5 and s["hybridllm:generation_tokens_total"] == 8
    assert s["hybridllm:request_time_per_output_token_seconds_count"] == 1
    assert s["hybridllm:inter_token_latency_seconds_count"] == 3
    assert s['hybridllm:inter_token_latency_seconds_bucket{le="0.1"}'] == 3  # le is inclusive
    assert s["hybridllm:inter_token_latency_seconds_sum"] == pytest.approx(0.3)
    assert s["hybridllm:request_queue_time_seconds_count"] == 1
    # Lengths of aborted requests are not lengths: only the finished one counts.
    assert s["hybridllm:request_prompt_tokens_count"] == 1
    assert s['hybridllm:request_generation_tokens_bucket{le="8.0"}'] == 1
    assert s['hybridllm:request_generation_tokens_bucket{le="4.0"}'] == 0
    assert s['hybridllm:tool_call_requests_total{tool_choice="auto"}'] == 1
    assert s['hybridllm:tool_calls_total{source="parsed"}'] == 2
    assert s["hybridllm:kv_cache_free_blocks"] == 30 and s["hybridllm:num_requests_waiting"] == 1
    assert s['hybridllm:worker_busy_seconds_total{worker="worker1"}'] == 0.5
    assert s["hybridllm:requests_in_flight"] == 3
    # A dead engine has no stats: the server's own metrics still render.
    dead = samples(m.render(None, engine_healthy=False, num_in_flight=0))
    assert dead["hybridllm:engine_healthy"] == 0 and "hybridllm:kv_cache_free_blocks" not in dead


def test_registries_are_per_instance():
    a, b = ServerMetrics(), ServerMetrics()
    a.observe_http(200)
    assert 'status="200"' not in b.render(None, True, 0)


def test_percentile_matches_numpy():
    values = [0.3, 5.0, 1.2, 9.9, 2.2, 0.01, 4.4]
    for p in (0, 10, 50, 90, 99, 100):
        assert percentile(values, p) == pytest.approx(np.percentile(values, p))
    assert percentile([], 99) == 0.0


def test_compute_metrics():
    ok = RequestResult(
        success=True,
        prompt_len=10,
        output_tokens=5,
        ttft=0.1,
        itl=[0.05, 0.05, 0.05, 0.05],
        latency=0.3,
    )
    ok2 = RequestResult(
        success=True, prompt_len=20, output_tokens=3, ttft=0.3, itl=[0.1, 0.1], latency=0.5
    )
    failed = RequestResult(success=False, error="HTTP 500")
    m = compute_metrics([ok, ok2, failed], duration_s=2.0, percentiles=(50, 99))
    assert (m.completed, m.failed) == (2, 1)
    assert m.total_input_tokens == 30 and m.total_output_tokens == 8
    assert m.request_throughput == 1.0 and m.output_throughput == 4.0
    assert m.total_token_throughput == 19.0
    assert m.ttft.mean_ms == pytest.approx(200) and m.ttft.median_ms == pytest.approx(200)
    # TPOT per request: (0.3 - 0.1) / 4 = 50 ms and (0.5 - 0.3) / 2 = 100 ms.
    assert m.tpot.mean_ms == pytest.approx(75)
    assert m.itl.median_ms == pytest.approx(50) and m.itl.percentiles_ms["p99"] > 95
    report = format_report(m)
    for line in (
        "Successful requests:",
        "Output token throughput (tok/s):",
        "Mean TTFT (ms):",
        "Median TPOT (ms):",
        "P99 ITL (ms):",
    ):
        assert line in report
