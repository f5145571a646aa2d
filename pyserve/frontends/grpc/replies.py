"""What a gRPC call sends back: initial metadata, response messages, and its status.

Headers go out before the first message (or with the status, as a trailers-only reply);
messages are length-prefixed DATA, compressed when the call asked for it and the client
accepts it; the status is a trailer block that ends the stream. A call that is not gRPC at all
gets an HTTP status instead.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc

from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.grpc.call import CallCancelled, encode_metadata
from pyserve.frontends.grpc.codec import WireParts
from pyserve.frontends.grpc.connection_state import DRAIN_ABOVE, MAX_MESSAGE_DETAILS, YIELD_EVERY
from pyserve.frontends.grpc.lifetime import ConnectionLifetime

if TYPE_CHECKING:
    from pyserve.frontends.grpc.http2_stream import Stream

_CONTENT_TYPE = h2.literal(b"content-type", b"application/grpc")
_RESPONSE_HEADERS = h2.STATUS_200 + _CONTENT_TYPE
_ACCEPT_ENCODING = h2.literal(b"grpc-accept-encoding", b"identity,deflate,gzip")
_TRAILERS_OK = h2.literal(b"grpc-status", b"0")
_PREFIX_PLAIN = 0


class CallReplies(ConnectionLifetime):
    """Writing a call's reply: headers, messages (within flow control) and trailers."""

    def send_initial_metadata(self, stream: Stream, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        """Send the call's headers now, with ``metadata``; only once, before any message."""
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


def _header_frames(stream_id: int, block: bytes, end_stream: bool, max_frame: int) -> bytes:
    """HEADERS (+ CONTINUATION) frames carrying ``block``, none longer than ``max_frame``."""
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
