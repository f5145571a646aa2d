"""``ModelStreamInfer``: many requests multiplexed on one stream, 0..N responses each.

A ``StreamSession`` reads requests as they arrive, schedules each one, and yields responses
in the order they are sent — from any instance thread — each tagged with the request's id
and the ``triton_final_response`` parameter. Errors are per request (``error_message``, with
an ``infer_response`` naming the request) and keep the stream open, unless the client asked for ``triton_grpc_error`` (then the first error
ends the stream with a status). Closing or cancelling the stream cancels every open request.
Responses wait for the writer in a ``pyserve.frontends.backlog.ResponseBacklog``: a decoupled model that
sends faster than the client reads is paused in its ``send`` (backpressure), not buffered
without bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from google.protobuf.message import DecodeError

from pyserve import protocol as pb
from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.dataplane.interface import InferencePlane
from pyserve.frontends.backlog import ResponseBacklog
from pyserve.frontends.grpc.codec import (
    decode_infer,
    encode_infer,
    error_only_response,
    model_version,
)

_END = object()


class _StreamSender:
    """Turns one request's responses into stream messages, from any thread.

    For a non-decoupled model, as Triton 2.51's stream does, what comes before the final
    call is held, and the first response (or error) goes out with the final call; any later
    one is dropped.
    """

    __slots__ = ("_decoded", "_empty_final", "_held", "_model", "_one", "_session")

    def __init__(self, session: StreamSession, decoded: Any, model: Any, empty_final: bool) -> None:
        self._session = session
        self._decoded = decoded
        self._model = model
        self._empty_final = empty_final
        self._one = not model.decoupled
        self._held: InferResponse | InferError | None = None

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        if self._session.closed:  # the stream ended: drop it (the loop may be gone too)
            return
        if self._one and (not final or self._held is not None):
            if self._held is None:
                self._held = response
            if not final:
                return
            response = self._held
        self._session.post(self, response, final)

    def is_cancelled(self) -> bool:
        return self._session.closed

    def message(self, response: InferResponse | InferError | None, final: bool) -> Any:
        """The stream message for one response, or None when nothing is to be sent.

        An error carries, as Triton 2.51 sends it, an ``infer_response`` with the model name,
        the request id and the ``triton_final_response`` flag, so a client can tell which
        request failed and whether more responses follow.
        """
        request: InferRequest = self._decoded.request
        if isinstance(response, InferError):
            return self._error(response, final)
        if response is None:
            if final and request.stats is not None:  # a final flag alone ends the request too
                request.stats.response_sent(request)
            if not (final and self._empty_final):
                return None
            infer = error_only_response(request, self._model)
        else:
            try:
                infer = encode_infer(response, self._decoded, self._model)
            except InferError as exc:
                return self._error(exc, final)
            if final and request.stats is not None:  # the request's duration ends here
                request.stats.response_sent(request)
        infer.parameters["triton_final_response"].bool_param = final
        return pb.ModelStreamInferResponse(infer_response=infer)

    def _error(self, error: InferError, final: bool) -> Any:
        infer = pb.ModelInferResponse(model_name=self._model.name, id=self._decoded.request.id)
        infer.parameters["triton_final_response"].bool_param = final
        return pb.ModelStreamInferResponse(error_message=error.message, infer_response=infer)


class StreamSession:
    """One ``ModelStreamInfer`` call.

    :param dataplane: the server's data plane.
    :param error_closes: end the stream with a status on the first error.
    :param trace_parent: the W3C ``traceparent`` the stream was opened with (tracing).
    :param forwarded: metadata forwarded as parameters of every request on the stream
        (``--grpc-header-forward-pattern``).
    """

    def __init__(self, dataplane: InferencePlane, error_closes: bool = False, trace_parent: str | None = None,
                 forwarded: Sequence[tuple[str, str]] = ()) -> None:
        self.dataplane = dataplane
        self.error_closes = error_closes
        self.trace_parent = trace_parent
        self.forwarded = forwarded
        self.loop = asyncio.get_running_loop()
        self.closed = False
        # (sender, response, final) from any thread, or (None, message to write, False) from the
        # loop; turned into messages only as the writer asks for them, so a reader that does not
        # keep up costs the loop nothing, and pauses the senders once the backlog is full
        self._inbox = ResponseBacklog(self.loop)
        self._open: set[InferRequest] = set()
        self._reading = True

    async def read(self, requests: AsyncIterator[Any]) -> None:
        """Schedule every request of the stream as it arrives.

        A message that cannot be deserialized ends the stream with INTERNAL (after the
        responses already queued), as it ends a unary call.
        """
        try:
            async for message in requests:
                self._start(message)
        except DecodeError:
            self._put(InferError("Exception deserializing request!", ErrorCode.INTERNAL))
        finally:
            self._reading = False
            self._maybe_end()

    def _start(self, message: Any) -> None:
        try:
            model = self.dataplane.model(message.model_name, model_version(message.model_version))
            decode_start = time.monotonic_ns()
            decoded = decode_infer(message, model, stream=True, shm=self.dataplane.shared_memory)
        except InferError as exc:
            self._emit_error(exc, message.id)
            return
        request = decoded.request
        request.arrival_ns = decode_start  # the request's statistics run from its decoding ...
        request.reply_ns = -1  # ... until its final response is encoded (``message``)
        for name, value in self.forwarded:
            request.parameters[name] = value
        empty_final = False
        param = message.parameters.get("triton_enable_empty_final_response")
        if param is not None and param.WhichOneof("parameter_choice") == "bool_param":
            empty_final = param.bool_param
        request.attach_sender(_StreamSender(self, decoded, model, empty_final))
        request.trace_parent = self.trace_parent
        try:
            self._open.add(self.dataplane.submit(model, request))
        except InferError as error:
            self._emit_error(error, request.id)

    def post(self, sender: _StreamSender, response: InferResponse | InferError | None, final: bool) -> None:
        """Queue one response for the writer (any thread); wakes the writer if it waits, and
        waits (off the loop) while the writer is ``RESPONSE_BACKLOG`` responses behind."""
        self._inbox.put((sender, response, final))

    def _put(self, item: Any) -> None:
        """Queue a message (or an error ending the stream) made on the loop."""
        self._inbox.put((None, item, False))

    def _deliver(self, sender: _StreamSender, response: InferResponse | InferError | None, final: bool) -> Any:
        """On the loop: the item to write for one response (None: nothing); closes the request
        on its final response."""
        if isinstance(response, InferError) and self.error_closes:
            item: Any = response
        else:
            item = sender.message(response, final)
        if final:
            request = sender._decoded.request
            if request in self._open:
                self._open.discard(request)
                request.release()
            self._maybe_end()
        return item

    def _emit_error(self, error: InferError, request_id: str) -> None:
        """A request refused before it was scheduled: as Triton 2.51, its error carries an
        ``infer_response`` with only the request id."""
        if self.error_closes:
            self._put(error)
        else:
            self._put(pb.ModelStreamInferResponse(error_message=error.message,
                                                  infer_response=pb.ModelInferResponse(id=request_id)))

    def _maybe_end(self) -> None:
        if not self._reading and not self._open:
            self._put(_END)

    async def responses(self) -> AsyncIterator[Any]:
        """Messages to write, in the order they were sent; ends when all requests are done."""
        inbox = self._inbox
        while not self.closed:
            sender, item, final = await inbox.get()
            if sender is not None:
                item = self._deliver(sender, item, final)
                if item is None:
                    continue
            elif item is _END:
                return
            yield item

    def cancel_open(self) -> None:
        """The stream ended or broke: cancel what is still running."""
        self.closed = True
        self._inbox.close()
        for request in list(self._open):
            request.cancel()
            request.release()
        self._open.clear()
