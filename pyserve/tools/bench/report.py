"""``pyserve bench`` results: the per-level record, the live progress display, the summary
table, and the CSV / JSON / PNG exports.

Latencies are kept in microseconds (as perf_analyzer reports them) and shown in milliseconds.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from pyserve import logs
from pyserve.tools.bench.options import BenchError, BenchOptions

STANDARD_PERCENTILES = (50, 90, 95, 99)


@dataclass
class ServerSplit:
    """Where a request's time went on the server (statistics extension deltas), per request."""

    queue_us: float
    compute_input_us: float
    compute_infer_us: float
    compute_output_us: float
    inferences: int
    executions: int

    @property
    def compute_us(self) -> float:
        """Compute input + infer + output."""
        return self.compute_input_us + self.compute_infer_us + self.compute_output_us

    @property
    def mean_batch(self) -> float:
        """Inferences per execution (the mean size of the batches the model ran)."""
        return self.inferences / self.executions if self.executions else 0.0


@dataclass
class LevelResult:
    """One load level's measurement (the last, stable, windows)."""

    mode: str
    level: float
    throughput: float
    requests_per_s: float
    requests: int
    errors: int
    delayed: int
    avg_us: float
    percentiles_us: dict[int, float]
    stable: bool
    windows: int
    first_error: str = ""
    server: ServerSplit | None = None
    client_cpu: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def level_label(self) -> str:
        """``4`` for a concurrency, ``250.0`` for a request rate."""
        return str(int(self.level)) if self.mode == "concurrency" else f"{self.level:g}"

    def latency_us(self, percentile: int | None) -> float:
        """The latency that drives stability and the summary: a percentile or the average."""
        return self.avg_us if percentile is None else self.percentiles_us[percentile]


def percentiles_for(options: BenchOptions) -> tuple[int, ...]:
    """The percentiles reported: p50/p90/p95/p99 plus ``--percentile`` if it is another one."""
    if options.percentile is None or options.percentile in STANDARD_PERCENTILES:
        return STANDARD_PERCENTILES
    return tuple(sorted((*STANDARD_PERCENTILES, options.percentile)))


