"""Dynamic-batching benchmark: pyserve against Triton on a model whose execute costs a fixed delay.

The workload: a 1×16 FP32 echo model whose execute sleeps ``--delay-ms`` (2 ms) once per call,
whatever the batch size, driven by ``--concurrency`` (64) closed-loop HTTP/1.1 keep-alive
clients sending the KServe v2 JSON infer body. Each server gets two models from one temporary
Triton-style repository: ``batched`` (``dynamic_batching { max_queue_delay_microseconds }``)
and ``unbatched`` (no dynamic batcher, so one request per execute).

* pyserve: the first-party ``identity`` backend with ``execute_delay_ms`` and
  ``report_batch_size`` (the mean batch size comes from the ``batch_size`` response parameter).
* Triton: a Python-backend ``model.py`` doing the same (the mean batch size comes from the
  statistics extension, ``inference_count / execution_count``), run from the ``nvidia-pytriton``
  wheel; see ``benchmarks/_triton.py``. ``--with-triton`` installs it on demand into its own venv.

The load comes from ``benchmarks/_load.py`` in ``--load-procs`` separate processes; cells are
interleaved (every server and model once per round) and the table shows the median over
``--rounds``. The script prints a markdown table and the target ratios and always exits 0.

Run: ``.venv/bin/python benchmarks/batching.py --with-triton`` (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _triton  # sibling helper module

HERE = Path(__file__).resolve().parent
LOAD_SCRIPT = HERE / "_load.py"
MODELS = ("batched", "unbatched")
BATCHED_TARGET_VS_UNBATCHED = 20.0
BATCHED_TARGET_VS_TRITON = 1.5


# --------------------------------------------------------------------------- model repositories


def _config(name: str, backend: str, args: argparse.Namespace, *, batched: bool, identity: bool) -> str:
    lines = [
        f'name: "{name}"',
        f'backend: "{backend}"',
        f"max_batch_size: {args.max_batch_size}",
        'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]',
        'output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]',
        "instance_group [ { count: 1, kind: KIND_CPU } ]",
    ]
    if batched:
        lines.append(f"dynamic_batching {{ max_queue_delay_microseconds: {args.max_queue_delay_us} }}")
    if identity:
        lines += [
            "parameters [",
            f'  {{ key: "execute_delay_ms", value: {{ string_value: "{args.delay_ms:g}" }} }},',
            '  { key: "report_batch_size", value: { string_value: "true" } }',
            "]",
        ]
    return "\n".join(lines) + "\n"


def write_pyserve_repository(root: Path, args: argparse.Namespace) -> Path:
    for name in MODELS:
        (root / name / "1").mkdir(parents=True)
        config = _config(name, "identity", args, batched=name == "batched", identity=True)
        (root / name / "config.pbtxt").write_text(config)
    return root


def write_triton_repository(root: Path, args: argparse.Namespace) -> Path:
    for name in MODELS:
        (root / name / "1").mkdir(parents=True)
        config = _config(name, "python", args, batched=name == "batched", identity=False)
        (root / name / "config.pbtxt").write_text(config)
        (root / name / "1" / "model.py").write_text(_triton.triton_model_py(args.delay_ms))
    return root


def infer_body() -> bytes:
    """The KServe v2 JSON request for one [1,16] FP32 tensor."""
    data = [float(i) for i in range(16)]
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": data}]}
    return json.dumps(body, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- servers


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port, never one this process handed out before (the kernel may offer a
    just-closed port again, and a server given the same port twice refuses to start)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@dataclass
class Server:
    """A started server process."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    def stop(self) -> None:
        stop_process(self.process)

    def cpu_seconds(self) -> float | None:
        """User + system CPU of the process and its live descendants (Linux ``/proc``)."""
        return _tree_cpu_seconds(self.process.pid)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """Terminate a server process; kill it if it has not exited after 30 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _log_tail(log: Path, lines: int = 15) -> str:
    with suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return ""


def start_server(name: str, command: list[str], port: int, log: Path, env: dict[str, str] | None,
                 timeout: float) -> Server:
    """Start ``command`` and wait until ``/v2/health/ready`` answers 200 (with frontend
    processes, pyserve says ready once they listen too, so every connection can land on any).

    :raises RuntimeError: it exited or did not get ready in time; the message has the log's tail.
    """
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(name, process, port, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _ready(port):
            return server
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{_log_tail(log)}")
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"{name} was not ready after {timeout:.0f} s:\n{_log_tail(log)}")


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def start_pyserve(repository: Path, work: Path, timeout: float) -> Server:
    port = free_port()
    command = [
        sys.executable, "-m", "pyserve", "run", "--model-repository", str(repository),
        "--http-port", str(port), "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
    ] + os.environ.get("PYSERVE_BENCH_PYSERVE_ARGS", "").split()  # e.g. --frontend-processes 1
    return start_server("pyserve", command, port, work / "pyserve.log", None, timeout)


def start_triton(install: _triton.TritonInstall, repository: Path, work: Path, timeout: float) -> Server:
    backends = install.prepare_backends(work / "triton-backends")
    port = free_port()
    command = [
        str(install.binary), "--model-repository", str(repository), "--backend-directory", str(backends),
        "--http-port", str(port), "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
    ]
    return start_server("triton", command, port, work / "triton.log", install.environment(), timeout)


def _tree_cpu_seconds(root: int) -> float | None:
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        parents: dict[int, int] = {}
        times: dict[int, int] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with suppress(OSError, ValueError, IndexError):
                stat = Path(entry.path, "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                parents[int(entry.name)] = int(fields[1])
                times[int(entry.name)] = int(fields[11]) + int(fields[12])
    except OSError:
        return None
    if root not in times:
        return None
    total, frontier = 0, [root]
    while frontier:
        pid = frontier.pop()
        total += times.get(pid, 0)
        frontier += [child for child, parent in parents.items() if parent == pid]
    return total / ticks


def model_stats(port: int, model: str) -> tuple[int, int] | None:
    """``(inference_count, execution_count)`` from the statistics extension, if served."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{model}/stats", timeout=5) as reply:
            stats = json.load(reply)["model_stats"][0]
        return int(stats["inference_count"]), int(stats["execution_count"])
    except (OSError, ValueError, KeyError, IndexError):
        return None


