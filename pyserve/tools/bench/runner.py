"""The ``pyserve bench`` run: prepare the requests, drive the worker processes level by level
until the measurements are stable, and report.

Stability follows perf_analyzer: a level is measured in windows of ``--measurement-interval``
until the last three windows' throughput and latency (the average, or ``--percentile``) each
stay within ``--stability-percentage`` of their mean, or ``--max-trials`` windows have passed.
The level's result merges the last three windows.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import uuid
from array import array
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from pyserve.tools.bench import inputs
from pyserve.tools.bench.control import ControlClient, Unsupported, connect
from pyserve.tools.bench.options import BenchError, BenchOptions
from pyserve.tools.bench.report import (
    LevelResult,
    Progress,
    ServerSplit,
    check_plot,
    percentiles_for,
    summary_table,
    write_csv,
    write_json,
    write_plot,
)
from pyserve.tools.bench.worker import LoadSpec, WorkerConfig, worker_main

STABLE_WINDOWS = 3
START_TIMEOUT_S = 60.0
REPLY_TIMEOUT_S = 60.0


@dataclass
class Window:
    """One measurement window, all workers together."""

    count: int
    errors: int
    delayed: int
    throughput_rps: float
    cpu_cores: float
    latencies: np.ndarray
    first_error: str

    def latency_us(self, percentile: int | None) -> float:
        if not len(self.latencies):
            return 0.0
        if percentile is None:
            return float(self.latencies.mean()) * 1e6
        return float(np.percentile(self.latencies, percentile)) * 1e6


class WorkerPool:
    """The load generator processes and their pipes."""

    def __init__(self, count: int, config: WorkerConfig) -> None:
        context = multiprocessing.get_context("spawn")  # no fork: the parent may hold gRPC threads
        self.pipes: list[Connection] = []
        self.processes: list[Any] = []
        for index in range(count):
            parent, child = context.Pipe()
            worker_config = WorkerConfig(**{**config.__dict__, "seed": config.seed + index})
            process = context.Process(target=worker_main, args=(child, worker_config), daemon=True,
                                      name=f"pyserve-bench-{index}")
            process.start()
            child.close()
            self.pipes.append(parent)
            self.processes.append(process)
        try:
            for index in range(count):
                self._expect(index, "ready", START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _expect(self, index: int, kind: str, timeout: float) -> Any:
        pipe = self.pipes[index]
        if not wait([pipe], timeout):
            raise BenchError(f"load generator process {index} did not answer within {timeout:.0f} s")
        try:
            message = pipe.recv()
        except (EOFError, OSError):
            raise BenchError(f"load generator process {index} exited unexpectedly") from None
        if message[0] == "failed":
            raise BenchError(f"load generator process {index} failed:\n{message[1]}")
        if message[0] != kind:
            raise BenchError(f"load generator process {index} answered '{message[0]}' instead of '{kind}'")
        return message

    def set_load(self, options: BenchOptions, level: float) -> None:
        """Split ``level`` (a concurrency or a request rate) over the workers."""
        count = len(self.pipes)
        for index, pipe in enumerate(self.pipes):
            if options.open_loop:
                spec = LoadSpec(rate=level / count, distribution=options.request_distribution, phase=index / count)
            else:
                total = int(level)
                spec = LoadSpec(concurrency=total // count + (1 if index < total % count else 0))
            pipe.send(("load", spec))

    def snapshot(self) -> Window:
        """Collect every worker's window and merge them."""
        for pipe in self.pipes:
            pipe.send(("snapshot",))
        count = errors = delayed = 0
        throughput = cpu = 0.0
        first_error = ""
        arrays: list[np.ndarray] = []
        for index in range(len(self.pipes)):
            window = self._expect(index, "window", REPLY_TIMEOUT_S)[1]
            duration = max(window["duration_s"], 1e-9)
            count += window["count"]
            errors += window["errors"]
            delayed += window["delayed"]
            throughput += window["count"] / duration
            cpu += window["cpu_s"] / duration
            first_error = first_error or window["first_error"]
            latencies = array("d")
            latencies.frombytes(window["latencies"])
            arrays.append(np.frombuffer(latencies, dtype=np.float64))
        merged = np.concatenate(arrays) if arrays else np.empty(0)
        return Window(count, errors, delayed, throughput, cpu, merged, first_error)

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        for pipe in self.pipes:
            try:
                pipe.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + 10.0
        for process in self.processes:
            process.join(max(deadline - time.monotonic(), 0.1))
            if process.is_alive():
                process.terminate()
                process.join(2.0)
        for pipe in self.pipes:
            pipe.close()


def is_stable(windows: list[Window], options: BenchOptions) -> bool:
    """Whether the last three windows agree within ``--stability-percentage``."""
    if len(windows) < STABLE_WINDOWS:
        return False
    last = windows[-STABLE_WINDOWS:]
    if any(w.count == 0 for w in last):
        return False
    tolerance = options.stability_percentage / 100.0
    for values in ([w.throughput_rps for w in last], [w.latency_us(options.percentile) for w in last]):
        mean = sum(values) / len(values)
        if mean <= 0 or max(values) > mean * (1 + tolerance) or min(values) < mean * (1 - tolerance):
            return False
    return True


