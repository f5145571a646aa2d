"""Per-model statistics (Triton's statistics extension) and the Prometheus metrics endpoint.

Three parts, all per server (nothing here is a module-level registry, so two servers in one
process never share counts):

* ``ModelStats``: the running counters of one model version, kept with plain integer adds
  under a per-version lock. The statistics extension (``/v2/models/{m}/stats``, gRPC
  ``ModelStatistics``) and the ``nv_inference_*`` metrics are both views of these counters,
  so serving metrics costs nothing per request beyond the statistics themselves.
* ``CustomMetrics``: what backends and models use to add their own metric families
  (``backend.metrics`` / ``model.metrics`` on the contexts), and to add whole collectors or
  registries of their own (``include``), all shown on the same ``/metrics`` page.
* ``ServerMetrics`` / ``MetricsService``: the server's ``CollectorRegistry`` and the small
  ASGI app serving ``GET /metrics`` on its own port (``--metrics-port``, default 8002), with
  CPU and memory gauges (and GPU gauges through NVML when ``pynvml`` and a GPU are present)
  refreshed every ``--metrics-interval-ms``.

Counting rules (Triton's): a request counts once as a success or a failure when its final
response is sent. Success, queue and request duration include response-cache hits; compute
input/infer/output, ``inference_count`` and ``execution_count`` do not. Queue time is execute
start minus arrival; compute infer is the execute call; compute input/output are the frontends'
decode/encode times when they report them (HTTP ``/infer``, gRPC ``ModelInfer``), else 0. A
backend that reports where its computation began and ended inside the execute
(``ModelStats.backend_compute``, e.g. a native backend's ``ModelInstanceReportStatistics``)
splits the execute call at those points: the part before goes to compute input, the part after
to compute output, the rest stays compute infer (the same nanoseconds, counted once).
Failures carry a reason: ``REJECTED`` (refused by the scheduler: queue full, queue timeout),
``CANCELED``, ``BACKEND`` (the request reached execute), ``OTHER``.

The text format follows Triton's: counter samples carry the family name itself (no
``_total`` suffix) and there are no ``_created`` samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from pyserve.errors import ErrorCode, InferError

if TYPE_CHECKING:
    from pyserve.inference import InferRequest, InferResponse
    from pyserve.models import ModelVersion

log = logging.getLogger("pyserve.metrics")

FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
"""The ``reason`` label values of ``nv_inference_request_failure`` (all four always shown)."""
_REJECTED, _CANCELED, _BACKEND, _OTHER = range(4)

FIRST_RESPONSE_BUCKETS_MS = (100.0, 500.0, 2000.0, 5000.0)
"""Bucket bounds of ``nv_inference_first_response_histogram_ms`` (Triton's defaults)."""
_FIRST_BUCKETS = len(FIRST_RESPONSE_BUCKETS_MS)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text exposition format."""


# -- per-model statistics ---------------------------------------------------------------------


class ModelStats:
    """The statistics of one model version.

    Thread-safety: counters change under ``lock`` (instance threads, the event loop), except
    ``enqueued``, ``input_ns`` and ``output_ns``, which only the event loop writes
    (``ModelVersion.enqueue``, the frontends' ``codec``) and so need no lock. Readers take a
    copy with ``snapshot``.

    A request carries its model's ``ModelStats`` in ``request.stats`` from the moment it is
    submitted; ``request.exec_start_ns`` is -1 before it is queued, 0 while it is queued and
    the execute start (``time.monotonic_ns``) once an instance took it.
    """

    __slots__ = (
        "backend_input_ns", "backend_output_ns", "batches", "cache_hit_count", "cache_hit_ns",
        "cache_miss_count", "cache_miss_ns",
        "compute_count", "dequeued", "enqueued", "execution_count", "fail_count", "fail_ns",
        "failures", "first_buckets", "first_count", "first_sum_ms", "inference_count",
        "infer_ns", "input_ns", "last_inference_ns", "lock", "output_ns", "queue_ns",
        "success_count", "success_ns", "_epoch_offset_ns",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.success_count = 0
        self.success_ns = 0
        self.fail_count = 0
        self.fail_ns = 0
        self.queue_ns = 0  # queue count == success_count (cache hits included)
        self.compute_count = 0  # successes that were not cache hits
        self.input_ns = 0
        self.infer_ns = 0
        self.output_ns = 0
        self.backend_input_ns = 0  # execute time before / after the backend's reported compute
        self.backend_output_ns = 0  # (under the lock; input_ns / output_ns are loop-only)
        self.cache_hit_count = 0
        self.cache_hit_ns = 0
        self.cache_miss_count = 0
        self.cache_miss_ns = 0
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ns = 0  # monotonic; 0 = never
        self.failures = [0, 0, 0, 0]  # by FAILURE_REASONS index
        self.batches: dict[int, list[int]] = {}  # batch size → [count, input_ns, infer_ns, output_ns]
        self.enqueued = 0
        self.dequeued = 0
        self.first_buckets = [0] * len(FIRST_RESPONSE_BUCKETS_MS)
        self.first_count = 0
        self.first_sum_ms = 0.0
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()

    # -- hot path ------------------------------------------------------------------------------
    def begin(self, requests: Sequence[InferRequest], start_ns: int) -> None:
        """An instance starts executing ``requests`` (they leave the queue)."""
        for request in requests:
            request.exec_start_ns = start_ns
        with self.lock:
            self.dequeued += len(requests)

    def executed(self, requests: Sequence[InferRequest], start_ns: int, end_ns: int) -> None:
        """The execute call of ``requests`` returned: one execution of their total batch size."""
        size = 0
        first = last = 0
        for request in requests:
            request.exec_end_ns = end_ns
            size += request.batch_size
            compute = request.compute_ns
            if compute is not None:  # the batch's compute: earliest start to latest end reported
                if not first or compute[0] < first:
                    first = compute[0]
                if compute[1] > last:
                    last = compute[1]
        duration = end_ns - start_ns
        before = after = 0
        if first and start_ns <= first <= last <= end_ns:
            before = first - start_ns
            after = end_ns - last
        with self.lock:
            self.execution_count += 1
            self.inference_count += size
            entry = self.batches.get(size)
            if entry is None:
                self.batches[size] = [1, before, duration - before - after, after]
            else:
                entry[0] += 1
                entry[1] += before
                entry[2] += duration - before - after
                entry[3] += after

    def backend_compute(
        self,
        requests: Sequence[InferRequest],
        exec_start_ns: int,
        compute_start_ns: int,
        compute_end_ns: int,
        exec_end_ns: int,
    ) -> None:
        """A backend reports, from inside its execute, where the computation of ``requests``
        began and ended (``time.monotonic_ns`` clock; Triton's
        ``TRITONBACKEND_ModelInstanceReportStatistics`` timestamps).

        The execute call the core measured is then split at those two points when the
        requests are counted: before ``compute_start_ns`` is compute input, after
        ``compute_end_ns`` compute output, between them compute infer (so nothing is counted
        twice). The batch statistics of the execute split at the earliest start and latest end
        its requests report. A report that is not ordered (``exec_start <= compute_start <=
        compute_end <= exec_end``) or falls outside the measured execute is ignored, leaving
        the core's numbers. Call it before the execute returns: it stores the two timestamps
        on each request; requests already answered (and counted) during the execute have their
        counted execute time moved under the lock instead, clamped to what was counted.
        """
        if not 0 < exec_start_ns <= compute_start_ns <= compute_end_ns <= exec_end_ns:
            return
        compute = (compute_start_ns, compute_end_ns)
        late = None
        for request in requests:
            request.compute_ns = compute
            if request.exec_end_ns and request.exec_start_ns > 0:  # already counted (answered early)
                late = [request] if late is None else [*late, request]
        if late is None:
            return
        with self.lock:  # move the counted execute time of those requests to the split
            for request in late:
                start, end = request.exec_start_ns, request.exec_end_ns
                first = min(max(compute_start_ns, start), end)
                last = min(max(compute_end_ns, first), end)
                self.backend_input_ns += first - start
                self.backend_output_ns += end - last
                self.infer_ns -= (first - start) + (end - last)

    def request_done(self, request: InferRequest, response: InferResponse | InferError | None) -> None:
        """The final response of ``request`` is being sent: count a success or a failure."""
        now = time.monotonic_ns()
        total = now - request.arrival_ns
        start = request.exec_start_ns
        if isinstance(response, InferError):
            code = response.code
            if code is ErrorCode.CANCELLED:
                reason = _CANCELED
            elif start > 0:
                reason = _BACKEND
            elif code is ErrorCode.UNAVAILABLE:
                reason = _REJECTED
            else:
                reason = _OTHER
            with self.lock:
                self.fail_count += 1
                self.fail_ns += total
                self.failures[reason] += 1
                if start == 0:
                    self.dequeued += 1
            return
        first = request.first_response_ns or now
        first_ms = (first - request.arrival_ns) / 1e6
        with self.lock:
            self.success_count += 1
            self.success_ns += total
            self.last_inference_ns = now
            if start > 0:
                self.queue_ns += start - request.arrival_ns
                self.compute_count += 1
                end = request.exec_end_ns
                if not end:  # answered during its execute: backend_compute may split it later
                    end = request.exec_end_ns = now
                compute = request.compute_ns
                if compute is not None and start <= compute[0] <= compute[1] <= end:
                    self.backend_input_ns += compute[0] - start
                    self.backend_output_ns += end - compute[1]
                    self.infer_ns += compute[1] - compute[0]
                else:
                    self.infer_ns += end - start
            elif start == 0:  # queued but answered without an instance (an ensemble)
                self.dequeued += 1
                self.compute_count += 1
            self.first_count += 1
            self.first_sum_ms += first_ms
            index = bisect_left(FIRST_RESPONSE_BUCKETS_MS, first_ms)  # bounds are inclusive ("le")
            if index < _FIRST_BUCKETS:
                self.first_buckets[index] += 1

    def codec(self, input_ns: int, output_ns: int) -> None:
        """A frontend reports how long it took to decode a request and encode its response.

        Event loop only (both frontends decode and encode there): the two counters have that
        single writer, so no lock is taken.
        """
        self.input_ns += input_ns
        self.output_ns += output_ns

    def rejected(self, request: InferRequest) -> None:
        """The scheduler refused ``request`` (queue full, bad sequence control): a failure."""
        total = time.monotonic_ns() - request.arrival_ns
        with self.lock:
            self.fail_count += 1
            self.fail_ns += total
            self.failures[_REJECTED] += 1

    # -- response cache --------------------------------------------------------------------------
    def cache_lookup(self, hit: bool, duration_ns: int) -> None:
        """Count one response-cache lookup: a hit (lookup time) or a miss (lookup + insert time).

        The request itself is counted when its response is sent, like any other.
        """
        with self.lock:
            if hit:
                self.cache_hit_count += 1
                self.cache_hit_ns += duration_ns
            else:
                self.cache_miss_count += 1
                self.cache_miss_ns += duration_ns

    # -- reading -------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Requests queued and not yet taken by an instance (or answered)."""
        return max(self.enqueued - self.dequeued, 0)

    def snapshot(self) -> StatsSnapshot:
        """A consistent copy of the counters."""
        with self.lock:
            return StatsSnapshot(
                success_count=self.success_count,
                success_ns=self.success_ns,
                fail_count=self.fail_count,
                fail_ns=self.fail_ns,
                queue_ns=self.queue_ns,
                compute_count=self.compute_count,
                input_ns=self.input_ns + self.backend_input_ns,
                infer_ns=self.infer_ns,
                output_ns=self.output_ns + self.backend_output_ns,
                cache_hit_count=self.cache_hit_count,
                cache_hit_ns=self.cache_hit_ns,
                cache_miss_count=self.cache_miss_count,
                cache_miss_ns=self.cache_miss_ns,
                inference_count=self.inference_count,
                execution_count=self.execution_count,
                last_inference_ms=(
                    (self.last_inference_ns + self._epoch_offset_ns) // 1_000_000 if self.last_inference_ns else 0
                ),
                failures=tuple(self.failures),
                batches={size: tuple(entry) for size, entry in self.batches.items()},
                pending=self.pending,
                first_buckets=tuple(self.first_buckets),
                first_count=self.first_count,
                first_sum_ms=self.first_sum_ms,
            )


@dataclass(frozen=True)
class StatsSnapshot:
    """A copy of a ``ModelStats`` at one moment (durations in ns)."""

    success_count: int
    success_ns: int
    fail_count: int
    fail_ns: int
    queue_ns: int
    compute_count: int
    input_ns: int
    infer_ns: int
    output_ns: int
    cache_hit_count: int
    cache_hit_ns: int
    cache_miss_count: int
    cache_miss_ns: int
    inference_count: int
    execution_count: int
    last_inference_ms: int
    failures: tuple[int, ...]
    batches: dict[int, tuple[int, ...]]
    pending: int
    first_buckets: tuple[int, ...]
    first_count: int
    first_sum_ms: float

    def to_json(self, name: str, version: int) -> dict[str, Any]:
        """Triton's ``ModelStatistics`` JSON object (one entry of ``model_stats``)."""

        def duration(count: int, ns: int) -> dict[str, int]:
            return {"count": count, "ns": ns}

        return {
            "name": name,
            "version": str(version),
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": duration(self.success_count, self.success_ns),
                "fail": duration(self.fail_count, self.fail_ns),
                "queue": duration(self.success_count, self.queue_ns),
                "compute_input": duration(self.compute_count, self.input_ns),
                "compute_infer": duration(self.compute_count, self.infer_ns),
                "compute_output": duration(self.compute_count, self.output_ns),
                "cache_hit": duration(self.cache_hit_count, self.cache_hit_ns),
                "cache_miss": duration(self.cache_miss_count, self.cache_miss_ns),
            },
            "response_stats": {},
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": duration(entry[0], entry[1]),
                    "compute_infer": duration(entry[0], entry[2]),
                    "compute_output": duration(entry[0], entry[3]),
                }
                for size, entry in sorted(self.batches.items())
            ],
            "memory_usage": [],
        }


