"""A connection the loop accepts while its server is stopping is closed at once (HTTP and gRPC).

Otherwise it would be registered after the server closed its connections, and left open when
the loop closes. Real sockets (a connected pair) and real transports.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import pytest

from pyserve.frontends.grpc.connection import GrpcConnection
from pyserve.frontends.grpc.listener import GrpcServer
from pyserve.frontends.grpc.server import GrpcOptions
from pyserve.frontends.http.connection import HttpProtocol
from pyserve.frontends.http.server import HttpServer


def _grpc() -> tuple[Any, Callable[[], asyncio.Protocol]]:
    server = GrpcServer(GrpcOptions())
    server.stopping = True
    return server, lambda: GrpcConnection(server)


def _http() -> tuple[Any, Callable[[], asyncio.Protocol]]:
    server = HttpServer(None, max_input_size=1024)
    server.shutting_down = True
    return server, lambda: HttpProtocol(server)


@pytest.mark.parametrize("make", [_grpc, _http], ids=["grpc", "http"])
def test_a_connection_accepted_while_stopping_is_closed(make: Callable[[], tuple[Any, Any]]) -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        server, factory = make()
        ours, peer = socket.socketpair()
        peer.setblocking(False)
        try:
            transport, protocol = await loop.connect_accepted_socket(factory, ours)
            assert transport.is_closing()
            assert protocol not in server.connections
            assert await asyncio.wait_for(loop.sock_recv(peer, 16), 5) == b""  # the peer sees the close
        finally:
            peer.close()

    asyncio.run(run())
