"""``pb_utils.MetricFamily`` / ``Metric``: custom metrics of Python models, for Prometheus.

Every family lives in ``REGISTRY``, a module-level ``prometheus_client.CollectorRegistry``
that the server's metrics endpoint can render next to its own metrics (e.g.
``prometheus_client.generate_latest(REGISTRY)``), and that tests read with
``REGISTRY.get_sample_value(name, labels)``. Families are exported under exactly the name the
model gave (as Triton does: no ``_total`` suffix on counter samples; note that
``generate_latest`` still writes ``_total`` in a counter's HELP/TYPE lines).

A family belongs to the models that created it: when the last of them is unloaded, the family
and its values are dropped, so a reloaded model starts from zero, as a new Triton stub would.
Creating a family whose name exists returns the same underlying family (same kind required);
asking it for a ``Metric`` with labels that exist returns the same values. As in Triton, the
family lives as long as a ``MetricFamily`` object for it does: once the last one is deleted
(garbage collected), the family leaves the metrics page, and a ``Metric`` of it that is still
used raises ``TritonModelException`` ("Invalid metric operation as the corresponding
'MetricFamily' has been deleted.").
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric as _PromMetric

from pyserve_backend_python import context
from pyserve_backend_python.errors import TritonModelException

REGISTRY = CollectorRegistry(auto_describe=False)
"""Where every Python-model metric family is collected (see the module docstring)."""

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_KIND_NAMES = {0: "counter", 1: "gauge", 2: "histogram"}


class _Values:
    """The current values of one metric (one label set)."""

    __slots__ = ("bucket_counts", "buckets", "count", "lock", "sum", "value")

    def __init__(self, buckets: Sequence[float] | None) -> None:
        self.lock = threading.Lock()
        self.value = 0.0
        self.buckets = list(buckets) if buckets is not None else []
        self.bucket_counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0


class _Family:
    __slots__ = ("deleted", "description", "handles", "kind", "metrics", "name", "owners", "remote")

    def __init__(self, name: str, description: str, kind: int) -> None:
        self.name = name
        self.description = description
        self.kind = kind
        self.handles = 0  # the live ``MetricFamily`` objects standing for it
        self.deleted = False  # dropped: its ``Metric`` objects refuse every operation
        self.metrics: dict[tuple[tuple[str, str], ...], _Values] = {}
        self.owners: set[tuple[str, int]] = set()
        self.remote: dict[str, dict[tuple[tuple[str, str], ...], tuple[Any, ...]]] = {}
        """Worker (``execution_mode: "process"``) → its last reported values, by label set."""


class _Collector:
    """Turns the families into prometheus_client metrics on each scrape."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # re-entrant: a ``MetricFamily`` may be collected while it is held
        self.families: dict[str, _Family] = {}

    def collect(self) -> Iterator[_PromMetric]:
        with self.lock:
            families = [(f, [dict(r) for r in f.remote.values()]) for f in self.families.values()]
        for family, reports in families:
            metric = _PromMetric(family.name, family.description, _KIND_NAMES[family.kind])
            merged: dict[tuple[tuple[str, str], ...], list[Any]] = {}
            for labels_key, values in list(family.metrics.items()):
                with values.lock:
                    merged[labels_key] = [values.value, list(values.buckets), list(values.bucket_counts),
                                          values.sum, values.count]
            for report in reports:  # process-mode workers: counters and histograms add up, gauges too
                for labels_key, (value, buckets, counts, total, count) in report.items():
                    entry = merged.setdefault(labels_key, [0.0, list(buckets), [0] * len(counts), 0.0, 0])
                    entry[0] += value
                    if entry[1] == list(buckets):
                        entry[2] = [a + b for a, b in zip(entry[2], counts)]
                    entry[3] += total
                    entry[4] += count
            for labels_key, (value, buckets, counts, total, count) in merged.items():
                labels = dict(labels_key)
                if family.kind == MetricFamily.HISTOGRAM:
                    cumulative = 0
                    for bound, bucket_count in zip(buckets, counts):
                        cumulative += bucket_count
                        metric.add_sample(f"{family.name}_bucket", {**labels, "le": _le(bound)}, cumulative)
                    metric.add_sample(f"{family.name}_bucket", {**labels, "le": "+Inf"}, count)
                    metric.add_sample(f"{family.name}_sum", labels, total)
                    metric.add_sample(f"{family.name}_count", labels, count)
                else:
                    metric.add_sample(family.name, labels, value)
            yield metric

    def release(self, owner: tuple[str, int]) -> None:
        with self.lock:
            for family in list(self.families.values()):
                if owner in family.owners:
                    family.owners.discard(owner)
                    if not family.owners:
                        self.drop(family)

    def drop(self, family: _Family) -> None:
        """Take ``family`` off the page for good (under the lock)."""
        family.deleted = True
        if self.families.get(family.name) is family:
            del self.families[family.name]


