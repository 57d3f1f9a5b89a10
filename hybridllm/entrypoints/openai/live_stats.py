"""The last minutes of the server's rates and latencies, sampled once a second for the web
page's live view (`GET /v1/live`): the same events /metrics counts, kept as a time series."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

HISTORY_S = 600  # seconds of points kept
PERCENTILE_WINDOW_S = 60  # each point's TTFT / ITL percentiles are over this trailing window
# Latency samples kept per second: enough for percentiles, bounded whatever the token rate.
MAX_SAMPLES_PER_S = 256
PERCENTILES = (50, 90, 99)


@dataclass
class _Second:
    """What happened in one sampling interval."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    num_itl_seen: int = 0  # ITL samples offered


class LiveStats:
    """Counts tokens and latencies as they happen (event-loop thread) and closes one point per
    `sample()` call; `snapshot()` is what /v1/live answers."""

    def __init__(self, history_s: int = HISTORY_S) -> None:
        self._generated = 0  # tokens since the last sample
        self._prompt = 0
        self._current = _Second()
        self._seconds: deque[_Second] = deque(maxlen=PERCENTILE_WINDOW_S)
        self.points: deque[dict[str, Any]] = deque(maxlen=history_s)
        self._last_time: float | None = None

    def record_first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        """A request's prefill ended: its prompt tokens are computed and its first token out."""
        self._prompt += prompt_tokens
        self._generated += 1
        if len(self._current.ttft) < MAX_SAMPLES_PER_S:
            self._current.ttft.append(ttft_s)

    def record_tokens(self, num_tokens: int, per_token_s: float) -> None:
        self._generated += num_tokens
        cur = self._current
        # past the cap the newest samples overwrite the oldest: a busy second stays bounded
        if len(cur.itl) < MAX_SAMPLES_PER_S:
            cur.itl.append(per_token_s)
        else:
            cur.itl[cur.num_itl_seen % MAX_SAMPLES_PER_S] = per_token_s
        cur.num_itl_seen += 1

    def sample(self, now: float, stats: Any | None) -> None:
        """Close the interval ending at `now` (monotonic seconds); `stats`: the engine's
        EngineStats, or None when it cannot answer."""
        elapsed = None if self._last_time is None else now - self._last_time
        self._last_time = now
        self._seconds.append(self._current)
        generated, prompt = self._generated, self._prompt
        self._generated = self._prompt = 0
        self._current = _Second()
        if not elapsed or elapsed <= 0:
            return  # the first call only starts the clock
        ttft = sorted(v for s in self._seconds for v in s.ttft)
        itl = sorted(v for s in self._seconds for v in s.itl)
        point = {
            "t": now,
            "generation_tokens_per_s": generated / elapsed,
            "prompt_tokens_per_s": prompt / elapsed,
            "running": getattr(stats, "num_running", None),
            "waiting": getattr(stats, "num_waiting", None),
            "kv_cache_usage": getattr(stats, "kv_cache_usage", None),
        }
        for p in PERCENTILES:
            point[f"ttft_p{p}_s"] = percentile(ttft, p)
            point[f"itl_p{p}_s"] = percentile(itl, p)
        self.points.append(point)

    def snapshot(self, since_s: float, now: float) -> dict[str, Any]:
        """The points of the last `since_s` seconds, times made relative to `now` (<= 0)."""
        points = [
            {k: _rounded(v) for k, v in p.items()} | {"t": round(p["t"] - now, 3)}
            for p in self.points
            if now - p["t"] <= since_s
        ]
        return {
            "percentile_window_s": PERCENTILE_WINDOW_S,
            "history_s": self.points.maxlen,
            "points": points,
        }


def percentile(sorted_values: list[float], p: float) -> float | None:
    """The nearest-rank p-th percentile of sorted values; None for none."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _rounded(value: Any) -> Any:
    """Four significant digits: a plot needs no more, and the page polls every second."""
    return float(f"{value:.4g}") if isinstance(value, float) else value
