"""The Prometheus side of the server's metrics: the per-model collector, the custom families
backends and models add (``CustomMetrics``), the ``--metrics-config`` settings, one server's
registry (``ServerMetrics``) and the text rendering of the ``/metrics`` page.

The text format follows Triton's: counter samples carry the family name itself (no
``_total`` suffix) and there are no ``_created`` samples.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from pyserve.api.custom_metrics import CustomMetrics  # re-exported
from pyserve.metrics.stats import FAILURE_REASONS, loaded_versions
from pyserve.metrics.summaries import DEFAULT_QUANTILES, SUMMARY_FIELDS, parse_quantiles

if TYPE_CHECKING:
    from pyserve.runtime.versions import ModelVersion

log = logging.getLogger("pyserve.metrics")


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text exposition format."""


# -- the server's collector -----------------------------------------------------------------------

@dataclass(frozen=True)
class MetricsSettings:
    """What ``--metrics-config`` and the ``--allow-*-metrics`` flags turn on.

    :ivar counter_latencies: the ``*_duration_us`` counters (Triton default true).
    :ivar histogram_latencies: ``nv_inference_first_response_histogram_ms`` (default false).
    :ivar summary_latencies: the ``nv_inference_*_summary_us`` families (default false).
    :ivar summary_quantiles: the quantiles those report (``summary_quantiles``).
    :ivar cpu: CPU and memory gauges (``--allow-cpu-metrics``).
    :ivar gpu: GPU gauges through NVML (``--allow-gpu-metrics``).
    :ivar interval_ms: how often the CPU/GPU gauges are refreshed (``--metrics-interval-ms``).
    """

    counter_latencies: bool = True
    histogram_latencies: bool = False
    summary_latencies: bool = False
    summary_quantiles: tuple[float, ...] = DEFAULT_QUANTILES
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
                values[key] = lowered in ("true", "1")
            elif key == "summary_quantiles":
                values[key] = parse_quantiles(raw)
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
    "nv_model_load_duration_secs": "Model load time in seconds",
    # Triton 2.51's help texts, its "Cumulative" on the compute summaries included
    "nv_inference_request_summary_us": "Summary of inference request duration in microseconds (includes cached requests)",
    "nv_inference_queue_summary_us": "Summary of inference queuing duration in microseconds (includes cached requests)",
    "nv_inference_compute_input_summary_us": "Cumulative compute input duration in microseconds (does not include cached requests)",
    "nv_inference_compute_infer_summary_us": "Cumulative compute inference duration in microseconds (does not include cached requests)",
    "nv_inference_compute_output_summary_us": "Cumulative inference compute output duration in microseconds (does not include cached requests)",
    "nv_cache_num_hits_per_model": "Number of cache hits per model",
    "nv_cache_num_misses_per_model": "Number of cache misses per model",
    "nv_cache_hit_duration_per_model": "Total cache hit duration per model, in microseconds",
    "nv_cache_miss_duration_per_model": "Total cache miss (insert+lookup) duration per model, in microseconds",
    "nv_cache_util": "Cache utilization [0.0 - 1.0]",
    "nv_cache_num_entries": "Number of responses stored in response cache",
    "nv_cache_num_hits": "Number of cache hits in response cache",
    "nv_cache_num_misses": "Number of cache misses in response cache",
    "nv_cache_num_lookups": "Number of cache lookups in response cache",
    "nv_cache_num_evictions": "Number of cache evictions in response cache",
    "nv_cache_lookup_duration": "Total cache lookup duration (hit and miss), in microseconds",
    "nv_cache_insertion_duration": "Total cache insertion duration, in microseconds",
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
        load = _family("nv_model_load_duration_secs", "gauge")
        durations = [
            (_family("nv_inference_request_duration_us", "counter"), "success_ns"),
            (_family("nv_inference_queue_duration_us", "counter"), "queue_ns"),
            (_family("nv_inference_compute_input_duration_us", "counter"), "input_ns"),
            (_family("nv_inference_compute_infer_duration_us", "counter"), "infer_ns"),
            (_family("nv_inference_compute_output_duration_us", "counter"), "output_ns"),
        ] if self._settings.counter_latencies else []
        first = _family("nv_inference_first_response_histogram_ms", "histogram")
        quantiles = self._settings.summary_quantiles
        summaries = [_family(f"nv_inference_{field}_summary_us", "summary") for field in SUMMARY_FIELDS] \
            if self._settings.summary_latencies else []
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
                failure.add_sample(failure.name,  # Triton's label order: model, reason, version
                                   {"model": version.name, "reason": reason, "version": labels["version"]}, value)
            count.add_sample(count.name, labels, snap.inference_count)
            exec_count.add_sample(exec_count.name, labels, snap.execution_count)
            pending.add_sample(pending.name, labels, snap.pending)
            if snap.load_duration_s is not None:
                load.add_sample(load.name, labels, snap.load_duration_s)
            for family, field in durations:
                family.add_sample(family.name, labels, getattr(snap, field) // 1000)
            if self._settings.histogram_latencies:
                cumulative = 0
                for bound, hits in zip(snap.first_bounds, snap.first_buckets):
                    cumulative += hits
                    first.add_sample(first.name + "_bucket", {**labels, "le": _number(bound)}, cumulative)
                first.add_sample(first.name + "_bucket", {**labels, "le": "+Inf"}, snap.first_count)
                first.add_sample(first.name + "_sum", labels, snap.first_sum_ms)
                first.add_sample(first.name + "_count", labels, snap.first_count)
            if summaries:
                recorder = version.stats.summaries
                values = recorder.snapshot(quantiles) if recorder is not None else []
                for family, (total_count, total_us, points) in zip(summaries, values):
                    family.add_sample(family.name + "_count", labels, total_count)
                    family.add_sample(family.name + "_sum", labels, total_us)
                    for q, point in zip(quantiles, points):
                        family.add_sample(family.name, {**labels, "quantile": _number(q)}, point)
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
        yield load
        if self._settings.histogram_latencies:
            yield first
        yield from summaries
        if cached_rows:
            yield from (family for family, _, _ in cache)


class WatchedCache(Protocol):
    """What the cache collector reads of ``pyserve.dataplane.cache.ResponseCache``."""

    def totals(self) -> Any:
        """Server-wide ``lookups``, ``hits``, ``misses``, ``lookup_ns``, ``insert_ns``."""

    def occupancy(self) -> Any:
        """``entries``, ``utilization``, ``evictions`` of the store, or None."""


class _CacheCollector:
    """Triton's server-wide response cache gauges (``nv_cache_util``, ``nv_cache_num_*``,
    ``nv_cache_*_duration`` in microseconds), when the server has a cache."""

    def __init__(self, cache: WatchedCache) -> None:
        self._cache = cache

    def collect(self) -> Iterator[Metric]:
        totals = self._cache.totals()
        occupancy = self._cache.occupancy()
        values = [
            ("nv_cache_util", occupancy.utilization if occupancy is not None else 0.0),
            ("nv_cache_num_entries", occupancy.entries if occupancy is not None else 0),
            ("nv_cache_num_hits", totals.hits),
            ("nv_cache_num_misses", totals.misses),
            ("nv_cache_num_lookups", totals.lookups),
            ("nv_cache_num_evictions", occupancy.evictions if occupancy is not None else 0),
            ("nv_cache_lookup_duration", totals.lookup_ns // 1000),
            ("nv_cache_insertion_duration", totals.insert_ns // 1000),
        ]
        for name, value in values:
            family = _family(name, "gauge")
            family.add_sample(name, {}, value)
            yield family


# -- the server's metrics and the /metrics page ------------------------------------------------


class ServerMetrics:
    """One server's metrics: its registry, the model collector and the custom families.

    :param records: ``ModelManager.records``, read at every scrape.
    :param settings: what ``--metrics-config`` turned on.
    """

    def __init__(self, records: Mapping[str, Any], settings: MetricsSettings | None = None) -> None:
        self.settings = settings if settings is not None else MetricsSettings()
        self.registry = CollectorRegistry(auto_describe=False)
        self._records = records
        self.registry.register(_ModelCollector(self.versions, self.settings))
        self.custom = CustomMetrics(self.registry)
        """What backends and models receive as ``backend.metrics`` / ``model.metrics``."""

    def versions(self) -> list[ModelVersion]:
        """The versions shown: every READY version."""
        return loaded_versions(self._records)

    def watch_cache(self, cache: WatchedCache) -> None:
        """Show the server's response cache: its gauges, and each lookup in the model's stats
        (``cache`` must also call ``on_cache_lookup``: ``cache.add_listener``)."""
        self.registry.register(_CacheCollector(cache))

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
