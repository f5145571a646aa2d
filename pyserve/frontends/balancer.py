"""Connection balancing for ``--frontend-processes``: each new connection goes to the process
that holds the fewest.

With ``SO_REUSEPORT`` the kernel picks a process for a new connection by a hash of its
addresses, blind to how many each process already serves: eight keep-alive connections over
two processes split 4/4 only about one time in four, and a 6/2 or 7/1 split leaves one
process's core half idle while the other's queue grows. ``--frontend-balance connections``
(the default) lets the owner accept every TCP connection of the HTTP and gRPC ports instead.
It keeps each connection whose process (itself or a frontend) has the fewest open, ties taken
in turn, and passes the others' sockets over a Unix socket (``SCM_RIGHTS``); the frontend then
serves the connection as if it had accepted it. Frontends report how many connections they hold
whenever one closes. ``--frontend-balance frontends`` passes every connection to a frontend (the
one with the fewest), and the owner serves one itself only when no frontend can take it: its
event loop is left to the models it alone serves, and every request of a client takes the
frontend's path (replica or hand-off).

The owner accepts and passes a socket; it reads nothing from the connection, so the cost is
one ``sendmsg`` per connection. Should a frontend not take a socket at once (its channel is
full, or it went away), the owner serves the connection itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("pyserve.handoff")

FRONTEND_BALANCE = ("connections", "frontends", "kernel")
"""The choices of ``--frontend-balance``."""

OWNER_ACCEPTS = ("connections", "frontends")
"""The ``--frontend-balance`` choices where the owner accepts every connection and places it."""

HTTP = b"h"
"""A connection of the HTTP port."""
GRPC = b"g"
"""A connection of the gRPC port."""

_REPORT = struct.Struct("!QQ")  # connections open (or being taken on), connections received so far
_ACCEPTS_PER_WAKE = 64
_ACCEPT_PAUSE = 1.0  # out of file descriptors: stop accepting for a while (as asyncio's servers do)

Adopt = Callable[[socket.socket], Awaitable[Any]]
"""Serves an accepted, non-blocking socket (``loop.connect_accepted_socket`` with a protocol)."""


def take_on(conn: socket.socket, adopt: Adopt, done: Callable[[], None]) -> None:
    """Serve ``conn`` with ``adopt`` (in a task); ``done`` runs once it is served or failed
    (a failed one is closed: the client sees the connection end)."""
    conn.setblocking(False)

    def finished(task: asyncio.Future[Any]) -> None:
        if task.cancelled() or task.exception() is not None:
            log.debug("connection not taken on: %r", None if task.cancelled() else task.exception())
            conn.close()
        done()

    asyncio.ensure_future(adopt(conn)).add_done_callback(finished)


class _Peer:
    """A frontend's channel, and what the owner knows of its connections."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent = 0
        self.open = 0
        self.received = 0

    @property
    def load(self) -> int:
        """Open connections as last reported, plus those sent since the report."""
        return self.open + self.sent - self.received


class ConnectionBalancer:
    """The owner's side: chooses the process for each connection its listeners accept.

    Event loop only. ``start`` listens for frontend channels on a Unix socket; ``listen``
    replaces ``loop.create_server`` for a TCP listening socket of the HTTP or gRPC server.
    """

    def __init__(self, owner_serves: bool = True) -> None:
        self.owner_serves = owner_serves
        """Whether the owner keeps connections when it holds the fewest (``connections``); False:
        only when no frontend is connected (``frontends``)."""
        self.peers: list[_Peer] = []
        self.passed = 0
        """Connections handed to frontends so far."""
        self._local_counts: list[Callable[[], int]] = []
        self._local_pending = 0
        self._turn = 0
        self._channel: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, path: str) -> None:
        """Listen for frontend channels on the Unix socket ``path``."""
        self._loop = asyncio.get_running_loop()
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            channel.bind(path)
            channel.listen(64)
            channel.setblocking(False)
        except OSError:
            channel.close()
            raise
        self._channel = channel
        self._loop.add_reader(channel.fileno(), self._accept_peers)

    def close(self) -> None:
        """Stop taking frontend channels and close the open ones."""
        if self._channel is not None and self._loop is not None:
            self._loop.remove_reader(self._channel.fileno())
            self._channel.close()
            self._channel = None
        for peer in list(self.peers):
            self._drop(peer)

    def listen(self, listener: socket.socket, kind: bytes, adopt: Adopt, local_count: Callable[[], int]) -> BalancedListener:
        """Accept on ``listener`` (bound and listening) from now on.

        :param kind: ``HTTP`` or ``GRPC``: tells a frontend which of its servers takes the socket.
        :param adopt: serves a connection kept by the owner.
        :param local_count: the owner's open connections on this port.
        :returns: the accepting listener (``close`` stops it, as ``asyncio.Server.close``).
        """
        self._local_counts.append(local_count)
        return BalancedListener(self, listener, kind, adopt)

    # -- frontend channels --------------------------------------------------------------------
    def _accept_peers(self) -> None:
        assert self._channel is not None and self._loop is not None
        while True:
            try:
                sock, _ = self._channel.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("frontend channel not accepted: %s", exc)
                return
            sock.setblocking(False)
            peer = _Peer(sock)
            self.peers.append(peer)
            self._loop.add_reader(sock.fileno(), self._read_reports, peer)

    def _read_reports(self, peer: _Peer) -> None:
        while True:
            try:
                data = peer.sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(peer)
                return
            if not data:  # the frontend closed its channel (stopping, or gone)
                self._drop(peer)
                return
            if len(data) == _REPORT.size:
                peer.open, peer.received = _REPORT.unpack(data)

    def _drop(self, peer: _Peer) -> None:
        if peer in self.peers:
            self.peers.remove(peer)
            if self._loop is not None:
                self._loop.remove_reader(peer.sock.fileno())
            peer.sock.close()

    # -- placing connections ----------------------------------------------------------------------
    def _choose(self) -> _Peer | None:
        """The frontend to take the next connection, or None for the owner: the fewest open,
        the owner first among equals (it answers every model without a hand-off, so a lone
        client never pays one), frontends in turn among themselves. Unless ``owner_serves``,
        the owner only when no frontend is connected."""
        if not self.peers:
            return None
        least = min(peer.load for peer in self.peers)
        if self.owner_serves and sum(count() for count in self._local_counts) + self._local_pending <= least:
            return None
        tied = [peer for peer in self.peers if peer.load == least]
        peer = tied[self._turn % len(tied)]
        self._turn += 1
        return peer

    def place(self, conn: socket.socket, kind: bytes, adopt: Adopt) -> None:
        """Pass ``conn`` to the frontend with the fewest connections, or serve it here."""
        peer = self._choose()
        if peer is not None:
            try:
                socket.send_fds(peer.sock, [kind], [conn.fileno()])
            except (BlockingIOError, InterruptedError):
                pass  # the frontend is not keeping up: this one stays here
            except OSError:
                self._drop(peer)
            else:
                peer.sent += 1
                self.passed += 1
                conn.close()  # the frontend holds the connection now
                return
        self._local_pending += 1
        take_on(conn, adopt, self._adopted)

    def _adopted(self) -> None:
        self._local_pending -= 1


