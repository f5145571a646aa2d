"""One HTTP/2 connection of pyserve's gRPC server: frames in, calls out (RFC 9113, gRPC over HTTP/2).

The protocol object parses frames as bytes arrive, keeps the streams and both directions of
flow control, and runs each call as a task on the event loop (the servicer functions are
``async``; model execution itself happens on instance threads, or on the loop for inline
models). Replies written during one loop turn leave in one ``writelines``. While one client is
calling (``pyserve.runtime.scheduling.client_activity.one_client``: every request of the last 10 ms came over this
connection; idle connections do not count) or the connection is the server's only one, a unary
call starts at once, inside ``data_received`` (``pyserve.frontends.grpc.eager``): a call that never waits
is then answered by that read's own flush, with no task and no extra loop turn. While several
connections send calls, calls stay tasks, so that the answers of one loop turn leave together
(clients woken once per burst).

What a peer may rely on:

* a request message larger than ``max_message_bytes`` is refused with RESOURCE_EXHAUSTED as
  soon as its 5-byte prefix arrives; others are buffered as their bytes arrive, within the memory,
  time and abuse limits of :mod:`pyserve.frontends.grpc.guard`;
* a call of a restricted category (``--grpc-restricted-protocol``) without its header is refused
  from its headers, before any byte of its body is buffered;
* a unary call starts only once the read that completed it has been parsed to its end, so a
  reset in the same read withdraws it before it runs;
* frames larger than the advertised ``SETTINGS_MAX_FRAME_SIZE``, header blocks above
  ``MAX_HEADER_LIST`` (or in more than ``MAX_CONTINUATIONS`` CONTINUATION frames), invalid HPACK,
  a new stream id not above the last and other protocol violations end the connection with
  GOAWAY and the matching error code; malformed requests (upper-case field names, misplaced
  pseudo-headers, a stream depending on itself) reset their stream; other connections and calls
  are not disturbed;
* RST_STREAM or a lost connection cancels the call's task (a queued inference is withdrawn);
  ``grpc-timeout`` ends the call with DEADLINE_EXCEEDED and frees its stream, also when it has
  already expired on arrival;
* a streaming reply gives the event loop a turn every ``YIELD_EVERY`` messages and waits while
  more than ``DRAIN_ABOVE`` bytes of it are held back by flow control or the transport is full:
  one call's responses never starve other connections, and a reset stops its writer promptly;
* data is never sent beyond the peer's flow-control windows; trailers follow the last DATA.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.grpc.connection_state import SERVER_PREFACE
from pyserve.frontends.grpc.frame_reader import FrameReader
from pyserve.frontends.grpc.guard import ConnectionGuard

if TYPE_CHECKING:
    from pyserve.frontends.grpc.listener import GrpcServer


class GrpcConnection(FrameReader):
    """The server side of one HTTP/2 connection carrying gRPC calls.

    Its behaviour comes in layers, one module each, every layer built on the ones below it:
    :mod:`~pyserve.frontends.grpc.connection_state` (limits and fields),
    :mod:`~pyserve.frontends.grpc.outgoing` (writing within the peer's windows),
    :mod:`~pyserve.frontends.grpc.lifetime` (GOAWAY, closing, keepalive),
    :mod:`~pyserve.frontends.grpc.replies` (headers, messages, status),
    :mod:`~pyserve.frontends.grpc.stream_lifecycle` (resets, cancellation, deadlines),
    :mod:`~pyserve.frontends.grpc.call_runner` (servicer functions),
    :mod:`~pyserve.frontends.grpc.request_body` (DATA into messages),
    :mod:`~pyserve.frontends.grpc.header_blocks` (HEADERS, CONTINUATION, new streams),
    :mod:`~pyserve.frontends.grpc.control_frames` (SETTINGS, WINDOW_UPDATE, PING, ...),
    :mod:`~pyserve.frontends.grpc.frame_reader` (``data_received``, frame dispatch).
    This class adds the transport's callbacks.

    :param server: the listening server (handlers, options, the set of open connections).
    """

    def __init__(self, server: GrpcServer) -> None:
        super().__init__(server)
        options = server.options
        self.guard = ConnectionGuard(
            self.loop, server.buffer_budget, server.connection_buffer, options.idle_timeout_secs,
            options.message_timeout_secs, self._idle, self._slow, lambda: (self._opened, len(self._streams)),
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.server.stopping:  # accepted while the server stops: nobody would close it later
            self._closed = True
            transport.abort()  # type: ignore[attr-defined]
            return
        self.peer = _peer_string(transport)
        refusal = self.server.refusal(self)
        if refusal:  # over --grpc-max-connections: a readable refusal, then close
            self._closed = True
            transport.write(SERVER_PREFACE + h2.goaway(0, h2.ENHANCE_YOUR_CALM, refusal.encode()))  # type: ignore[attr-defined]
            transport.close()
            return
        self.server.connections.add(self)
        self._arm_keepalive()
        self.guard.start()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.server.connections.discard(self)
        for handle in (self._keepalive_handle, self._keepalive_timeout):
            if handle is not None:
                handle.cancel()
        for stream in list(self._streams.values()):
            self._cancel_stream(stream)
        self._streams.clear()
        self._ready.clear()
        self.guard.stop()
        self._blocked.clear()
        self._wake_drain()
        self.server.connection_closed(self)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self.guard.control_owed = 0
        self._wake_drain()

    def eof_received(self) -> bool | None:
        return None  # close the transport


def _peer_string(transport: asyncio.BaseTransport) -> str:
    """The peer as grpc writes it: ``ipv4:host:port``, ``ipv6:[host]:port`` or ``unix:path``."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        host, port = peer[0], peer[1]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
    return f"unix:{peer or ''}"