def _le(bound: float) -> str:
    """A bucket bound as Triton's metrics page writes it: ``1``, ``2.5``, ``+Inf``."""
    if math.isinf(bound):
        return "+Inf" if bound > 0 else "-Inf"
    text = repr(float(bound))
    return text[:-2] if text.endswith(".0") else text


_COLLECTOR = _Collector()
REGISTRY.register(_COLLECTOR)


def snapshot() -> list[tuple[Any, ...]]:
    """Every family of this process with its values (what a process-mode worker reports)."""
    with _COLLECTOR.lock:
        families = list(_COLLECTOR.families.values())
    report = []
    for family in families:
        values = []
        for labels_key, current in list(family.metrics.items()):
            with current.lock:
                values.append((labels_key, current.value, list(current.buckets), list(current.bucket_counts),
                               current.sum, current.count))
        report.append((family.name, family.description, family.kind, values))
    return report


def mirror(source: str, owner: tuple[str, int], report: list[tuple[Any, ...]]) -> None:
    """Show the families a worker reported (``snapshot``), replacing its previous report; a
    family name taken by another kind keeps its own and the report's values are ignored."""
    with _COLLECTOR.lock:
        reported = {entry[0] for entry in report}
        for gone in list(_COLLECTOR.families.values()):  # deleted in the worker since its last report
            if gone.name not in reported and gone.remote.pop(source, None) is not None:
                if not gone.remote and not gone.handles and not gone.metrics:
                    _COLLECTOR.drop(gone)
        for name, description, kind, values in report:
            family = _COLLECTOR.families.get(name)
            if family is None:
                family = _COLLECTOR.families[name] = _Family(name, description, kind)
            elif family.kind != kind:
                continue
            family.owners.add(owner)
            family.remote[source] = {
                tuple(tuple(pair) for pair in labels_key): (value, buckets, counts, total, count)
                for labels_key, value, buckets, counts, total, count in values
            }


def forget(source: str) -> None:
    """Drop what a worker reported (it exited: its successor starts from zero, as a new Triton stub)."""
    with _COLLECTOR.lock:
        for family in _COLLECTOR.families.values():
            family.remote.pop(source, None)


def release_model(name: str, version: int) -> None:
    """Drop the families only the given model version owns (called at model finalize)."""
    _COLLECTOR.release((name, version))


class MetricFamily:
    """A named group of metrics of one kind (Triton's ``pb_utils.MetricFamily``).

    :param name: the Prometheus metric name.
    :param description: the HELP text.
    :param kind: ``MetricFamily.COUNTER``, ``GAUGE`` or ``HISTOGRAM``.
    :raises TritonModelException: an invalid name or kind, or a name already used by a family
        of another kind.
    """

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2

    def __init__(self, name: str, description: str, kind: int) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise TritonModelException(f"invalid metric family name {name!r}")
        if kind not in _KIND_NAMES:
            raise TritonModelException(f"metric family '{name}': unknown kind {kind!r}")
        model = context.current_model()
        with _COLLECTOR.lock:
            family = _COLLECTOR.families.get(name)
            if family is None:
                family = _COLLECTOR.families[name] = _Family(name, str(description), int(kind))
            elif family.kind != kind:
                raise TritonModelException(
                    f"a metric family named '{name}' already exists with kind "
                    f"{_KIND_NAMES[family.kind]}, not {_KIND_NAMES[kind]}"
                )
            if model is not None:
                family.owners.add((model.name, model.version))
            family.handles += 1
        self._family = family

    def __del__(self) -> None:
        family = getattr(self, "_family", None)
        if family is None:
            return
        with _COLLECTOR.lock:
            family.handles -= 1
            if family.handles <= 0:
                _COLLECTOR.drop(family)

    def Metric(self, labels: Mapping[str, str] | None = None, buckets: Sequence[float] | None = None) -> Metric:  # noqa: N802
        """The metric of this family with the given labels (created at zero if new).

        :param buckets: histogram bucket upper bounds (required for, and only for, histograms).
        :raises TritonModelException: invalid labels or buckets.
        """
        return Metric(self, labels, buckets)


