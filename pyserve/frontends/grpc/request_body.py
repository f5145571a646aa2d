"""A gRPC call's request body: DATA frames cut into length-prefixed messages.

DATA is taken as it arrives (a large frame need not be whole before its bytes are used) and
returned to the peer's windows in WINDOW_UPDATEs. A message whole in one piece of DATA is taken
with one copy; one spread over several frames grows as its bytes come, within the connection's
and the server's buffer budgets (:mod:`pyserve.frontends.grpc.guard`). A message larger than
``max_message_bytes`` is refused from its 5-byte prefix. The end of the request starts a unary
call (at the end of the read that completed it) or ends a client-streaming one's messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.grpc.call_runner import CallRunner
from pyserve.frontends.grpc.connection_state import RECEIVE_WINDOW
from pyserve.frontends.http.body import TooLarge, inflate

if TYPE_CHECKING:
    from pyserve.frontends.grpc.http2_stream import Stream


class RequestBody(CallRunner):
    """Receiving DATA: request messages, the receive windows, and the end of a request."""

    def _data_frame(self, flags: int, stream_id: int, payload: memoryview) -> None:
        """A whole DATA frame (one taken as it arrives goes through ``_begin_data`` itself)."""
        if flags & h2.PADDED:
            payload = h2.unpad(payload)
        self._begin_data(stream_id, flags, len(payload))
        self._data_left = 0
        self._receive_data(payload, len(payload), bool(flags & h2.END_STREAM))

    def _begin_data(self, stream_id: int, flags: int, length: int) -> None:
        if self._continuation is not None:  # also for DATA taken as it arrives, not only whole frames
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
