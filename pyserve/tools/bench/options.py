"""``pyserve bench`` command line: perf_analyzer's core flags, parsed into :class:`BenchOptions`.

This module imports only the standard library, so ``pyserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pyserve.server.argtypes import boolean as _bool

DEFAULT_HTTP_URL = "localhost:8000"
DEFAULT_GRPC_URL = "localhost:8001"


class BenchError(Exception):
    """A problem ``pyserve bench`` reports as ``error: ...`` and exit status 1."""


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _range(kind: type[int] | type[float]) -> Callable[[str], tuple[float, float, float]]:
    """A parser for ``start[:end[:step]]`` with numbers of ``kind``."""

    def parse(text: str) -> tuple[float, float, float]:
        parts = text.split(":")
        if not 1 <= len(parts) <= 3 or not all(p.strip() for p in parts):
            raise argparse.ArgumentTypeError(f"expected start[:end[:step]], got '{text}'")
        try:
            numbers = [kind(p) for p in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__} values in '{text}'") from None
        start = numbers[0]
        end = numbers[1] if len(numbers) > 1 else start
        step = numbers[2] if len(numbers) > 2 else kind(1)
        if start <= 0 or step <= 0 or end < start:
            raise argparse.ArgumentTypeError(
                f"'{text}': start and step must be positive and end must not be below start"
            )
        return start, end, step

    return parse


def _shape(text: str) -> tuple[str, list[int]]:
    """One ``--shape NAME:d1,d2,...`` value."""
    name, sep, dims = text.rpartition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME:d1,d2,..., got '{text}'")
    try:
        shape = [int(d) for d in dims.split(",")] if dims.strip() else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': dimensions must be integers") from None
    if any(d < 0 for d in shape):
        raise argparse.ArgumentTypeError(f"'{text}': dimensions must not be negative")
    return name, shape


def range_values(start: float, end: float, step: float) -> list[float]:
    """``start, start+step, ... <= end`` (with a little tolerance for float steps)."""
    values: list[float] = []
    k = 0
    while True:
        value = start + k * step
        if value > end + step * 1e-9:
            return values
        values.append(value)
        k += 1


@dataclass
class BenchOptions:
    """Everything one ``pyserve bench`` run needs."""

    model: str
    model_version: str = ""
    url: str = ""
    protocol: str = "http"
    concurrency: list[int] = field(default_factory=lambda: [1])
    request_rates: list[float] = field(default_factory=list)
    request_distribution: str = "constant"
    batch_size: int = 1
    shapes: dict[str, list[int]] = field(default_factory=dict)
    input_data: str = "random"
    string_length: int = 128
    measurement_interval_ms: int = 5000
    percentile: int | None = None
    stability_percentage: float = 10.0
    max_trials: int = 10
    http_binary: bool = True
    shared_memory: str = "none"
    streaming: bool = False
    workers: int = 1
    max_connections: int = 256
    csv: Path | None = None
    json: Path | None = None
    plot: Path | None = None
    quiet: bool = False

    @property
    def open_loop(self) -> bool:
        """Whether the load is a request rate (open loop) rather than a concurrency."""
        return bool(self.request_rates)

    @property
    def levels(self) -> list[float]:
        """The load levels to measure, in order (concurrencies or request rates)."""
        return list(self.request_rates) if self.open_loop else [float(c) for c in self.concurrency]

    @property
    def host_port(self) -> tuple[str, int]:
        """The server's host and port from ``url`` (``http://`` / ``grpc://`` prefixes allowed)."""
        url = self.url
        for scheme in ("http://", "grpc://", "https://"):
            if url.startswith(scheme):
                url = url[len(scheme) :]
        url = url.rstrip("/")
        host, sep, port = url.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise BenchError(f"-u/--url must be HOST:PORT, got '{self.url}'")
        return host.strip("[]"), int(port)


