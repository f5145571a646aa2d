"""The request-latency histogram every ``ModelStats`` keeps (what the status page's percentiles
are read from).

Buckets are log-linear: four per power of two of nanoseconds (each at most 25 % wide), from
1 µs to 2^38 ns (about 275 s). Everything faster than 1024 ns shares bucket 0, everything
slower than the last bound shares the last bucket. A bucket index is found with a few integer
operations (no search), so counting costs the hot path one list increment under the lock
``ModelStats`` already holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_FIRST_BITS = 10
"""Durations of up to this many bits (< 1024 ns) go to bucket 0."""
_MAX_BITS = 38
"""Durations of more bits (>= 2^38 ns) go to the last bucket."""
_PER_OCTAVE = 4

LATENCY_BUCKETS = 1 + (_MAX_BITS - _FIRST_BITS) * _PER_OCTAVE
"""How many buckets a histogram has."""


def latency_bucket(duration_ns: int) -> int:
    """The bucket of a duration (negative durations count as 0)."""
    bits = duration_ns.bit_length() if duration_ns > 0 else 0
    if bits <= _FIRST_BITS:
        return 0
    if bits > _MAX_BITS:
        return LATENCY_BUCKETS - 1
    return 1 + (bits - _FIRST_BITS - 1) * _PER_OCTAVE + ((duration_ns >> (bits - 3)) & 3)


def bucket_bounds_ns(index: int) -> tuple[int, int]:
    """``(lower, upper)``: the durations bucket ``index`` holds, ``lower <= d < upper`` (the
    last bucket also holds everything slower than its upper bound)."""
    if index <= 0:
        return 0, 1 << _FIRST_BITS
    step, sub = divmod(index - 1, _PER_OCTAVE)
    shift = step + _FIRST_BITS + 1 - 3
    return (4 + sub) << shift, (5 + sub) << shift


def quantile_ns(counts: Sequence[int], q: float) -> float | None:
    """The duration at quantile ``q`` (0..1) of a histogram, interpolated linearly inside the
    bucket that holds it; None for an empty histogram.

    :param counts: a count per bucket (``LATENCY_BUCKETS`` of them, or fewer).
    """
    total = sum(counts)
    if total <= 0:
        return None
    rank = max(math.ceil(min(max(q, 0.0), 1.0) * total), 1)
    seen = 0
    for index, count in enumerate(counts):
        if count <= 0:
            continue
        if seen + count >= rank:
            lower, upper = bucket_bounds_ns(index)
            return lower + (upper - lower) * (rank - seen) / count
        seen += count
    lower, upper = bucket_bounds_ns(len(counts) - 1)  # not reached: the counts add up to total
    return float(upper)