def loaded_versions(records: Mapping[str, Any]) -> list[ModelVersion]:
    """The READY versions of every model, sorted by name then version.

    :param records: ``ModelManager.records`` (name → ``ModelRecord``).
    """
    found: list[ModelVersion] = []
    for name in sorted(list(records)):
        record = records.get(name)
        if record is not None:
            found.extend(v for _, v in sorted(list(record.versions.items())) if v.ready)
    return found


# -- custom metrics -------------------------------------------------------------------------------


class _RegistryCollector:
    """Yields the families of another registry (or collector) inside this server's registry."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        yield from self.source.collect()


class CustomMetrics:
    """Metric families that backends and models add to the server's ``/metrics`` page.

    Reached as ``backend.metrics`` and ``model.metrics`` in every hook (the same object for
    the whole server). The families are ``prometheus_client`` metrics registered in the
    server's registry::

        requests = model.metrics.counter("my_requests", "Requests seen", ["model", "kind"])
        requests.labels(model=model.name, kind="text").inc()

    Counters are shown under exactly the name given (as Triton shows custom metrics: no
    ``_total`` suffix; a name ending in ``_total`` loses it, a ``prometheus_client`` rule).
    Asking again for a family that exists returns it when its kind and labels match.
    Families live as long as the server: a reloaded model finds its family with its values.

    ``include(registry_or_collector)`` adds everything an existing ``CollectorRegistry`` (or
    any object with ``collect()``) holds, e.g. a backend's own registry.

    :param registry: the server's registry; a private one when omitted (contexts created
        outside a server, where nothing is served).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self._families: dict[str, tuple[str, tuple[str, ...], Any]] = {}
        self._included: dict[int, _RegistryCollector] = {}
        self._lock = threading.Lock()

    def counter(self, name: str, description: str, labels: Sequence[str] = ()) -> Counter:
        """A counter family (``.inc()``, or ``.labels(...).inc()`` when it has labels).

        :raises ValueError: an invalid name, a name Triton's own metrics use, or a family of
            that name with another kind or other labels.
        """
        return self._family("counter", name, description, labels, lambda: Counter(
            name, description, tuple(labels), registry=self.registry
        ))

    def gauge(self, name: str, description: str, labels: Sequence[str] = ()) -> Gauge:
        """A gauge family (``.set()``, ``.inc()``, ``.dec()``). See ``counter`` for errors."""
        return self._family("gauge", name, description, labels, lambda: Gauge(
            name, description, tuple(labels), registry=self.registry
        ))

    def histogram(
        self, name: str, description: str, labels: Sequence[str] = (), buckets: Sequence[float] | None = None
    ) -> Histogram:
        """A histogram family (``.observe()``); ``buckets`` are the upper bounds (prometheus
        defaults when omitted). See ``counter`` for errors."""
        def make() -> Histogram:
            if buckets is None:
                return Histogram(name, description, tuple(labels), registry=self.registry)
            return Histogram(name, description, tuple(labels), registry=self.registry, buckets=tuple(buckets))

        return self._family("histogram", name, description, labels, make)

    def include(self, source: Any) -> None:
        """Show everything ``source`` (a ``CollectorRegistry`` or a collector) yields.

        Including the same object again does nothing.
        """
        with self._lock:
            if id(source) in self._included:
                return
            wrapper = _RegistryCollector(source)
            self._included[id(source)] = wrapper
        self.registry.register(wrapper)  # type: ignore[arg-type]

    def exclude(self, source: Any) -> None:
        """Stop showing what ``include(source)`` added (no-op if it was not included)."""
        with self._lock:
            wrapper = self._included.pop(id(source), None)
        if wrapper is not None:
            self.registry.unregister(wrapper)  # type: ignore[arg-type]

    def _family(
        self, kind: str, name: str, description: str, labels: Sequence[str], make: Callable[[], Any]
    ) -> Any:
        key = name[:-6] if kind == "counter" and name.endswith("_total") else name
        if key in BUILTIN_FAMILIES:
            raise ValueError(f"metric family name '{name}' is reserved for the server's own metrics")
        labels = tuple(labels)
        with self._lock:
            existing = self._families.get(key)
            if existing is not None:
                if existing[0] != kind or existing[1] != labels:
                    raise ValueError(
                        f"metric family '{name}' already exists as a {existing[0]} with labels "
                        f"{list(existing[1])}"
                    )
                return existing[2]
            family = make()
            self._families[key] = (kind, labels, family)
            return family


