"""The ``pyserve`` command: ``run`` (Triton's flag names), ``validate``, ``backends`` and ``new-backend``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

from pyserve import __version__, logs
from pyserve.cli import triton_flags
from pyserve.frontends.balancer import FRONTEND_BALANCE
from pyserve.handoff.layout import AUTO, Layout
from pyserve.handoff.layout import choose as choose_layout
from pyserve.repository.bundled import EXAMPLE_REPOSITORY, missing_backends
from pyserve.repository.scan import check_config_name
from pyserve.runtime.scheduling.busy_poll import MAX_WINDOW_US
from pyserve.server.argtypes import boolean as _bool


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be between 0 and 65535, got {port}")
    return port


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return number


def _non_negative_float(value: str) -> float:
    number = float(value)
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return number


def _poll_secs(value: str) -> float:
    secs = float(value)
    if not secs > 0:
        raise argparse.ArgumentTypeError(f"--repository-poll-secs must be greater than 0, got {value}")
    return secs


def _config_name(value: str) -> str:
    try:
        return check_config_name(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _auto_count(value: str) -> str | int:
    if value == AUTO:
        return AUTO
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a whole number, got '{value}'") from None


def _auto_bool(value: str) -> str | bool:
    return AUTO if value == AUTO else _bool(value)


def _busy_poll_us(value: str) -> str | int:
    if value == AUTO:
        return AUTO
    try:
        microseconds = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--busy-poll-us must be a whole number of microseconds, got '{value}'") from None
    if not 0 <= microseconds <= MAX_WINDOW_US:
        raise argparse.ArgumentTypeError(f"--busy-poll-us must be between 0 and {MAX_WINDOW_US}, got {value}")
    return microseconds


def _load_model_problem(mode: str, names: Sequence[str]) -> str | None:
    """Why the ``--load-model`` values cannot be used with ``--model-control-mode``, or None."""
    if names and mode != "explicit":
        return "--load-model can only be used with --model-control-mode=explicit"
    if "*" in names and len(names) > 1:
        return "--load-model=* must be the only --load-model argument"
    return None


def _backend_setting(item: str) -> tuple[str, str, str]:
    """One ``--backend-config`` value, Triton's ``<backend>,<key>=<value>`` or global ``<key>=<value>``.

    :returns: ``(backend, key, value)``; ``backend`` is ``""`` for a global setting.
    """
    backend, setting = "", item
    if "," in item.split("=", 1)[0]:
        backend, _, setting = item.partition(",")
        if not backend.strip():
            raise argparse.ArgumentTypeError(f"'{item}' names no backend before ','")
    key, sep, value = setting.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"'{item}' must be <backend>,<key>=<value> or <key>=<value>")
    return backend.strip(), key.strip(), value


def _metrics_setting(item: str) -> tuple[str, str]:
    """One ``--metrics-config`` value, ``<key>=<value>``."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"'{item}' must be <key>=<value>")
    return key.strip(), value.strip()


def _backend_config(items: Sequence[tuple[str, str, str]]) -> dict[str, dict[str, str]]:
    """The parsed ``--backend-config`` values, as settings per backend (``""`` = every backend)."""
    settings: dict[str, dict[str, str]] = {}
    for backend, key, value in items:
        settings.setdefault(backend, {})[key] = value
    return settings


