"""Serving-latency metrics with the field's definitions, and SLO attainment over a sliding window.

The definitions match the serving benchmarks of vLLM and SGLang, so numbers compare:

    TTFT  = first token's arrival - request sent
    E2E   = last token's arrival - request sent
    TPOT  = (E2E - TTFT) / (output tokens - 1)         (requests with more than one output token)
    ITL   = every gap between successive token arrivals, pooled over requests
    goodput = finished requests per second that met every SLO

A response message may carry several tokens; the arrival time of a message stamps all of its
tokens (the benchmarks count ITL per message for the same reason: what a client sees).
"""

from __future__ import annotations

import collections
import itertools
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestTiming:
    """One request seen from where it was sent: the send time and each chunk's (arrival, tokens)."""

    sent: float
    chunks: tuple[tuple[float, int], ...]  # (arrival time, tokens in that chunk)

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.sent

    @property
    def e2e(self) -> float:
        return self.chunks[-1][0] - self.sent

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itl(self) -> list[float]:
        times = [t for t, _ in self.chunks]
        return [b - a for a, b in itertools.pairwise(times)]


@dataclass(frozen=True)
class Targets:
    ttft_s: float
    tpot_s: float

    def met(self, ttft: float, tpot: float | None) -> bool:
        return ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation, as numpy's default."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p90": float("nan"), "p99": float("nan")}
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def goodput(timings: Sequence[RequestTiming], targets: Targets, duration_s: float) -> float:
    """Requests per second that met both targets."""
    good = sum(1 for t in timings if t.chunks and targets.met(t.ttft, t.tpot))
    return good / duration_s if duration_s > 0 else 0.0


class SLOWindow:
    """Requests finished in the last `window_s` seconds: the share that met their targets, and
    their TTFT and TPOT percentiles (the autoscalers' latency signals)."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._events: collections.deque[tuple[float, bool, float | None, float | None]] = collections.deque()
        self._met = 0  # of the events, those that met their targets (attainment is read per request)
        self._lock = threading.Lock()

    def record(self, met: bool, ttft: float | None = None, tpot: float | None = None) -> None:
        with self._lock:
            self._events.append((self.clock(), met, ttft, tpot))
            self._met += met
            self._trim()

    def attainment(self) -> float | None:
        """None until a request has finished inside the window."""
        with self._lock:
            self._trim()
            if not self._events:
                return None
            return self._met / len(self._events)

    def latency(self, q: float = 90) -> tuple[float | None, float | None]:
        """The q-th percentile TTFT and TPOT in the window (None where there is none)."""
        with self._lock:
            self._trim()
            ttfts = [e[2] for e in self._events if e[2] is not None]
            tpots = [e[3] for e in self._events if e[3] is not None]
        return (percentile(ttfts, q) if ttfts else None, percentile(tpots, q) if tpots else None)

    def _trim(self) -> None:
        cutoff = self.clock() - self.window_s
        while self._events and self._events[0][0] < cutoff:
            self._met -= self._events.popleft()[1]
