"""What a gRPC connection writes: one queue of frames per loop turn, within the peer's windows.

Frames are queued in ``_out`` and leave in one ``writelines`` (at the end of ``data_received``,
or one loop turn after a call queued them). DATA beyond the peer's flow-control windows waits in
its stream's ``pending`` queue, in order with the frames queued after it, until window updates
let it go; a stream whose last frames are out is then forgotten.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.grpc.connection_state import ConnectionState

if TYPE_CHECKING:
    from pyserve.frontends.grpc.http2_stream import Stream


class OutgoingFrames(ConnectionState):
    """Queueing, flow control of what is sent, and flushing to the transport."""

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
