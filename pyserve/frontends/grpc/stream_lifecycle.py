"""How a stream of a gRPC connection ends: cancelled by the peer, reset here, timed out, or
forgotten once its reply is out and the client ended its side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.grpc.call import CallCancelled
from pyserve.frontends.grpc.replies import CallReplies

if TYPE_CHECKING:
    from pyserve.frontends.grpc.http2_stream import Stream


class StreamLifecycle(CallReplies):
    """Ending streams: cancellation, resets, deadlines, and dropping finished ones."""

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
        self._schedule_flush()  # from a call's task too (not only while a read is parsed)

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
