"""Scaling with cores: the default ``pyserve run`` on 1, 2, 4, ... CPUs (``taskset``).

The server is the plain command of the README, started under ``taskset -c <cpus>``; it counts
the CPUs of its affinity mask and chooses its process layout from them by itself (one
process per CPU). The model and the loads are ``serving.py``'s: the Python ``identity``
``model.py``, HTTP JSON through ``wrk`` and gRPC through ``h2load``, 8 connections per CPU
(at least 8), one load thread per two CPUs.

Where the load generator runs decides what a ratio means (``--load-cpus``):

* ``spare``: on CPUs outside the largest set measured, the same ones for every count: the
  server's CPUs are its own (needs a machine with CPUs to spare, e.g. 1-8 of 16);
* ``same``: on the server's own CPUs, so at every count it takes the same share of them: the
  fair choice when no CPU is spare (1 and 2 of 2);
* ``any``: unpinned. At 1 CPU the generator then runs beside the server on a CPU of its own,
  while at the largest count it takes part of the server's: the ratio is bounded by the
  generator's cost, not only the server's;
* ``auto`` (default): ``spare`` when at least half the largest count is spare, else ``same``.

Prints a markdown table of req/s per CPU count, the ratio to one CPU, and the server's req/s
per core it used (its efficiency, whatever the generator takes), the rounds interleaved
(medians). Run: ``.venv/bin/python benchmarks/scaling.py [--cpus 1,2] [--rounds 3]``.
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


def _cpu_sets(counts: list[int], available: list[int]) -> list[tuple[int, str]]:
    """``(count, taskset list)`` for each count the affinity mask (``available``) can give."""
    return [(n, ",".join(str(c) for c in available[:n])) for n in counts if n <= len(available)]


LOAD_PLACEMENTS = ("auto", "spare", "same", "any")


def load_placement(choice: str, available: list[int], largest: int) -> str:
    """The placement ``--load-cpus`` resolves to; raises ValueError for ``spare`` without a
    spare CPU."""
    spare = len(available) - largest
    if choice == "auto":
        return "spare" if spare >= max(1, largest // 2) else "same"
    if choice == "spare" and spare < 1:
        raise ValueError(f"--load-cpus spare needs a CPU outside the largest set ({largest} of {len(available)})")
    return choice


def load_cpus(placement: str, server_cpus: str, spare: list[int]) -> list[int] | None:
    """The CPUs the load generator is pinned to for one count (None: unpinned)."""
    if placement == "same":
        return [int(c) for c in server_cpus.split(",")]
    return spare if placement == "spare" else None


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
    parser.add_argument("--load-cpus", choices=LOAD_PLACEMENTS, default="auto",
                        help="where the load generator runs (see the module docstring)")
    args = parser.parse_args(argv)
    missing = [tool for tool in ("taskset", "wrk", "h2load") if shutil.which(tool) is None]
    if missing:
        print(f"needs {', '.join(missing)} (apt-get install util-linux wrk nghttp2-client)")
        return 0
    available = sorted(os.sched_getaffinity(0))
    sets = _cpu_sets([int(n) for n in args.cpus.split(",")], available)
    if not sets:
        print(f"none of the CPU counts {args.cpus} fits this affinity mask")
        return 0
    largest = max(count for count, _ in sets)
    spare = available[largest:]
    try:
        placement = load_placement(args.load_cpus, available, largest)
    except ValueError as error:
        print(error)
        return 0
    protocols = args.protocols.split(",")
    results: dict[tuple[int, str], list[Measurement]] = {}
    with tempfile.TemporaryDirectory(prefix="pyserve-scaling-") as folder:
        work = Path(folder)
        repository = write_repository(work / "repo", [MODEL])
        cache: dict = {}
        for round_number in range(args.rounds):
            for count, cpus in sets:
                server = start(cpus, repository, work, args.start_timeout)
                pinned = load_cpus(placement, cpus, spare)
                prefix = ("taskset", "-c", ",".join(map(str, pinned))) if pinned else ()
                threads = min(max(1, count // 2), len(pinned) if pinned else len(available))
                try:
                    for protocol in protocols:
                        spec = cell(protocol, "json" if protocol == "http" else "grpc", SMALL, max(8, 8 * count))
                        files = prepare_requests(spec, work, cache)
                        problem = check(server, spec, files)
                        if problem:
                            print(f"{count} CPUs {protocol}: check failed: {problem}", file=sys.stderr)
                            continue
                        measure(server, spec, files, 1.0, work, prefix, threads)  # warm-up
                        m = measure(server, spec, files, args.duration, work, prefix, threads)
                        results.setdefault((count, protocol), []).append(m)
                        print(f"round {round_number + 1}: {count} CPUs {protocol} c={spec.concurrency}: "
                              f"{m.rps:,.0f} req/s, p99 {m.p99_ms:.2f} ms, server {m.server_cpu or 0:.2f} "
                              f"cores, load {m.load_cpu:.2f}", file=sys.stderr, flush=True)
                finally:
                    server.stop()
    where = {"same": "on the server's CPUs", "spare": f"on CPUs {spare} (spare)",
             "any": "unpinned"}[placement]
    print(f"Load generator {where}; medians of {args.rounds} rounds.\n")
    columns = "req/s | vs 1 CPU | server cores | req/s per server core | load-gen cores"
    print(f"| CPUs | {' | '.join(f'{p} {columns}' for p in protocols)} |")
    print("|---:|" + "---:|---:|---:|---:|---:|" * len(protocols))
    base = {p: statistics.median(m.rps for m in results.get((sets[0][0], p), [])) if results.get((sets[0][0], p))
            else None for p in protocols}
    for count, _ in sets:
        cells = []
        for protocol in protocols:
            runs = results.get((count, protocol), [])
            if not runs:
                cells.append("— | — | — | — | —")
                continue
            rps = statistics.median(m.rps for m in runs)
            first = base[protocol]
            ratio = rps / first if first else None
            server_cpu = statistics.median(m.server_cpu or 0.0 for m in runs)
            per_core = [m.rps / m.server_cpu for m in runs if m.server_cpu]
            load_cpu = statistics.median(m.load_cpu for m in runs)
            cells.append(f"{rps:,.0f} | {'—' if ratio is None else f'{ratio:.2f}x'} | {server_cpu:.2f} | "
                         f"{f'{statistics.median(per_core):,.0f}' if per_core else '—'} | {load_cpu:.2f}")
        print(f"| {count} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
