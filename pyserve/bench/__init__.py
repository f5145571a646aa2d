"""``pyserve bench``: a load generator for KServe v2 / Triton servers with perf_analyzer's core flags.

* :mod:`pyserve.bench.options` — the command line (standard library only);
* :mod:`pyserve.bench.control` — model metadata/config, statistics, shared memory registration;
* :mod:`pyserve.bench.inputs` — input tensors and the pre-encoded requests;
* :mod:`pyserve.bench.worker` — the load generator processes (asyncio, raw HTTP/1.1, unary gRPC over
  :mod:`pyserve.bench.h2client`, `grpc.aio` for `--streaming`);
* :mod:`pyserve.bench.runner` — levels, stability, aggregation;
* :mod:`pyserve.bench.report` — progress display, summary table, CSV / JSON / PNG.
"""

from __future__ import annotations

import argparse
import sys

from pyserve.bench.options import BenchError, BenchOptions, add_bench_parser, options_from_args

__all__ = ["BenchError", "BenchOptions", "add_bench_parser", "cmd_bench", "options_from_args"]


def cmd_bench(args: argparse.Namespace) -> int:
    """``pyserve bench``: run and report; exit status 0, or 1 on an error or a failed request."""
    from pyserve.bench.runner import run

    try:
        options = options_from_args(args)
        return run(options)
    except BenchError as exc:
        print(f"pyserve bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pyserve bench: interrupted", file=sys.stderr)
        return 130
