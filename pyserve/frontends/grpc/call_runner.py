"""Running a gRPC call: its servicer function, from the request it got to the status it ends with.

A unary call starts once its request is complete, at once (eagerly) while one client is
calling, else as a task; a client-streaming call starts as a task when its headers arrive.
Whatever the servicer does (returns, aborts, raises, is cancelled or passes its deadline) the
call ends with a status and its context's done callbacks run.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import TYPE_CHECKING, Any, Final

import grpc

from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.grpc.call import AbortError, CallCancelled, raw_message
from pyserve.frontends.grpc.eager import start_eagerly
from pyserve.frontends.grpc.stream_lifecycle import StreamLifecycle
from pyserve.runtime.scheduling import client_activity

if TYPE_CHECKING:
    from pyserve.frontends.grpc.call import CallContext
    from pyserve.frontends.grpc.http2_stream import Stream

log = logging.getLogger("pyserve.frontends.grpc")

_UNDECODABLE: Final = object()
"""The request of a unary call whose message its deserializer refused."""


class CallRunner(StreamLifecycle):
    """Starting calls and running their servicer functions to a status."""

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

    async def _run(self, stream: Stream) -> None:
        context = stream.context
        assert context is not None
        handler = stream.handler
        try:
            if self.server.interceptors:
                handler = await self.server.intercept(handler, stream, context)
            if handler is None:  # no interceptor let the call through
                context.set_code(grpc.StatusCode.UNIMPLEMENTED)
                context.set_details("Method not found")
            else:
                request = self._request(stream, handler, context)
                if request is _UNDECODABLE:
                    pass
                elif handler.response_streaming:
                    await self._stream_responses(stream, handler, request, context)
                else:
                    behaviour = handler.stream_unary if handler.request_streaming else handler.unary_unary
                    response = behaviour(request, context)
                    if inspect.isawaitable(response):
                        response = await response
                    self._send_response(stream, handler, response, context)
            self._finish(stream)
        except AbortError:
            self._finish(stream)
        except asyncio.CancelledError:
            self._cancelled(stream, context)
        except CallCancelled:
            pass
        except Exception as exc:
            self._servicer_failed(stream, handler, context, exc)
        finally:
            if stream.deadline_handle is not None:
                stream.deadline_handle.cancel()
                stream.deadline_handle = None
            context.run_done_callbacks()

    @staticmethod
    def _request(stream: Stream, handler: Any, context: CallContext) -> Any:
        """The request the servicer function gets: the messages of a client-streaming call, the
        deserialized message of a unary one (``_UNDECODABLE``, the status set, if it is not)."""
        if handler.request_streaming:
            return stream.messages
        deserialize = handler.request_deserializer
        try:
            request = raw_message(stream.unary_request) if deserialize is None else deserialize(stream.unary_request)
        except Exception:
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details("Exception deserializing request!")
            return _UNDECODABLE
        stream.unary_request = None
        return request

    async def _stream_responses(self, stream: Stream, handler: Any, request: Any, context: CallContext) -> None:
        """Run a server-streaming servicer function, writing each message it produces."""
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

    def _send_response(self, stream: Stream, handler: Any, response: Any, context: CallContext) -> None:
        """Send a unary reply's one message, unless the servicer set a status other than OK."""
        if context.code() != grpc.StatusCode.OK:
            return
        if response is None:
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details("the servicer returned no response")
        else:
            self._send_message(stream, response, handler.response_serializer)

    def _cancelled(self, stream: Stream, context: CallContext) -> None:
        """The call's task was cancelled: by its deadline, or because the server is stopping."""
        if stream.deadline_hit and not stream.finished:
            context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            context.set_details("Deadline Exceeded")
            self._finish(stream)
        elif not stream.finished and not self._closed:
            self._reset(stream, h2.CANCEL)  # the server is stopping

    def _servicer_failed(self, stream: Stream, handler: Any, context: CallContext, exc: Exception) -> None:
        """The servicer function raised: UNKNOWN, as grpc answers it."""
        if not stream.finished:
            log.exception("gRPC method %s failed", _method_name(handler), exc_info=exc)
            context.set_code(grpc.StatusCode.UNKNOWN)
            context.set_details(f"Unexpected {type(exc)}: {exc}")
            self._finish(stream)


def _method_name(handler: Any) -> str:
    for attribute in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        function = getattr(handler, attribute, None)
        if function is not None:
            return getattr(function, "__qualname__", repr(function))
    return "?"
