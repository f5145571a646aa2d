"""One HTTP/2 stream of a gRPC connection: the state of the call it carries.

A :class:`Stream` is plain state, owned and changed only by its connection
(:mod:`pyserve.frontends.grpc.connection`); the call's context (:mod:`pyserve.frontends.grpc.call`)
and the connection's guard hold a reference to it. The context writes the call's reply through
``stream.connection`` (:class:`~pyserve.frontends.grpc.replies.CallReplies`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyserve.frontends.grpc.call import CallContext, RequestMessages
    from pyserve.frontends.grpc.replies import CallReplies


class Stream:
    """One call's stream: its state on this connection (owned by the connection)."""

    __slots__ = (
        "id", "connection", "handler", "context", "task", "messages", "message", "filled", "head",
        "compressed", "unary_request", "send_window", "pending", "headers_sent", "remote_closed",
        "finished", "cancelled", "deadline_handle", "deadline_hit", "encoding", "accept_gzip",
        "accept_deflate", "unacked", "drain_waiter", "initial_metadata", "path", "pending_bytes", "writes",
        "expected", "held",
    )

    def __init__(self, stream_id: int, connection: CallReplies, send_window: int) -> None:
        self.id = stream_id
        self.connection = connection
        self.handler: Any = None
        self.context: CallContext | None = None
        self.task: asyncio.Task[None] | None = None
        self.messages: RequestMessages | None = None  # client-streaming calls
        self.message: bytearray | None = None  # a message being filled across DATA frames, as they come
        self.expected = 0  # the length its prefix declared
        self.held = 0  # bytes counted against the connection's buffer budget (guard)
        self.filled = 0
        self.head = b""  # a message prefix split across DATA frames
        self.compressed = False
        self.unary_request: Any = None  # the one request message of a unary call
        self.send_window = send_window
        self.pending: deque[Any] = deque()  # data (memoryview) and frames (bytes) behind flow control
        self.pending_bytes = 0  # the length of everything in ``pending``, kept as items come and go
        self.writes = 0  # messages written by write_message (a turn for the loop every YIELD_EVERY)
        self.headers_sent = False
        self.remote_closed = False
        self.finished = False  # trailers (or a reset) are queued: the call is over
        self.cancelled = False
        self.deadline_handle: asyncio.TimerHandle | None = None
        self.deadline_hit = False
        self.encoding = "identity"
        self.accept_gzip = False
        self.accept_deflate = False
        self.unacked = 0
        self.drain_waiter: asyncio.Future[None] | None = None
        self.initial_metadata: list[tuple[bytes, bytes]] | None = None
        self.path = ""
