"""NVIDIA perf_analyzer against pyserve (and, with ``--triton``, the real Triton 2.51) in each of
its modes, on the same model repository (``_pa_models``: Triton Python-backend models).

Each mode is one short perf_analyzer run (``count_windows`` of ``--requests`` requests). A mode
passes when perf_analyzer exits 0, measured at least one request, and the server-side breakdown
it printed is plausible: queue + compute input + compute infer + compute output is at most the
average request time (perf_analyzer prints "overhead 0 usec" when the parts add up to more), up
to 1 µs of rounding per part, and the request time is at most the client's average latency
(except for the decoupled model, whose request ends with the final flag, after the last
response perf_analyzer times).

perf_analyzer comes from PyPI's ``perf-analyzer`` wheel and runs on Debian 12 through Debian 13's
C library, fetched and unpacked into a cache folder (``_perf_analyzer``; nothing is installed
into the system). Triton comes from the ``nvidia-pytriton`` wheel (``_triton``).

Run: ``.venv/bin/python benchmarks/perf_analyzer_modes.py [--triton] [--modes http-sync,...]
[--markdown FILE]``. Prints one line per mode and server, then a markdown table; exits 1 when a
mode failed on pyserve (0 otherwise).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _pa_models  # noqa: E402  sibling helper modules
import _perf_analyzer  # noqa: E402
import _triton  # noqa: E402
from batching import _log_tail, free_port  # noqa: E402
from serving import Server, spawn  # noqa: E402


@dataclass(frozen=True)
class Mode:
    """One perf_analyzer run: ``name``, the model, the protocol and the extra arguments."""

    name: str
    model: str
    protocol: str
    args: tuple[str, ...] = ()


def _modes() -> list[Mode]:
    found: list[Mode] = []
    for protocol in ("http", "grpc"):
        p = protocol
        found += [
            Mode(f"{p}-sync", "add_sub", p),
            Mode(f"{p}-async", "add_sub", p, ("--async",)),
            Mode(f"{p}-concurrency-4", "add_sub", p, ("--concurrency-range", "4")),
            Mode(f"{p}-async-concurrency-4", "add_sub", p, ("--async", "--concurrency-range", "4")),
            Mode(f"{p}-shm-system", "add_sub", p, ("--shared-memory", "system")),
            Mode(f"{p}-request-rate", "add_sub", p, ("--request-rate-range", "100")),
            Mode(f"{p}-request-intervals-poisson", "add_sub", p,
                 ("--request-rate-range", "100", "--request-distribution", "poisson")),
            Mode(f"{p}-batch-4", "add_sub", p, ("-b", "4")),
            Mode(f"{p}-string", "strings", p, ("--string-length", "24")),
            Mode(f"{p}-string-data", "strings", p, ("--string-data", "hello")),
            Mode(f"{p}-sequence", "accumulate", p, ("--sequence-length", "4")),
            Mode(f"{p}-sequence-async", "accumulate", p, ("--sequence-length", "4", "--async")),
            Mode(f"{p}-ensemble", "pipeline", p),
            Mode(f"{p}-zero-input", "add_sub", p, ("--input-data", "zero")),
        ]
    found += [
        Mode("grpc-streaming", "add_sub", "grpc", ("--streaming",)),
        Mode("grpc-streaming-decoupled", "decoupled", "grpc", ("--streaming",)),
        Mode("grpc-streaming-sequence", "accumulate", "grpc", ("--streaming", "--sequence-length", "4")),
        Mode("grpc-streaming-ensemble", "pipeline", "grpc", ("--streaming",)),
        Mode("grpc-shm-system-batch-4", "add_sub", "grpc", ("--shared-memory", "system", "-b", "4")),
        Mode("http-shm-system-batch-4", "add_sub", "http", ("--shared-memory", "system", "-b", "4")),
    ]
    return found


MODES = _modes()

_SERVER = re.compile(
    r"Avg request latency: (\d+) usec \(overhead (\d+) usec \+ queue (\d+) usec \+ compute input (\d+) usec "
    r"\+ compute infer (\d+) usec \+ compute output (\d+) usec\)")
_SERVER_ENSEMBLE = re.compile(
    r"Avg request latency: (\d+) usec \(overhead (\d+) usec \+ queue (\d+) usec \+ compute (\d+) usec\)")
_CLIENT = re.compile(r"Avg (?:latency|gRPC time|HTTP time): (\d+) usec")
_COUNT = re.compile(r"Successful request count: (\d+)")


@dataclass(frozen=True)
class Outcome:
    """What one mode did on one server: ``ok``, a short ``note`` (the breakdown, or why not)."""

    ok: bool
    note: str


def judge(returncode: int, output: str, client_bound: bool = True) -> Outcome:
    """Read one perf_analyzer run: passed, and the server-side breakdown it printed.

    :param client_bound: also require the server's request time to be within the client's
        latency (not for decoupled models: the server's request runs until the final flag,
        after the last response perf_analyzer times).
    """
    if returncode != 0:
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        return Outcome(False, f"exit {returncode}: {' | '.join(lines[-2:])[:240]}")
    counts = [int(c) for c in _COUNT.findall(output)]
    if not counts or counts[0] == 0:
        return Outcome(False, "no request measured")
    client = _CLIENT.search(output)
    detailed = _SERVER.search(output)
    if detailed is not None:
        request, _, queue, c_in, c_infer, c_out = (int(v) for v in detailed.groups())
        parts = queue + c_in + c_infer + c_out
        slack = 4  # each of the 5 averages is rounded down to a µs
        text = f"request {request} = queue {queue} + in {c_in} + infer {c_infer} + out {c_out} + {request - parts} µs"
    else:
        ensemble = _SERVER_ENSEMBLE.search(output)
        if ensemble is None:
            return Outcome(False, "no server-side breakdown printed")
        request, _, queue, compute = (int(v) for v in ensemble.groups())
        parts = queue + compute
        slack = 2
        text = f"request {request} = queue {queue} + compute {compute} + {request - parts} µs"
    if parts > request + slack:
        return Outcome(False, f"parts exceed the request: {text}")
    if client_bound and client is not None and request > int(client.group(1)) + 1:
        return Outcome(False, f"server request {request} µs above client latency {client.group(1)} µs")
    return Outcome(True, text)


def arguments(mode: Mode, server: Server, requests: int) -> list[str]:
    """perf_analyzer's command line for ``mode`` against ``server``."""
    port = server.http_port if mode.protocol == "http" else server.grpc_port
    return ["-m", mode.model, "-u", f"127.0.0.1:{port}", "-i", mode.protocol,
            "--measurement-mode", "count_windows", "--measurement-request-count", str(requests),
            "-s", "500", "--max-trials", "10", *mode.args]