class BalancedListener:
    """Accepts on one TCP listening socket of the owner and places each connection
    (``ConnectionBalancer.place``). Stands in for the ``asyncio.Server`` of that socket."""

    def __init__(self, balancer: ConnectionBalancer, listener: socket.socket, kind: bytes, adopt: Adopt) -> None:
        self.balancer = balancer
        self.listener = listener
        self.kind = kind
        self.adopt = adopt
        self.loop = asyncio.get_running_loop()
        self.closed = False
        listener.setblocking(False)
        self.loop.add_reader(listener.fileno(), self._accept)

    @property
    def sockets(self) -> list[socket.socket]:
        """The listening socket (as ``asyncio.Server.sockets``)."""
        return [] if self.closed else [self.listener]

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:  # out of descriptors or memory: try again a little later
                log.error("cannot accept connections (%s); pausing for %.0f s", exc, _ACCEPT_PAUSE)
                self.loop.remove_reader(self.listener.fileno())
                self.loop.call_later(_ACCEPT_PAUSE, self._resume)
                return
            with contextlib.suppress(OSError):  # on the connection: whichever process serves it, no Nagle delays
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.balancer.place(conn, self.kind, self.adopt)

    def _resume(self) -> None:
        if not self.closed:
            self.loop.add_reader(self.listener.fileno(), self._accept)

    def close(self) -> None:
        """Stop accepting and close the listening socket."""
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.listener.fileno())
        self.listener.close()


class BalancedReceiver:
    """A frontend's side: takes the connections the owner passes and reports its count.

    Event loop only. ``adopters`` maps ``HTTP``/``GRPC`` to the server that serves that kind;
    ``open_count`` is how many connections this frontend holds. Call ``changed`` when one
    closes.
    """

    def __init__(self, adopters: dict[bytes, Adopt], open_count: Callable[[], int]) -> None:
        self.adopters = adopters
        self.open_count = open_count
        self.received = 0
        self._pending = 0
        self._report_due = False
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def connect(self, path: str) -> None:
        """Open the channel to the owner's balancer at ``path``.

        :raises OSError: the owner does not listen there.
        """
        loop = self._loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, path)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        loop.add_reader(sock.fileno(), self._receive)

    def close(self) -> None:
        """Take no more connections: the owner serves the next ones itself."""
        if self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None

    def _receive(self) -> None:
        while self._sock is not None:
            try:
                kind, fds, _, _ = socket.recv_fds(self._sock, 16, 4)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.close()
                return
            if not kind and not fds:  # the owner is gone (the hand-off link notices too)
                self.close()
                return
            for fd in fds:
                self._take(kind[:1], fd)

    def _take(self, kind: bytes, fd: int) -> None:
        self.received += 1  # counted even if refused: the owner counted it as sent
        adopt = self.adopters.get(kind)
        try:
            conn = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            self.changed()
            return
        if adopt is None:
            conn.close()
            self.changed()
            return
        self._pending += 1
        take_on(conn, adopt, self._adopted)

    def _adopted(self) -> None:
        self._pending -= 1
        self.changed()

    def changed(self) -> None:
        """A connection opened or closed: report the count once this loop turn is over."""
        if not self._report_due and self._loop is not None:
            self._report_due = True
            self._loop.call_soon(self._report)

    def _report(self) -> None:
        self._report_due = False
        if self._sock is None:
            return
        try:
            self._sock.send(_REPORT.pack(self.open_count() + self._pending, self.received))
        except (BlockingIOError, InterruptedError):
            assert self._loop is not None
            self._report_due = True
            self._loop.call_later(0.05, self._report)  # the owner reads later; the count stays due
        except OSError:
            self.close()
