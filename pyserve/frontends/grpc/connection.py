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
import functools
import inspect
import logging
import zlib
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc

from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.grpc.call import (
    AbortError,
    CallCancelled,
    CallContext,
    RequestMessages,
    encode_metadata,
)
from pyserve.frontends.grpc.codec import WireParts
from pyserve.frontends.grpc.eager import start_eagerly
from pyserve.frontends.grpc.guard import ConnectionGuard
from pyserve.frontends.http.body import TooLarge, inflate
from pyserve.frontends.restricted import GRPC_CATEGORIES
from pyserve.runtime.scheduling import client_activity

if TYPE_CHECKING:
    from pyserve.frontends.grpc.listener import GrpcServer

log = logging.getLogger("pyserve.frontends.grpc")

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

_CONTENT_TYPE = h2.literal(b"content-type", b"application/grpc")
_RESPONSE_HEADERS = h2.STATUS_200 + _CONTENT_TYPE
_ENCODINGS = {"identity", "gzip", "deflate"}
_ACCEPT_ENCODING = h2.literal(b"grpc-accept-encoding", b"identity,deflate,gzip")
_TRAILERS_OK = h2.literal(b"grpc-status", b"0")
_PREFIX_PLAIN = 0


@functools.lru_cache(maxsize=64)
def _accepted_compressions(value: str) -> tuple[bool, bool]:
    """(gzip, deflate) accepted by a ``grpc-accept-encoding`` value (clients repeat one value)."""
    accepted = {item.strip() for item in value.split(",")}
    return "gzip" in accepted, "deflate" in accepted


class Stream:
    """One call's stream: its state on this connection (owned by the connection)."""

    __slots__ = (
        "id", "connection", "handler", "context", "task", "messages", "message", "filled", "head",
        "compressed", "unary_request", "send_window", "pending", "headers_sent", "remote_closed",
        "finished", "cancelled", "deadline_handle", "deadline_hit", "encoding", "accept_gzip",
        "accept_deflate", "unacked", "drain_waiter", "initial_metadata", "path", "pending_bytes", "writes",
        "expected", "held",
    )

    def __init__(self, stream_id: int, connection: GrpcConnection, send_window: int) -> None:
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


