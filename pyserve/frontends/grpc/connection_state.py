"""What one gRPC connection advertises and keeps: its limits and its state.

:class:`ConnectionState` is the bottom of the layers :class:`~pyserve.frontends.grpc.connection.GrpcConnection`
is made of (each layer a module: writing, lifetime, replies, stream endings, running calls,
request bodies, header blocks, control frames, frame reading). It holds every field those layers
share; a layer uses the fields and the methods of the layers below it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.grpc.guard import ConnectionGuard
from pyserve.runtime.scheduling import client_activity

if TYPE_CHECKING:
    from pyserve.frontends.grpc.http2_stream import Stream
    from pyserve.frontends.grpc.listener import GrpcServer

RECEIVE_WINDOW = 16 * 1024 * 1024
"""Flow-control window granted to each stream, and to the connection (fewer WINDOW_UPDATEs)."""
RECEIVE_FRAME = 1024 * 1024
"""``SETTINGS_MAX_FRAME_SIZE`` advertised: large DATA frames mean fewer frames to parse."""
MAX_CONCURRENT_STREAMS = 4096
MAX_HEADER_LIST = 64 * 1024
MAX_CONTINUATIONS = 32
"""CONTINUATION frames one header block may take (a block of ``MAX_HEADER_LIST`` needs 4 frames
of the smallest frame size a peer may use)."""
MAX_MESSAGE_DETAILS = 8192
"""``grpc-message`` is cut to this many bytes: a header list must fit the peer's limit."""
DRAIN_ABOVE = 4 * 1024 * 1024
"""A streaming reply waits for the peer once this much of it is queued behind flow control."""
YIELD_EVERY = 32
"""A streaming reply gives the event loop a turn after this many messages, even when nothing
makes it wait: other connections, resets and the peer's window updates are then handled."""

SERVER_PREFACE = h2.settings({
    h2.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
    h2.INITIAL_WINDOW_SIZE: RECEIVE_WINDOW,
    h2.MAX_FRAME_SIZE: RECEIVE_FRAME,
    h2.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
}) + h2.window_update(0, RECEIVE_WINDOW - h2.DEFAULT_WINDOW)
"""The server's SETTINGS and connection window, the same for every connection."""


class ConnectionState(asyncio.Protocol):
    """The fields of one gRPC connection, shared by the layers that make it up.

    :param server: the listening server (handlers, options, the set of open connections).
    """

    guard: ConnectionGuard
    """Memory, time and abuse limits; made by ``GrpcConnection``, whose layers hold its callbacks."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.max_message = server.options.max_message_bytes
        self.loop = asyncio.get_running_loop()  # built by the loop's protocol factory
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.activity_key = client_activity.connection_key()
        self._buffer: bytearray | None = None
        self._preface = False
        self._decoder = h2.HeaderDecoder(MAX_HEADER_LIST)
        self._streams: dict[int, Stream] = {}
        self._last_stream_id = 0
        self._continuation: tuple[int, int, bytearray] | None = None  # stream id, flags, block so far
        self._continuations = 0  # CONTINUATION frames of the block so far
        self._ready: list[Stream] = []  # unary calls completed by the current read, started at its end
        self._opened = 0  # streams opened on this connection (the idle check)
        self._data_left = 0  # bytes of a DATA frame still to arrive
        self._data_stream: Stream | None = None
        self._data_end = False
        # sending
        self._out: list[Any] = []
        self._flush_scheduled = False
        self._receiving = False  # inside data_received, which writes what was queued at its end
        self._opened_in_read = 0  # streams opened by the current data_received (client_activity)
        self._paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self.send_window = h2.DEFAULT_WINDOW
        self.peer_initial_window = h2.DEFAULT_WINDOW
        self.peer_max_frame = h2.DEFAULT_MAX_FRAME
        self._blocked: dict[int, Stream] = {}  # streams waiting for the connection window
        self._unacked = 0  # received bytes not yet returned to the peer's connection window
        # lifetime
        self.closing = False  # GOAWAY sent: no new streams
        self._closed = False
        self._ping_strikes = 0
        self._last_ping = 0.0
        self._data_since_ping = True
        self._keepalive_handle: asyncio.TimerHandle | None = None
        self._keepalive_timeout: asyncio.TimerHandle | None = None

    def _forget(self, stream: Stream) -> None:
        """Drop a finished stream once its last frames are out (``stream_lifecycle``)."""
        raise NotImplementedError