def _add_run(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="serve a Triton model repository over KServe v2 (HTTP and gRPC)")
    run.add_argument("--model-repository", "--model-store", action="append", default=[], metavar="PATH",
                     help="a model repository (repeatable); default: the bundled example repository")
    run.add_argument("--host", "--http-address", dest="host", default="0.0.0.0",
                     help="address to listen on (default 0.0.0.0, as Triton)")
    run.add_argument("--http-port", type=_port, default=8000, help="HTTP port (default 8000; 0 = any free port)")
    run.add_argument("--grpc-port", type=_port, default=8001, help="gRPC port (default 8001)")
    run.add_argument("--metrics-port", type=_port, default=8002, help="metrics port (default 8002)")
    run.add_argument("--allow-http", type=_bool, default=True, metavar="BOOL")
    run.add_argument("--allow-grpc", type=_bool, default=True, metavar="BOOL")
    run.add_argument("--allow-openai", type=_bool, default=True, metavar="BOOL",
                     help="serve the OpenAI-compatible /v1 routes on the HTTP port (default true)")
    run.add_argument("--allow-metrics", type=_bool, default=True, metavar="BOOL",
                     help="serve Prometheus metrics on --metrics-port at /metrics (default true)")
    metrics_flags = run.add_argument_group("metrics")
    metrics_flags.add_argument("--metrics-address", default="", metavar="HOST",
                               help="address the metrics service listens on (default: --http-address)")
    metrics_flags.add_argument("--metrics-interval-ms", type=int, default=2000, metavar="MS",
                               help="how often CPU and GPU metrics are refreshed (default 2000)")
    metrics_flags.add_argument("--metrics-config", action="append", default=[], type=_metrics_setting,
                               metavar="KEY=VALUE",
                               help="counter_latencies=BOOL (default true), histogram_latencies=BOOL "
                                    "(default false); repeatable")
    metrics_flags.add_argument("--allow-cpu-metrics", type=_bool, default=True, metavar="BOOL")
    metrics_flags.add_argument("--allow-gpu-metrics", type=_bool, default=True, metavar="BOOL",
                               help="GPU metrics through NVML (needs pynvml and a GPU; default true)")
    grpc_flags = run.add_argument_group("gRPC")
    grpc_flags.add_argument("--grpc-address", default="", metavar="HOST",
                            help="address the gRPC service listens on (default: --host)")
    grpc_flags.add_argument("--grpc-infer-response-compression-level", default="none",
                            choices=["none", "low", "medium", "high"],
                            help="compress infer responses (gzip) unless 'none'")
    grpc_flags.add_argument("--grpc-max-message-size", type=int, default=2**31 - 1, metavar="BYTES",
                            help="largest gRPC message sent or received (default 2 GiB - 1)")
    grpc_flags.add_argument("--grpc-keepalive-time", type=int, default=7_200_000, metavar="MS")
    grpc_flags.add_argument("--grpc-keepalive-timeout", type=int, default=20_000, metavar="MS")
    grpc_flags.add_argument("--grpc-keepalive-permit-without-calls", type=_bool, default=False, metavar="BOOL")
    grpc_flags.add_argument("--grpc-http2-max-pings-without-data", type=int, default=2, metavar="N")
    grpc_flags.add_argument("--grpc-http2-min-recv-ping-interval-without-data", type=int, default=300_000,
                            metavar="MS")
    grpc_flags.add_argument("--grpc-http2-max-ping-strikes", type=int, default=2, metavar="N")
    grpc_flags.add_argument("--grpc-use-ssl", type=_bool, default=False, metavar="BOOL",
                            help="TLS on the gRPC port (needs --grpc-server-cert and --grpc-server-key)")
    grpc_flags.add_argument("--grpc-use-ssl-mutual", type=_bool, default=False, metavar="BOOL",
                            help="TLS, and clients must present a certificate signed by --grpc-root-cert")
    grpc_flags.add_argument("--grpc-server-cert", default="", metavar="PEM")
    grpc_flags.add_argument("--grpc-server-key", default="", metavar="PEM")
    grpc_flags.add_argument("--grpc-root-cert", default="", metavar="PEM")
    grpc_flags.add_argument("--grpc-header-forward-pattern", default="", metavar="REGEX",
                            help="forward gRPC metadata whose key matches REGEX as request parameters "
                                 "(case-insensitive unless REGEX starts with (?-i))")
    grpc_flags.add_argument("--reuse-grpc-port", type=_bool, default=False, metavar="BOOL",
                            help="let other servers listen on the same gRPC port (SO_REUSEPORT)")
    grpc_flags.add_argument("--grpc-max-connections", type=_non_negative_int, default=0, metavar="N",
                            help="open connections past which new ones get GOAWAY (default 0: half the "
                                 "descriptor limit less a reserve, at most 16384)")
    grpc_flags.add_argument("--grpc-idle-timeout-secs", type=_non_negative_float, default=300.0, metavar="SECS",
                            help="close a connection without calls after this long (default 300; 0 = never)")
    grpc_flags.add_argument("--grpc-message-timeout-secs", type=_non_negative_float, default=300.0, metavar="SECS",
                            help="a request message must arrive whole within this of its first byte "
                                 "(default 300; 0 = no limit)")
    grpc_flags.add_argument("--grpc-max-connection-buffer", type=_non_negative_int, default=0, metavar="BYTES",
                            help="bytes of incomplete request messages one connection may hold "
                                 "(default 0: --grpc-max-message-size)")
    grpc_flags.add_argument("--grpc-max-server-buffer", type=_non_negative_int, default=0, metavar="BYTES",
                            help="bytes of incomplete request messages all connections may hold "
                                 "(default 0: a quarter of the machine's memory)")
    run.add_argument("--id", dest="server_id", default="pyserve", help="server name in server metadata")
    run.add_argument("--log-verbose", type=int, default=0, metavar="N", help="verbose logging level (0 = off)")
    run.add_argument("--strict-model-config", type=_bool, nargs="?", const=True, default=False, metavar="BOOL",
                     help="require config.pbtxt and turn off auto-complete (deprecated in Triton)")
    run.add_argument("--disable-auto-complete-config", action="store_true",
                     help="backends do not complete model configs")
    run.add_argument("--exit-timeout-secs", type=float, default=30.0, metavar="SECS",
                     help="on SIGINT/SIGTERM, wait this long for in-flight requests (default 30)")
    run.add_argument("--exit-on-error", type=_bool, nargs="?", const=True, default=True, metavar="BOOL",
                     help="exit if any model fails to load at startup (default true, as Triton; "
                          "false: serve the others)")
    run.add_argument("--backend-config", action="append", default=[], type=_backend_setting,
                     metavar="BACKEND,KEY=VALUE",
                     help="a setting passed to a backend (repeatable)")
    run.add_argument("--model-load-thread-count", type=int, default=4, metavar="N")
    run.add_argument("--model-load-retry-count", type=int, default=0, metavar="N",
                     help="try a model version that fails to load N more times (default 0)")
    run.add_argument("--model-control-mode", default="none", choices=["none", "poll", "explicit"],
                     help="none: load all, no changes; poll: load all, reload on repository changes; "
                          "explicit: load --load-model names, then only through the load/unload API")
    run.add_argument("--load-model", action="append", default=[], metavar="NAME",
                     help="a model to load at startup in explicit mode (repeatable; '*' alone = all)")
    run.add_argument("--repository-poll-secs", type=_poll_secs, default=15.0, metavar="SECS",
                     help="seconds between repository scans in poll mode (default 15)")
    run.add_argument("--model-config-name", default="", type=_config_name, metavar="NAME",
                     help="read a model's configs/NAME.pbtxt instead of its config.pbtxt where it has one")
    run.add_argument("--backend-directory", default="/opt/tritonserver/backends", metavar="PATH",
                     help="where native backends live: <dir>/<backend>/libtriton_<backend>.so "
                          "(default /opt/tritonserver/backends)")
    run.add_argument("--http-max-input-size", type=int, default=64 * 1024 * 1024, metavar="BYTES",
                     help="largest request body accepted (default 64 MiB)")
    run.add_argument("--http-max-connections", type=_non_negative_int, default=0, metavar="N",
                     help="open connections past which new ones are answered 503 (default 0: half the "
                          "descriptor limit less a reserve, at most 16384)")
    run.add_argument("--http-header-timeout-secs", type=_non_negative_float, default=30.0, metavar="SECS",
                     help="a request's line and headers must arrive within this (default 30; 0 = no limit)")
    run.add_argument("--http-body-timeout-secs", type=_non_negative_float, default=300.0, metavar="SECS",
                     help="a request's body must arrive within this of its headers (default 300; 0 = no limit)")
    run.add_argument("--strict-readiness", type=_bool, default=True, metavar="BOOL",
                     help="ready only while every model is ready (default true, as Triton); false: while serving")
    run.add_argument("--http-header-forward-pattern", default="", metavar="REGEX",
                     help="forward HTTP headers whose name matches REGEX as request parameters "
                          "(case-insensitive unless REGEX starts with (?-i))")
    run.add_argument("--reuse-http-port", type=_bool, default=False, metavar="BOOL",
                     help="let other servers listen on the same HTTP port (SO_REUSEPORT)")
    run.add_argument("--rate-limit", choices=["off", "execution_count"], default="off",
                     help="execution_count: instances execute only while the resources of their "
                          "instance_group rate_limiter are free (default off, as Triton)")
    run.add_argument("--rate-limit-resource", action="append", default=[], metavar="NAME:COUNT[:DEVICE]",
                     help="units of a rate-limiter resource, on one device or (without DEVICE) on every device "
                          "(repeatable; default: the most any instance asks for)")
    _add_operations(run)
    _add_tuning(run)
    triton_flags.add_flags(run)


