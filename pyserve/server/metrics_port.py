"""The metrics service: ``GET /metrics`` on its own port, and the refresh of the CPU/GPU gauges."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from pyserve.frontends.tcp import bind_tcp
from pyserve.metrics.prometheus import CONTENT_TYPE

if TYPE_CHECKING:
    from pyserve.frontends.http.server import HttpServer
    from pyserve.metrics.prometheus import ServerMetrics
    from pyserve.metrics.system import SystemMonitor

log = logging.getLogger("pyserve.metrics")

_MAX_BODY = 64 * 1024
"""The largest request body the metrics port reads (its requests have none)."""


class MetricsStartError(RuntimeError):
    """The metrics service could not listen on its address."""


class MetricsService:
    """``GET /metrics`` on its own port, served by pyserve's HTTP/1.1 server
    (``pyserve.frontends.http.server.HttpServer``) on the server's event loop.

    :param metrics: what the page shows.
    :param monitor: the CPU/GPU readings refreshed every ``interval_ms``, or None.
    """

    def __init__(self, metrics: ServerMetrics, monitor: SystemMonitor | None = None) -> None:
        self.metrics = metrics
        self.monitor = monitor
        self.port: int | None = None
        self._server: HttpServer | None = None
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
        from pyserve.frontends.http.server import HttpServer  # (pyserve.http imports pyserve.metrics)

        try:
            listener = bind_tcp(host, port, service="metrics")
        except OSError as exc:
            raise MetricsStartError(
                f"Metrics service cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from exc
        try:
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise MetricsStartError(
                f"Metrics service cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from exc
        if self.monitor is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.monitor.sample)
            self._sampler = asyncio.create_task(self._sample_every(self.metrics.settings.interval_ms / 1000))
        self._server = HttpServer(self, max_input_size=_MAX_BODY)
        await self._server.start(listener)
        self.port = self._server.port
        log.info("Started Metrics Service at %s:%d", host, self.port)

    async def _sample_every(self, seconds: float) -> None:
        assert self.monitor is not None
        loop = asyncio.get_running_loop()
        failing = False
        while True:
            await asyncio.sleep(max(seconds, 0.01))
            try:
                reading = loop.run_in_executor(None, self.monitor.sample)
            except RuntimeError:  # the loop's executor is shut down: the server is stopping
                return
            try:
                await reading
            except Exception:  # a failed reading must not stop the next ones
                if not failing:  # the traceback once, not at every interval while it keeps failing
                    log.exception("reading CPU/GPU metrics failed")
                failing = True
            else:
                failing = False

    async def stop(self) -> None:
        """Stop serving and sampling; release NVML."""
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
            self._sampler = None
        if self._server is not None:
            await self._server.shutdown(1.0)
            self._server = None
        if self.monitor is not None:
            self.monitor.close()