# --------------------------------------------------------------------------- measuring


@dataclass
class Cell:
    """One measurement of one server and model."""

    rps: float
    p50_ms: float
    p99_ms: float
    mean_batch: float | None
    server_cpu: float | None  # cores busy, e.g. 0.98
    load_cpu: float  # cores busy, all generator processes together
    errors: int
    first_error: str = ""


@dataclass
class Summary:
    cells: list[Cell] = field(default_factory=list)

    def median(self, attribute: str) -> float | None:
        values = [getattr(c, attribute) for c in self.cells if getattr(c, attribute) is not None]
        return statistics.median(values) if values else None


def _percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def measure(server: Server, model: str, body_file: Path, args: argparse.Namespace) -> Cell:
    """Drive one model for warm-up + duration from ``--load-procs`` generator processes."""
    before = model_stats(server.port, model)
    start_at = time.time() + 0.5  # time for the generators to start
    shares = [args.concurrency // args.load_procs + (i < args.concurrency % args.load_procs)
              for i in range(args.load_procs)]
    generators = [
        subprocess.Popen(
            [sys.executable, str(LOAD_SCRIPT), "--port", str(server.port), "--path", f"/v2/models/{model}/infer",
             "--body-file", str(body_file), "--concurrency", str(share), "--start-at", repr(start_at),
             "--warmup", str(args.warmup), "--duration", str(args.duration)],
            stdout=subprocess.PIPE,
        )
        for share in shares if share > 0
    ]
    time.sleep(max(0.0, start_at + args.warmup - time.time()))
    cpu_start = server.cpu_seconds()
    time.sleep(args.duration)
    cpu_end = server.cpu_seconds()
    outputs = [json.loads(g.communicate()[0] or b"{}") for g in generators]
    after = model_stats(server.port, model)

    latencies = sorted(x for o in outputs for x in o.get("latencies_ms", []))
    requests = len(latencies)
    inverse_sum = sum(o.get("batch_inverse_sum", 0.0) for o in outputs)
    reported = sum(o.get("batch_reported", 0) for o in outputs)
    mean_batch: float | None = None
    if before is not None and after is not None and after[1] > before[1]:
        mean_batch = (after[0] - before[0]) / (after[1] - before[1])
    elif reported and inverse_sum > 0:
        mean_batch = reported / inverse_sum
    server_cpu = None
    if cpu_start is not None and cpu_end is not None:
        server_cpu = (cpu_end - cpu_start) / args.duration
    errors = sum(o.get("errors", 1) for o in outputs)
    first_error = next((o["first_error"] for o in outputs if o.get("first_error")), "")
    return Cell(
        rps=requests / args.duration,
        p50_ms=_percentile(latencies, 0.50),
        p99_ms=_percentile(latencies, 0.99),
        mean_batch=mean_batch,
        server_cpu=server_cpu,
        load_cpu=sum(o.get("cpu_s", 0.0) for o in outputs) / args.duration,
        errors=errors,
        first_error=first_error,
    )


# --------------------------------------------------------------------------- report


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None or value != value else format(value, spec)  # None or NaN


