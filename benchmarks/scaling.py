"""Scaling with cores: the default ``pyserve run`` on 1, 2, 4, ... CPUs (``taskset``).

The server is the plain command of the README, started under ``taskset -c <cpus>``; it counts
the CPUs of its affinity mask and chooses its process layout from them by itself (one
process per CPU). The model and the loads are ``serving.py``'s: the Python ``identity``
``model.py``, HTTP JSON through ``wrk`` and gRPC through ``h2load``, 8 connections per CPU
(at least 8). The load generator is not pinned: on a machine with few cores it shares them
with the server, so the largest CPU counts here are bounded by the client too (the table
shows its CPU use).

Prints a markdown table of req/s per CPU count and the ratio to one CPU, the rounds
interleaved (medians). Run: ``.venv/bin/python benchmarks/scaling.py [--cpus 1,2] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batching import free_port  # noqa: E402  sibling helper modules
from serving import (  # noqa: E402
    MODEL,
    SMALL,
    Measurement,
    Server,
    cell,
    check,
    measure,
    prepare_requests,
    spawn,
    write_repository,
)


def _cpu_sets(counts: list[int]) -> list[tuple[int, str]]:
    """``(count, taskset list)`` for each count the affinity mask can give."""
    available = sorted(os.sched_getaffinity(0))
    return [(n, ",".join(str(c) for c in available[:n])) for n in counts if n <= len(available)]


def start(cpus: str, repository: Path, work: Path, timeout: float) -> Server:
    http, grpc_port = free_port(), free_port()
    command = ["taskset", "-c", cpus, sys.executable, "-m", "pyserve", "run", "--model-repository",
               str(repository), "--http-port", str(http), "--grpc-port", str(grpc_port),
               "--metrics-port", str(free_port())]
    return spawn(f"pyserve-{cpus}", command, http, grpc_port, work / f"pyserve-cpus-{cpus.replace(',', '_')}.log",
                 None, timeout, [MODEL])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpus", default="1,2,4,8,16", help="CPU counts to try (those the machine has)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--start-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    missing = [tool for tool in ("taskset", "wrk", "h2load") if shutil.which(tool) is None]
    if missing:
        print(f"needs {', '.join(missing)} (apt-get install util-linux wrk nghttp2-client)")
        return 0
    sets = _cpu_sets([int(n) for n in args.cpus.split(",")])
    protocols = args.protocols.split(",")
    results: dict[tuple[int, str], list[Measurement]] = {}
    with tempfile.TemporaryDirectory(prefix="pyserve-scaling-") as folder:
        work = Path(folder)
        repository = write_repository(work / "repo", [MODEL])
        cache: dict = {}
        for round_number in range(args.rounds):
            for count, cpus in sets:
                server = start(cpus, repository, work, args.start_timeout)
                try:
                    for protocol in protocols:
                        spec = cell(protocol, "json" if protocol == "http" else "grpc", SMALL, max(8, 8 * count))
                        files = prepare_requests(spec, work, cache)
                        problem = check(server, spec, files)
                        if problem:
                            print(f"{count} CPUs {protocol}: check failed: {problem}", file=sys.stderr)
                            continue
                        measure(server, spec, files, 1.0, work)  # warm-up
                        m = measure(server, spec, files, args.duration, work)
                        results.setdefault((count, protocol), []).append(m)
                        print(f"round {round_number + 1}: {count} CPUs {protocol} c={spec.concurrency}: "
                              f"{m.rps:,.0f} req/s, p99 {m.p99_ms:.2f} ms, server {m.server_cpu or 0:.2f} "
                              f"cores, load {m.load_cpu:.2f}", file=sys.stderr, flush=True)
                finally:
                    server.stop()
    print(f"| CPUs | {' | '.join(f'{p} req/s | vs 1 CPU | server cores | load-gen cores' for p in protocols)} |")
    print("|---:|" + "---:|---:|---:|---:|" * len(protocols))
    base = {p: statistics.median(m.rps for m in results.get((sets[0][0], p), [])) if results.get((sets[0][0], p))
            else None for p in protocols}
    for count, _ in sets:
        cells = []
        for protocol in protocols:
            runs = results.get((count, protocol), [])
            if not runs:
                cells.append("— | — | — | —")
                continue
            rps = statistics.median(m.rps for m in runs)
            ratio = rps / base[protocol] if base[protocol] else None
            server_cpu = statistics.median(m.server_cpu or 0.0 for m in runs)
            load_cpu = statistics.median(m.load_cpu for m in runs)
            cells.append(f"{rps:,.0f} | {'—' if ratio is None else f'{ratio:.2f}x'} | {server_cpu:.2f} | {load_cpu:.2f}")
        print(f"| {count} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