class Metric:
    """One metric (a family plus a label set). Created through ``MetricFamily.Metric``.

    Thread-safe: calls from any thread are atomic.
    """

    def __init__(self, family: MetricFamily, labels: Mapping[str, str] | None, buckets: Sequence[float] | None) -> None:
        shared = family._family
        labels = dict(labels or {})
        for key, value in labels.items():
            if not isinstance(key, str) or not _LABEL.match(key) or key == "le":
                raise TritonModelException(f"metric '{shared.name}': invalid label name {key!r}")
            if not isinstance(value, str):
                raise TritonModelException(f"metric '{shared.name}': label '{key}' must have a str value")
        bounds: list[float] | None = None
        if shared.kind == MetricFamily.HISTOGRAM:
            if buckets is None:
                raise TritonModelException(f"histogram metric '{shared.name}' needs buckets")
            bounds = [float(b) for b in buckets]
            if bounds != sorted(set(bounds)):
                raise TritonModelException(f"histogram metric '{shared.name}': buckets must be increasing")
        elif buckets is not None:
            raise TritonModelException(f"metric '{shared.name}': buckets are only for histograms")
        label_key = tuple(sorted(labels.items()))
        with _COLLECTOR.lock:
            values = shared.metrics.get(label_key)
            if values is None:
                values = shared.metrics[label_key] = _Values(bounds)
        self._family = shared
        self._values = values

    def _require(self, operation: str, *kinds: int) -> None:
        if self._family.deleted:
            raise TritonModelException("Invalid metric operation as the corresponding 'MetricFamily' has been deleted.")
        if self._family.kind not in kinds:
            raise TritonModelException(
                f"{operation}() is not supported by {_KIND_NAMES[self._family.kind]} metric '{self._family.name}'"
            )

    def increment(self, value: float) -> None:
        """Add ``value`` (counters: must not be negative; gauges: any sign)."""
        self._require("increment", MetricFamily.COUNTER, MetricFamily.GAUGE)
        if self._family.kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException(f"counter metric '{self._family.name}' cannot be incremented by a negative value")
        with self._values.lock:
            self._values.value += float(value)

    def set(self, value: float) -> None:
        """Set a gauge to ``value``."""
        self._require("set", MetricFamily.GAUGE)
        with self._values.lock:
            self._values.value = float(value)

    def observe(self, value: float) -> None:
        """Record one observation in a histogram."""
        self._require("observe", MetricFamily.HISTOGRAM)
        values = self._values
        with values.lock:
            index = bisect.bisect_left(values.buckets, float(value))
            if index < len(values.buckets):
                values.bucket_counts[index] += 1
            values.sum += float(value)
            values.count += 1

    def value(self) -> float:
        """The current value of a counter or gauge."""
        self._require("value", MetricFamily.COUNTER, MetricFamily.GAUGE)
        with self._values.lock:
            return self._values.value

    def _snapshot(self) -> dict[str, Any]:
        """Histogram state for tests and debugging (pyserve extension)."""
        with self._values.lock:
            return {"buckets": list(self._values.buckets), "counts": list(self._values.bucket_counts),
                    "sum": self._values.sum, "count": self._values.count}
