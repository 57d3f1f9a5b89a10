"""Aggregate benchmark results: throughput, TTFT, TPOT, ITL and E2E latency statistics."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from hybridllm.benchmarks.serve_client import RequestResult


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolation percentile (numpy's default), 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class LatencyStats:
    """mean / median / std and the asked-for percentiles of one latency, in milliseconds."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[str, float]

    @classmethod
    def of(cls, seconds: list[float], percentiles: tuple[float, ...]) -> LatencyStats:
        ms = [s * 1000 for s in seconds]
        return cls(
            mean_ms=statistics.fmean(ms) if ms else 0.0,
            median_ms=statistics.median(ms) if ms else 0.0,
            std_ms=statistics.pstdev(ms) if ms else 0.0,
            percentiles_ms={f"p{p:g}": percentile(ms, p) for p in percentiles},
        )


@dataclass(frozen=True)
class BenchmarkMetrics:
    """Counts, throughputs and latency statistics of one benchmark run."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    ttft: LatencyStats
    tpot: LatencyStats  # per request: (latency - ttft) / (output tokens - 1)
    itl: LatencyStats  # every gap between streamed chunks, pooled
    e2el: LatencyStats
    # Each distinct reason a request failed, with how many failed for it, most frequent first.
    failure_reasons: dict[str, int] = field(default_factory=dict)


def failure_reasons(results: list[RequestResult]) -> dict[str, int]:
    """How many requests failed for each distinct reason, most frequent first."""
    counts = Counter(r.error or "unknown error" for r in results if not r.success)
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def compute_metrics(
    results: list[RequestResult], duration_s: float, percentiles: tuple[float, ...] = (99,)
) -> BenchmarkMetrics:
    ok = [r for r in results if r.success]
    # Non-streamed requests have no token timing (no ITL): they get no TPOT either.
    tpots = [
        (r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and r.itl
    ]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        ttft=LatencyStats.of([r.ttft for r in ok], percentiles),
        tpot=LatencyStats.of(tpots, percentiles),
        itl=LatencyStats.of([gap for r in ok for gap in r.itl], percentiles),
        e2el=LatencyStats.of([r.latency for r in ok], percentiles),
        failure_reasons=failure_reasons(results),
    )


def format_report(m: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    rows: list[tuple[str, str]] = [
        ("Successful requests:", f"{m.completed}"),
        ("Failed requests:", f"{m.failed}"),
        ("Benchmark duration (s):", f"{m.duration_s:.2f}"),
        ("Total input tokens:", f"{m.total_input_tokens}"),
        ("Total generated tokens:", f"{m.total_output_tokens}"),
        ("Request throughput (req/s):", f"{m.request_throughput:.2f}"),
        ("Output token throughput (tok/s):", f"{m.output_throughput:.2f}"),
        ("Total token throughput (tok/s):", f"{m.total_token_throughput:.2f}"),
    ]
    sections = [
        ("Time to First Token", "TTFT", m.ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", m.tpot),
        ("Inter-token Latency", "ITL", m.itl),
        ("End-to-end Latency", "E2EL", m.e2el),
    ]
    lines = [f"{' ' + title + ' ':=^60}"]
    lines += [f"{k:<44}{v:>16}" for k, v in rows]
    if m.failure_reasons:
        lines.append(f"{' Failures (count: reason) ':-^60}")
        lines += [f"{count:>5}: {reason}" for reason, count in m.failure_reasons.items()]
    for heading, short, stats in sections:
        lines.append(f"{' ' + heading + ' ':-^60}")
        lines.append(f"{'Mean ' + short + ' (ms):':<44}{stats.mean_ms:>16.2f}")
        lines.append(f"{'Median ' + short + ' (ms):':<44}{stats.median_ms:>16.2f}")
        for name, value in stats.percentiles_ms.items():
            lines.append(f"{name.upper() + ' ' + short + ' (ms):':<44}{value:>16.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)