def _add_tuning(run: argparse.ArgumentParser) -> None:
    """The process layout and server implementations: chosen by themselves (``auto``)."""
    tuning = run.add_argument_group(
        "advanced tuning", "the defaults fit the machine (pyserve.handoff.layout): set these only to override them")
    tuning.add_argument("--frontend-processes", type=_auto_count, default=AUTO, metavar="auto|N",
                        help="processes that serve the HTTP and gRPC ports beside this one, which holds the "
                             "models (default auto: one per usable CPU beyond this one; 0 = this process alone)")
    tuning.add_argument("--replicate-models", default=AUTO, metavar="auto|none|NAMES",
                        help="models that frontend processes answer themselves from a replica: auto (default: "
                             "every model that can be: no sequence batcher, decoupled, ensemble, GPU instances, "
                             "response cache or BLS / custom metrics in model.py), none (every request is "
                             "handed to this process), or comma-separated model names")
    tuning.add_argument("--frontend-balance", choices=FRONTEND_BALANCE, default="connections",
                        help="how new connections are spread over this process and its frontends: connections "
                             "(default: this process accepts each and passes it to the process with the fewest "
                             "open connections) or kernel (every process listens with SO_REUSEPORT and the "
                             "kernel picks by a hash of the addresses)")
    tuning.add_argument("--busy-poll-us", type=_busy_poll_us, default=AUTO, metavar="auto|US",
                        help="after a model executed on the event loop answers a lone client that sends its "
                             "requests back to back, keep polling the sockets for US microseconds instead of "
                             "sleeping (0-1000000; default auto: 300 on two or more CPUs, else 0)")
    tuning.add_argument("--pin-processes", type=_auto_bool, default=AUTO, metavar="auto|BOOL",
                        help="run this process and each frontend process on a CPU of its own (Linux; default "
                             "auto: only where the cgroup cpuset is exclusive to the server)")
    tuning.add_argument("--http-server", choices=["pyserve", "uvicorn"], default="pyserve",
                        help="the HTTP/1.1 server on --http-port: pyserve's own (default) or uvicorn")
    tuning.add_argument("--grpc-server", choices=["pyserve", "grpcio"], default="pyserve",
                        help="gRPC server: pyserve's own HTTP/2 server (default) or grpc.aio")


