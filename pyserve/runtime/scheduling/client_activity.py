"""Whether this process's requests lately all came from one client connection.

The adaptive scheduler (``pyserve.runtime.scheduling.adaptive``) asks it whether anyone else could be
waiting for the event loop. When every request of the last ``WINDOW_NS`` came over the same
connection, one client is talking to the server, request after request: a short execute run on
the loop delays nobody, and it saves the two thread wake-ups of a hand-off to an instance
thread. When requests came over several connections, executes stay on the instance threads and
the loop goes on serving. Idle connections (a load balancer's pool, a client's unused channel)
do not count: only requests do. The gRPC server asks the same to start a call inside the read
that completed it (``pyserve.frontends.grpc.connection``), and ``--busy-poll-us`` polls only while no
other client is seen (``several_clients``).

A second, stricter question is whether that client also sends one request at a time: a request
that starts while another of its connection is in progress (HTTP/1.1 pipelining, several gRPC
streams at once) says it does not, and a batcher should then keep gathering such requests.

The servers tell it of each request as it starts (``request_from``): HTTP when a request's
headers are read, gRPC when a call's stream opens. A frontend process's link carries many
clients' requests, so each of them counts as coming from a new connection (``request_mixed``),
and a server that does not report its requests (uvicorn) turns the signal off while it runs
(``untracked_server``). Called on the servers' event loop threads; process-wide.
"""

from __future__ import annotations

import itertools
import time

WINDOW_NS = 10_000_000
"""How long (10 ms) after a request from another connection the process is not alone with one client."""

_now = time.monotonic_ns  # the clock (a test may replace it)
_last_connection = 0  # the key of the connection of the last request (not the object: never kept alive)
_mixed_at_ns = 0  # when a request last came from another connection than the one before it
_together_at_ns = 0  # when a request last started beside another of its connection
_untracked = 0  # servers running that do not report their requests
_started_at_ns = 0  # when the last request started (``last_request_ns``)


_keys = itertools.count(1)


def connection_key() -> int:
    """A key for a new connection, never given before in this process (unlike ``id()``, which a
    new connection object may share with one already closed)."""
    return next(_keys)


def request_from(key: int, together: bool = False) -> None:
    """A request starts on the connection with ``key`` (``connection_key``); ``together``: while
    another request of the same connection is in progress (or arrived in the same read)."""
    global _last_connection, _mixed_at_ns, _together_at_ns, _started_at_ns
    _started_at_ns = now = _now()
    if key != _last_connection:
        _last_connection = key
        _mixed_at_ns = now
    if together:
        _together_at_ns = now


def request_mixed() -> None:
    """A request starts that may come from any of several clients (a frontend process's link)."""
    global _last_connection, _mixed_at_ns, _together_at_ns
    _last_connection = 0
    _mixed_at_ns = _together_at_ns = _now()


def now_ns() -> int:
    """This module's clock (``time.monotonic_ns``, unless a test replaced it)."""
    return _now()


def last_request_ns() -> int:
    """When (``time.monotonic_ns``) the last reported request started; 0 before any."""
    return _started_at_ns


def untracked_server(running: bool) -> None:
    """A server that does not report its requests starts (True) or stops (False)."""
    global _untracked
    _untracked = max(_untracked + (1 if running else -1), 0)


def one_client() -> bool:
    """Whether every request of the last ``WINDOW_NS`` came over one connection."""
    return not _untracked and _now() - _mixed_at_ns > WINDOW_NS


def several_clients() -> bool:
    """Whether requests came over more than one connection in the last ``WINDOW_NS`` (a server
    that does not report its requests does not make this True)."""
    return _now() - _mixed_at_ns <= WINDOW_NS


def one_request_at_a_time() -> bool:
    """Whether every request of the last ``WINDOW_NS`` came over one connection, each after the
    previous one was answered."""
    now = _now()
    return not _untracked and now - _mixed_at_ns > WINDOW_NS and now - _together_at_ns > WINDOW_NS