class Progress:
    """The live progress display on ``stream`` (stderr).

    On a terminal, one line rewritten in place; otherwise one line per finished window.
    """

    def __init__(self, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.interactive = enabled and self.stream.isatty()
        self._width = 0

    def update(self, text: str, final: bool = False) -> None:
        """Show ``text``; on a non-terminal only ``final`` lines are written."""
        if not self.enabled:
            return
        if self.interactive:
            self.stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
            if final:
                self.stream.write("\n")
                self._width = 0
            self.stream.flush()
        elif final:
            self.stream.write(text + "\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own (warnings, notes); nothing with ``--quiet``."""
        if not self.enabled:
            return
        if self.interactive and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()


def _ms(us: float) -> str:
    return f"{us / 1000:.3f}"


def summary_table(results: list[LevelResult], options: BenchOptions) -> str:
    """The summary table (latencies in ms, server split in µs when the server reports it)."""
    mode = "Request rate" if options.open_loop else "Concurrency"
    percentiles = percentiles_for(options)
    with_server = any(r.server is not None for r in results)
    headers = [mode, "Infer/s", "Avg ms", *(f"p{p} ms" for p in percentiles)]
    if with_server:
        headers += ["Queue us", "Compute us", "Batch"]
    headers += ["Errors"]
    rows: list[list[str]] = []
    for r in results:
        row = [r.level_label + ("" if r.stable else " (unstable)"), f"{r.throughput:,.1f}", _ms(r.avg_us),
               *(_ms(r.percentiles_us[p]) for p in percentiles)]
        if with_server:
            if r.server is not None:
                row += [f"{r.server.queue_us:,.1f}", f"{r.server.compute_us:,.1f}", f"{r.server.mean_batch:.2f}"]
            else:
                row += ["-", "-", "-"]
        row.append(str(r.errors))
        rows.append(row)
    return logs.table(headers, rows)


CSV_LATENCY_COLUMNS = {50: "p50 latency", 90: "p90 latency", 95: "p95 latency", 99: "p99 latency"}


def write_csv(path: Path, results: list[LevelResult], options: BenchOptions) -> None:
    """perf_analyzer's ``-f`` CSV: one row per level, times in microseconds."""
    percentiles = percentiles_for(options)
    header = ["Request Rate" if options.open_loop else "Concurrency", "Inferences/Second", "Client Send",
              "Network+Server Send/Recv", "Server Queue", "Server Compute Input", "Server Compute Infer",
              "Server Compute Output", "Client Recv",
              *(CSV_LATENCY_COLUMNS.get(p, f"p{p} latency") for p in percentiles), "Avg latency", "Errors"]
    with _open_output(path, newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for r in results:
            server = r.server
            server_us = (server.queue_us + server.compute_us) if server else 0.0
            writer.writerow([
                r.level_label, f"{r.throughput:.2f}", 0,
                round(max(r.avg_us - server_us, 0.0)) if server else "",
                round(server.queue_us) if server else "", round(server.compute_input_us) if server else "",
                round(server.compute_infer_us) if server else "", round(server.compute_output_us) if server else "",
                0, *(round(r.percentiles_us[p]) for p in percentiles), round(r.avg_us), r.errors,
            ])


def results_document(results: list[LevelResult], options: BenchOptions, notes: list[str]) -> dict[str, Any]:
    """Everything measured, as one JSON-serializable object."""
    levels = []
    for r in results:
        entry = asdict(r)
        entry["percentiles_us"] = {f"p{p}": v for p, v in r.percentiles_us.items()}
        if r.server is not None:
            entry["server"]["compute_us"] = r.server.compute_us
            entry["server"]["mean_batch"] = r.server.mean_batch
        levels.append(entry)
    return {
        "tool": "pyserve bench",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": options.model,
        "model_version": options.model_version,
        "url": options.url,
        "protocol": options.protocol,
        "streaming": options.streaming,
        "mode": "request_rate" if options.open_loop else "concurrency",
        "request_distribution": options.request_distribution if options.open_loop else None,
        "batch_size": options.batch_size,
        "http_binary": options.http_binary,
        "shared_memory": options.shared_memory,
        "measurement_interval_ms": options.measurement_interval_ms,
        "percentile": options.percentile,
        "workers": options.workers,
        "notes": notes,
        "results": levels,
    }


def write_json(path: Path, results: list[LevelResult], options: BenchOptions, notes: list[str]) -> None:
    """Write :func:`results_document` to ``path``."""
    with _open_output(path) as handle:
        json.dump(results_document(results, options, notes), handle, indent=2)
        handle.write("\n")


def check_plot(path: Path) -> None:
    """What ``--plot`` needs, checked before the run so that it does not fail after it:
    the file's folder exists, and matplotlib imports.

    :raises BenchError: no such folder, or matplotlib is not installed (or fails to import).
    """
    folder = path.parent
    if not folder.is_dir():
        raise BenchError(f"cannot write --plot file '{path}': folder '{folder}' does not exist")
    _pyplot()


def _pyplot() -> Any:
    """``matplotlib.pyplot`` with the file-only Agg backend.

    :raises BenchError: matplotlib is not installed or fails to import.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        detail = "" if isinstance(exc, ModuleNotFoundError) and exc.name == "matplotlib" else f" ({exc})"
        raise BenchError(f"--plot needs matplotlib: pip install matplotlib{detail}") from None
    return plt


def write_plot(path: Path, results: list[LevelResult], options: BenchOptions) -> None:
    """Latency (p50 and the ``--percentile`` or p99) against throughput, as a PNG.

    :raises BenchError: matplotlib is not installed, or the file cannot be written.
    """
    plt = _pyplot()
    upper = options.percentile if options.percentile is not None else 99
    throughput = [r.throughput for r in results]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.plot(throughput, [r.percentiles_us[50] / 1000 for r in results], marker="o", label="p50")
    axes.plot(throughput, [r.percentiles_us[upper] / 1000 for r in results], marker="s", label=f"p{upper}")
    for r in results:
        axes.annotate(r.level_label, (r.throughput, r.percentiles_us[upper] / 1000), textcoords="offset points",
                      xytext=(4, 4), fontsize=8)
    axes.set_xlabel("throughput (infer/s)")
    axes.set_ylabel("latency (ms)")
    mode = "request rate" if options.open_loop else "concurrency"
    axes.set_title(f"{options.model} over {options.protocol.upper()} (points: {mode})")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=110)
    except OSError as exc:
        raise BenchError(f"cannot write --plot file '{path}': {exc.strerror or exc}") from None
    finally:
        plt.close(figure)


def _open_output(path: Path, newline: str | None = None) -> TextIO:
    try:
        return open(path, "w", encoding="utf-8", newline=newline)
    except OSError as exc:
        raise BenchError(f"cannot write '{path}': {exc.strerror or exc}") from None