class GrpcConnection(asyncio.Protocol):
    """The server side of one HTTP/2 connection carrying gRPC calls.

    :param server: the listening server (handlers, options, the set of open connections).
    """

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        options = server.options
        self.max_message = options.max_message_bytes
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
        self.guard = ConnectionGuard(
            self.loop, server.buffer_budget, server.connection_buffer, options.idle_timeout_secs,
            options.message_timeout_secs, self._idle, self._slow, lambda: (self._opened, len(self._streams)),
        )

    # -- asyncio.Protocol ------------------------------------------------------------------------
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
            transport.write(_SERVER_PREFACE + h2.goaway(0, h2.ENHANCE_YOUR_CALM, refusal.encode()))  # type: ignore[attr-defined]
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

    # -- receiving -------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self._receiving = True
        self._opened_in_read = 0
        try:
            self._receive(data)
            if self._ready and not self._closed:
                self._start_ready()
        finally:
            self._receiving = False
        if not self._closed:
            self._flush()

    def _start_ready(self) -> None:
        """Start the unary calls this read completed, unless a frame after them reset them."""
        ready, self._ready = self._ready, []
        for stream in ready:
            if not stream.finished and stream.task is None:
                stream.task = self._start_unary(stream)

    def _receive(self, data: bytes) -> None:
        """Parse ``data``; everything its frames and the calls they finish queued is written at
        the end (which is why ``_schedule_flush`` does nothing meanwhile)."""
        position = 0
        if self._buffer:
            position = self._complete_leftover(data)
            if position < 0:
                return
        buffer: bytes | bytearray = data
        view = memoryview(buffer)
        end = len(buffer)
        try:
            if not self._preface:
                if end < len(h2.PREFACE):
                    if not h2.PREFACE.startswith(bytes(view[:end])):
                        self._not_http2()
                        return
                    self._buffer = bytearray(buffer)
                    return
                if view[:len(h2.PREFACE)] != h2.PREFACE:
                    self._not_http2()
                    return
                self._preface = True
                position = len(h2.PREFACE)
                # the server's preface follows the client's (an HTTP/1 client gets a readable answer)
                self._out.append(_SERVER_PREFACE)
            while position < end:
                if self._data_left:
                    take = min(self._data_left, end - position)
                    self._data_left -= take
                    self._receive_data(view[position:position + take], take, self._data_left == 0 and self._data_end)
                    position += take
                    continue
                if end - position < 9:
                    break
                length = (buffer[position] << 16) | (buffer[position + 1] << 8) | buffer[position + 2]
                kind = buffer[position + 3]
                flags = buffer[position + 4]
                stream_id = int.from_bytes(view[position + 5:position + 9], "big") & 0x7FFFFFFF
                if length > RECEIVE_FRAME:
                    raise h2.ConnectionError_(h2.FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds {RECEIVE_FRAME}")
                if kind == h2.DATA and not flags & h2.PADDED and end - position - 9 < length:
                    position += 9  # a large DATA frame: its payload is taken as it arrives
                    self._begin_data(stream_id, flags, length)
                    continue
                if end - position - 9 < length:
                    break
                payload = view[position + 9:position + 9 + length]
                position += 9 + length
                self._frame(kind, flags, stream_id, payload)
                if self._closed:
                    return
        except h2.ConnectionError_ as exc:
            self._connection_error(exc.code, str(exc))
            return
        except Exception as exc:  # a bug: this connection ends, the server and other calls go on
            log.exception("gRPC connection from %s failed", self.peer)
            self._connection_error(h2.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
            return
        if position < end:
            self._buffer = bytearray(view[position:])
        else:
            self._buffer = None
        if self._unacked >= RECEIVE_WINDOW // 4:
            self._write(h2.window_update(0, self._unacked))
            self._unacked = 0

    def _complete_leftover(self, data: bytes) -> int:
        """Finish the frame (or frame header) left over from the last read with the start of
        ``data``; the offset in ``data`` where parsing goes on, or -1 if ``data`` was all used.

        Only the missing bytes are copied: the rest of ``data`` is parsed where it lies.
        """
        leftover = self._buffer
        assert leftover is not None
        if not self._preface:
            self._buffer = None
            merged = bytes(leftover) + data
            self._receive(merged)
            return -1
        if len(leftover) < 9:
            take = 9 - len(leftover)
            if len(data) < take:
                leftover += data
                return -1
            leftover += data[:take]
            length = (leftover[0] << 16) | (leftover[1] << 8) | leftover[2]
            kind, flags = leftover[3], leftover[4]
            if kind == h2.DATA and not flags & h2.PADDED and length <= RECEIVE_FRAME:
                self._buffer = None
                stream_id = int.from_bytes(leftover[5:9], "big") & 0x7FFFFFFF
                try:
                    self._begin_data(stream_id, flags, length)
                    if length == 0:
                        self._receive_data(memoryview(b""), 0, self._data_end)
                except h2.ConnectionError_ as exc:
                    self._connection_error(exc.code, str(exc))
                    return -1
                return take
            consumed = take
        else:
            consumed = 0
            length = (leftover[0] << 16) | (leftover[1] << 8) | leftover[2]
        if length > RECEIVE_FRAME:
            self._buffer = None
            self._connection_error(h2.FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds {RECEIVE_FRAME}")
            return -1
        missing = 9 + length - len(leftover)
        if len(data) - consumed < missing:
            leftover += data[consumed:]
            return -1
        self._buffer = None
        self._receive(bytes(leftover) + data[consumed:consumed + missing])
        return -1 if self._closed else consumed + missing

    def _not_http2(self) -> None:
        """Bytes that are not the HTTP/2 preface: an HTTP/1 client on the gRPC port."""
        assert self.transport is not None
        body = b'{"error":"this port serves gRPC (HTTP/2); HTTP/1.x requests belong on the HTTP port"}'
        self.transport.write(b"HTTP/1.1 505 HTTP Version Not Supported\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self._closed = True
        self.transport.close()

    def _frame(self, kind: int, flags: int, stream_id: int, payload: memoryview) -> None:
        if self._continuation is not None and kind != h2.CONTINUATION:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "expected CONTINUATION")
        if kind == h2.DATA:
            if flags & h2.PADDED:
                payload = _unpad(payload)
            self._begin_data(stream_id, flags, len(payload))
            self._data_left = 0
            self._receive_data(payload, len(payload), bool(flags & h2.END_STREAM))
        elif kind == h2.HEADERS:
            if stream_id == 0:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "HEADERS on stream 0")
            if flags & h2.PADDED:
                payload = _unpad(payload)
            if flags & h2.PRIORITY_FLAG:
                if len(payload) < 5:
                    raise h2.ConnectionError_(h2.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
                if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:
                    flags |= _SELF_DEPENDENT  # the block is decoded (HPACK state), then the stream reset
                payload = payload[5:]
            if len(payload) > MAX_HEADER_LIST:
                raise h2.ConnectionError_(h2.ENHANCE_YOUR_CALM, f"header block larger than {MAX_HEADER_LIST} bytes")
            if flags & h2.END_HEADERS:
                self._headers(stream_id, flags, bytes(payload))
            else:
                self._continuation = (stream_id, flags, bytearray(payload))
                self._continuations = 0
                self.guard.header_block_begins()
        elif kind == h2.CONTINUATION:
            if self._continuation is None or self._continuation[0] != stream_id:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "unexpected CONTINUATION")
            block = self._continuation[2]
            block += payload
            self._continuations += 1
            if len(block) > MAX_HEADER_LIST:
                raise h2.ConnectionError_(h2.ENHANCE_YOUR_CALM, f"header block larger than {MAX_HEADER_LIST} bytes")
            if self._continuations > MAX_CONTINUATIONS and not flags & h2.END_HEADERS:
                raise h2.ConnectionError_(h2.ENHANCE_YOUR_CALM,
                                          f"header block in more than {MAX_CONTINUATIONS} CONTINUATION frames")
            if flags & h2.END_HEADERS:
                _, first_flags, _ = self._continuation
                self._continuation = None
                self.guard.header_started = None
                self._headers(stream_id, first_flags, bytes(block))
        elif kind == h2.SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == h2.WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == h2.PING:
            self._ping(flags, stream_id, payload)
        elif kind == h2.RST_STREAM:
            if stream_id == 0 or len(payload) != 4:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "malformed RST_STREAM")
            stream = self._streams.pop(stream_id, None)
            if stream is not None:
                self._blocked.pop(stream_id, None)
                unanswered = not stream.finished
                self._cancel_stream(stream)
                if unanswered and not self.guard.reset_allowed():  # "rapid reset" (CVE-2023-44487)
                    raise h2.ConnectionError_(h2.ENHANCE_YOUR_CALM, "too many calls reset")
        elif kind == h2.GOAWAY:
            self.closing = True
            if not self._streams:
                self._close()
        elif kind == h2.PUSH_PROMISE:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "a client cannot push")
        elif kind == h2.PRIORITY:
            if stream_id == 0:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                raise h2.ConnectionError_(h2.FRAME_SIZE_ERROR, "malformed PRIORITY")
            if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:  # RFC 9113 §5.3.1
                stream = self._streams.get(stream_id)
                if stream is not None:
                    self._reset(stream, h2.PROTOCOL_ERROR)
                else:
                    self._control(h2.rst_stream(stream_id, h2.PROTOCOL_ERROR))
        # unknown frame types are ignored (RFC 9113 §4.1)

    def _settings(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id != 0:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & h2.ACK:
            if payload:
                raise h2.ConnectionError_(h2.FRAME_SIZE_ERROR, "SETTINGS acknowledgement with a payload")
            return
        if len(payload) % 6:
            raise h2.ConnectionError_(h2.FRAME_SIZE_ERROR, "malformed SETTINGS")
        for offset in range(0, len(payload), 6):
            key = int.from_bytes(payload[offset:offset + 2], "big")
            value = int.from_bytes(payload[offset + 2:offset + 6], "big")
            if key == h2.INITIAL_WINDOW_SIZE:
                if value > h2.MAX_WINDOW:
                    raise h2.ConnectionError_(h2.FLOW_CONTROL_ERROR, "initial window size too large")
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for stream in self._streams.values():
                    stream.send_window += delta
            elif key == h2.ENABLE_PUSH:
                if value > 1:
                    raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH must be 0 or 1")
            elif key == h2.MAX_FRAME_SIZE:
                if not h2.DEFAULT_MAX_FRAME <= value <= 16_777_215:
                    raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "invalid max frame size")
                self.peer_max_frame = value
        self._control(_SETTINGS_ACK)
        for stream in list(self._streams.values()):
            if stream.pending:
                self._send_pending(stream)

    def _window_update(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise h2.ConnectionError_(h2.FRAME_SIZE_ERROR, "malformed WINDOW_UPDATE")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            if increment == 0:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > h2.MAX_WINDOW:
                raise h2.ConnectionError_(h2.FLOW_CONTROL_ERROR, "connection window overflow")
            blocked, self._blocked = self._blocked, {}
            for stream in blocked.values():
                self._send_pending(stream)
            return
        window_stream = self._streams.get(stream_id)
        if window_stream is None:
            return  # a stream that already ended
        stream = window_stream
        if increment == 0:
            self._reset(stream, h2.PROTOCOL_ERROR)
            return
        stream.send_window += increment
        if stream.send_window > h2.MAX_WINDOW:
            self._reset(stream, h2.FLOW_CONTROL_ERROR)
            return
        if stream.pending:
            self._send_pending(stream)

    def _ping(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id != 0 or len(payload) != 8:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "malformed PING")
        if flags & h2.ACK:
            if self._keepalive_timeout is not None:
                self._keepalive_timeout.cancel()
                self._keepalive_timeout = None
            return
        options = self.server.options
        now = self.loop.time()
        if not self._data_since_ping and options.http2_max_ping_strikes > 0:
            idle = not self._streams and not options.keepalive_permit_without_calls
            interval = 7200.0 if idle else options.http2_min_recv_ping_interval_without_data_ms / 1000.0
            if now - self._last_ping < interval:
                self._ping_strikes += 1
                if self._ping_strikes > options.http2_max_ping_strikes:
                    raise h2.ConnectionError_(h2.ENHANCE_YOUR_CALM, "too_many_pings")
        self._last_ping = now
        self._data_since_ping = False
        self._control(h2.frame(h2.PING, h2.ACK, 0, bytes(payload)))

    # -- streams ---------------------------------------------------------------------------------
    def _headers(self, stream_id: int, flags: int, block: bytes) -> None:
        headers, problem = self._decoder.decode(block)  # always: the HPACK table must follow every block
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers from the client end its stream
            if not flags & h2.END_STREAM or problem or flags & _SELF_DEPENDENT:
                self._reset(stream, h2.PROTOCOL_ERROR)
                return
            self._remote_end(stream)
            return
        if stream_id <= self._last_stream_id:
            if any(name.startswith(":") for name, _ in headers):  # a new request, not late trailers
                raise h2.ConnectionError_(
                    h2.PROTOCOL_ERROR, f"stream id {stream_id} is not above the last one ({self._last_stream_id})")
            return  # trailers of a stream that already ended here
        if not stream_id & 1:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "even stream id from a client")
        self._last_stream_id = stream_id
        if problem or flags & _SELF_DEPENDENT:  # malformed (RFC 9113 §8.1.1): a stream error
            log.debug("gRPC connection from %s: stream %d reset: %s", self.peer, stream_id,
                      problem or "the stream depends on itself")
            self._control(h2.rst_stream(stream_id, h2.PROTOCOL_ERROR))
            return
        if self.closing or len(self._streams) >= MAX_CONCURRENT_STREAMS:
            self._control(h2.rst_stream(stream_id, h2.REFUSED_STREAM))
            return
        stream = Stream(stream_id, self, self.peer_initial_window)
        path = method = content_type = ""
        timeout: float | None = None
        for name, value in headers:
            if name == ":path":
                path = value
            elif name == ":method":
                method = value
            elif name == "content-type":
                content_type = value
            elif name == "grpc-timeout":
                timeout = h2.parse_timeout(value)
            elif name == "grpc-encoding":
                stream.encoding = value
            elif name == "grpc-accept-encoding":
                stream.accept_gzip, stream.accept_deflate = _accepted_compressions(value)
        self._streams[stream_id] = stream
        self._opened += 1
        self._opened_in_read += 1
        client_activity.request_from(self.activity_key, together=self._opened_in_read > 1 or len(self._streams) > 1)
        stream.path = path
        deadline = None if timeout is None else self.loop.time() + timeout
        context = stream.context = CallContext(stream, headers, deadline, self.peer)
        if flags & h2.END_STREAM:
            stream.remote_closed = True
        if method != "POST" or not content_type.startswith("application/grpc"):
            self._http_error(stream, 405 if method != "POST" else 415)
            return
        handler = self.server.lookup(path)
        if handler is None:
            self._fail(stream, grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {path}")
            return
        denied = self._restricted(path, headers)
        if denied:  # before any byte of the body is taken
            self._fail(stream, grpc.StatusCode.UNAVAILABLE, denied)
            return
        if stream.encoding not in _ENCODINGS:
            self._fail(stream, grpc.StatusCode.UNIMPLEMENTED,
                       f"Compression algorithm '{stream.encoding}' is not supported (identity, deflate, gzip)")
            return
        stream.handler = handler
        if timeout is not None and timeout <= 0:  # expired on arrival: nothing to run
            stream.deadline_hit = True
            self._fail(stream, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            return
        if timeout is not None:
            stream.deadline_handle = self.loop.call_later(timeout, self._deadline, stream)
        if handler.request_streaming:
            stream.messages = RequestMessages(handler.request_deserializer)
            context.attach_messages(stream.messages)
            stream.task = self.loop.create_task(self._run(stream))
        if stream.remote_closed:
            self._remote_end(stream)

    def _restricted(self, path: str, headers: Sequence[tuple[str, str]]) -> str:
        """The refusal of a call to a restricted category without its header, or ""."""
        rules = self.server.restrictions
        if not rules:
            return ""
        rule = rules.get(GRPC_CATEGORIES.get(path.rsplit("/", 1)[-1], ""))
        if rule is None or (rule.key, rule.value) in headers:
            return ""
        return rule.grpc_message

    def _begin_data(self, stream_id: int, flags: int, length: int) -> None:
        if self._continuation is not None:  # also for DATA taken as it arrives, not only in _frame
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "expected CONTINUATION")
        if stream_id == 0:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "DATA on stream 0")
        stream = self._streams.get(stream_id)
        if stream is None and stream_id > self._last_stream_id:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "DATA on an idle stream")
        if stream is not None and stream.remote_closed:
            self._reset(stream, h2.STREAM_CLOSED)
            stream = None
        self._data_stream = stream
        self._data_left = length
        self._data_end = bool(flags & h2.END_STREAM)

    def _receive_data(self, chunk: memoryview, length: int, ends: bool) -> None:
        self._unacked += length
        stream = self._data_stream
        if stream is None or stream.finished:
            return
        if chunk:
            stream.unacked += length
            self._stream_bytes(stream, chunk)
            if stream.unacked >= RECEIVE_WINDOW // 4 and not stream.finished:
                self._write(h2.window_update(stream.id, stream.unacked))
                stream.unacked = 0
        if ends and not stream.finished:
            self._remote_end(stream)

    def _stream_bytes(self, stream: Stream, chunk: memoryview) -> None:
        """Cut a stream's DATA bytes into gRPC messages (5-byte prefix + message).

        A message whole in ``chunk`` is taken with one copy; one spread over several DATA frames
        grows as its bytes arrive (counted against the connection's buffer budget)."""
        position, end = 0, len(chunk)
        while position < end:
            message = stream.message
            if message is not None:
                take = min(stream.expected - len(message), end - position)
                if not self._hold(stream, take):
                    return
                message += chunk[position:position + take]
                position += take
                if len(message) == stream.expected:
                    stream.message = None
                    self.guard.release(stream)
                    self._message(stream, message)
                continue
            if stream.head or end - position < 5:
                take = min(5 - len(stream.head), end - position)
                stream.head += bytes(chunk[position:position + take])
                position += take
                if len(stream.head) < 5:
                    return
                prefix, stream.head = stream.head, b""
            else:
                prefix = chunk[position:position + 5]  # type: ignore[assignment]  # a view: only indexed
                position += 5
            flag = prefix[0]
            length = int.from_bytes(prefix[1:5], "big")
            if flag > 1:
                self._fail(stream, grpc.StatusCode.INTERNAL, f"invalid gRPC message flag {flag}")
                return
            if length > self.max_message:
                self._fail(stream, grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"Received message larger than max ({length} vs. {self.max_message})")
                return
            stream.compressed = flag == 1
            if end - position >= length:
                self._message(stream, bytes(chunk[position:position + length]))
                position += length
                if stream.finished:
                    return
            else:
                stream.expected = length
                stream.message = bytearray()

    def _hold(self, stream: Stream, size: int) -> bool:
        """Count ``size`` more bytes of a stream's incomplete message; False (the call ended with
        RESOURCE_EXHAUSTED) when the connection's or the server's budget would be passed."""
        refusal = self.guard.hold(stream, size)
        if refusal:
            self._fail(stream, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            return False
        return True

    def _message(self, stream: Stream, message: bytes | bytearray) -> None:
        if stream.compressed:
            room = min(self.max_message, self.guard.available())
            try:
                message = inflate(message, stream.encoding, room)
            except TooLarge as exc:
                limit = (f"--grpc-max-message-size {self.max_message}" if room == self.max_message
                         else f"the {room} byte(s) left of the server's buffers for incomplete messages")
                self._fail(stream, grpc.StatusCode.RESOURCE_EXHAUSTED, f"Received message larger than max ({exc}; {limit})")
                return
            except ValueError as exc:
                self._fail(stream, grpc.StatusCode.INTERNAL, f"cannot decompress the request message: {exc}")
                return
        if stream.messages is not None:
            stream.messages.push(message)
        elif stream.unary_request is None:
            stream.unary_request = message
        else:
            self._fail(stream, grpc.StatusCode.UNIMPLEMENTED, "a unary call got more than one request message")

    def _remote_end(self, stream: Stream) -> None:
        stream.remote_closed = True
        if stream.finished:
            self._forget(stream)
            return
        if stream.message is not None or stream.head:
            self._fail(stream, grpc.StatusCode.INTERNAL, "the request ended inside a message")
            return
        if stream.messages is not None:
            stream.messages.end()
        elif stream.handler is not None and stream.task is None:
            if stream.unary_request is None:
                self._fail(stream, grpc.StatusCode.UNIMPLEMENTED, "a unary call got no request message")
                return
            if self._receiving:  # started once the whole read is parsed (a reset after it withdraws it)
                self._ready.append(stream)
            else:
                stream.task = self._start_unary(stream)

    def _start_unary(self, stream: Stream) -> asyncio.Task[None] | None:
        """Run a unary call whose request is complete; its task, or None if it already ended.

        While this connection's client is the only one calling (or the connection is the
        server's only one) the call runs at once, up to its first wait: nothing else could join
        its answer's write. Otherwise it becomes a task, and calls arriving on several
        connections in one loop turn run, and answer, together in the next.
        """
        if len(self.server.connections) != 1 and not client_activity.one_client():
            return self.loop.create_task(self._run(stream))
        try:
            return start_eagerly(self.loop, self._run(stream))
        except Exception:  # _run answers its call's own errors: this is a bug in it
            log.exception("gRPC call %s failed", stream.path)
            self._fail(stream, grpc.StatusCode.INTERNAL, "internal error")
            return None

    def _deadline(self, stream: Stream) -> None:
        stream.deadline_handle = None
        if stream.finished:
            return
        stream.deadline_hit = True
        # answered here, not by the task: a task cancelled before its first step never runs _run
        self._fail(stream, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def _cancel_stream(self, stream: Stream) -> None:
        """The peer reset the stream or went away: the call is cancelled."""
        stream.cancelled = True
        was_finished, stream.finished = stream.finished, True
        stream.pending.clear()
        stream.pending_bytes = 0
        stream.message = None
        self.guard.release(stream)
        if stream.deadline_handle is not None:
            stream.deadline_handle.cancel()
        if stream.messages is not None:
            stream.messages.fail(CallCancelled("the call was cancelled"))
        if stream.task is not None and not stream.task.done():
            self._cancel_task(stream, stream.task)
        elif not was_finished and stream.context is not None:
            stream.context.run_done_callbacks()
        self._wake_stream(stream)

    def _reset(self, stream: Stream, code: int) -> None:
        """Reset a stream from this side (RST_STREAM ``code``) and cancel its call."""
        self._streams.pop(stream.id, None)
        self._blocked.pop(stream.id, None)
        self._write(h2.rst_stream(stream.id, code))
        self._cancel_stream(stream)

    def _forget(self, stream: Stream) -> None:
        """Drop a finished stream once its last frames are out and the client ended its side."""
        if stream.pending:
            return
        if not stream.remote_closed:
            stream.remote_closed = True  # the call is over: the rest of the request is not wanted
            self._write(h2.rst_stream(stream.id, h2.NO_ERROR))
        self._streams.pop(stream.id, None)
        if self.closing and not self._streams:
            self._close()

    # -- running a call --------------------------------------------------------------------------
    async def _run(self, stream: Stream) -> None:
        context = stream.context
        assert context is not None
        handler = stream.handler
        try:
            if self.server.interceptors:
                handler = await self.server.intercept(handler, stream, context)
                if handler is None:
                    context.set_code(grpc.StatusCode.UNIMPLEMENTED)
                    context.set_details("Method not found")
                    self._finish(stream)
                    return
            if handler.request_streaming:
                request: Any = stream.messages
            else:
                deserialize = handler.request_deserializer
                try:
                    request = stream.unary_request if deserialize is None else deserialize(stream.unary_request)
                except Exception:
                    context.set_code(grpc.StatusCode.INTERNAL)
                    context.set_details("Exception deserializing request!")
                    self._finish(stream)
                    return
                stream.unary_request = None
            if handler.response_streaming:
                behaviour = handler.stream_stream if handler.request_streaming else handler.unary_stream
                result = behaviour(request, context)
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        await self.write_message(stream, item)
                elif inspect.isawaitable(result):
                    await result
                else:
                    for item in result:
                        await self.write_message(stream, item)
            else:
                behaviour = handler.stream_unary if handler.request_streaming else handler.unary_unary
                response = behaviour(request, context)
                if inspect.isawaitable(response):
                    response = await response
                if context.code() == grpc.StatusCode.OK:
                    if response is None:
                        context.set_code(grpc.StatusCode.INTERNAL)
                        context.set_details("the servicer returned no response")
                    else:
                        self._send_message(stream, response, handler.response_serializer)
            self._finish(stream)
        except AbortError:
            self._finish(stream)
        except asyncio.CancelledError:
            if stream.deadline_hit and not stream.finished:
                context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
                context.set_details("Deadline Exceeded")
                self._finish(stream)
            elif not stream.finished and not self._closed:
                self._reset(stream, h2.CANCEL)  # the server is stopping
        except CallCancelled:
            pass
        except Exception as exc:
            if not stream.finished:
                log.exception("gRPC method %s failed", _method_name(handler))
                context.set_code(grpc.StatusCode.UNKNOWN)
                context.set_details(f"Unexpected {type(exc)}: {exc}")
                self._finish(stream)
        finally:
            if stream.deadline_handle is not None:
                stream.deadline_handle.cancel()
                stream.deadline_handle = None
            context.run_done_callbacks()

    def send_initial_metadata(self, stream: Stream, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        if stream.headers_sent:
            raise RuntimeError("initial metadata was already sent")
        stream.initial_metadata = encode_metadata(metadata)
        self._send_headers(stream, stream.context.compression if stream.context else None)

    async def write_message(self, stream: Stream, message: Any) -> None:
        """Send one message of a streaming reply, waiting while the peer is not reading."""
        if stream.finished:
            raise CallCancelled("the call has ended")
        serializer = stream.handler.response_serializer if stream.handler is not None else None
        self._send_message(stream, message, serializer)
        self._schedule_flush()
        stream.writes += 1
        if not (self._paused or stream.pending_bytes > DRAIN_ABOVE):
            if stream.writes % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # one loop turn: the flush, other connections, a reset
        while (self._paused or stream.pending_bytes > DRAIN_ABOVE) and not stream.finished:
            waiter = self.loop.create_future()
            stream.drain_waiter = waiter  # woken when the stream's queue empties (_wake_stream)
            if self._paused:  # ... or when the transport can take more (_wake_drain)
                self._drain_waiters.append(waiter)
            await waiter
        if stream.finished and stream.cancelled:
            raise CallCancelled("the call was cancelled")

    def _send_message(self, stream: Stream, message: Any, serializer: Any) -> None:
        context = stream.context
        compression = context.compression if context is not None else None
        if not stream.headers_sent:
            self._send_headers(stream, compression)
        compress = _response_encoding(stream, compression) is not None and not (context and context.next_uncompressed)
        if context is not None:
            context.next_uncompressed = False
        if type(message) is WireParts and not compress:
            self._send_parts(stream, message)
            return
        payload = message if serializer is None else serializer(message)
        flag = _PREFIX_PLAIN
        if compress:
            payload, flag = (_gzip(payload) if compression == grpc.Compression.Gzip else zlib.compress(payload)), 1
        length = len(payload)
        prefix = bytes((flag,)) + length.to_bytes(4, "big")
        total = length + 5
        if not stream.pending and total <= self.send_window and total <= stream.send_window and total <= self.peer_max_frame:
            self.send_window -= total
            stream.send_window -= total
            if length < 4096:
                self._out.append(h2.frame_header(h2.DATA, 0, stream.id, total) + prefix + payload)
            else:
                self._out.append(h2.frame_header(h2.DATA, 0, stream.id, total) + prefix)
                self._out.append(payload)
            self._data_since_ping = True
            return
        stream.pending.append(memoryview(prefix))
        stream.pending.append(memoryview(payload).cast("B") if length else memoryview(b""))
        stream.pending_bytes += total
        self._send_pending(stream)

    def _send_parts(self, stream: Stream, parts: WireParts) -> None:
        """A large serialized message whose pieces (views of the output arrays) are not joined."""
        pending = stream.pending
        pending.append(memoryview(b"\x00" + parts.nbytes.to_bytes(4, "big")))
        added = 5
        for part in parts:
            if len(part):
                view = part if type(part) is memoryview else memoryview(part)
                pending.append(view)
                added += len(view)
        stream.pending_bytes += added
        self._send_pending(stream)

    def _send_headers(self, stream: Stream, compression: grpc.Compression | None) -> None:
        stream.headers_sent = True
        block = _RESPONSE_HEADERS
        encoding = _response_encoding(stream, compression)
        if encoding is not None:
            block += h2.literal(b"grpc-encoding", encoding) + _ACCEPT_ENCODING
        if stream.initial_metadata:
            block += b"".join(h2.literal(name, value) for name, value in stream.initial_metadata)
        self._queue_frames(stream, _header_frames(stream.id, block, False, self.peer_max_frame))

    def _finish(self, stream: Stream) -> None:
        """Send the call's status (trailers, or a trailers-only reply) and end the stream."""
        if stream.finished:
            return
        context = stream.context
        code = context.code() if context is not None else grpc.StatusCode.OK
        details = context.details() if context is not None else ""
        trailing = context.trailing_metadata() if context is not None else ()
        stream.finished = True
        if stream.deadline_handle is not None:
            stream.deadline_handle.cancel()
            stream.deadline_handle = None
        if stream.message is not None or stream.held:
            stream.message = None
            self.guard.release(stream)
        if code == grpc.StatusCode.OK and not trailing and not details:
            block = _TRAILERS_OK
        else:
            block = h2.literal(b"grpc-status", str(code.value[0]).encode("ascii"))
            if details:
                block += h2.literal(b"grpc-message", h2.percent_encode(details)[:MAX_MESSAGE_DETAILS])
            if trailing:
                block += b"".join(h2.literal(name, value) for name, value in encode_metadata(trailing))
        if not stream.headers_sent:
            stream.headers_sent = True
            block = _RESPONSE_HEADERS + block  # trailers-only reply
        self._queue_frames(stream, _header_frames(stream.id, block, True, self.peer_max_frame))
        self._data_since_ping = True
        if stream.messages is not None and not stream.remote_closed:
            stream.messages.fail(CallCancelled("the call has ended"))
        self._forget(stream)
        self._schedule_flush()

    def _fail(self, stream: Stream, code: grpc.StatusCode, details: str) -> None:
        """End a call with ``code`` before (or instead of) its servicer function."""
        if stream.finished:
            return
        if stream.context is not None:
            stream.context.set_code(code)
            stream.context.set_details(details)
        task = stream.task
        self._finish(stream)
        if task is not None and not task.done():
            self._cancel_task(stream, task)
        elif task is None and stream.context is not None:
            stream.context.run_done_callbacks()

    @staticmethod
    def _cancel_task(stream: Stream, task: asyncio.Task[None]) -> None:
        """Cancel a call's task; its context's done callbacks run even if the task never started
        (``_run``, which runs them, is then never entered; running them twice is harmless)."""
        task.cancel()
        context = stream.context
        if context is not None:
            task.add_done_callback(lambda _: context.run_done_callbacks())

    def _http_error(self, stream: Stream, status: int) -> None:
        """A request that is not gRPC at all: an HTTP status, as gRPC servers answer it."""
        stream.finished = True
        block = h2.literal(b":status", str(status).encode("ascii"))
        self._queue_frames(stream, _header_frames(stream.id, block, True, self.peer_max_frame))
        self._forget(stream)

    # -- sending ---------------------------------------------------------------------------------
    def _queue_frames(self, stream: Stream, frames: bytes) -> None:
        if stream.pending:
            stream.pending.append(frames)
            stream.pending_bytes += len(frames)
        else:
            self._out.append(frames)

    def _send_pending(self, stream: Stream) -> None:
        """Send what flow control allows of a stream's queued data (frames follow in order)."""
        pending = stream.pending
        while pending:
            item = pending[0]
            if type(item) is bytes:
                self._out.append(item)
                pending.popleft()
                stream.pending_bytes -= len(item)
                continue
            allowed = min(self.send_window, stream.send_window, self.peer_max_frame)
            if not item:
                pending.popleft()
                continue
            if allowed <= 0:
                if self.send_window <= 0:
                    self._blocked[stream.id] = stream
                break
            chunk = item[:allowed]
            size = len(chunk)
            self._out.append(h2.frame_header(h2.DATA, 0, stream.id, size))
            self._out.append(chunk)
            self.send_window -= size
            stream.send_window -= size
            stream.pending_bytes -= size
            self._data_since_ping = True
            if size < len(item):
                pending[0] = item[size:]
            else:
                pending.popleft()
        self._schedule_flush()
        if not pending:
            self._wake_stream(stream)
            if stream.finished and stream.id in self._streams:
                self._forget(stream)

    def _write(self, data: bytes) -> None:
        self._out.append(data)

    def _control(self, frame: bytes) -> None:
        """Queue a control frame owed to the peer (an acknowledgement, a reset); a peer that
        keeps asking for them while it does not read is told to calm down and dropped."""
        if not self.guard.control_frame(self._paused):
            raise h2.ConnectionError_(h2.ENHANCE_YOUR_CALM, "too many control frames owed to a peer that does not read")
        self._out.append(frame)

    def _schedule_flush(self) -> None:
        if self._receiving:
            return  # data_received writes at its end (a call it finished at once included)
        if not self._flush_scheduled and self._out:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and self.transport is not None and not self._closed:
            out, self._out = self._out, []
            self.transport.writelines(out)

    def _wake_stream(self, stream: Stream) -> None:
        waiter = stream.drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_drain(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- lifetime --------------------------------------------------------------------------------
    def _connection_error(self, code: int, message: str) -> None:
        log.debug("gRPC connection from %s closed: %s", self.peer, message)
        self._write(h2.goaway(self._last_stream_id, code, message.encode("utf-8", "replace")[:256]))
        self._flush()
        if self._paused:  # a peer that does not read would keep the socket open for ever
            self._closed = True
            self.abort()
        else:
            self._close()

    def _idle(self) -> None:
        """No call for ``--grpc-idle-timeout-secs``: GOAWAY NO_ERROR, then close."""
        log.debug("gRPC connection from %s closed: idle", self.peer)
        self.goaway()

    def _slow(self, stream: Stream | None) -> None:
        """A message (``stream``) or a header block (None) took longer than
        ``--grpc-message-timeout-secs`` to arrive."""
        timeout = self.guard.message_timeout
        if stream is None:
            self._connection_error(h2.PROTOCOL_ERROR, f"header block not received within {timeout:g} s")
            return
        self._fail(stream, grpc.StatusCode.DEADLINE_EXCEEDED,
                   f"the request message was not received within {timeout:g} s (--grpc-message-timeout-secs)")
        self._schedule_flush()

    def goaway(self) -> None:
        """Refuse new streams (GOAWAY, NO_ERROR) and close once the open ones are done."""
        if self._closed or self.closing:
            return
        self.closing = True
        self._write(h2.goaway(self._last_stream_id, h2.NO_ERROR))
        self._flush()
        if not self._streams:
            self._close()

    def abort(self) -> None:
        """Close now, cancelling the calls still open."""
        if self.transport is not None:
            self.transport.abort()

    def _close(self) -> None:
        if self.transport is not None and not self._closed:
            self._flush()
            self._closed = True
            self.transport.close()

    def _arm_keepalive(self) -> None:
        interval = self.server.options.keepalive_time_ms / 1000.0
        if interval > 0 and interval < 10**8:
            self._keepalive_handle = self.loop.call_later(interval, self._keepalive)

    def _keepalive(self) -> None:
        self._keepalive_handle = None
        if self._closed:
            return
        options = self.server.options
        if self._preface and (self._streams or options.keepalive_permit_without_calls):
            self._write(h2.frame(h2.PING, 0, 0, b"pyserve\x00"))
            self._flush()
            if self._keepalive_timeout is None:
                self._keepalive_timeout = self.loop.call_later(
                    options.keepalive_timeout_ms / 1000.0, self._keepalive_expired)
        self._arm_keepalive()

    def _keepalive_expired(self) -> None:
        self._keepalive_timeout = None
        log.debug("gRPC connection from %s: keepalive ping not answered", self.peer)
        self.abort()


# -- helpers ---------------------------------------------------------------------------------------


_SELF_DEPENDENT = 0x100
"""Not an HTTP/2 flag: marks a HEADERS frame whose priority names its own stream."""
_SETTINGS_ACK = h2.frame(h2.SETTINGS, h2.ACK, 0)

_SERVER_PREFACE = h2.settings({
    h2.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
    h2.INITIAL_WINDOW_SIZE: RECEIVE_WINDOW,
    h2.MAX_FRAME_SIZE: RECEIVE_FRAME,
    h2.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
}) + h2.window_update(0, RECEIVE_WINDOW - h2.DEFAULT_WINDOW)
"""The server's SETTINGS and connection window, the same for every connection."""


def _header_frames(stream_id: int, block: bytes, end_stream: bool, max_frame: int) -> bytes:
    """HEADERS (+ CONTINUATION) frames carrying ``block``."""
    flags = h2.END_STREAM if end_stream else 0
    if len(block) <= max_frame:
        return h2.frame(h2.HEADERS, flags | h2.END_HEADERS, stream_id, block)
    pieces = [block[offset:offset + max_frame] for offset in range(0, len(block), max_frame)]
    frames = [h2.frame(h2.HEADERS, flags, stream_id, pieces[0])]
    for index, piece in enumerate(pieces[1:], start=1):
        frames.append(h2.frame(h2.CONTINUATION, h2.END_HEADERS if index == len(pieces) - 1 else 0, stream_id, piece))
    return b"".join(frames)


def _response_encoding(stream: Stream, compression: grpc.Compression | None) -> bytes | None:
    if compression == grpc.Compression.Gzip and stream.accept_gzip:
        return b"gzip"
    if compression == grpc.Compression.Deflate and stream.accept_deflate:
        return b"deflate"
    return None


def _gzip(payload: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=31)
    return compressor.compress(payload) + compressor.flush()


def _unpad(payload: memoryview) -> memoryview:
    if not payload:
        raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "padded frame without a pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1:len(payload) - pad]


def _peer_string(transport: asyncio.BaseTransport) -> str:
    """The peer as grpc writes it: ``ipv4:host:port``, ``ipv6:[host]:port`` or ``unix:path``."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        host, port = peer[0], peer[1]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
    return f"unix:{peer or ''}"


def _method_name(handler: Any) -> str:
    for attribute in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        function = getattr(handler, attribute, None)
        if function is not None:
            return getattr(function, "__qualname__", repr(function))
    return "?"