def add_bench_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``pyserve``'s subparsers and return it."""
    bench = sub.add_parser(
        "bench",
        help="measure a model's throughput and latency on a running server (perf_analyzer's core flags)",
        description="Load generator for KServe v2 / Triton servers: closed loop (--concurrency-range) or "
        "open loop (--request-rate-range), HTTP or gRPC, with a summary table, CSV/JSON export and a plot.",
    )
    bench.add_argument("-m", "--model-name", dest="model", required=True, help="the model to load")
    bench.add_argument("-x", "--model-version", default="", help="the model version (default: the server's choice)")
    bench.add_argument("-u", "--url", default="", help=f"server address (default {DEFAULT_HTTP_URL}, "
                       f"{DEFAULT_GRPC_URL} with -i grpc)")
    bench.add_argument("-i", "--protocol", default="http", type=str.lower, choices=["http", "grpc"])
    load = bench.add_mutually_exclusive_group()
    load.add_argument("--concurrency-range", type=_range(int), default=None, metavar="START:END:STEP",
                      help="closed loop: requests kept in flight (default 1)")
    load.add_argument("--request-rate-range", type=_range(float), default=None, metavar="START:END:STEP",
                      help="open loop: requests sent per second, whatever the responses do")
    bench.add_argument("--request-distribution", default="constant", choices=["constant", "poisson"],
                       help="send times for --request-rate-range (default constant)")
    bench.add_argument("-b", "--batch-size", type=_positive_int, default=1)
    bench.add_argument("--shape", action="append", type=_shape, default=[], metavar="NAME:D1,D2,...",
                       help="the shape of an input with variable dimensions, without the batch dimension "
                       "(repeatable)")
    bench.add_argument("--input-data", default="random", metavar="random|zero|FILE.json",
                       help="input values: random, zero, or perf_analyzer's JSON input-data file")
    bench.add_argument("--string-length", type=_positive_int, default=128,
                       help="length of random BYTES elements (default 128)")
    bench.add_argument("-p", "--measurement-interval", dest="measurement_interval", type=_positive_int,
                       default=5000, metavar="MS", help="length of one measurement window (default 5000 ms)")
    bench.add_argument("--percentile", type=int, default=None, metavar="N",
                       help="use the Nth latency percentile (1-99) for stability and the summary "
                       "instead of the average")
    bench.add_argument("-s", "--stability-percentage", type=float, default=10.0, metavar="PCT",
                       help="3 windows are stable when throughput and latency stay within PCT%% (default 10)")
    bench.add_argument("-r", "--max-trials", type=_positive_int, default=10,
                       help="windows per level before giving up on stability (default 10)")
    bench.add_argument("--http-binary", type=_bool, default=True, metavar="BOOL",
                       help="HTTP: send tensors with the binary data extension (default true) or as JSON")
    bench.add_argument("--shared-memory", default="none", choices=["none", "system"],
                       help="pass inputs through system shared memory (the server must support it)")
    bench.add_argument("--streaming", action="store_true",
                       help="gRPC: use the ModelStreamInfer stream (required for decoupled models)")
    bench.add_argument("--workers", type=_positive_int, default=os.cpu_count() or 1,
                       help="load generator processes (default: the CPU count)")
    bench.add_argument("--max-connections", type=_positive_int, default=256, metavar="N",
                       help="open loop: connections (gRPC: requests in flight) per worker at most (default 256)")
    bench.add_argument("-f", "--latency-report-file", dest="csv", type=Path, default=None, metavar="FILE.csv",
                       help="write the results as CSV (perf_analyzer's column names)")
    bench.add_argument("--json", type=Path, default=None, metavar="FILE.json", help="write the results as JSON")
    bench.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                       help="draw latency against throughput (needs matplotlib)")
    bench.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    llm = bench.add_argument_group(
        "language models", "--endpoint-type measures a model on the OpenAI-compatible routes instead: time to first "
        "token, inter-token latency and tokens/s of streamed requests, per --concurrency-range level")
    llm.add_argument("--endpoint-type", choices=["completions", "chat"], default=None,
                     help="/v1/completions or /v1/chat/completions")
    llm.add_argument("--request-count", type=_positive_int, default=32, metavar="N",
                     help="streamed requests per concurrency level (default 32)")
    llm.add_argument("--prompt", default=None, help="the prompt (or the user message) of every request")
    llm.add_argument("--max-tokens", type=_positive_int, default=64, metavar="N",
                     help="max_tokens of every request (default 64)")
    return bench


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """Build :class:`BenchOptions` from the parsed ``bench`` arguments.

    :raises BenchError: an inconsistent combination of flags.
    """
    if args.percentile is not None and not 1 <= args.percentile <= 99:
        raise BenchError(f"--percentile must be between 1 and 99, got {args.percentile}")
    if args.streaming and args.protocol != "grpc":
        raise BenchError("--streaming needs -i grpc")
    shapes: dict[str, list[int]] = {}
    for name, shape in args.shape:
        shapes[name] = shape
    concurrency = [1]
    rates: list[float] = []
    if args.request_rate_range is not None:
        rates = range_values(*args.request_rate_range)
    elif args.concurrency_range is not None:
        concurrency = [int(v) for v in range_values(*args.concurrency_range)]
    return BenchOptions(
        model=args.model,
        model_version=args.model_version,
        url=args.url or (DEFAULT_GRPC_URL if args.protocol == "grpc" else DEFAULT_HTTP_URL),
        protocol=args.protocol,
        concurrency=concurrency,
        request_rates=rates,
        request_distribution=args.request_distribution,
        batch_size=args.batch_size,
        shapes=shapes,
        input_data=args.input_data,
        string_length=args.string_length,
        measurement_interval_ms=args.measurement_interval,
        percentile=args.percentile,
        stability_percentage=args.stability_percentage,
        max_trials=args.max_trials,
        http_binary=args.http_binary,
        shared_memory=args.shared_memory,
        streaming=args.streaming,
        workers=args.workers,
        max_connections=args.max_connections,
        csv=args.csv,
        json=args.json,
        plot=args.plot,
        quiet=args.quiet,
    )
