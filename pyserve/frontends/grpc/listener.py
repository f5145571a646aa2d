"""pyserve's own gRPC server: ``grpc.aio``-style handlers served over :mod:`pyserve.frontends.grpc.connection`.

It takes the same generic RPC handlers and ``grpc.aio.ServerInterceptor`` objects as a
``grpc.aio`` server and offers the calls pyserve makes on one (``add_generic_rpc_handlers``,
``add_insecure_port``, ``start``, ``stop``), so either server runs the same servicer. Calls run as
tasks on the event loop that started the server; one process, one loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import ssl
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc

from pyserve.frontends import balancer as balancing
from pyserve.frontends import limits
from pyserve.frontends.grpc.connection import GrpcConnection
from pyserve.frontends.grpc.guard import BufferBudget, server_buffer_default
from pyserve.frontends.tcp import bind_tcp

if TYPE_CHECKING:
    from pyserve.frontends.grpc.call import CallContext
    from pyserve.frontends.grpc.http2_stream import Stream
    from pyserve.frontends.grpc.server import GrpcOptions


log = logging.getLogger("pyserve.frontends.grpc")


class _CallDetails(NamedTuple):
    """``grpc.HandlerCallDetails`` as interceptors and generic handlers read it."""

    method: str
    invocation_metadata: Any


class GrpcServer:
    """A gRPC server on asyncio (HTTP/2 with prior knowledge, no TLS).

    :param options: message size cap, keepalive and ping policy, restricted protocols, and the
        limits of :mod:`pyserve.frontends.grpc.guard` (``GrpcOptions``).
    :param interceptors: ``grpc.aio.ServerInterceptor`` objects, applied per call in order.
    :param reuse_port: bind TCP ports with ``SO_REUSEPORT`` (processes sharing a port).
    """

    def __init__(self, options: GrpcOptions, interceptors: Sequence[Any] | None = None, reuse_port: bool = False) -> None:
        self.options = options
        self.interceptors = tuple(interceptors or ())
        self.restrictions = dict(options.restrictions)
        """``--grpc-restricted-protocol``: checked from each call's headers (``GrpcConnection``)."""
        self.connection_buffer = options.max_connection_buffer or options.max_message_bytes
        self.buffer_budget = BufferBudget(options.max_server_buffer or server_buffer_default(self.connection_buffer))
        """Bytes of incomplete request messages all connections hold (``--grpc-max-server-buffer``)."""
        self.max_connections = limits.connection_limit(options.max_connections)
        self._refusals = limits.RefusalLog(log, "gRPC service (--grpc-max-connections)")
        self.reuse_port = reuse_port
        self.inherit_as: str | None = None
        """The service name whose pre-bound socket (``pyserve.frontends.tcp.inherit``) a TCP port takes."""
        self.connections: set[GrpcConnection] = set()
        self._handlers: list[grpc.GenericRpcHandler] = []
        self._methods: dict[str, Any] = {}
        self._sockets: list[socket.socket] = []
        self._tls: dict[int, ssl.SSLContext] = {}  # id(listening socket) → its TLS context
        self._servers: list[Any] = []  # asyncio.Server, or the balancer's BalancedListener
        self._unix_paths: list[str] = []
        self.balancer: balancing.ConnectionBalancer | None = None
        """Set before ``start`` in the owner of ``--frontend-balance connections``: it accepts on
        the TCP ports and serves here only the connections it keeps."""
        self.adopted_tls: ssl.SSLContext | None = None
        """The TLS context for connections handed over by a balancer (a frontend's ``adopt``)."""
        self.on_connection_closed: Callable[[], None] | None = None
        """Called after a connection closes (a frontend reports its count to the owner's balancer)."""
        self._all_closed: asyncio.Event | None = None
        self.stopping = False
        """Set by ``stop``: a connection accepted from then on is closed at once."""
        self._stopped = asyncio.Event()  # binds to a loop on first use (Python >= 3.10)

    # -- handlers ---------------------------------------------------------------------------------
    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._handlers.extend(handlers)
        self._methods.clear()

    def lookup(self, path: str) -> Any:
        """The method handler serving ``path`` (``/package.Service/Method``), or None."""
        handler = self._methods.get(path)
        if handler is None and path not in self._methods:
            details = _CallDetails(path, ())
            for generic in self._handlers:
                handler = generic.service(details)
                if handler is not None:
                    break
            if len(self._methods) < 1024:  # unknown paths are remembered too, but not without bound
                self._methods[path] = handler
        return handler

    async def intercept(self, handler: Any, stream: Stream, context: CallContext) -> Any:
        """The handler after the interceptors have seen the call (None: method not found)."""
        details = _CallDetails(stream.path, context.invocation_metadata())

        async def innermost(_: Any) -> Any:
            return handler

        continuation = innermost
        for interceptor in reversed(self.interceptors):
            continuation = _chain(interceptor, continuation)
        return await continuation(details)

    # -- ports ------------------------------------------------------------------------------------
    def add_insecure_port(self, address: str) -> int:
        """Bind ``address`` (``host:port``, ``[v6]:port``, ``:port`` or ``unix:PATH``); the port bound.

        :raises RuntimeError: the address cannot be bound.
        """
        if address.startswith("unix:"):
            path = address[len("unix:"):]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(path)
            except OSError as exc:
                listener.close()
                raise RuntimeError(exc.strerror or str(exc)) from None
            self._unix_paths.append(path)
            self._sockets.append(listener)
            return 0
        host, _, port_text = address.rpartition(":")
        host = host.strip("[]")
        try:
            port = int(port_text)
        except ValueError:
            raise RuntimeError("not HOST:PORT") from None
        try:
            listener = bind_tcp(host, port, reuse_port=self.reuse_port, dual_stack=True, service=self.inherit_as)
        except OSError as exc:
            raise RuntimeError(exc.strerror or str(exc)) from None
        self._sockets.append(listener)
        return int(listener.getsockname()[1])

    def add_secure_port(self, address: str, context: ssl.SSLContext) -> int:
        """Bind ``address`` for TLS connections (``context`` offers ALPN ``h2``); the port bound.

        :raises RuntimeError: the address cannot be bound.
        """
        port = self.add_insecure_port(address)
        self._tls[id(self._sockets[-1])] = context
        return port

    # -- lifetime ---------------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for listener in self._sockets:
            listener.setblocking(False)
            server: Any
            if listener.family == socket.AF_UNIX:
                server = await loop.create_unix_server(lambda: GrpcConnection(self), sock=listener, backlog=2048)
            elif self.balancer is not None:
                listener.listen(2048)
                adopt = functools.partial(self.adopt, tls=self._tls.get(id(listener)))
                server = self.balancer.listen(listener, balancing.GRPC, adopt, self.tcp_connection_count)
            else:
                server = await loop.create_server(lambda: GrpcConnection(self), sock=listener, backlog=2048,
                                                  ssl=self._tls.get(id(listener)))
            self._servers.append(server)

    async def adopt(self, sock: socket.socket, tls: ssl.SSLContext | None = None) -> None:
        """Serve a TCP connection accepted elsewhere (non-blocking; handed over by the balancer).

        :param tls: the port's TLS context (default: ``adopted_tls``).
        """
        await asyncio.get_running_loop().connect_accepted_socket(
            lambda: GrpcConnection(self), sock, ssl=tls or self.adopted_tls)

    def refusal(self, connection: GrpcConnection) -> str:
        """Why a new connection is refused (the cap of TCP connections is reached), or ""."""
        if connection.peer.startswith("unix:") or len(self.connections) < self.max_connections:
            return ""
        self._refusals.refused(self.max_connections)
        return f"the server has reached its limit of {self.max_connections} connections; try again later"

    def tcp_connection_count(self) -> int:
        """Open TCP connections (frontends' relay channels on the Unix socket left out)."""
        return sum(1 for connection in self.connections if not connection.peer.startswith("unix:"))

    def connection_closed(self, connection: GrpcConnection) -> None:
        if not self.connections and self._all_closed is not None:
            self._all_closed.set()
        if self.on_connection_closed is not None:
            self.on_connection_closed()

    async def stop(self, grace: float | None) -> None:
        """Stop listening; let open calls finish for ``grace`` seconds (None or 0: cancel them now)."""
        self.stopping = True
        for server in self._servers:
            server.close()
        self._servers.clear()
        self._all_closed = asyncio.Event()
        for connection in list(self.connections):
            connection.goaway()
        if grace and self.connections:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._all_closed.wait(), grace)
        for connection in list(self.connections):
            connection.abort()
        if self.connections:  # each socket is closed in its connection_lost, a loop turn later
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._all_closed.wait(), 1.0)
        for path in self._unix_paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._stopped.set()

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), timeout)
        return self._stopped.is_set()


def _chain(interceptor: Any, continuation: Any) -> Any:
    async def call(details: Any) -> Any:
        return await interceptor.intercept_service(continuation, details)

    return call
