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
* ``ServerMetrics``: the server's ``CollectorRegistry``, served as ``GET /metrics`` on its own
  port (``--metrics-port``, default 8002) by ``pyserve.server.metrics_port``, with
  CPU and memory gauges (and GPU gauges through NVML when ``pynvml`` and a GPU are present)
  refreshed every ``--metrics-interval-ms``.

The modules: ``stats`` (``ModelStats``, ``StatsSnapshot``, the statistics extension's JSON and
the choice of versions a statistics request names), ``prometheus`` (the per-model collector,
``MetricsSettings``, ``ServerMetrics`` and the text rendering) and ``system`` (CPU, memory and
NVML GPU readings); ``CustomMetrics`` lives in ``pyserve.api.custom_metrics``, the layer backends
import. Every name other code uses is importable from ``pyserve.metrics`` itself. Nothing here
serves a port: the transport is the server's (``pyserve.server.metrics_port``).
"""

from __future__ import annotations

from pyserve.api.custom_metrics import BUILTIN_FAMILIES, CustomMetrics
from pyserve.metrics.prometheus import (
    CONTENT_TYPE,
    MetricsSettings,
    ServerMetrics,
    render,
)
from pyserve.metrics.stats import (
    FAILURE_REASONS,
    FIRST_RESPONSE_BUCKETS_MS,
    ModelStats,
    StatsSnapshot,
    loaded_versions,
    select_versions,
    statistics_json,
)
from pyserve.metrics.system import GpuSample, NvmlReader, SystemMonitor

__all__ = [
    "BUILTIN_FAMILIES",
    "CONTENT_TYPE",
    "FAILURE_REASONS",
    "FIRST_RESPONSE_BUCKETS_MS",
    "CustomMetrics",
    "GpuSample",
    "MetricsSettings",
    "ModelStats",
    "NvmlReader",
    "ServerMetrics",
    "StatsSnapshot",
    "SystemMonitor",
    "loaded_versions",
    "render",
    "select_versions",
    "statistics_json",
]
