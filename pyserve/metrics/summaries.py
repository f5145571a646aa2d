"""Latency summaries (``--metrics-config summary_latencies=true``): Triton's
``nv_inference_*_summary_us`` families.

Each model version keeps, per duration, a running count and sum (all time) and the samples of
the last ``max_age_s`` seconds, from which the quantiles are computed exactly at scrape time
(Triton's Prometheus client keeps a 60 s sliding window too, with approximate quantiles). A
quantile of an empty window is NaN, as Triton reports it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

SUMMARY_FIELDS = ("request", "queue", "compute_input", "compute_infer", "compute_output")
"""The durations summarised, in the order of ``LatencySummaries.observe``'s ``field``."""

REQUEST, QUEUE, COMPUTE_INPUT, COMPUTE_INFER, COMPUTE_OUTPUT = range(len(SUMMARY_FIELDS))

DEFAULT_QUANTILES = (0.5, 0.9, 0.95, 0.99, 0.999)
"""Triton's default ``summary_quantiles`` (its error bounds do not apply: quantiles are exact)."""

MAX_AGE_S = 60.0
MAX_SAMPLES = 50_000
"""Samples kept per duration at most (the oldest go first): bounds memory under heavy load."""


class _Window:
    __slots__ = ("count", "samples", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0
        self.samples: deque[tuple[float, int]] = deque(maxlen=MAX_SAMPLES)


class LatencySummaries:
    """The summaries of one model version.

    Thread-safety: ``observe`` may be called from any thread (instance threads, the event
    loop); ``snapshot`` from the scraping thread. One lock, held for a deque append.
    """

    __slots__ = ("_lock", "_max_age_s", "_windows")

    def __init__(self, max_age_s: float = MAX_AGE_S) -> None:
        self._lock = threading.Lock()
        self._max_age_s = max_age_s
        self._windows = tuple(_Window() for _ in SUMMARY_FIELDS)

    def observe(self, field: int, duration_ns: int) -> None:
        """One request's duration ``field`` (an index of ``SUMMARY_FIELDS``)."""
        value = duration_ns // 1000
        window = self._windows[field]
        now = time.monotonic()
        with self._lock:
            window.count += 1
            window.total += value
            window.samples.append((now, value))

    def snapshot(self, quantiles: tuple[float, ...]) -> list[tuple[int, int, list[float]]]:
        """Per field of ``SUMMARY_FIELDS``: (count, sum in µs, the value at each quantile)."""
        horizon = time.monotonic() - self._max_age_s
        result = []
        with self._lock:
            copies = []
            for window in self._windows:
                samples = window.samples
                while samples and samples[0][0] < horizon:
                    samples.popleft()
                copies.append((window.count, window.total, [v for _, v in samples]))
        for count, total, values in copies:
            values.sort()
            result.append((count, total, [_quantile(values, q) for q in quantiles]))
        return result


def _quantile(ordered: list[int], q: float) -> float:
    """The value at quantile ``q`` of ``ordered`` (nearest rank); NaN when empty."""
    if not ordered:
        return math.nan
    rank = max(math.ceil(q * len(ordered)) - 1, 0)
    return float(ordered[min(rank, len(ordered) - 1)])


def parse_quantiles(text: str) -> tuple[float, ...]:
    """``summary_quantiles``: comma-separated ``<quantile>:<error>`` pairs (Triton's form; the
    error is accepted and unused), or bare quantiles.

    :raises ValueError: a quantile that is not a number in [0, 1], or an empty list.
    """
    found = []
    for item in text.split(","):
        quantile = item.split(":", 1)[0].strip()
        try:
            value = float(quantile)
        except ValueError:
            raise ValueError(f"--metrics-config summary_quantiles: '{item}' is not <quantile>:<error>") from None
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"--metrics-config summary_quantiles: quantile {value} is not within [0, 1]")
        found.append(value)
    if not found:
        raise ValueError("--metrics-config summary_quantiles: no quantile given")
    return tuple(found)