def _server_split(before: dict[str, int], after: dict[str, int]) -> ServerSplit | None:
    delta = {key: after[key] - before.get(key, 0) for key in after}
    requests = delta.get("success_count", 0)
    if requests <= 0:
        return None

    def per_request(kind: str) -> float:
        return delta.get(f"{kind}_ns", 0) / requests / 1000.0

    return ServerSplit(
        queue_us=per_request("queue"),
        compute_input_us=per_request("compute_input"),
        compute_infer_us=per_request("compute_infer"),
        compute_output_us=per_request("compute_output"),
        inferences=delta.get("inference_count", 0),
        executions=delta.get("execution_count", 0),
    )


class _Stats:
    """Statistics extension snapshots, or a note once when the server has none."""

    def __init__(self, control: ControlClient, options: BenchOptions, notes: list[str], progress: Progress) -> None:
        self.control = control
        self.options = options
        self.notes = notes
        self.progress = progress
        self.available = True

    def take(self) -> dict[str, int] | None:
        if not self.available:
            return None
        try:
            return self.control.statistics(self.options.model, self.options.model_version)
        except (Unsupported, BenchError) as exc:
            self.available = False
            note = f"server-side queue/compute split not shown: the statistics extension is unavailable ({exc})"
            self.notes.append(note)
            self.progress.note(f"note: {note}")
            return None


def _describe(options: BenchOptions, level: float) -> str:
    if options.open_loop:
        return f"request rate {level:g}/s"
    return f"concurrency {int(level)}"


def measure_level(
    pool: WorkerPool, options: BenchOptions, level: float, stats: _Stats, progress: Progress
) -> LevelResult:
    """Drive one load level until stable (or out of trials) and merge the last windows."""
    pool.set_load(options, level)
    marks = [stats.take()]
    windows: list[Window] = []
    interval = options.measurement_interval_ms / 1000.0
    label = _describe(options, level)
    latency_name = "avg" if options.percentile is None else f"p{options.percentile}"
    while True:
        started = time.monotonic()
        while (left := interval - (time.monotonic() - started)) > 0:
            time.sleep(min(left, 0.25))
            elapsed = min(time.monotonic() - started, interval)
            progress.update(f"{label}: window {len(windows) + 1}/{options.max_trials} {elapsed:4.1f}/{interval:.1f} s")
        window = pool.snapshot()
        windows.append(window)
        marks.append(stats.take())
        if window.count == 0 and window.errors > 0:
            raise BenchError(f"every request failed at {label}: {window.first_error}")
        progress.update(
            f"{label}: window {len(windows)}/{options.max_trials}: {window.throughput_rps * options.batch_size:,.1f} "
            f"infer/s, {latency_name} {window.latency_us(options.percentile) / 1000:.3f} ms"
            + (f", {window.errors} error(s)" if window.errors else ""),
            final=True,
        )
        if is_stable(windows, options) or len(windows) >= options.max_trials:
            break
    last = windows[-STABLE_WINDOWS:]
    latencies = np.concatenate([w.latencies for w in last])
    if not len(latencies):
        raise BenchError(f"no request completed at {label} in {len(windows)} window(s) of {interval:g} s; "
                         f"raise --measurement-interval")
    wanted = percentiles_for(options)
    values = np.percentile(latencies, wanted) * 1e6
    requests_per_s = sum(w.throughput_rps for w in last) / len(last)
    before, after = marks[-len(last) - 1], marks[-1]
    return LevelResult(
        mode="request_rate" if options.open_loop else "concurrency",
        level=level,
        throughput=requests_per_s * options.batch_size,
        requests_per_s=requests_per_s,
        requests=int(sum(w.count for w in last)),
        errors=int(sum(w.errors for w in last)),
        delayed=int(sum(w.delayed for w in last)),
        avg_us=float(latencies.mean()) * 1e6,
        percentiles_us={p: float(v) for p, v in zip(wanted, values)},
        stable=is_stable(windows, options),
        windows=len(windows),
        first_error=next((w.first_error for w in last if w.first_error), ""),
        server=_server_split(before, after) if before is not None and after is not None else None,
        client_cpu=sum(w.cpu_cores for w in last) / len(last),
    )


class _SharedMemory:
    """A system shared memory region holding every request's inputs, registered with the server."""

    def __init__(self, control: ControlClient, content: bytes, region: str) -> None:
        try:
            from tritonclient.utils import shared_memory as shm
        except ImportError:
            raise BenchError("--shared-memory system needs tritonclient: pip install 'tritonclient[http]'") from None
        self.shm = shm
        self.control = control
        self.region = region
        self.key = f"/{region}"
        self.handle = shm.create_shared_memory_region(region, self.key, max(len(content), 1))
        self.registered = False
        try:
            shm.set_shared_memory_region(self.handle, [np.frombuffer(content, dtype=np.uint8)])
            control.register_system_shm(region, self.key, max(len(content), 1))
            self.registered = True
        except Unsupported as exc:
            self.close()
            raise BenchError(f"--shared-memory system: the server does not support system shared memory ({exc}); "
                             f"run with --shared-memory none") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.registered:
            self.control.unregister_system_shm(self.region)
            self.registered = False
        if self.handle is not None:
            self.shm.destroy_shared_memory_region(self.handle)
            self.handle = None