def run_mode(tool: _perf_analyzer.PerfAnalyzer, mode: Mode, server: Server, requests: int,
             timeout: float) -> Outcome:
    """Run one mode; a run past ``timeout`` seconds fails."""
    try:
        result = tool.run(arguments(mode, server, requests), timeout)
    except Exception as error:  # a timeout, or perf_analyzer could not be started
        return Outcome(False, f"{type(error).__name__}: {error}"[:240])
    return judge(result.returncode, result.stdout, client_bound=mode.model != "decoupled")


def start_pyserve(repository: Path, work: Path, timeout: float) -> Server:
    """``pyserve run`` on ``repository``, loopback only."""
    http, grpc_port, metrics = free_port(), free_port(), free_port()
    command = [sys.executable, "-m", "pyserve", "run", "--model-repository", str(repository),
               "--host", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1",
               "--http-port", str(http), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics)]
    return spawn("pyserve", command, http, grpc_port, work / "pyserve.log", None, timeout, _pa_models.MODELS)


def start_triton(install: _triton.TritonInstall, repository: Path, work: Path, timeout: float) -> Server:
    """Triton 2.51 on ``repository``, loopback only."""
    http, grpc_port, metrics = free_port(), free_port(), free_port()
    backends = work / "triton-backends"
    if not backends.exists():
        install.prepare_backends(backends)
    command = [str(install.binary), "--model-repository", str(repository.resolve()),
               "--backend-directory", str(backends),
               "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1",
               "--http-port", str(http), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics)]
    return spawn("triton", command, http, grpc_port, work / "triton.log", install.environment(), timeout,
                 _pa_models.MODELS)


@contextmanager
def running(server: Server) -> Iterator[Server]:
    try:
        yield server
    finally:
        server.stop()


def markdown(modes: list[Mode], results: dict[str, dict[str, Outcome]]) -> str:
    """The results as a markdown table: a row per mode, a column per server."""
    names = list(results)
    lines = ["| mode | perf_analyzer arguments | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    for mode in modes:
        cells = []
        for name in names:
            outcome = results[name].get(mode.name)
            cells.append("" if outcome is None else ("pass" if outcome.ok else "FAIL: " + outcome.note))
        args = " ".join(("-m", mode.model, "-i", mode.protocol, *mode.args))
        lines.append(f"| {mode.name} | `{args}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton", action="store_true", help="also run every mode on Triton 2.51 (nvidia-pytriton)")
    parser.add_argument("--triton-venv", type=Path, default=_triton.default_venv(),
                        help="where nvidia-pytriton is (installed there when missing)")
    parser.add_argument("--modes", default="", help="comma-separated mode names (default: all)")
    parser.add_argument("--requests", type=int, default=100, help="requests per measurement window")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one mode may take")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    wanted = {m for m in args.modes.split(",") if m}
    unknown = wanted - {m.name for m in MODES}
    if unknown:
        parser.error(f"unknown mode(s): {', '.join(sorted(unknown))}")
    modes = [m for m in MODES if not wanted or m.name in wanted]
    tool = _perf_analyzer.ensure()
    print(f"perf_analyzer {_perf_analyzer.VERSION}: {tool.how}", file=sys.stderr)
    results: dict[str, dict[str, Outcome]] = {}
    with tempfile.TemporaryDirectory(prefix="pa-modes-") as tmp:
        work = Path(tmp)
        repository = _pa_models.write_repository(work / "models")
        starters = [("pyserve", lambda: start_pyserve(repository, work, 120))]
        if args.triton:
            install = _triton.find(args.triton_venv) or _triton.install(args.triton_venv, work / "triton-install.log")
            starters.append(("triton", lambda: start_triton(install, repository, work, 180)))
        for name, start in starters:
            outcomes = results[name] = {}
            with running(start()) as server:
                for mode in modes:
                    outcome = run_mode(tool, mode, server, args.requests, args.timeout)
                    if server.process.poll() is not None:
                        outcome = Outcome(False, f"{name} exited: {_log_tail(server.log, 3)}"[:240])
                        outcomes[mode.name] = outcome
                        print(f"{name:8} {mode.name:32} FAIL {outcome.note}", flush=True)
                        break
                    outcomes[mode.name] = outcome
                    print(f"{name:8} {mode.name:32} {'pass' if outcome.ok else 'FAIL'} {outcome.note}", flush=True)
    table = markdown(modes, results)
    print(table)
    if args.markdown is not None:
        args.markdown.write_text(table)
    return 0 if all(o.ok for o in results["pyserve"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
