"""The metrics service: ``GET /metrics`` on its own port, and the refresh of the CPU/GPU gauges."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from pyserve.metrics.prometheus import CONTENT_TYPE

if TYPE_CHECKING:
    from pyserve.metrics.prometheus import ServerMetrics
    from pyserve.metrics.system import SystemMonitor

log = logging.getLogger("pyserve.metrics")


class MetricsStartError(RuntimeError):
    """The metrics service could not listen on its address."""


class _QuietUvicorn:
    """Builds a uvicorn server that leaves signal handling to the pyserve server."""

    @staticmethod
    def create(config: Any) -> Any:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Generator[None, None, None]:
                yield

        return _Server(config)


class MetricsService:
    """``GET /metrics`` on its own uvicorn server, on the server's event loop.

    :param metrics: what the page shows.
    :param monitor: the CPU/GPU readings refreshed every ``interval_ms``, or None.
    """

    def __init__(self, metrics: ServerMetrics, monitor: SystemMonitor | None = None) -> None:
        self.metrics = metrics
        self.monitor = monitor
        self.port: int | None = None
        self._server: Any = None
        self._serve_task: asyncio.Task[None] | None = None
        self._sampler: asyncio.Task[None] | None = None
        self.before_render: Any = None
        """An async callable run before each scrape (frontend replicas report their counts)."""
        if monitor is not None:
            metrics.registry.register(monitor)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The ASGI app: ``/metrics`` (GET or HEAD); 404 elsewhere, 405 for other methods."""
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics":
            status, body, media = 404, b"Not Found", b"text/plain; charset=utf-8"
        elif scope["method"] not in ("GET", "HEAD"):
            status, body, media = 405, b"Method Not Allowed", b"text/plain; charset=utf-8"
        else:
            if self.before_render is not None:
                await self.before_render()
            status, body, media = 200, self.metrics.render(), CONTENT_TYPE.encode()
        headers = [(b"content-type", media), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (0 = any free port) and start refreshing the gauges.

        :raises MetricsStartError: the address cannot be bound.
        """
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
        except OSError as exc:
            listener.close()
            raise MetricsStartError(
                f"Metrics service cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from exc
        config = uvicorn.Config(
            self, host=host, port=port, lifespan="off", log_config=None, access_log=False,
            timeout_graceful_shutdown=1, server_header=False,
        )
        self._server = _QuietUvicorn.create(config)
        if self.monitor is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.monitor.sample)
            self._sampler = asyncio.create_task(self._sample_every(self.metrics.settings.interval_ms / 1000))
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[listener]))
        while not self._server.started:
            if self._serve_task.done():
                self._serve_task.result()
                raise MetricsStartError(f"Metrics service could not start on {host}:{port}")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        log.info("Started Metrics Service at %s:%d", host, self.port)

    async def _sample_every(self, seconds: float) -> None:
        assert self.monitor is not None
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(seconds, 0.01))
            try:
                await loop.run_in_executor(None, self.monitor.sample)
            except Exception:  # a failed reading must not stop the next ones
                log.exception("reading CPU/GPU metrics failed")

    async def stop(self) -> None:
        """Stop serving and sampling; release NVML."""
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
            self._sampler = None
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._serve_task
            self._server = None
            self._serve_task = None
        if self.monitor is not None:
            self.monitor.close()
