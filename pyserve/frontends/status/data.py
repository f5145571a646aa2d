"""What the status page shows, as JSON: every model version, its settings and its recent numbers.

``StatusReport.build`` reads the server's models and statistics (the same counters the
statistics extension answers from, the replicas' included once the caller pulled them) and
leaves out each part whose API category the request may not read (``--http-restricted-api``):
the model list and the load/unload buttons need ``model-repository``, backend, instances and
batching need ``model-config``, the numbers need ``statistics``, server name and version
``metadata``, live and ready ``health``. A left-out part is named in ``restricted`` with the
header it needs.

The recent numbers (request rate, latency percentiles, average queue time) compare the
counters now with the counters some seconds ago (``StatsHistory``): no per-request work
beyond what the statistics already count.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pyserve.dataplane.interface import ServingPlane
from pyserve.frontends.restricted import Restrictions, denied
from pyserve.metrics.latency import quantile_ns
from pyserve.metrics.stats import ModelStats
from pyserve.runtime.control import ControlMode
from pyserve.runtime.versions import ModelRecord, ModelVersion

WINDOW_S = 10.0
"""The recent numbers cover about this many seconds (less just after start)."""
KEEP_S = 60.0
"""How long ``StatsHistory`` keeps a reading."""
MIN_GAP_S = 1.0
"""Readings closer together than this are not kept (many pages polling at once cost nothing more)."""
QUANTILES = (("p50_ms", 0.5), ("p90_ms", 0.9), ("p99_ms", 0.99))

_KINDS = {0: "AUTO", 1: "GPU", 2: "CPU", 3: "MODEL"}


@dataclass(frozen=True, slots=True)
class _Reading:
    """The counters of one version that the recent numbers are computed from."""

    success: int
    failure: int
    queue_ns: int
    compute_count: int
    infer_ns: int
    latency: tuple[int, ...]


_ZERO = _Reading(0, 0, 0, 0, 0, ())


class StatsHistory:
    """Readings of every version's counters over the last ``KEEP_S`` seconds.

    Event loop only (one status request at a time reads and adds). Memory: at most
    ``KEEP_S / MIN_GAP_S`` readings, each a few integers per loaded version.
    """

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._readings: deque[tuple[float, dict[ModelStats, _Reading]]] = deque()

    def recent(self, now: float, current: Mapping[ModelStats, _Reading]) -> tuple[float, dict[ModelStats, _Reading]]:
        """``(seconds, readings)`` to compare ``current`` with (the newest reading at least
        ``window_s`` old, else the oldest kept; ``(0.0, {})`` when there is none), and keep
        ``current`` as a reading of ``now``."""
        readings = self._readings
        while len(readings) > 1 and readings[1][0] <= now - KEEP_S:
            readings.popleft()
        base: tuple[float, dict[ModelStats, _Reading]] | None = None
        for reading in readings:
            if reading[0] <= now - self.window_s or base is None:
                base = reading
            else:
                break
        if not readings or now - readings[-1][0] >= MIN_GAP_S:
            readings.append((now, dict(current)))
        if base is None or now - base[0] < MIN_GAP_S / 2:  # too short to say anything
            return 0.0, {}
        return now - base[0], base[1]


def _reading(stats: ModelStats) -> _Reading:
    snap = stats.snapshot()
    return _Reading(snap.success_count, snap.fail_count, snap.queue_ns, snap.compute_count, snap.infer_ns,
                    snap.latency_buckets)


def _recent(now: _Reading, before: _Reading, seconds: float) -> dict[str, Any]:
    """The numbers of the last ``seconds``: rates per second, latencies in milliseconds (None
    when no request finished meanwhile)."""
    success = now.success - before.success
    result: dict[str, Any] = {
        "window_s": round(seconds, 3),
        "requests_per_s": success / seconds,
        "failures_per_s": (now.failure - before.failure) / seconds,
    }
    if before.latency:
        latency = [a - b for a, b in zip(now.latency, before.latency)]
    else:
        latency = list(now.latency)
    for key, q in QUANTILES:
        value = quantile_ns(latency, q)
        result[key] = None if value is None else value / 1e6
    result["queue_ms"] = (now.queue_ns - before.queue_ns) / success / 1e6 if success > 0 else None
    computed = now.compute_count - before.compute_count
    result["compute_ms"] = (now.infer_ns - before.infer_ns) / computed / 1e6 if computed > 0 else None
    return result


def _batching(config: Any) -> dict[str, Any]:
    """The scheduler and batch settings of a config."""
    result: dict[str, Any] = {"max_batch_size": int(config.max_batch_size)}
    if config.HasField("dynamic_batching"):
        dynamic = config.dynamic_batching
        result["scheduler"] = "dynamic"
        result["preferred_batch_size"] = [int(s) for s in dynamic.preferred_batch_size]
        result["max_queue_delay_us"] = int(dynamic.max_queue_delay_microseconds)
    elif config.HasField("sequence_batching"):
        sequence = config.sequence_batching
        result["scheduler"] = "sequence"
        result["strategy"] = "oldest" if sequence.HasField("oldest") else "direct"
        result["max_sequence_idle_us"] = int(sequence.max_sequence_idle_microseconds)
    elif config.platform == "ensemble" or config.HasField("ensemble_scheduling"):
        result["scheduler"] = "ensemble"
    else:
        result["scheduler"] = "default"
    result["decoupled"] = bool(config.model_transaction_policy.decoupled)
    return result


def _settings(version: ModelVersion) -> dict[str, Any]:
    """Backend, instances and batching of a version (what its config says; how many
    instances were created once it is READY)."""
    config = version.config
    if config is None:
        return {}
    backend = version.backend.info.name if version.backend is not None else (config.backend or "")
    groups = [
        {"name": g.name, "kind": _KINDS.get(int(g.kind), str(g.kind)), "count": int(g.count),
         "gpus": [int(d) for d in g.gpus]}
        for g in config.instance_group
    ]
    return {
        "backend": backend,
        "platform": config.platform,
        "instance_groups": groups,
        "instances": len(version.instances) if version.ready else None,
        "batching": _batching(config),
    }


class StatusReport:
    """Builds the status JSON of one server.

    :param dataplane: the server's data plane (its models, name and readiness).
    :param restrictions: the ``--http-restricted-api`` rules.
    """

    def __init__(self, dataplane: ServingPlane, restrictions: Restrictions | None = None) -> None:
        self.dataplane = dataplane
        self.restrictions: Restrictions = restrictions or {}
        self.history = StatsHistory()
        self.started = time.time()

    def allowed(self, headers: Iterable[tuple[bytes, bytes]]) -> tuple[set[str], dict[str, str]]:
        """The categories the request may read, and ``category → 403 message`` for the others."""
        headers = list(headers)
        allowed: set[str] = set()
        refused: dict[str, str] = {}
        for category in ("health", "metadata", "model-repository", "model-config", "statistics"):
            rule = denied(self.restrictions, category, headers)
            if rule is None:
                allowed.add(category)
            else:
                refused[category] = rule.message
        return allowed, refused

    def needs_statistics(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """Whether the request may read statistics (the caller pulls the replicas' first)."""
        return denied(self.restrictions, "statistics", list(headers)) is None

    async def build(self, headers: Iterable[tuple[bytes, bytes]]) -> dict[str, Any]:
        """The status JSON for a request with ``headers`` (event loop; awaits the health checks)."""
        dataplane = self.dataplane
        allowed, refused = self.allowed(headers)
        server: dict[str, Any] = {"uptime_s": round(time.time() - self.started, 1)}
        if "metadata" in allowed:
            server["name"] = dataplane.server_name
            server["version"] = dataplane.server_version
        if "health" in allowed:
            server["live"] = bool(dataplane.live and not dataplane.exiting)
            server["ready"] = await dataplane.check_server_ready()
        mode = dataplane.models.control_mode
        report: dict[str, Any] = {
            "server": server,
            "restricted": refused,
            "control": {
                "mode": ControlMode(mode).value,
                "enabled": mode is ControlMode.EXPLICIT and "model-repository" in allowed,
            },
            "models": None,
        }
        if "model-repository" in allowed:
            report["models"] = self._models("model-config" in allowed, "statistics" in allowed)
        return report

    def _models(self, settings: bool, statistics: bool) -> list[dict[str, Any]]:
        records: dict[str, ModelRecord] = dict(self.dataplane.models.records)
        entries: list[dict[str, Any]] = []
        readings: dict[ModelStats, _Reading] = {}
        for entry in self.dataplane.repository_index():
            name = entry["name"]
            record = records.get(name)
            item: dict[str, Any] = {
                "name": name,
                "version": entry.get("version"),
                "state": entry.get("state", ""),
                "reason": entry.get("reason", ""),
            }
            version = None
            if record is not None and item["version"] is not None:
                version = record.versions.get(int(item["version"]))
            if version is not None and settings:
                item.update(_settings(version))
            if version is not None and statistics and version.ready:
                readings[version.stats] = _reading(version.stats)
                item["_stats"] = version.stats
            entries.append(item)
        if statistics:
            seconds, before = self.history.recent(time.monotonic(), readings)
            for item in entries:
                stats = item.pop("_stats", None)
                if stats is None:
                    continue
                now = readings[stats]
                item["stats"] = {
                    "success": now.success,
                    "failure": now.failure,
                    "pending": stats.pending,
                    "recent": _recent(now, before.get(stats, _ZERO), seconds) if seconds > 0 else None,
                }
        return entries