def _add_operations(run: argparse.ArgumentParser) -> None:
    """Logging, tracing, response cache, endpoint restriction and limits flags."""
    ops = run.add_argument_group("logging, tracing, cache and security")
    ops.add_argument("--log-info", type=_bool, default=True, metavar="BOOL", help="log info lines (default true)")
    ops.add_argument("--log-warning", type=_bool, default=True, metavar="BOOL", help="log warnings (default true)")
    ops.add_argument("--log-error", type=_bool, default=True, metavar="BOOL", help="log errors (default true)")
    ops.add_argument("--log-format", default="default", choices=["default", "ISO8601", "json"],
                     help="log line format (default: Triton's default)")
    ops.add_argument("--log-file", default=None, metavar="PATH", help="write the log here instead of stderr")
    ops.add_argument("--trace-config", action="append", default=[], metavar="[MODE,]KEY=VALUE",
                     help="trace setting (repeatable), e.g. level=TIMESTAMPS, rate=100, triton,file=PATH, "
                          "mode=opentelemetry, opentelemetry,url=http://host:4318/v1/traces")
    ops.add_argument("--cache-config", action="append", default=[], type=_backend_setting,
                     metavar="CACHE,KEY=VALUE",
                     help="response cache (repeatable): local,size=BYTES or redis,host=H / redis,port=P")
    ops.add_argument("--http-restricted-api", action="append", default=[], metavar="APIS:KEY=VALUE",
                     help="require header KEY: VALUE for the listed HTTP API categories (repeatable)")
    ops.add_argument("--grpc-restricted-protocol", action="append", default=[], metavar="APIS:KEY=VALUE",
                     help="require metadata triton-grpc-protocol-KEY: VALUE for the listed gRPC categories")
    ops.add_argument("--status-page", type=_bool, default=True, metavar="BOOL",
                     help="serve the status page on the HTTP port at /status (and / for browsers; default true)")
    ops.add_argument("--max-tensor-elements", type=int, default=0, metavar="N",
                     help="refuse input tensors declaring more than N elements (default 0: no limit)")