# -- the server's collector -----------------------------------------------------------------------

BUILTIN_FAMILIES = frozenset({
    "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
    "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us", "nv_inference_pending_request_count",
    "nv_inference_first_response_histogram_ms", "nv_cache_num_hits_per_model",
    "nv_cache_num_misses_per_model", "nv_cache_hit_duration_per_model", "nv_cache_miss_duration_per_model",
    "nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes", "nv_gpu_power_usage",
    "nv_gpu_power_limit", "nv_energy_consumption", "nv_cpu_utilization", "nv_cpu_memory_total_bytes",
    "nv_cpu_memory_used_bytes",
})
"""Names of the families the server itself exports (custom families cannot take them)."""


@dataclass(frozen=True)
class MetricsSettings:
    """What ``--metrics-config`` and the ``--allow-*-metrics`` flags turn on.

    :ivar counter_latencies: the ``*_duration_us`` counters (Triton default true).
    :ivar histogram_latencies: ``nv_inference_first_response_histogram_ms`` (default false).
    :ivar cpu: CPU and memory gauges (``--allow-cpu-metrics``).
    :ivar gpu: GPU gauges through NVML (``--allow-gpu-metrics``).
    :ivar interval_ms: how often the CPU/GPU gauges are refreshed (``--metrics-interval-ms``).
    """

    counter_latencies: bool = True
    histogram_latencies: bool = False
    cpu: bool = True
    gpu: bool = True
    interval_ms: int = 2000

    @classmethod
    def from_config(cls, config: Mapping[str, str], **flags: Any) -> MetricsSettings:
        """Build settings from ``--metrics-config`` ``key=value`` pairs plus flag values.

        :raises ValueError: an unknown key or a value that is not a boolean.
        """
        values: dict[str, Any] = dict(flags)
        for key, raw in config.items():
            if key in ("counter_latencies", "histogram_latencies", "summary_latencies"):
                lowered = raw.strip().lower()
                if lowered not in ("true", "false", "1", "0"):
                    raise ValueError(f"--metrics-config {key} must be true or false, got '{raw}'")
                enabled = lowered in ("true", "1")
                if key == "summary_latencies":
                    if enabled:
                        log.warning("--metrics-config summary_latencies=true is not supported; ignored")
                    continue
                values[key] = enabled
            elif key == "summary_quantiles":
                log.warning("--metrics-config summary_quantiles is not supported; ignored")
            else:
                raise ValueError(f"unknown --metrics-config key '{key}'")
        return cls(**values)


