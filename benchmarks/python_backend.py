"""Python-backend benchmark: the same identity ``model.py`` under pyserve and under real Triton.

The model, repository, servers, load tools and measurement are those of ``serving.py``
(``wrk -t1`` for HTTP/1.1 JSON, ``h2load -t1 -m1`` for gRPC unary; a 1x16 FP32 tensor echoed by
a Triton Python-backend ``model.py``, one CPU instance, no dynamic batcher), restricted to
pyserve and Triton at concurrency 1, 8 and 32 over HTTP and gRPC. Cells are interleaved over
``--rounds`` rounds (3) and the tables show medians.

Target (issue 5): pyserve at least 1.5x Triton's throughput and a p99 latency no worse than
Triton's, at every concurrency and on both protocols.

Prints markdown tables and the verdicts on stdout and always exits 0.
Run: ``.venv/bin/python benchmarks/python_backend.py [--duration 3] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving  # noqa: E402  sibling benchmark module
from batching import run_report  # noqa: E402

THROUGHPUT_TARGET = 1.5
P99_TARGET = 1.0
CELLS = [serving.cell(protocol, encoding, serving.SMALL, c)
         for protocol, encoding in (("http", "json"), ("grpc", "grpc")) for c in (1, 8, 32)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    serving.common_arguments(parser, rounds=3)
    args = parser.parse_args(argv)
    results = serving.Results()
    cells = list(CELLS)
    missing = serving.tools_missing(cells)
    if missing:
        results.notes.append("skipped (wrk or h2load not installed; apt-get install wrk nghttp2-client): "
                             + ", ".join(s.label for s in missing))
        cells = [c for c in cells if c not in missing]
    names = ["pyserve"]
    with tempfile.TemporaryDirectory(prefix="pyserve-pybackend-") as temp:
        work = Path(temp)
        install, why = serving._triton.install_for(args, work)
        if why:
            results.notes.append(why)
            serving._log(why)
        servers = serving.start_servers(args, work, results, with_echo=False, install=install)
        names = [s.name for s in servers] or names
        try:
            run = serving.run_cells
            run(servers, cells, args, work, results)
        finally:
            for server in servers:
                server.stop()
    lines = [serving.header(args, "Identity model.py (1x16 FP32 echo), HTTP/1.1 JSON via wrk -t1, gRPC unary via "
                                  "h2load -t1 -m1"), ""]
    lines += serving.cell_table(results, cells, names) + [""]
    lines += ["| cell | pyserve / Triton req/s | target | pyserve / Triton p99 | target | verdict |",
              "|---|---:|---:|---:|---:|---|"]
    for spec in cells:
        rps = serving.ratio(results, spec.key, "rps")
        p99 = serving.ratio(results, spec.key, "p99_ms")
        if rps is None or p99 is None:
            verdict = "not measured"
        else:
            misses = [what for what, bad in (("throughput", rps < THROUGHPUT_TARGET), ("p99", p99 > P99_TARGET)) if bad]
            verdict = "met" if not misses else "**MISSED** (" + ", ".join(misses) + ")"
        lines.append(f"| {spec.label} | {serving._fmt(rps, '.2f')}x | >= {THROUGHPUT_TARGET:g}x "
                     f"| {serving._fmt(p99, '.2f')}x | <= {P99_TARGET:g}x | {verdict} |")
    lines += [""] + [f"- {note}" for note in results.notes]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    run_report(main)
