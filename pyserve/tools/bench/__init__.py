"""``pyserve bench``: a load generator for KServe v2 / Triton servers with perf_analyzer's core flags.

* :mod:`pyserve.tools.bench.options` — the command line (standard library only);
* :mod:`pyserve.tools.bench.control` — model metadata/config, statistics, shared memory registration;
* :mod:`pyserve.tools.bench.inputs` — input tensors and the pre-encoded requests;
* :mod:`pyserve.tools.bench.worker` — the load generator processes (asyncio, raw HTTP/1.1, unary gRPC over
  :mod:`pyserve.tools.bench.h2client`, `grpc.aio` for `--streaming`);
* :mod:`pyserve.tools.bench.runner` — levels, stability, aggregation;
* :mod:`pyserve.tools.bench.report` — progress display, summary table, CSV / JSON / PNG;
* :mod:`pyserve.tools.bench.llm` — ``--endpoint-type``: time to first token, inter-token latency and
  tokens/s on the OpenAI-compatible routes.
"""

from __future__ import annotations

import argparse
import sys

from pyserve.tools.bench.options import (
    DEFAULT_HTTP_URL,
    BenchError,
    BenchOptions,
    add_bench_parser,
    options_from_args,
    range_values,
)

__all__ = ["BenchError", "BenchOptions", "add_bench_parser", "cmd_bench", "options_from_args"]


def _run_llm(args: argparse.Namespace) -> int:
    """``--endpoint-type``: the OpenAI-routes benchmark (``pyserve.tools.bench.llm``)."""
    from pyserve.tools.bench.llm import DEFAULT_PROMPT, LlmOptions, run

    if args.protocol != "http" or args.request_rate_range is not None or args.streaming:
        raise BenchError("--endpoint-type measures the HTTP /v1 routes at --concurrency-range levels: "
                         "leave out -i grpc, --streaming and --request-rate-range")
    url = BenchOptions(model=args.model, url=args.url or DEFAULT_HTTP_URL)
    host, port = url.host_port
    levels = [1] if args.concurrency_range is None else [int(v) for v in range_values(*args.concurrency_range)]
    return run(LlmOptions(
        model=args.model, host=host, port=port, endpoint_type=args.endpoint_type, concurrency=levels,
        request_count=args.request_count, prompt=args.prompt or DEFAULT_PROMPT, max_tokens=args.max_tokens,
        json=args.json, quiet=args.quiet,
    ))


def cmd_bench(args: argparse.Namespace) -> int:
    """``pyserve bench``: run and report; exit status 0, or 1 on an error or a failed request."""
    from pyserve.tools.bench.runner import run

    try:
        if args.endpoint_type is not None:
            return _run_llm(args)
        options = options_from_args(args)
        return run(options)
    except BenchError as exc:
        print(f"pyserve bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pyserve bench: interrupted", file=sys.stderr)
        return 130
