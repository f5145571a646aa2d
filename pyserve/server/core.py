"""The server: owns the plugins, the models, the data plane and the frontends.

``Server.run`` is what ``pyserve run`` calls: it loads the models, serves HTTP, and on
SIGINT/SIGTERM stops accepting, lets in-flight requests finish (up to
``--exit-timeout-secs``), then finalizes instances, models and backends in reverse order.
``ServerThread`` runs the same server on a background thread (tests, notebooks).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

from pyserve import __version__, logs
from pyserve.dataplane.bls import ServerHandle
from pyserve.dataplane.cache import create_cache
from pyserve.dataplane.header_forwarding import compile_forwarding
from pyserve.dataplane.plane import DataPlane
from pyserve.frontends import limits, tcp
from pyserve.frontends.balancer import FRONTEND_BALANCE, OWNER_ACCEPTS, ConnectionBalancer
from pyserve.frontends.grpc.server import create_server as create_grpc_server
from pyserve.frontends.http.app import create_app
from pyserve.frontends.http.native_infer import InferHttpServer
from pyserve.frontends.http.openai import OpenAIMetrics
from pyserve.frontends.http.server import HttpServer
from pyserve.frontends.tcp import bind_tcp
from pyserve.handoff import affinity, rundir
from pyserve.handoff.owner import HandoffServer
from pyserve.handoff.prefork import Preforked
from pyserve.handoff.replicas import ReplicationMode
from pyserve.handoff.supervisor import (
    MAX_FRONTEND_PROCESSES,
    FrontendStartError,
    FrontendSupervisor,
    ModelChangeObserver,
)
from pyserve.host.plugins import PluginHost
from pyserve.metrics import MetricsSettings, ServerMetrics, SystemMonitor
from pyserve.repository import tensor_checks
from pyserve.repository.scan import check_config_name
from pyserve.runtime import execution_board
from pyserve.runtime.manager import ModelManager
from pyserve.runtime.registry import ModelRegistry
from pyserve.runtime.scheduling import busy_poll, client_activity
from pyserve.runtime.scheduling.rate_limiter import RateLimiter, RateLimitError
from pyserve.server import model_table
from pyserve.server.metrics_port import MetricsService, MetricsStartError
from pyserve.server.options import ServerOptions
from pyserve.tracing import TraceManager

log = logging.getLogger("pyserve.server")


def _uvicorn_server(config: Any) -> Any:
    """A uvicorn server without its own signal handling (the pyserve server owns shutdown);
    uvicorn is imported only for ``--http-server uvicorn``."""
    import uvicorn

    class NoSignalUvicorn(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            yield

    return NoSignalUvicorn(config)


class StartupError(RuntimeError):
    """The server could not start (e.g. ``--exit-on-error`` with a model that failed)."""


def _bind(host: str, port: int, reuse_port: bool = False, service: str = "HTTP") -> socket.socket:
    """A socket bound to ``host:port`` for the HTTP server (pyserve's or uvicorn) to listen on.

    Bound here rather than by uvicorn, which calls ``sys.exit`` when the port is taken.
    ``reuse_port``: frontend processes bind the same port (``pyserve.frontends.tcp.bind_tcp``). A socket
    bound before the server process started (``pyserve.frontends.tcp.inherit``) is used instead.

    :raises StartupError: the address cannot be resolved or bound (e.g. the port is in use).
    """
    try:
        return bind_tcp(host, port, reuse_port=reuse_port, service=service.lower())
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise StartupError(f"{service} service cannot listen on {host}:{port}: {reason}") from exc


def prebind_listeners(options: ServerOptions) -> None:
    """Bind the HTTP, gRPC and metrics ports ``options`` serve, as the server would, and record
    them (``pyserve.frontends.tcp.inherit``) for the servers this process starts to listen on.

    :raises StartupError: a port cannot be bound (the same message the server gives).
    """
    balanced = options.frontend_processes > 0 and options.frontend_balance in OWNER_ACCEPTS
    shared = options.frontend_processes > 0 and not balanced  # frontends bind the port too
    if options.allow_http:
        tcp.inherit("http", _bind(options.host, options.http_port, reuse_port=shared or options.reuse_http_port))
    if options.allow_grpc and options.grpc.implementation == "pyserve":
        host = options.grpc.host or options.host
        try:
            listener = bind_tcp(host, options.grpc_port, reuse_port=shared or options.grpc.reuse_port,
                                dual_stack=True)
        except OSError as exc:
            raise StartupError(f"gRPC service could not bind {host}:{options.grpc_port}: "
                               f"{exc.strerror or exc}") from exc
        tcp.inherit("grpc", listener)
    if options.allow_metrics:
        host = options.metrics_address or options.host
        try:
            tcp.inherit("metrics", bind_tcp(host, options.metrics_port))
        except OSError as exc:
            raise StartupError(f"Metrics service cannot listen on {host}:{options.metrics_port}: "
                               f"{exc.strerror or exc}") from exc


def _config_name(name: str) -> str:
    """``--model-config-name`` checked (a plain file name), as a startup error."""
    try:
        return check_config_name(name) if name else ""
    except ValueError as exc:
        raise StartupError(str(exc)) from None


def _rate_limiter(options: ServerOptions) -> RateLimiter | None:
    """The server's rate limiter (``--rate-limit execution_count``), or None when off.

    :raises StartupError: an unknown ``--rate-limit`` value or a bad ``--rate-limit-resource``.
    """
    if options.rate_limit not in ("off", "execution_count"):
        raise StartupError(f"--rate-limit must be off or execution_count, got '{options.rate_limit}'")
    try:
        limiter = RateLimiter(options.rate_limit_resources)  # parsed either way: a typo is an error
    except RateLimitError as exc:
        raise StartupError(str(exc)) from None
    if options.rate_limit == "off":
        if options.rate_limit_resources:
            log.info("--rate-limit-resource has no effect with --rate-limit off")
        return None
    return limiter


def _cpu_threads(options: ServerOptions) -> int | None:
    """``BackendContext.cpu_threads``: with frontend processes, the CPUs each process has (so
    that processes times threads fit the machine); None for one process (libraries' defaults)."""
    if options.frontend_processes <= 0:
        return None
    from pyserve.handoff.layout import usable_cpus

    return max(1, usable_cpus().count // (options.frontend_processes + 1))


class Server:
    """One pyserve server.

    :param options: the settings.
    :param plugins: the plugin host; a default one reading entry points is made if omitted.
    """

    def __init__(self, options: ServerOptions, plugins: PluginHost | None = None) -> None:
        self.options = options
        self.plugins = plugins if plugins is not None else PluginHost()
        config_name, rate_limiter = _config_name(options.model_config_name), _rate_limiter(options)
        try:
            metrics_settings = MetricsSettings.from_config(
                options.metrics_config, cpu=options.allow_cpu_metrics, gpu=options.allow_gpu_metrics,
                interval_ms=options.metrics_interval_ms,
            )
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        registry = ModelRegistry()
        self.metrics = ServerMetrics(registry.records, metrics_settings)
        self._owner_only = ("--metrics-config summary_latencies=true (the summaries' samples are kept in one "
                            "process)" if metrics_settings.summary_latencies else "")
        """The server's metrics registry (per server: two servers never share counts)."""
        server_handle = ServerHandle(None, None)  # bound to the data plane below, to the loop in start
        self.models = ModelManager(
            options.model_repositories,
            self.plugins,
            auto_complete=options.auto_complete,
            backend_config=options.backend_config,
            load_threads=options.model_load_thread_count,
            load_retries=options.model_load_retry_count,
            control_mode=options.model_control_mode,
            startup_models=options.load_models,
            poll_secs=options.repository_poll_secs,
            backend_directory=options.backend_directory,
            config_name=config_name,
            rate_limiter=rate_limiter,
            cpu_threads=_cpu_threads(options),
            unload_wait_secs=options.exit_timeout_secs,
            server_handle=server_handle,
            custom_metrics=self.metrics.custom,
            latency_summaries=metrics_settings.summary_latencies,
            registry=registry,
        )
        self.dataplane = DataPlane(self.models, options.server_id, __version__)
        server_handle.bind(self.dataplane, None)
        self.dataplane.tracing = TraceManager(options.trace_config)
        self.dataplane.strict_readiness = options.strict_readiness
        self.dataplane.shared_memory.allow_client = options.allow_client_shm
        if options.cache_config is not None:
            try:
                self.dataplane.cache = create_cache(*options.cache_config)
            except ValueError as exc:
                raise StartupError(f"--cache-config: {exc}") from None
        for flag, pattern, attribute in (
            ("--http-header-forward-pattern", options.http_header_forward_pattern, "http_forwarding"),
            ("--grpc-header-forward-pattern", options.grpc.header_forward_pattern, "grpc_forwarding"),
        ):
            try:
                setattr(self.dataplane, attribute, compile_forwarding(pattern))
            except ValueError as exc:
                raise StartupError(f"{flag}: {exc}") from None
        if self.dataplane.cache is not None:
            self.dataplane.cache.add_listener(self.metrics.on_cache_lookup)
            self.metrics.watch_cache(self.dataplane.cache)
        self._metrics_service: MetricsService | None = None
        self.metrics_port: int | None = None
        self._saved_element_limit: int | None = None
        self._saved_busy_poll: int | None = None
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self._grpc: Any = None  # grpc.aio.Server or pyserve.frontends.grpc.listener.GrpcServer
        self._uvicorn: Any = None  # the uvicorn server (--http-server uvicorn)
        self._http: HttpServer | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._handoff: HandoffServer | None = None
        self._handoff_dir: str | None = None
        self._balancer: ConnectionBalancer | None = None
        self._cpus: list[int] | None = None  # --pin-processes: the CPUs to spread the processes over (and to restore)
        self._owner_http: HttpServer | None = None
        self._preforked: Preforked | None = None
        self.frontends: FrontendSupervisor | None = None
        """The frontend processes (``--frontend-processes``), once started."""
        self._stop = asyncio.Event()
        self._stopped = False
        self.clean_exit = True
        """False once a shutdown left requests in flight or models executing or loading at the
        exit timeout (``run(exit_when_stuck=True)`` then ends the process at once)."""

    def prefork(self) -> None:
        """Load the models that frontend processes replicate, then fork the frontends from
        that state (``pyserve.handoff.prefork``), so that all processes share their weights.

        ``pyserve run`` calls it on its main thread before ``run``, while no other thread runs;
        without frontend processes, or where forking is not possible, it does nothing (the
        frontends are then spawned when the server starts).
        """
        options = self.options
        if not 0 < options.frontend_processes <= MAX_FRONTEND_PROCESSES or self._preforked is not None:
            return
        if not (options.allow_http or options.allow_grpc) or (options.allow_http and options.http_server != "pyserve"):
            return  # start() refuses these
        from pyserve.handoff import frontend, prefork

        models = self.models

        def serve_child(settings: dict[str, Any]) -> int:
            return frontend.run_forked(settings, models)

        try:
            mode: ReplicationMode | None = self._replication()
        except ValueError:
            mode = None  # start() refuses it
        self._preforked = prefork.prepare_and_fork(models, options.frontend_processes, mode, serve_child)

    def _replication(self) -> ReplicationMode:
        """``--replicate-models`` with what of this server holds ``auto`` back.

        :raises ValueError: a bad ``--replicate-models``.
        """
        return ReplicationMode(self.options.replicate_models, self.plugins, self._owner_only)

    async def start(self) -> None:
        """Load the models, then start listening.

        :raises StartupError: a model failed and ``exit_on_error`` is set, or the port is taken.
        """
        loop = asyncio.get_running_loop()
        descriptors = limits.raise_descriptor_limit()  # many clients need many descriptors
        log.debug("open file descriptor limit: %d", descriptors)
        if self.options.pin_processes:
            if not affinity.supported():
                raise StartupError("--pin-processes needs Linux (sched_setaffinity)")
            self._cpus = affinity.allowed_cpus()
            affinity.pin_this_process(affinity.cpu_for(0, self._cpus))
        if self.options.busy_poll_us:  # process-wide, as the tensor element limit
            try:
                self._saved_busy_poll = busy_poll.configure(self.options.busy_poll_us)
            except ValueError as exc:
                raise StartupError(str(exc)) from None
        self.models.server_handle.bind(self.dataplane, loop, metrics=self.metrics.render)
        self.models.attach_loop(loop)
        await loop.run_in_executor(None, self.models.load_all)
        model_table.log_startup_tables(self.models, self.plugins)
        if self.options.exit_on_error and (self.models.missing_startup_models or not self.models.all_ready()):
            failures = self.models.startup_failures()
            await loop.run_in_executor(None, self.models.unload_all)
            raise StartupError("failed to load all models (--exit-on-error true, the default; "
                               "--exit-on-error false serves the others):\n" + "\n".join(failures))
        if self.options.max_tensor_elements:  # process-wide: validation has no per-server state
            self._saved_element_limit = tensor_checks.LIMITS.max_tensor_elements
            tensor_checks.LIMITS.max_tensor_elements = self.options.max_tensor_elements
        self.dataplane.starting = True  # ready only once every listener and frontend is up
        self.dataplane.live = True
        self.dataplane.accepting = True
        self.models.start_polling()
        if self.options.frontend_processes:
            await self._start_handoff()
        # Triton's order: gRPC, metrics, then HTTP, whose log line a script may wait for: it is
        # written once the frontend processes serve too, and nothing runs on the loop between it
        # and being ready
        if self.options.allow_grpc:
            await self._start_grpc()
        if self.options.allow_metrics:
            await self._start_metrics()
        if self.options.allow_http:
            await self._start_http()
        if self.options.frontend_processes:
            await self._start_frontends()
        # from now on a death is a crash (``pyserve.handoff.keeper``): before the line that says
        # the server serves, which a script may act on at once
        execution_board.serving()
        if self.http_port is not None:  # the line scripts wait for: only once every process serves
            log.info("Started HTTPService at %s:%d", self.options.host, self.http_port)
        self.dataplane.starting = False

    async def _start_handoff(self) -> None:
        count = self.options.frontend_processes
        if not 0 < count <= MAX_FRONTEND_PROCESSES:
            raise StartupError(f"--frontend-processes must be between 0 and {MAX_FRONTEND_PROCESSES}, got {count}")
        if not (self.options.allow_http or self.options.allow_grpc):
            raise StartupError("--frontend-processes needs the HTTP or the gRPC service")
        if self.options.allow_http and self.options.http_server != "pyserve":
            raise StartupError("--frontend-processes needs --http-server pyserve")
        self._handoff_dir = rundir.make()  # mode 0700: this user only
        try:
            replication = self._replication()
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        if self.options.frontend_balance not in FRONTEND_BALANCE:
            raise StartupError(f"--frontend-balance must be one of {', '.join(FRONTEND_BALANCE)}, "
                               f"got '{self.options.frontend_balance}'")
        self._handoff = HandoffServer(self.dataplane, self.options.http_max_input_size, replication,
                                      unload_wait_secs=self.options.exit_timeout_secs)
        await self._handoff.start(os.path.join(self._handoff_dir, "handoff.sock"))
        if self.options.frontend_balance in OWNER_ACCEPTS:
            self._balancer = ConnectionBalancer(owner_serves=self.options.frontend_balance == "connections")
            self._balancer.start(os.path.join(self._handoff_dir, "balance.sock"))
        self.dataplane.stats_sources.append(self._handoff.collect_stats)
        self.dataplane.model_control_listeners.append(self._handoff.sync_frontends)
        self.dataplane.unloading_elsewhere.append(self._handoff.unloading_versions)
        self.dataplane.replica_readiness.append(self._handoff.replicas_not_ready)
        self.plugins.add_server_plugin(ModelChangeObserver(self._handoff), name="pyserve-handoff")
        self.models.loader.retire_listeners.append(self._handoff.models_changed)

    @property
    def balancer(self) -> ConnectionBalancer | None:
        """The balancer that places client connections on this process and its frontends, or
        None (no frontends, or ``--frontend-balance kernel``). Read on the event loop."""
        return self._balancer

    def _balances_grpc(self) -> bool:
        """Whether the balancer places gRPC connections (pyserve's own gRPC server can take them;
        with ``--grpc-server grpcio`` the frontends listen on the gRPC port themselves)."""
        return self._balancer is not None and self.options.grpc.implementation == "pyserve"

    async def _start_frontends(self) -> None:
        assert self._handoff is not None and self._handoff_dir is not None
        options = self.options
        grpc_settings = dataclasses.asdict(options.grpc)
        grpc_settings["restrictions"] = {k: [r.key, r.value] for k, r in options.grpc.restrictions.items()}
        settings = {
            "handoff": os.path.join(self._handoff_dir, "handoff.sock"),
            "owner_http": os.path.join(self._handoff_dir, "http.sock"),
            "owner_grpc": os.path.join(self._handoff_dir, "grpc.sock"),
            # the owner's balancer passes connections (None: frontends listen, SO_REUSEPORT)
            "balance": os.path.join(self._handoff_dir, "balance.sock") if self._balancer is not None else None,
            "balance_grpc": self._balances_grpc(),
            "host": options.host,
            "http_port": self.http_port,
            "grpc_port": self.grpc_port,
            "http_max_input_size": options.http_max_input_size,
            "http_limits": {"max_connections": options.http_max_connections,
                            "header_timeout": options.http_header_timeout_secs,
                            "body_timeout": options.http_body_timeout_secs},
            "http_restricted_api": {k: [r.key, r.value] for k, r in options.http_restricted_api.items()},
            "grpc": grpc_settings,
            "max_tensor_elements": options.max_tensor_elements,
            "http_header_forward_pattern": options.http_header_forward_pattern,
            "exit_timeout_secs": options.exit_timeout_secs,
            "log": logs.configuration(),  # at the start; the hand-off passes on later changes
            "replicate": options.replicate_models,
            "busy_poll_us": options.busy_poll_us,
            "repositories": [str(Path(p).resolve()) for p in options.model_repositories],
            "auto_complete": options.auto_complete,
            "backend_config": {k: dict(v) for k, v in options.backend_config.items()},
            "backend_directory": options.backend_directory,
            "cpu_threads": self.models.cpu_threads,
            "load_threads": options.model_load_thread_count,
        }
        self.frontends = FrontendSupervisor(options.frontend_processes, settings, self._handoff, cpus=self._cpus,
                                            preforked=self._preforked)
        try:
            await self.frontends.start()
        except FrontendStartError as exc:
            raise StartupError(str(exc)) from None
        log.info("Started %d frontend process(es): pids %s", len(self.frontends.pids),
                 ", ".join(str(p) for p in self.frontends.pids))

    async def _start_metrics(self) -> None:
        settings = self.metrics.settings
        loop = asyncio.get_running_loop()
        monitor = None
        if settings.cpu or settings.gpu:  # NVML start-up can take a while: off the loop
            monitor = await loop.run_in_executor(None, SystemMonitor, settings.cpu, settings.gpu)
        self._metrics_service = MetricsService(self.metrics, monitor)
        host = self.options.metrics_address or self.options.host
        try:
            await self._metrics_service.start(host, self.options.metrics_port)
        except MetricsStartError as exc:
            raise StartupError(str(exc)) from None
        self.metrics_port = self._metrics_service.port
        if self._handoff is not None:
            self._metrics_service.before_render = self._handoff.collect_stats

    async def _start_grpc(self) -> None:
        settings = dataclasses.replace(self.options.grpc, port=self.options.grpc_port)
        if not settings.host:
            settings.host = self.options.host
        try:
            shared = self._handoff_dir is not None and not self._balances_grpc()  # frontends listen too
            self._grpc, self.grpc_port = create_grpc_server(self.dataplane, settings, reuse_port=shared or settings.reuse_port)
            if self._handoff_dir is not None:  # frontend processes relay other RPCs here
                self._grpc.add_insecure_port("unix:" + os.path.join(self._handoff_dir, "grpc.sock"))
            if self._balances_grpc():
                self._grpc.balancer = self._balancer
        except RuntimeError as exc:
            raise StartupError(str(exc)) from None
        await self._grpc.start()
        log.info("Started GRPCInferenceService at %s:%d", settings.host, self.grpc_port)

    async def _start_http(self) -> None:
        app = create_app(
            self.dataplane,
            max_input_size=self.options.http_max_input_size,
            restrictions=self.options.http_restricted_api,
            status_page=self.options.status_page,
            openai=self.options.allow_openai,
            openai_metrics=OpenAIMetrics(self.metrics.registry) if self.options.allow_openai else None,
        )
        if self.options.http_server not in ("pyserve", "uvicorn"):
            raise StartupError(f"unknown HTTP server '{self.options.http_server}' (expected pyserve or uvicorn)")
        if self._handoff_dir is not None:  # frontend processes relay other routes here
            self._owner_http = InferHttpServer(
                app, self.dataplane, max_input_size=self.options.http_max_input_size,
                restrictions=self.options.http_restricted_api,
            )
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.bind(os.path.join(self._handoff_dir, "http.sock"))
            unix.listen(2048)
            await self._owner_http.start(unix)
        if self.options.http_server == "pyserve":
            shared = self._handoff_dir is not None and self._balancer is None  # frontends listen too
            listener = _bind(self.options.host, self.options.http_port, reuse_port=shared or self.options.reuse_http_port)
            self._http = InferHttpServer(
                app,
                self.dataplane,
                max_input_size=self.options.http_max_input_size,
                restrictions=self.options.http_restricted_api,
                max_connections=self.options.http_max_connections,
                header_timeout=self.options.http_header_timeout_secs,
                body_timeout=self.options.http_body_timeout_secs,
            )
            try:
                listener.listen(2048)
                await self._http.start(listener, balancer=self._balancer)
            except OSError as exc:
                listener.close()
                where = f"{self.options.host}:{self.options.http_port}"
                raise StartupError(f"HTTP service cannot listen on {where}: {exc}") from exc
            self.http_port = self._http.port
            return
        import uvicorn

        config = uvicorn.Config(
            app,
            host=self.options.host,
            port=self.options.http_port,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=max(int(self.options.exit_timeout_secs), 1),
            server_header=False,
        )
        listener = _bind(self.options.host, self.options.http_port, reuse_port=self.options.reuse_http_port)
        self._uvicorn = _uvicorn_server(config)
        self._serve_task = asyncio.create_task(self._uvicorn.serve(sockets=[listener]))
        while not self._uvicorn.started:
            if self._serve_task.done():
                self._serve_task.result()
                raise StartupError(
                    f"HTTP service could not start on {self.options.host}:{self.options.http_port}"
                )
            await asyncio.sleep(0.01)
        self.http_port = self._uvicorn.servers[0].sockets[0].getsockname()[1]
        client_activity.untracked_server(True)  # its requests are not reported: executes stay on threads

    def request_stop(self) -> None:
        """Ask a running ``serve_until_stopped`` to shut down (thread-safe via the loop)."""
        self._stop.set()

    async def serve_until_stopped(self) -> None:
        """Wait for ``request_stop`` (or a signal), then shut down gracefully."""
        await self._stop.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop accepting, finish in-flight requests (bounded), then unload everything."""
        if self._stopped:
            return
        self._stopped = True
        self.dataplane.exiting = True
        loop = asyncio.get_running_loop()
        timeout = self.options.exit_timeout_secs
        deadline = loop.time() + timeout
        log.info("Shutting down: waiting up to %.0f s for in-flight requests", timeout)
        frontends_clean = True
        if self.frontends is not None:  # they finish their in-flight requests first (replicas' and the owner's)
            frontends_clean = await self.frontends.stop(timeout)
        drained = await self.dataplane.drain(max(deadline - loop.time(), 0.0))
        self.clean_exit = drained and frontends_clean
        await self._stop_listening(deadline, drained)
        self.dataplane.live = False
        remaining = max(deadline - loop.time(), 0.0)
        await loop.run_in_executor(None, self.models.unload_all, remaining)
        if self.models.unfinished:
            self.clean_exit = False
            log.error("still running at the exit timeout: %s", ", ".join(self.models.unfinished))
        await loop.run_in_executor(None, self.dataplane.tracing.shutdown)  # write pending traces
        self.dataplane.readiness.close()
        if self._metrics_service is not None:  # last, as Triton: metrics stay readable while draining
            await self._metrics_service.stop()
        await self._restore_process()
        log.info("Server stopped")

    async def _stop_listening(self, deadline: float, drained: bool) -> None:
        """Close the HTTP, hand-off and gRPC services; ``drained``: the in-flight requests finished
        before ``deadline`` (the loop's clock), else the services get 1 s more at most."""
        loop = asyncio.get_running_loop()
        if self._http is not None:  # the exit timeout spent: give open answers 1 s more at most
            await self._http.shutdown(max(deadline - loop.time(), 0.0) if drained else 1.0)
        if self._owner_http is not None:
            await self._owner_http.shutdown(1.0)
        if self._handoff is not None:
            await self._handoff.close()
        if self._uvicorn is not None and self._serve_task is not None:
            if not drained:  # the exit timeout is spent: do not let uvicorn wait that long again
                self._uvicorn.config.timeout_graceful_shutdown = 1
            self._uvicorn.should_exit = True
            with contextlib.suppress(Exception):
                await self._serve_task
            client_activity.untracked_server(False)
            self._uvicorn = None
        if self._grpc is not None:
            await self._grpc.stop(grace=max(deadline - loop.time(), 0.0) if drained else 0)
        if self._balancer is not None:
            self._balancer.close()

    async def _restore_process(self) -> None:
        """Undo what ``start`` changed process-wide (limits, busy polling, CPU affinity), end the
        preforked frontends never used and remove the hand-off folder."""
        if self._saved_element_limit is not None:
            tensor_checks.LIMITS.max_tensor_elements = self._saved_element_limit
        if self._saved_busy_poll is not None:
            busy_poll.configure(self._saved_busy_poll)
        if self._cpus is not None:
            affinity.restore(self._cpus)
        if self._preforked is not None:  # children never given their settings exit
            await asyncio.get_running_loop().run_in_executor(None, self._preforked.close)
        if self._handoff_dir is not None:
            shutil.rmtree(self._handoff_dir, ignore_errors=True)

    async def run(self, exit_when_stuck: bool = False) -> None:
        """Start, serve until SIGINT/SIGTERM, then shut down (``pyserve run``).

        :param exit_when_stuck: end the process (exit code 1, as Triton) when the exit timeout
            passed with requests in flight or models still executing or loading: their threads
            would otherwise keep the process alive after "Server stopped".
        """
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start()
        except BaseException:
            await self.shutdown()
            raise
        await self.serve_until_stopped()
        if exit_when_stuck and not self.clean_exit:
            _exit_now("Exit timeout expired. Exiting immediately.")


def _exit_now(message: str) -> None:
    """Log ``message``, end this server's child processes (model workers) and exit with 1 without
    waiting for threads that may never end."""
    import multiprocessing

    log.error("%s", message)
    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):
            child.kill()
    logging.shutdown()
    os._exit(1)


class ServerThread:
    """Runs a ``Server`` on its own thread and event loop; for tests and embedding.

    Use as a context manager; ``url`` is ``http://127.0.0.1:<port>`` once entered.
    """

    def __init__(self, server: Server) -> None:
        self.server = server
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """``127.0.0.1:<http port>``, as ``tritonclient.http`` takes it."""
        return f"127.0.0.1:{self.server.http_port}"

    @property
    def grpc_url(self) -> str:
        """``127.0.0.1:<grpc port>``, as ``tritonclient.grpc`` takes it."""
        return f"127.0.0.1:{self.server.grpc_port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="pyserve-server", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)

        async def main() -> None:
            try:
                await self.server.start()
            except BaseException as exc:
                self._error = exc
                self._started.set()
                await self.server.shutdown()
                return
            self._started.set()
            await self.server.serve_until_stopped()

        try:
            loop.run_until_complete(main())
        finally:
            try:  # as asyncio.run does: cancel what is left (a connection still being accepted
                # closes its transport when cancelled), let closing transports close their sockets
                left = asyncio.all_tasks(loop)
                for task in left:
                    task.cancel()
                if left:
                    loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(asyncio.sleep(0))
            finally:
                loop.close()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.server.request_stop)
            self._thread.join(timeout=60)

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