def encode_requests(
    info: inputs.ModelInfo, samples: list[inputs.Sample], options: BenchOptions, host: str,
    shm_slots: list[dict[str, inputs.ShmSlot]] | None,
) -> list[bytes]:
    """The pre-encoded requests the workers cycle through."""
    encoded: list[bytes] = []
    for index, sample in enumerate(samples):
        slots = shm_slots[index] if shm_slots is not None else None
        if options.protocol == "grpc":
            encoded.append(inputs.grpc_request(info, sample, options.streaming, slots))
        else:
            encoded.append(inputs.http_request(info, sample, host, options.http_binary, slots))
    return encoded


def _measure_levels(pool: WorkerPool, options: BenchOptions, stats: _Stats, progress: Progress,
                    notes: list[str]) -> list[LevelResult]:
    """Measure each level in turn (the ones measured when interrupted), noting the levels that
    were not stable or could not send on time."""
    results: list[LevelResult] = []
    try:
        for level in options.levels:
            result = measure_level(pool, options, level, stats, progress)
            results.append(result)
            if not result.stable:
                note = (f"{_describe(options, level)} was not stable within {options.max_trials} windows; "
                        f"the last {STABLE_WINDOWS} are reported")
                notes.append(note)
                progress.note(f"warning: {note}")
            if result.delayed:
                note = (f"{_describe(options, level)}: {result.delayed} request(s) could not be sent on time "
                        f"(all connections busy); raise --max-connections")
                notes.append(note)
                progress.note(f"warning: {note}")
    except KeyboardInterrupt:
        notes.append("interrupted: the remaining levels were not measured")
        progress.note("interrupted")
    return results


def _report(results: list[LevelResult], options: BenchOptions, notes: list[str], out: Any) -> None:
    """Print the summary table and the notes to ``out``; write the CSV, JSON and plot asked for."""
    print(summary_table(results, options), file=out)
    for note in notes:
        print(f"note: {note}", file=out)
    if options.csv is not None:
        write_csv(options.csv, results, options)
    if options.json is not None:
        write_json(options.json, results, options, notes)
    if options.plot is not None:
        write_plot(options.plot, results, options)


def run(options: BenchOptions, out: Any = None, err: Any = None) -> int:
    """Run the benchmark and report; returns the exit status (1 when a request failed)."""
    out = out if out is not None else sys.stdout
    progress = Progress(err if err is not None else sys.stderr, enabled=not options.quiet)
    host, port = options.host_port
    notes: list[str] = []
    if options.plot is not None:
        check_plot(options.plot)  # before the run, not after it
    control = connect(options.protocol, host, port)
    shared: _SharedMemory | None = None
    pool: WorkerPool | None = None
    results: list[LevelResult] = []
    try:
        info = control.model_info(options.model, options.model_version)
        if info.decoupled and not options.streaming:
            raise BenchError(f"model '{info.name}' is decoupled: use -i grpc --streaming (or --endpoint-type "
                             "completions|chat for a language model on the OpenAI routes)")
        samples = inputs.build_samples(info, options)
        shm_slots = None
        if options.shared_memory == "system":
            region = f"pyserve_bench_{os.getpid()}_{uuid.uuid4().hex[:8]}"
            shm_slots, content = inputs.shm_layout(samples, info, region)
            shared = _SharedMemory(control, content, region)
        requests = encode_requests(info, samples, options, f"{host}:{port}", shm_slots)
        progress.note(
            f"pyserve bench: model '{info.name}' at {host}:{port} over {options.protocol.upper()}"
            f"{' (streaming)' if options.streaming else ''}, batch size {options.batch_size}, "
            f"{options.workers} worker process(es), {options.measurement_interval_ms} ms windows"
        )
        pool = WorkerPool(options.workers, WorkerConfig(
            protocol=options.protocol, host=host, port=port, requests=requests,
            streaming=options.streaming, max_connections=options.max_connections,
        ))
        results = _measure_levels(pool, options, _Stats(control, options, notes, progress), progress, notes)
    finally:
        if pool is not None:
            pool.close()
        if shared is not None:
            shared.close()
        control.close()
    if not results:
        raise BenchError("nothing was measured")
    _report(results, options, notes, out)
    failed = sum(r.errors for r in results)
    if failed:
        first = next(r.first_error for r in results if r.first_error)
        print(f"error: {failed} request(s) failed; the first: {first}", file=err if err is not None else sys.stderr)
        return 1
    return 0
