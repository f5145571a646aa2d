"""The metric families backends and models add to the server's ``/metrics`` page.

``CustomMetrics`` is what ``backend.metrics`` and ``model.metrics`` are; it needs only
``prometheus_client``, so a backend's import of it loads nothing of the server.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

BUILTIN_FAMILIES = frozenset({
    "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
    "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us", "nv_inference_pending_request_count",
    "nv_inference_first_response_histogram_ms", "nv_model_load_duration_secs", "nv_cache_num_hits_per_model",
    # the summaries (pyserve.metrics.summaries.SUMMARY_FIELDS)
    *(f"nv_inference_{field}_summary_us" for field in (
        "request", "queue", "compute_input", "compute_infer", "compute_output"
    )),
    "nv_cache_num_misses_per_model", "nv_cache_hit_duration_per_model", "nv_cache_miss_duration_per_model",
    "nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes", "nv_gpu_power_usage",
    "nv_gpu_power_limit", "nv_energy_consumption", "nv_cpu_utilization", "nv_cpu_memory_total_bytes",
    "nv_cpu_memory_used_bytes",
    # the OpenAI routes' families (pyserve.frontends.http.openai.metrics.FAMILIES)
    "pyserve_openai_time_to_first_token_seconds", "pyserve_openai_inter_token_latency_seconds",
    "pyserve_openai_prompt_tokens", "pyserve_openai_completion_tokens",
})
"""The families the server itself exports: a custom family may not take one of their names."""


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
        self.registry.register(wrapper)

    def exclude(self, source: Any) -> None:
        """Stop showing what ``include(source)`` added (no-op if it was not included)."""
        with self._lock:
            wrapper = self._included.pop(id(source), None)
        if wrapper is not None:
            self.registry.unregister(wrapper)

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
