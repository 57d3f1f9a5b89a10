"""LiveStats: per-second rates, trailing-minute percentiles, bounded memory."""

from __future__ import annotations

from types import SimpleNamespace

from hybridllm.entrypoints.openai.live_stats import (
    MAX_SAMPLES_PER_S,
    PERCENTILE_WINDOW_S,
    LiveStats,
    percentile,
)

STATS = SimpleNamespace(num_running=3, num_waiting=1, kv_cache_usage=0.25)


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0
    assert percentile([7.0], 90) == 7.0 and percentile([], 50) is None


def test_rates_are_per_second_of_the_interval():
    live = LiveStats()
    live.sample(100.0, STATS)  # starts the clock: no point yet
    assert not live.points
    live.record_first_token(0.2, prompt_tokens=40)
    live.record_tokens(9, per_token_s=0.01)
    live.sample(102.0, STATS)  # 2 s: 10 tokens generated, 40 prompt tokens
    point = live.points[-1]
    assert point["generation_tokens_per_s"] == 5.0 and point["prompt_tokens_per_s"] == 20.0
    assert (point["running"], point["waiting"], point["kv_cache_usage"]) == (3, 1, 0.25)
    assert point["ttft_p50_s"] == 0.2 and point["itl_p99_s"] == 0.01
    live.sample(103.0, None)  # an engine that did not answer: counts unknown, rates zero
    point = live.points[-1]
    assert point["running"] is None and point["generation_tokens_per_s"] == 0.0
    assert point["ttft_p50_s"] == 0.2  # still inside the trailing window


def test_percentiles_forget_what_left_the_window():
    live = LiveStats()
    live.sample(0.0, STATS)
    live.record_first_token(5.0, 1)
    live.sample(1.0, STATS)
    for t in range(2, PERCENTILE_WINDOW_S + 2):
        live.record_first_token(0.1, 1)
        live.sample(float(t), STATS)
    assert live.points[-1]["ttft_p99_s"] == 0.1  # the 5 s one is older than the window


def test_memory_is_bounded_whatever_the_rate():
    live = LiveStats(history_s=10)
    live.sample(0.0, STATS)
    for t in range(1, 30):
        for i in range(10 * MAX_SAMPLES_PER_S):
            live.record_tokens(1, 0.001 * (i % 7))
        live.sample(float(t), STATS)
    assert len(live.points) == 10
    assert all(len(s.itl) <= MAX_SAMPLES_PER_S for s in live._seconds)
    assert live.points[-1]["generation_tokens_per_s"] == 10 * MAX_SAMPLES_PER_S


def test_snapshot_keeps_the_asked_seconds_with_times_relative_to_now():
    live = LiveStats()
    for t in range(0, 11):
        live.sample(float(t), STATS)
    snap = live.snapshot(since_s=3, now=10.5)
    assert [p["t"] for p in snap["points"]] == [-2.5, -1.5, -0.5]
    assert snap["percentile_window_s"] == PERCENTILE_WINDOW_S