def report(results: dict[tuple[str, str], Summary], args: argparse.Namespace, notes: list[str]) -> str:
    lines = [
        (
            f"Workload: execute costs {args.delay_ms:g} ms per call whatever the batch; 1x16 FP32 JSON over "
            f"HTTP/1.1 keep-alive; {args.concurrency} connections from {args.load_procs} generator "
            f"process(es); {args.rounds} round(s) x {args.duration:g} s after {args.warmup:g} s warm-up, "
            f"medians; max_batch_size {args.max_batch_size}, max_queue_delay_microseconds "
            f"{args.max_queue_delay_us}; {os.cpu_count()} CPUs."
        ),
        "",
        "| server | model | req/s | p50 ms | p99 ms | mean batch | server CPU (cores) | load-gen CPU (cores) | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (server, model), summary in results.items():
        errors = sum(c.errors for c in summary.cells)
        lines.append(
            f"| {server} | {model} | {_fmt(summary.median('rps'), ',.0f')} | {_fmt(summary.median('p50_ms'), '.2f')} "
            f"| {_fmt(summary.median('p99_ms'), '.2f')} | {_fmt(summary.median('mean_batch'), '.1f')} "
            f"| {_fmt(summary.median('server_cpu'), '.2f')} | {_fmt(summary.median('load_cpu'), '.2f')} | {errors} |"
        )
    lines.append("")

    def rps(server: str, model: str) -> float | None:
        summary = results.get((server, model))
        return summary.median("rps") if summary else None

    def ratio(label: str, top: float | None, bottom: float | None, target: float) -> None:
        if top is None or bottom is None or bottom <= 0:
            lines.append(f"- {label}: not measured")
            return
        value = top / bottom
        verdict = "meets" if value >= target else "MISSES"
        lines.append(f"- {label}: {value:.2f}x (target >= {target:g}x: {verdict})")

    ratio("pyserve batched / pyserve unbatched", rps("pyserve", "batched"), rps("pyserve", "unbatched"),
          BATCHED_TARGET_VS_UNBATCHED)
    ratio("pyserve batched / Triton batched", rps("pyserve", "batched"), rps("triton", "batched"),
          BATCHED_TARGET_VS_TRITON)
    for (server, model), summary in results.items():
        for cell in summary.cells:
            if cell.first_error:
                lines.append(f"- {server}/{model} error: {cell.first_error[:200]}")
                break
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


@contextmanager
def running(servers: list[Server]) -> Iterator[None]:
    try:
        yield
    finally:
        for server in servers:
            server.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured per cell (5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of load before measuring (1)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all cells; medians shown (3)")
    parser.add_argument("--concurrency", type=int, default=64, help="connections in total (64)")
    parser.add_argument("--load-procs", type=int, default=1, help="load generator processes (1)")
    parser.add_argument("--delay-ms", type=float, default=2.0, help="execute cost per call (2)")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-queue-delay-us", type=int, default=100,
                        help="dynamic_batching max_queue_delay_microseconds of the batched models (100)")
    parser.add_argument("--with-triton", action="store_true",
                        help="install nvidia-pytriton into --triton-venv if no Triton is found")
    parser.add_argument("--no-triton", action="store_true", help="measure pyserve only")
    parser.add_argument("--triton-venv", type=Path, default=_triton.default_venv(),
                        help="venv holding nvidia-pytriton (default: %(default)s)")
    parser.add_argument("--start-timeout", type=float, default=120.0, help="seconds to wait for a server")
    args = parser.parse_args(argv)
    args.load_procs = max(1, min(args.load_procs, args.concurrency))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    notes: list[str] = []
    results: dict[tuple[str, str], Summary] = {}
    with tempfile.TemporaryDirectory(prefix="pyserve-bench-") as temp:
        work = Path(temp)
        body_file = work / "body.json"
        body_file.write_bytes(infer_body())
        servers: list[Server] = []
        with running(servers):
            try:
                servers.append(start_pyserve(write_pyserve_repository(work / "pyserve-repo", args), work,
                                             args.start_timeout))
            except RuntimeError as error:
                notes.append(f"pyserve could not be started: {error}")
            install, why = _triton.install_for(args, work)
            if install is not None:
                try:
                    servers.append(start_triton(install, write_triton_repository(work / "triton-repo", args),
                                                work, args.start_timeout))
                except (RuntimeError, OSError) as error:
                    why = f"Triton skipped: it could not be started: {error}"
            if why:
                notes.append(why)
                print(why, file=sys.stderr)
            for server in servers:
                for model in MODELS:
                    results[(server.name, model)] = Summary()
            for round_number in range(1, args.rounds + 1):
                for server in servers:
                    for model in MODELS:
                        cell = measure(server, model, body_file, args)
                        results[(server.name, model)].cells.append(cell)
                        print(f"round {round_number}: {server.name}/{model}: {cell.rps:,.0f} req/s, "
                              f"p50 {cell.p50_ms:.2f} ms, batch {_fmt(cell.mean_batch, '.1f')}, "
                              f"server CPU {_fmt(cell.server_cpu, '.2f')}", file=sys.stderr)
    print(report(results, args, notes))
    return 0


def run_report(main: Any) -> None:
    """Run a benchmark's ``main`` as a report, not a test: say what broke and still exit 0."""
    try:
        main()
    except KeyboardInterrupt:
        pass
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    sys.exit(0)


if __name__ == "__main__":
    run_report(main)