def _operations_options(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Parse the operations flags and configure logging.

    :returns: ``ServerOptions`` and ``GrpcOptions`` keyword arguments.
    :raises ValueError: a malformed flag value (the message names it).
    """
    from pyserve.dataplane.cache import parse_cache_config
    from pyserve.frontends.restricted import parse_restrictions
    from pyserve.tracing import parse_trace_config

    if args.log_verbose < 0:
        raise ValueError("--log-verbose must be >= 0")
    if args.max_tensor_elements < 0:
        raise ValueError("--max-tensor-elements must be >= 0")
    if not 0 <= args.exit_timeout_secs < 1e9:  # also refuses nan and inf
        raise ValueError(f"--exit-timeout-secs must be a number of seconds >= 0, not {args.exit_timeout_secs}")
    try:
        logs.configure(args.log_verbose, info=args.log_info, warning=args.log_warning, error=args.log_error,
                       log_format=args.log_format, log_file=args.log_file)
    except OSError as exc:
        raise ValueError(f"--log-file '{args.log_file}': {exc.strerror or exc}") from None
    server = {
        "trace_config": parse_trace_config(args.trace_config),
        "cache_config": parse_cache_config(args.cache_config),
        "http_restricted_api": parse_restrictions(args.http_restricted_api),
        "max_tensor_elements": args.max_tensor_elements,
        "status_page": args.status_page,
    }
    grpc = {"restrictions": parse_restrictions(args.grpc_restricted_protocol, grpc=True)}
    return server, grpc


def _repositories(paths: Sequence[str], exit_on_error: bool) -> list[Path]:
    """The repositories to serve: ``paths``, or without any the bundled example repository (whose
    backends, missing, would each fail a model; with ``exit_on_error`` that is said at once)."""
    if paths:
        return [Path(p) for p in paths]
    if not EXAMPLE_REPOSITORY.is_dir():
        raise SystemExit(
            "pyserve: no --model-repository given, and the bundled example repository is not "
            "available in this installation"
        )
    missing = missing_backends() if exit_on_error else []
    if missing:
        raise SystemExit(
            "pyserve: no --model-repository given, and the bundled example repository needs backends "
            f"that are not installed ({', '.join(missing)}): pip install 'pyserve-server[examples]' "
            "(from the wheels of `make dist`: pip install --find-links dist 'pyserve-server[examples]'), "
            "or serve a repository of your own with --model-repository"
        )
    return [EXAMPLE_REPOSITORY]


def _layout(args: argparse.Namespace) -> Layout:
    """The process layout for ``run``: each ``auto`` flag resolved (``pyserve.handoff.layout``)."""
    single = None
    if not (args.allow_http or args.allow_grpc):
        single = "neither HTTP nor gRPC is served"
    elif args.allow_http and args.http_server != "pyserve":
        single = f"--http-server {args.http_server} serves HTTP from this process only"
    return choose_layout(args.frontend_processes, args.replicate_models, args.busy_poll_us, args.pin_processes,
                         single_reason=single)


def cmd_run(args: argparse.Namespace) -> int:
    from pyserve.frontends.grpc.server import GrpcOptions
    from pyserve.server.core import (
        Server,
        ServerOptions,
        StartupError,
        prebind_listeners,
    )

    try:
        operations, grpc_operations = _operations_options(args)
    except ValueError as exc:
        print(f"pyserve: {exc}", file=sys.stderr)
        return 2
    layout = _layout(args)
    logging.getLogger("pyserve").info("%s", layout.describe())
    repositories = _repositories(args.model_repository, args.exit_on_error)
    for repo in repositories:
        if not repo.is_dir():
            print(f"pyserve: --model-repository '{repo}' does not exist or is not a directory", file=sys.stderr)
            return 2
    fixed_ports = [p for p in (args.http_port, args.grpc_port, args.metrics_port) if p]  # 0 = any free port
    if len(set(fixed_ports)) < len(fixed_ports):
        print("pyserve: --http-port, --grpc-port and --metrics-port must differ", file=sys.stderr)
        return 2
    notices, flag_problem = triton_flags.check(args)
    if flag_problem:
        print(f"pyserve: {flag_problem}", file=sys.stderr)
        return 2
    for notice in notices:
        logging.getLogger("pyserve").info("%s", notice)
    load_problem = _load_model_problem(args.model_control_mode, args.load_model)
    if load_problem:
        print(f"pyserve: {load_problem}", file=sys.stderr)
        return 2
    options = ServerOptions(
        model_repositories=repositories,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        allow_http=args.allow_http,
        allow_grpc=args.allow_grpc,
        allow_openai=args.allow_openai,
        allow_metrics=args.allow_metrics,
        allow_cpu_metrics=args.allow_cpu_metrics,
        allow_gpu_metrics=args.allow_gpu_metrics,
        metrics_address=args.metrics_address,
        metrics_interval_ms=args.metrics_interval_ms,
        metrics_config=dict(args.metrics_config),
        grpc=GrpcOptions(
            host=args.grpc_address,
            max_message_bytes=args.grpc_max_message_size,
            infer_compression=args.grpc_infer_response_compression_level,
            keepalive_time_ms=args.grpc_keepalive_time,
            keepalive_timeout_ms=args.grpc_keepalive_timeout,
            keepalive_permit_without_calls=args.grpc_keepalive_permit_without_calls,
            http2_max_pings_without_data=args.grpc_http2_max_pings_without_data,
            http2_min_recv_ping_interval_without_data_ms=args.grpc_http2_min_recv_ping_interval_without_data,
            http2_max_ping_strikes=args.grpc_http2_max_ping_strikes,
            implementation=args.grpc_server,
            reuse_port=args.reuse_grpc_port,
            use_ssl=args.grpc_use_ssl,
            use_ssl_mutual=args.grpc_use_ssl_mutual,
            server_cert=args.grpc_server_cert,
            server_key=args.grpc_server_key,
            root_cert=args.grpc_root_cert,
            header_forward_pattern=args.grpc_header_forward_pattern,
            max_connections=args.grpc_max_connections,
            idle_timeout_secs=args.grpc_idle_timeout_secs,
            message_timeout_secs=args.grpc_message_timeout_secs,
            max_connection_buffer=args.grpc_max_connection_buffer,
            max_server_buffer=args.grpc_max_server_buffer,
            **grpc_operations,
        ),
        server_id=args.server_id,
        exit_timeout_secs=args.exit_timeout_secs,
        auto_complete=not (args.strict_model_config or args.disable_auto_complete_config),
        exit_on_error=args.exit_on_error,
        backend_config=_backend_config(args.backend_config),
        http_max_input_size=args.http_max_input_size,
        http_max_connections=args.http_max_connections,
        http_header_timeout_secs=args.http_header_timeout_secs,
        http_body_timeout_secs=args.http_body_timeout_secs,
        http_server=args.http_server,
        reuse_http_port=args.reuse_http_port,
        http_header_forward_pattern=args.http_header_forward_pattern,
        strict_readiness=args.strict_readiness,
        frontend_processes=layout.frontend_processes,
        frontend_balance=args.frontend_balance,
        replicate_models=layout.replicate_models,
        busy_poll_us=layout.busy_poll_us,
        pin_processes=layout.pin_processes,
        rate_limit=args.rate_limit,
        rate_limit_resources=args.rate_limit_resource,
        model_load_thread_count=args.model_load_thread_count,
        model_load_retry_count=args.model_load_retry_count,
        model_control_mode=args.model_control_mode,
        load_models=args.load_model,
        repository_poll_secs=args.repository_poll_secs,
        backend_directory=args.backend_directory,
        model_config_name=args.model_config_name,
        **operations,
    )
    runner: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        runner = asyncio.run

    def serve() -> int:
        try:
            server = Server(options)
            server.prefork()  # frontends forked from the loaded models, before any thread starts
            runner(server.run(exit_when_stuck=True))
        except (StartupError, OSError) as exc:
            print(f"pyserve: error: {exc}", file=sys.stderr)
            return 1
        return 0

    from pyserve.handoff import keeper

    if not keeper.supported():
        return serve()
    try:  # the keeper holds the ports, so that they outlive a server process a model crashed
        prebind_listeners(options)
    except StartupError as exc:
        print(f"pyserve: error: {exc}", file=sys.stderr)
        return 1
    return keeper.Keeper(serve, stop_timeout=options.exit_timeout_secs + 15).run()


def cmd_validate(args: argparse.Namespace) -> int:
    from pyserve.repository.validate import validate_repositories

    problems = validate_repositories(
        [Path(p) for p in args.repository],
        config_name=args.model_config_name,
        auto_complete=not (args.strict_model_config or args.disable_auto_complete_config),
        backend_config=_backend_config(args.backend_config),
    )
    for line in problems:
        print(line)
    if problems:
        print(f"{len(problems)} problem(s) found", file=sys.stderr)
        return 1
    print("OK: no problems found")
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    from pyserve.host.plugins import PluginHost

    if args.check:
        return _check_backends()
    host = PluginHost()
    infos = host.installed()
    plugins = host.installed_server_plugins()
    if args.json:
        print(json.dumps([
            *({"kind": "backend", "name": i.name, "distribution": i.distribution, "version": i.version,
               "platforms": list(i.platforms), "entry_point": i.source} for i in infos),
            *({"kind": "server_plugin", "name": p.name, "distribution": p.distribution, "version": p.version,
               "platforms": [], "entry_point": p.source, "resolves_backends": p.resolves_backends,
               "summary": p.summary} for p in plugins),
        ], indent=2))
        return 0
    if not infos and not plugins:
        print("no backends installed (pip install pyserve-backend-<name>)")
        return 0
    rows = [[i.name, i.distribution, i.version, ", ".join(i.platforms) or "-"] for i in infos]
    rows += [[f"{p.name} *", p.distribution, p.version, "-"] for p in plugins if p.resolves_backends]
    print(logs.table(["Backend", "Distribution", "Version", "Platforms"], rows))
    for plugin in plugins:  # a resolver is asked first for every model's backend
        summary = plugin.summary.rstrip(".") or "no summary"
        if plugin.resolves_backends:
            print(f"* {plugin.name}: {summary} (a server plugin, asked first for the backend of every model)")
        else:
            print(f"server plugin {plugin.name} ({plugin.distribution} {plugin.version}): {summary}")
    return 0


def _check_backends() -> int:
    """``pyserve backends --check``: exit 1 if any installed backend breaks the contract."""
    from pyserve.host.check import check_installed

    infos, problems = check_installed()
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    failed = {p.backend for p in problems}
    for info in infos:
        if info.name not in failed:
            print(f"ok: backend '{info.name}' ({info.distribution} {info.version})".rstrip())
    if problems:
        print(f"{len(problems)} problem(s) in {len(failed)} backend(s)", file=sys.stderr)
        return 1
    if not infos:
        print("no backends installed (pip install pyserve-backend-<name>)")
    return 0


def cmd_new_backend(args: argparse.Namespace) -> int:
    from pyserve.cli.scaffold import ScaffoldError, create_backend_project

    try:
        project = create_backend_project(args.name, Path(args.directory), args.style)
    except (ScaffoldError, OSError) as exc:
        print(f"pyserve new-backend: error: {exc}", file=sys.stderr)
        return 2
    print(f"created {project.path} ({project.distribution}, backend '{project.name}', {project.style} style)")
    print(f"next: pip install -e {project.path} && pytest {project.path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyserve", description="A Python inference server that speaks Triton's protocol.")
    parser.add_argument("--version", action="version", version=f"pyserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    validate = sub.add_parser("validate", help="check model repositories without serving them")
    validate.add_argument("repository", nargs="+", help="model repository directories")
    validate.add_argument("--model-config-name", default="", type=_config_name, metavar="NAME",
                          help="check configs/NAME.pbtxt instead of config.pbtxt where a model has one")
    validate.add_argument("--strict-model-config", type=_bool, nargs="?", const=True, default=False, metavar="BOOL",
                          help="as for run: every config must declare its inputs and outputs")
    validate.add_argument("--disable-auto-complete-config", action="store_true",
                          help="as for run: backends will not complete model configs")
    validate.add_argument("--backend-config", action="append", default=[], type=_backend_setting,
                          metavar="BACKEND,KEY=VALUE",
                          help="as for run: settings the backends' own checks use (repeatable)")
    backends = sub.add_parser("backends", help="list installed backends")
    backends.add_argument("--json", action="store_true", help="print JSON instead of a table")
    backends.add_argument("--check", action="store_true",
                          help="import every backend and check its hooks against the contract (exit 1 on problems)")
    new_backend = sub.add_parser("new-backend", help="write a ready-to-install backend plugin project")
    new_backend.add_argument("name", help="the backend name (lowercase letters, digits, underscores)")
    style = new_backend.add_mutually_exclusive_group()
    style.add_argument("--class", dest="style", action="store_const", const="class", default="class",
                       help="a pyserve.Backend subclass (default)")
    style.add_argument("--hooks", dest="style", action="store_const", const="hooks",
                       help="@pyserve.hookimpl functions in a module")
    new_backend.add_argument("--directory", default=".", metavar="DIR",
                             help="where pyserve-backend-NAME/ is created (default: the current directory)")
    from pyserve.tools.bench import add_bench_parser  # standard library only: keeps --help fast

    add_bench_parser(sub)
    ray = sub.add_parser("ray-deploy", help="deploy a model repository as a Ray Serve application (pyserve-server[ray])")
    ray.add_argument("--model-repository", action="append", required=True, metavar="PATH",
                     help="model repository (repeatable); every Ray node must reach it at the same path")
    ray.add_argument("--address", default="auto", help="the Ray cluster to join (default auto: the running one)")
    ray.add_argument("--name", default="pyserve", help="the Serve application name (default pyserve)")
    ray.add_argument("--per-repository", action="store_true",
                     help="one deployment holding every model instead of one deployment per model")
    ray.add_argument("--num-replicas", type=int, default=None, metavar="N",
                     help="replicas for models whose config sets no ray_num_replicas (default 1)")
    ray.add_argument("--http-host", default="0.0.0.0", help="Serve's HTTP proxy address (default 0.0.0.0)")
    ray.add_argument("--http-port", type=int, default=8000, help="Serve's HTTP proxy port (default 8000)")
    ray.add_argument("--grpc-port", type=int, default=9000, help="Serve's gRPC proxy port (default 9000)")
    ray.add_argument("--backend-config", action="append", default=[], type=_backend_setting, metavar="<backend>,<key>=<value>",
                     help="backend settings passed to every replica, as pyserve run's")
    ray.add_argument("--num-cpus", type=float, default=None, metavar="N",
                     help="CPUs each model replica reserves where its config sets no ray_num_cpus (fractions allowed, "
                          "e.g. 0.5; default: its CPU instance count; 1 with --per-repository; ensembles run in the "
                          "ingress and reserve none)")
    ray.add_argument("--skip-resource-check", action="store_true",
                     help="deploy even when the cluster lacks the CPUs/GPUs the deployments reserve (a cluster that "
                          "adds nodes on demand)")
    ray.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the application (300)")
    return parser


def cmd_ray_deploy(args: argparse.Namespace) -> int:
    """Deploy to Ray Serve; returns once the application is RUNNING (it keeps running)."""
    try:
        import ray
        from ray import serve
    except ImportError:
        print("pyserve: error: Ray Serve is not installed: pip install 'pyserve-server[ray]'", file=sys.stderr)
        return 1
    from pyserve.tools.ray_serve import (
        GRPC_SERVICER_FUNCTION,
        RayConfigError,
        build_app,
        plan_app,
    )
    from pyserve.tools.ray_serve.resources import shortfall

    if args.num_replicas is not None and args.num_replicas < 1:
        print("pyserve: error: --num-replicas must be at least 1", file=sys.stderr)
        return 2
    try:
        backend_config = {k: dict(v) for k, v in _backend_config(args.backend_config).items()}
        plan = plan_app(args.model_repository, per_repository=args.per_repository, num_replicas=args.num_replicas,
                        backend_config=backend_config, num_cpus=args.num_cpus)
    except (RayConfigError, ValueError) as exc:
        print(f"pyserve: error: {exc}", file=sys.stderr)
        return 2
    with _neutral_directory():  # Ray puts the driver's folder first on its workers' path
        ray.init(address=args.address, log_to_driver=False)
    if not args.skip_resource_check:
        nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
        problems = shortfall(plan, ray.cluster_resources(), nodes, args.per_repository)
        if problems:
            print("pyserve: error: " + "\n  ".join(problems), file=sys.stderr)
            return 1
    serve.start(
        http_options={"host": args.http_host, "port": args.http_port},
        grpc_options={"port": args.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER_FUNCTION]},
    )
    serve.run(build_app([], plan=plan), name=args.name, route_prefix="/", blocking=False)
    return _wait_for_application(serve, args)


@contextlib.contextmanager
def _neutral_directory() -> Iterator[None]:
    """Run the block in an empty folder of its own: ``ray.init`` gives Ray's workers the
    driver's current folder at the front of their ``sys.path``, where a folder named like an
    installed package (a checkout's ``pyserve/``) would be imported instead of it."""
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="pyserve-ray-") as empty:
        os.chdir(empty)
        try:
            yield
        finally:
            os.chdir(here)


def _wait_for_application(serve: Any, args: argparse.Namespace) -> int:
    """Wait until the application is RUNNING (0) or failed or timed out (1), printing what Serve
    says about a deployment as it changes (a replica waiting for resources, one failing)."""
    import time

    said: dict[str, str] = {}
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        status = serve.status().applications.get(args.name)
        if status is not None and status.status == "RUNNING":
            print(f"pyserve: application '{args.name}' RUNNING: HTTP :{args.http_port}, gRPC :{args.grpc_port}")
            return 0
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            print(f"pyserve: error: application '{args.name}' {status.status}: {status.message}", file=sys.stderr)
            return 1
        for name, deployment in (status.deployments.items() if status is not None else ()):
            message = (deployment.message or "").strip()
            if message and said.get(name) != message:
                said[name] = message
                print(f"pyserve: {name}: {message}", file=sys.stderr)
        time.sleep(0.5)
    print(f"pyserve: error: application '{args.name}' not RUNNING after {args.timeout:.0f} s", file=sys.stderr)
    return 1


def cmd_bench(args: argparse.Namespace) -> int:
    from pyserve.tools.bench import cmd_bench as run_bench

    return run_bench(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None and args.command == "run":
        # Model code sees no command-line arguments, as in Triton's Python-backend stub: a
        # model's unittest.main("model", exit=False) must not read the server's flags.
        del sys.argv[1:]
    handlers = {"run": cmd_run, "validate": cmd_validate, "backends": cmd_backends, "new-backend": cmd_new_backend,
                "bench": cmd_bench, "ray-deploy": cmd_ray_deploy}
    return handlers[args.command](args)
