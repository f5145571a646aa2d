"""The TCP listening sockets of pyserve's services (HTTP, gRPC, and their frontend processes).

A service's socket may be bound before the server process exists (``pyserve.handoff.keeper``
binds them once and keeps them open across restarts of the server): ``inherit`` records such a
socket under its service name, and ``bind_tcp(..., service=NAME)`` then returns a duplicate of
it instead of binding a new one.
"""

from __future__ import annotations

import socket

_inherited: dict[str, socket.socket] = {}


def inherit(service: str, listener: socket.socket) -> None:
    """Serve ``service`` (``"http"``, ``"grpc"``, ``"metrics"``) on ``listener``, bound already."""
    _inherited[service] = listener


def inherited_descriptors() -> dict[str, int]:
    """The file descriptor of each service's recorded socket (``inherit``), by service name."""
    return {service: listener.fileno() for service, listener in _inherited.items()}


def forget_inherited() -> None:
    """Bind every service anew (a process forked from the server that binds its own)."""
    _inherited.clear()


def bind_tcp(host: str, port: int, *, reuse_port: bool = False, dual_stack: bool = False,
             service: str | None = None) -> socket.socket:
    """A TCP socket bound to ``host:port``, not yet listening.

    The socket's ``proto`` says TCP: accepted sockets inherit it, and asyncio sets
    ``TCP_NODELAY`` only on sockets whose ``proto`` is ``IPPROTO_TCP`` (without it every
    response pays a ~40 ms Nagle stall). ``SO_REUSEADDR`` is always set.

    :param reuse_port: set ``SO_REUSEPORT``: frontend processes bind the same port and the
        kernel spreads new connections over every process listening on it.
    :param dual_stack: an empty host or ``::`` listens on IPv6 and IPv4 (as grpc does for
        ``:port``); on a kernel without IPv6, on every IPv4 address.
    :param service: take the socket ``inherit`` recorded for this service, if any (a
        duplicate: closing it leaves the recorded one open).
    :raises OSError: the socket cannot be made or bound (it is closed).
    """
    if service is not None and service in _inherited:
        return _inherited[service].dup()
    both = dual_stack and host in ("", "::") and socket.has_ipv6
    family = socket.AF_INET6 if (":" in host or both) else socket.AF_INET
    try:
        listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    except OSError:
        if not both:
            raise
        both, host = False, "0.0.0.0"  # no IPv6 in this kernel
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if both:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        listener.bind(("::" if both else host, port))
    except OSError:
        listener.close()
        raise
    return listener
