"""The metrics settings: the Prometheus port and what it reports."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pyserve.server.options import values
from pyserve.server.options.declare import METRICS, flag, setting


@dataclass(kw_only=True)
class MetricsOptions:
    """The metrics port (``--metrics-*``, ``--allow-*-metrics``)."""

    metrics_port: int = setting(flag("--metrics-port", type=values.port, headline=True,
                                     help="metrics port (default 8002)"), default=8002)
    # Serve GET /metrics on metrics_port. Off by default for embedded servers, so that they never
    # take port 8002 unasked; ``pyserve run`` turns it on, as Triton (--allow-metrics, default true).
    allow_metrics: bool = setting(
        flag("--allow-metrics", type=values.boolean, metavar="BOOL", default=True, headline=True,
             help="serve Prometheus metrics on --metrics-port at /metrics (default true)"),
        default=False,
    )
    metrics_address: str = setting(  # "" = host (Triton: the HTTP address)
        flag("--metrics-address", metavar="HOST", group=METRICS,
             help="address the metrics service listens on (default: --http-address)"),
        default="",
    )
    metrics_interval_ms: int = setting(  # how often CPU/GPU gauges are refreshed
        flag("--metrics-interval-ms", type=int, metavar="MS", group=METRICS,
             help="how often CPU and GPU metrics are refreshed (default 2000)"),
        default=2000,
    )
    metrics_config: Mapping[str, str] = setting(
        flag("--metrics-config", action="append", type=values.metrics_setting, metavar="KEY=VALUE", group=METRICS,
             help="counter_latencies=BOOL (default true), histogram_latencies=BOOL (default false); repeatable"),
        default_factory=dict, convert=dict,
    )
    allow_cpu_metrics: bool = setting(flag("--allow-cpu-metrics", type=values.boolean, metavar="BOOL", group=METRICS),
                                      default=True)
    allow_gpu_metrics: bool = setting(  # GPU gauges need pynvml and a GPU
        flag("--allow-gpu-metrics", type=values.boolean, metavar="BOOL", group=METRICS,
             help="GPU metrics through NVML (needs pynvml and a GPU; default true)"),
        default=True,
    )
