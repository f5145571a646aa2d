"""pyserve's HTTP/1.1 server: the listener, its connections and their answers.

A lean server (``asyncio.Protocol`` + ``httptools``): ``HttpServer`` accepts connections
(``pyserve.frontends.http.connection``) and hands every request to an ASGI application
(``pyserve.frontends.http.asgi_bridge``); it needs no data plane, so the metrics port serves
with it as it is. The HTTP port's server answers infer requests natively on top of it
(``pyserve.frontends.http.native_infer.InferHttpServer``).

While more than one connection is open, answers of small size are queued and written together
one loop turn later (``HttpServer.flush_replies``): replies then leave in bursts, so the clients
(and, in turn, their next requests) wake up once per burst instead of once per reply; on this
machine that cut the server's CPU per request by about a sixth and the load generator's by half
at 8–32 connections. A lone connection is answered at once: nothing would join its burst.

Idle keep-alive connections stay open until their client closes them, as in Triton
(``connection.KEEP_ALIVE_TIMEOUT``). Past ``max_connections`` open TCP connections
(``--http-max-connections``) the longest idle one is closed to make room; when none is idle, a
new connection is answered 503 and closed, and a warning is logged. On shutdown, listening
stops, idle keep-alive connections close, and the answers in progress get a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

from pyserve.frontends import balancer as balancing
from pyserve.frontends import limits
from pyserve.frontends.balancer import ConnectionBalancer
from pyserve.frontends.http.connection import HttpProtocol
from pyserve.frontends.http.errors import error_body
from pyserve.frontends.http.wire import status_line

log = logging.getLogger("pyserve.frontends.http")

ASGIApp = Callable[..., Any]

HEADER_TIMEOUT = 30.0
"""``--http-header-timeout-secs`` default: a request line and headers must arrive within this."""
BODY_TIMEOUT = 300.0
"""``--http-body-timeout-secs`` default: a request body must arrive within this of its headers."""


class HttpServer:
    """pyserve's HTTP/1.1 server for an ASGI application: every request goes to ``app``
    (a subclass may answer some natively: ``infer_target``).

    :param app: the ASGI application.
    :param max_input_size: the body cap of a request answered natively (``--http-max-input-size``).
    :param max_connections: open TCP connections past which new ones are refused with 503
        (``--http-max-connections``; 0: the default of ``pyserve.frontends.limits.connection_limit``).
    :param header_timeout: seconds a request's line and headers may take in all.
    :param body_timeout: seconds a request's body may take in all, from the end of its headers.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_input_size: int,
        max_connections: int = 0,
        header_timeout: float = HEADER_TIMEOUT,
        body_timeout: float = BODY_TIMEOUT,
    ) -> None:
        self.app = app
        self.max_connections = limits.connection_limit(max_connections)
        self.header_timeout = header_timeout if header_timeout > 0 else float("inf")
        self.body_timeout = body_timeout if body_timeout > 0 else float("inf")
        self._refusals = limits.RefusalLog(log, "HTTP service (--http-max-connections)")
        self.max_input_size = max_input_size
        self.connections: set[HttpProtocol] = set()
        self.shutting_down = False
        self._server: Any = None  # asyncio.Server, or the balancer's BalancedListener
        self._all_closed: asyncio.Event | None = None
        self.on_connection_closed: Callable[[], None] | None = None
        """Called after a connection closes (a frontend reports its count to the owner's balancer)."""
        self.replies: list[tuple[HttpProtocol, bytes]] = []
        """Answers waiting for ``flush_replies`` (in the order they were made)."""

    protocol_class: type[HttpProtocol] = HttpProtocol
    """The connection class (``InferHttpServer``'s answers infer natively; a frontend process's
    hands infer requests off)."""

    def queue_reply(self, connection: HttpProtocol, data: bytes) -> None:
        """Queue a whole answer; the first one queued in a loop turn schedules the flush."""
        if not self.replies:
            connection.loop.call_soon(self.flush_replies)
        self.replies.append((connection, data))
        connection.queued = True

    def flush_replies(self) -> None:
        """Write every queued answer (connections closed since are skipped). Also called
        early by a connection about to write something else, so its bytes stay in order."""
        replies, self.replies = self.replies, []
        for connection, data in replies:
            connection.queued = False
            transport = connection.transport
            if transport is not None and not connection.closed and not transport.is_closing():
                transport.write(data)

    def refusal(self, transport: asyncio.BaseTransport) -> bytes | None:
        """The 503 answer for a new TCP connection past ``max_connections``, or None to serve it
        (a frontend's relay connections on the Unix socket are never refused)."""
        if len(self.connections) < self.max_connections:
            return None
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:
            return None
        idle = [c for c in self.connections if c.idle and c.client is not None]  # TCP ones, not relays
        if idle:  # the longest idle keep-alive connection makes room (its client reconnects)
            min(idle, key=lambda c: c.idle_since or 0.0).close()
            return None
        self._refusals.refused(self.max_connections)
        body = error_body(f"the server has reached its limit of {self.max_connections} connections "
                          "(--http-max-connections); try again later")
        return (status_line(503) + b"content-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % len(body) + body)

    def infer_target(self, url: bytes) -> tuple[str, str | None] | None:
        """``(model, version)`` when a POST to ``url`` is answered natively, else None (here:
        always None, every request goes to the application)."""
        return None

    async def start(self, sock: socket.socket, balancer: ConnectionBalancer | None = None) -> None:
        """Listen on an already bound socket (TCP, or a Unix socket for frontend processes).

        :param balancer: the owner's connection balancer (``--frontend-balance connections``):
            it accepts on ``sock`` and serves here only the connections it keeps.
        """
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        factory = self.protocol_class
        if balancer is not None:
            self._server = balancer.listen(sock, balancing.HTTP, self.adopt, lambda: len(self.connections))
        elif sock.family == socket.AF_UNIX:
            self._server = await loop.create_unix_server(lambda: factory(self), sock=sock, backlog=2048)
        else:
            self._server = await loop.create_server(lambda: factory(self), sock=sock, backlog=2048)

    async def adopt(self, sock: socket.socket) -> None:
        """Serve a connection accepted elsewhere (non-blocking; handed over by the balancer)."""
        factory = self.protocol_class
        await asyncio.get_running_loop().connect_accepted_socket(lambda: factory(self), sock)

    @property
    def port(self) -> int:
        """The port listened on (TCP only)."""
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    def connection_closed(self, connection: HttpProtocol) -> None:
        self.connections.discard(connection)
        if not self.connections and self._all_closed is not None:
            self._all_closed.set()
        if self.on_connection_closed is not None:
            self.on_connection_closed()

    async def shutdown(self, timeout: float) -> None:
        """Stop listening, close idle keep-alive connections, let the answers in progress
        finish for up to ``timeout`` seconds, then close whatever is left."""
        self.shutting_down = True
        if self._server is not None:
            self._server.close()
        self._all_closed = asyncio.Event()
        for connection in list(self.connections):
            connection.shutdown()
        if self.connections:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._all_closed.wait(), max(timeout, 0.0))
        for connection in list(self.connections):
            for request in connection.pipeline:
                if request.asgi is not None:
                    request.asgi.task.cancel()
            if connection.transport is not None:
                connection.transport.abort()
        await asyncio.sleep(0)  # let connection_lost run
