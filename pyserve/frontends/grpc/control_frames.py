"""Control frames of a gRPC connection: SETTINGS, WINDOW_UPDATE, PING, RST_STREAM, GOAWAY,
PUSH_PROMISE and PRIORITY.

Each handler takes ``(flags, stream_id, payload)`` of one whole frame; a malformed frame raises
:class:`~pyserve.frontends.grpc.http2.ConnectionError_` (the connection ends with its code),
or resets only its stream where RFC 9113 says so. Peers that abuse pings or resets
(CVE-2023-44487) are told ENHANCE_YOUR_CALM.
"""

from __future__ import annotations

from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.grpc.header_blocks import HeaderBlocks

_SETTINGS_ACK = h2.frame(h2.SETTINGS, h2.ACK, 0)


class ControlFrames(HeaderBlocks):
    """The peer's settings, windows, pings, resets and goodbyes."""

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

    def _window_update(self, flags: int, stream_id: int, payload: memoryview) -> None:
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

    def _rst_stream_frame(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id == 0 or len(payload) != 4:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "malformed RST_STREAM")
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            self._blocked.pop(stream_id, None)
            unanswered = not stream.finished
            self._cancel_stream(stream)
            if unanswered and not self.guard.reset_allowed():  # "rapid reset" (CVE-2023-44487)
                raise h2.ConnectionError_(h2.ENHANCE_YOUR_CALM, "too many calls reset")

    def _goaway_frame(self, flags: int, stream_id: int, payload: memoryview) -> None:
        self.closing = True
        if not self._streams:
            self._close()

    def _push_promise_frame(self, flags: int, stream_id: int, payload: memoryview) -> None:
        raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "a client cannot push")

    def _priority_frame(self, flags: int, stream_id: int, payload: memoryview) -> None:
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
