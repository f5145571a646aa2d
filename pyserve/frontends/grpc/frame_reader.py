"""Reading a gRPC connection: the client preface, then frames parsed where they lie in each read.

Frames are cut from the bytes of each read without copying them; only a frame split across
reads is joined (with just its missing bytes), and a large DATA frame is taken as its bytes
arrive. Each whole frame goes to the handler of its type (unknown types are ignored, RFC 9113
§4.1); a protocol error ends the connection with GOAWAY. What a read's frames queued, and the
replies of the unary calls it completed, leave together at its end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.grpc.connection_state import RECEIVE_FRAME, RECEIVE_WINDOW, SERVER_PREFACE
from pyserve.frontends.grpc.control_frames import ControlFrames

log = logging.getLogger("pyserve.frontends.grpc")

_NOT_HTTP2_BODY = b'{"error":"this port serves gRPC (HTTP/2); HTTP/1.x requests belong on the HTTP port"}'


class FrameReader(ControlFrames):
    """``data_received``: bytes in, frames dispatched, one write out."""

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
        view = memoryview(data)
        end = len(data)
        try:
            if not self._preface:
                position = self._take_preface(data)
                if position < 0:
                    return
            position = self._parse_frames(data, view, position, end)
            if position < 0:
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

    def _take_preface(self, data: bytes) -> int:
        """Check the client preface at the start of ``data``: where frames begin, or -1 when
        ``data`` is the start of a preface (kept for the next read) or is not HTTP/2."""
        if len(data) < len(h2.PREFACE):
            if not h2.PREFACE.startswith(data):
                self._not_http2()
                return -1
            self._buffer = bytearray(data)
            return -1
        if not data.startswith(h2.PREFACE):
            self._not_http2()
            return -1
        self._preface = True
        # the server's preface follows the client's (an HTTP/1 client gets a readable answer)
        self._out.append(SERVER_PREFACE)
        return len(h2.PREFACE)

    def _parse_frames(self, data: bytes, view: memoryview, position: int, end: int) -> int:
        """Dispatch the frames of ``data`` from ``position`` to their handlers (``_FRAME_HANDLERS``,
        called from here: no call in between): where an incomplete frame begins (``end`` if none),
        or -1 if a frame closed the connection."""
        while position < end:
            if self._data_left:
                take = min(self._data_left, end - position)
                self._data_left -= take
                self._receive_data(view[position:position + take], take, self._data_left == 0 and self._data_end)
                position += take
                continue
            if end - position < 9:
                break
            length = (data[position] << 16) | (data[position + 1] << 8) | data[position + 2]
            kind = data[position + 3]
            flags = data[position + 4]
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
            if self._continuation is not None and kind != h2.CONTINUATION:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "expected CONTINUATION")
            handler = _FRAME_HANDLERS.get(kind)
            if handler is not None:  # unknown frame types are ignored (RFC 9113 §4.1)
                handler(self, flags, stream_id, payload)
                if self._closed:
                    return -1
        return position

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
        self.transport.write(b"HTTP/1.1 505 HTTP Version Not Supported\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                             % (len(_NOT_HTTP2_BODY), _NOT_HTTP2_BODY))
        self._closed = True
        self.transport.close()


_FRAME_HANDLERS: dict[int, Callable[[FrameReader, int, int, memoryview], None]] = {
    h2.DATA: FrameReader._data_frame,
    h2.HEADERS: FrameReader._headers_frame,
    h2.CONTINUATION: FrameReader._continuation_frame,
    h2.SETTINGS: FrameReader._settings,
    h2.WINDOW_UPDATE: FrameReader._window_update,
    h2.PING: FrameReader._ping,
    h2.RST_STREAM: FrameReader._rst_stream_frame,
    h2.GOAWAY: FrameReader._goaway_frame,
    h2.PUSH_PROMISE: FrameReader._push_promise_frame,
    h2.PRIORITY: FrameReader._priority_frame,
}
"""The handler of each frame type, ``(connection, flags, stream_id, payload)`` of a whole frame:
one look-up a frame, no chain of comparisons."""