_HELP = {
    "nv_inference_request_success": "Number of successful inference requests, all batch sizes",
    "nv_inference_request_failure": "Number of failed inference requests, all batch sizes",
    "nv_inference_count": "Number of inferences performed (does not include cached requests)",
    "nv_inference_exec_count": "Number of model executions performed (does not include cached requests)",
    "nv_inference_request_duration_us": "Cumulative inference request duration in microseconds (includes cached requests)",
    "nv_inference_queue_duration_us": "Cumulative inference queuing duration in microseconds (includes cached requests)",
    "nv_inference_compute_input_duration_us": "Cumulative compute input duration in microseconds (does not include cached requests)",
    "nv_inference_compute_infer_duration_us": "Cumulative compute inference duration in microseconds (does not include cached requests)",
    "nv_inference_compute_output_duration_us": "Cumulative inference compute output duration in microseconds (does not include cached requests)",
    "nv_inference_pending_request_count": "Instantaneous number of pending requests awaiting execution per-model.",
    "nv_inference_first_response_histogram_ms": "Duration from request to first response in milliseconds",
    "nv_cache_num_hits_per_model": "Number of cache hits per model",
    "nv_cache_num_misses_per_model": "Number of cache misses per model",
    "nv_cache_hit_duration_per_model": "Total cache hit duration per model, in microseconds",
    "nv_cache_miss_duration_per_model": "Total cache miss (insert+lookup) duration per model, in microseconds",
    "nv_cpu_utilization": "CPU utilization rate [0.0 - 1.0]",
    "nv_cpu_memory_total_bytes": "CPU total memory (RAM), in bytes",
    "nv_cpu_memory_used_bytes": "CPU used memory (RAM), in bytes",
    "nv_gpu_utilization": "GPU utilization rate [0.0 - 1.0)",
    "nv_gpu_memory_total_bytes": "GPU total memory, in bytes",
    "nv_gpu_memory_used_bytes": "GPU used memory, in bytes",
    "nv_gpu_power_usage": "GPU power usage in watts",
    "nv_gpu_power_limit": "GPU power management limit in watts",
    "nv_energy_consumption": "GPU energy consumption in joules since the server started",
}


def _family(name: str, kind: str) -> Metric:
    return Metric(name, _HELP[name], kind)


class _ModelCollector:
    """Turns every loaded version's ``ModelStats`` into Triton's per-model families."""

    def __init__(self, versions: Callable[[], list[ModelVersion]], settings: MetricsSettings) -> None:
        self._versions = versions
        self._settings = settings

    def collect(self) -> Iterator[Metric]:
        rows = [(v, v.stats.snapshot()) for v in self._versions()]
        success = _family("nv_inference_request_success", "counter")
        failure = _family("nv_inference_request_failure", "counter")
        count = _family("nv_inference_count", "counter")
        exec_count = _family("nv_inference_exec_count", "counter")
        pending = _family("nv_inference_pending_request_count", "gauge")
        durations = [
            (_family("nv_inference_request_duration_us", "counter"), "success_ns"),
            (_family("nv_inference_queue_duration_us", "counter"), "queue_ns"),
            (_family("nv_inference_compute_input_duration_us", "counter"), "input_ns"),
            (_family("nv_inference_compute_infer_duration_us", "counter"), "infer_ns"),
            (_family("nv_inference_compute_output_duration_us", "counter"), "output_ns"),
        ] if self._settings.counter_latencies else []
        first = _family("nv_inference_first_response_histogram_ms", "histogram")
        cache = [
            (_family("nv_cache_num_hits_per_model", "counter"), "cache_hit_count", 1),
            (_family("nv_cache_num_misses_per_model", "counter"), "cache_miss_count", 1),
            (_family("nv_cache_hit_duration_per_model", "counter"), "cache_hit_ns", 1000),
            (_family("nv_cache_miss_duration_per_model", "counter"), "cache_miss_ns", 1000),
        ]
        cached_rows = 0
        for version, snap in rows:
            labels = {"model": version.name, "version": str(version.version)}
            success.add_sample(success.name, labels, snap.success_count)
            for reason, value in zip(FAILURE_REASONS, snap.failures):
                failure.add_sample(failure.name, {**labels, "reason": reason}, value)
            count.add_sample(count.name, labels, snap.inference_count)
            exec_count.add_sample(exec_count.name, labels, snap.execution_count)
            pending.add_sample(pending.name, labels, snap.pending)
            for family, field in durations:
                family.add_sample(family.name, labels, getattr(snap, field) // 1000)
            if self._settings.histogram_latencies:
                cumulative = 0
                for bound, hits in zip(FIRST_RESPONSE_BUCKETS_MS, snap.first_buckets):
                    cumulative += hits
                    first.add_sample(first.name + "_bucket", {**labels, "le": _number(bound)}, cumulative)
                first.add_sample(first.name + "_bucket", {**labels, "le": "+Inf"}, snap.first_count)
                first.add_sample(first.name + "_sum", labels, snap.first_sum_ms)
                first.add_sample(first.name + "_count", labels, snap.first_count)
            config = version.config
            if (config is not None and config.response_cache.enable) or snap.cache_hit_count or snap.cache_miss_count:
                cached_rows += 1
                for family, field, divisor in cache:
                    family.add_sample(family.name, labels, getattr(snap, field) // divisor)
        yield success
        yield failure
        yield count
        yield exec_count
        yield from (family for family, _ in durations)
        yield pending
        if self._settings.histogram_latencies:
            yield first
        if cached_rows:
            yield from (family for family, _, _ in cache)


# -- CPU, memory and GPU gauges -------------------------------------------------------------------


def _read_cpu_times() -> tuple[int, int] | None:
    """``(idle, total)`` jiffies from /proc/stat, or None where there is no /proc."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    values = [int(x) for x in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already counted in user/nice
    return idle, total


def _read_memory() -> tuple[int, int] | None:
    """``(total, used)`` bytes from /proc/meminfo (used = total - available), or None."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                key, _, rest = line.partition(b":")
                if key in (b"MemTotal", b"MemAvailable", b"MemFree"):
                    info[key.decode()] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        return None
    total = info.get("MemTotal")
    if total is None:
        return None
    available = info.get("MemAvailable", info.get("MemFree", 0))
    return total, total - available


@dataclass(frozen=True)
class GpuSample:
    """One GPU's readings (``None`` where NVML does not support a reading)."""

    uuid: str
    utilization: float | None
    memory_total: int | None
    memory_used: int | None
    power_watts: float | None
    power_limit_watts: float | None
    energy_joules: float | None


class NvmlReader:
    """GPU readings through NVML (``pynvml``, from the ``nvidia-ml-py`` package).

    :raises RuntimeError: ``pynvml`` is missing, NVML cannot start, or there is no GPU.
    """

    def __init__(self) -> None:
        try:
            import pynvml  # type: ignore[import-not-found,import-untyped]
        except ImportError:
            raise RuntimeError("pynvml is not installed (pip install nvidia-ml-py)") from None
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            raise RuntimeError(f"NVML is not available: {exc}") from None
        try:
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                raise RuntimeError("NVML reports no GPU")
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        except Exception:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
            raise
        self._energy_start = [self._call(pynvml.nvmlDeviceGetTotalEnergyConsumption, h) for h in self._handles]

    @staticmethod
    def _call(function: Callable[..., Any], *args: Any) -> Any:
        try:
            return function(*args)
        except Exception:  # NVMLError_NotSupported and friends: that reading is left out
            return None

    def sample(self) -> list[GpuSample]:
        """Read every GPU now."""
        nvml = self._nvml
        samples = []
        for handle, uuid, energy_start in zip(self._handles, self._uuids, self._energy_start):
            rates = self._call(nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = self._call(nvml.nvmlDeviceGetMemoryInfo, handle)
            power = self._call(nvml.nvmlDeviceGetPowerUsage, handle)
            limit = self._call(nvml.nvmlDeviceGetPowerManagementLimit, handle)
            energy = self._call(nvml.nvmlDeviceGetTotalEnergyConsumption, handle)
            samples.append(GpuSample(
                uuid=uuid,
                utilization=None if rates is None else rates.gpu / 100.0,
                memory_total=None if memory is None else int(memory.total),
                memory_used=None if memory is None else int(memory.used),
                power_watts=None if power is None else power / 1000.0,
                power_limit_watts=None if limit is None else limit / 1000.0,
                energy_joules=(
                    None if energy is None or energy_start is None else (energy - energy_start) / 1000.0
                ),
            ))
        return samples

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class SystemMonitor:
    """CPU, memory and (when available) GPU readings, refreshed by ``sample``; a collector.

    :param cpu: read CPU utilization and memory.
    :param gpu: read GPUs through NVML when ``pynvml`` and a GPU are present.
    """

    def __init__(self, cpu: bool = True, gpu: bool = True) -> None:
        self._cpu = cpu
        self._last_cpu: tuple[int, int] | None = None
        self.cpu_utilization: float | None = None
        self.memory: tuple[int, int] | None = None
        self.gpus: list[GpuSample] = []
        self._nvml: NvmlReader | None = None
        if gpu:
            try:
                self._nvml = NvmlReader()
            except RuntimeError as exc:
                log.info("GPU metrics are off: %s", exc)

    @property
    def has_gpu(self) -> bool:
        return self._nvml is not None

    def sample(self) -> None:
        """Take new readings (blocking: call off the event loop)."""
        if self._cpu:
            times = _read_cpu_times()
            if times is not None:
                if self._last_cpu is not None:
                    idle = times[0] - self._last_cpu[0]
                    total = times[1] - self._last_cpu[1]
                    if total > 0:
                        self.cpu_utilization = min(max(1.0 - idle / total, 0.0), 1.0)
                elif self.cpu_utilization is None:
                    self.cpu_utilization = 0.0
                self._last_cpu = times
            self.memory = _read_memory()
        if self._nvml is not None:
            self.gpus = self._nvml.sample()

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None

    def collect(self) -> Iterator[Metric]:
        if self._cpu:
            if self.cpu_utilization is not None:
                family = _family("nv_cpu_utilization", "gauge")
                family.add_sample(family.name, {}, self.cpu_utilization)
                yield family
            if self.memory is not None:
                for name, value in (("nv_cpu_memory_total_bytes", self.memory[0]),
                                    ("nv_cpu_memory_used_bytes", self.memory[1])):
                    family = _family(name, "gauge")
                    family.add_sample(name, {}, value)
                    yield family
        gpus = self.gpus
        if not gpus:
            return
        readings: list[tuple[str, str, Callable[[GpuSample], float | None]]] = [
            ("nv_gpu_utilization", "gauge", lambda g: g.utilization),
            ("nv_gpu_memory_total_bytes", "gauge", lambda g: g.memory_total),
            ("nv_gpu_memory_used_bytes", "gauge", lambda g: g.memory_used),
            ("nv_gpu_power_usage", "gauge", lambda g: g.power_watts),
            ("nv_gpu_power_limit", "gauge", lambda g: g.power_limit_watts),
            ("nv_energy_consumption", "counter", lambda g: g.energy_joules),
        ]
        for name, kind, read in readings:
            family = _family(name, kind)
            for gpu in gpus:
                value = read(gpu)
                if value is not None:
                    family.add_sample(name, {"gpu_uuid": gpu.uuid}, value)
            if family.samples:
                yield family


# -- the server's metrics and the /metrics endpoint ---------------------------------------------


class ServerMetrics:
    """One server's metrics: its registry, the model collector and the custom families.

    :param records: ``ModelManager.records``, read at every scrape.
    :param settings: what ``--metrics-config`` turned on.
    """

    def __init__(self, records: Mapping[str, Any], settings: MetricsSettings | None = None) -> None:
        self.settings = settings if settings is not None else MetricsSettings()
        self.registry = CollectorRegistry(auto_describe=False)
        self._records = records
        self.registry.register(_ModelCollector(self.versions, self.settings))  # type: ignore[arg-type]
        self.custom = CustomMetrics(self.registry)
        """What backends and models receive as ``backend.metrics`` / ``model.metrics``."""

    def versions(self) -> list[ModelVersion]:
        """The versions shown: every READY version."""
        return loaded_versions(self._records)

    def on_cache_lookup(self, model: str, version: int, hit: bool, duration_ns: int) -> None:
        """``ResponseCache`` listener: count a hit or miss on the model version's stats."""
        record = self._records.get(model)
        served = record.versions.get(version) if record is not None else None
        if served is not None:
            served.stats.cache_lookup(hit, duration_ns)

    def render(self) -> bytes:
        """The ``/metrics`` page."""
        return render(self.registry)


def render(registry: CollectorRegistry) -> bytes:
    """Prometheus text format, Triton style: counter samples under the family name (no
    ``_total``) and no ``_created`` samples."""
    lines: list[str] = []
    for family in registry.collect():
        name = family.name
        kind = family.type
        if kind == "unknown":
            kind = "untyped"
        elif kind not in ("counter", "gauge", "histogram", "summary", "untyped"):
            kind = "gauge"  # info / stateset / gaugehistogram samples read fine as gauges
        lines.append(f"# HELP {name} {_escape_help(family.documentation)}")
        lines.append(f"# TYPE {name} {kind}")
        for sample in family.samples:
            sample_name = sample.name
            if sample_name.endswith(("_created", "_gcreated")) and sample_name != name:
                continue
            if kind == "counter" and sample_name == name + "_total":
                sample_name = name
            if sample.labels:
                label_text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sample.labels.items())
                lines.append(f"{sample_name}{{{label_text}}} {_number(sample.value)}")
            else:
                lines.append(f"{sample_name} {_number(sample.value)}")
    lines.append("")
    return "\n".join(lines).encode("utf-8")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label(value: str) -> str:
    return str(value).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isfinite(value) and value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return floatToGoString(value)


class MetricsStartError(RuntimeError):
    """The metrics service could not listen on its address."""


class _QuietUvicorn:
    """Builds a uvicorn server that leaves signal handling to the pyserve server."""

    @staticmethod
    def create(config: Any) -> Any:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Generator[None, None, None]:
                yield

        return _Server(config)


class MetricsService:
    """``GET /metrics`` on its own uvicorn server, on the server's event loop.

    :param metrics: what the page shows.
    :param monitor: the CPU/GPU readings refreshed every ``interval_ms``, or None.
    """

    def __init__(self, metrics: ServerMetrics, monitor: SystemMonitor | None = None) -> None:
        self.metrics = metrics
        self.monitor = monitor
        self.port: int | None = None
        self._server: Any = None
        self._serve_task: asyncio.Task[None] | None = None
        self._sampler: asyncio.Task[None] | None = None
        if monitor is not None:
            metrics.registry.register(monitor)  # type: ignore[arg-type]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The ASGI app: ``/metrics`` (GET or HEAD); 404 elsewhere, 405 for other methods."""
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics":
            status, body, media = 404, b"Not Found", b"text/plain; charset=utf-8"
        elif scope["method"] not in ("GET", "HEAD"):
            status, body, media = 405, b"Method Not Allowed", b"text/plain; charset=utf-8"
        else:
            status, body, media = 200, self.metrics.render(), CONTENT_TYPE.encode()
        headers = [(b"content-type", media), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (0 = any free port) and start refreshing the gauges.

        :raises MetricsStartError: the address cannot be bound.
        """
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
        except OSError as exc:
            listener.close()
            raise MetricsStartError(
                f"Metrics service cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from exc
        config = uvicorn.Config(
            self, host=host, port=port, lifespan="off", log_config=None, access_log=False,
            timeout_graceful_shutdown=1, server_header=False,
        )
        self._server = _QuietUvicorn.create(config)
        if self.monitor is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.monitor.sample)
            self._sampler = asyncio.create_task(self._sample_every(self.metrics.settings.interval_ms / 1000))
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[listener]))
        while not self._server.started:
            if self._serve_task.done():
                self._serve_task.result()
                raise MetricsStartError(f"Metrics service could not start on {host}:{port}")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        log.info("Started Metrics Service at %s:%d", host, self.port)

    async def _sample_every(self, seconds: float) -> None:
        assert self.monitor is not None
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(seconds, 0.01))
            try:
                await loop.run_in_executor(None, self.monitor.sample)
            except Exception:  # a failed reading must not stop the next ones
                log.exception("reading CPU/GPU metrics failed")

    async def stop(self) -> None:
        """Stop serving and sampling; release NVML."""
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
            self._sampler = None
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._serve_task
            self._server = None
            self._serve_task = None
        if self.monitor is not None:
            self.monitor.close()


def statistics_json(rows: Iterable[ModelVersion]) -> dict[str, Any]:
    """Triton's statistics response ``{"model_stats": [...]}`` for the given versions."""
    return {"model_stats": [v.stats.snapshot().to_json(v.name, v.version) for v in rows]}


def select_versions(records: Mapping[str, Any], name: str, version: str | None) -> list[ModelVersion]:
    """The versions a statistics request names, as Triton picks them.

    :param name: a model name, or ``""`` for every model.
    :param version: a version number, or None / ``""`` for every READY version of the model.
    :raises InferError: INVALID_ARG for a model or version that is not loaded (Triton's code).
    """
    if not name:
        return loaded_versions(records)
    record = records.get(name)
    ready = [] if record is None else [v for _, v in sorted(list(record.versions.items())) if v.ready]
    if not ready:
        raise InferError.invalid(f"requested model '{name}' is not available")
    if not version:
        return ready
    if not version.isdigit():
        raise InferError.invalid(f"failed to get statistics: model version '{version}' is not a number")
    chosen = [v for v in ready if v.version == int(version)]
    if not chosen:
        raise InferError.invalid(f"requested model version is not available for model '{name}'")
    return chosen
