"""``InferenceResponse``, ``InferenceResponseSender`` and ``ResponseIterator``."""

from __future__ import annotations

import asyncio
import json
import queue
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pyserve import InferError, InferRequest, InferResponse
from pyserve.api.inference import BackendResponseSender
from pyserve_backend_python import arguments
from pyserve_backend_python.constants import TRITONSERVER_RESPONSE_COMPLETE_FINAL
from pyserve_backend_python.errors import TritonError, TritonModelException, as_triton_error
from pyserve_backend_python.tensor import Tensor, owned_output, server_array


def parse_parameters(parameters: Mapping[str, Any] | str | None, what: str) -> dict[str, Any]:
    """Parameters given as a dict (or a JSON object string), checked as Triton's stub checks
    them: str keys, bool/int/str values (no floats, None or nesting), with its messages.

    :raises TritonModelException: not a dict (or JSON object), a key that is not a str, or a
        value that is not bool/int/str.
    """
    if parameters is None or parameters == "":
        return {}
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters)
        except json.JSONDecodeError as exc:
            raise TritonModelException(f"{what} parameters are not valid JSON: {exc}") from None
    if not isinstance(parameters, Mapping):
        raise TritonModelException(f"Expect {what} parameters to be a dict, got {type(parameters)}")
    checked: dict[str, Any] = {}
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(f"Expect parameters keys to have type str, found type {type(key)}")
        if not isinstance(value, (bool, int, str)):
            raise TritonModelException(
                f"Expect parameters values to have type bool/int/str, found type {type(value)}")
        checked[key] = value
    return checked


class InferenceResponse:
    """One response of a Python model, or one received through BLS.

    Callers may rely on ``output_tensors()`` returning the tensors in the order given,
    ``has_error()`` / ``error()`` reporting the ``TritonError`` (None when there is none),
    and ``parameters()`` returning the response parameters as a JSON object string.
    """

    __slots__ = ("_error", "_output_tensors", "_parameters")

    def __init__(
        self,
        output_tensors: Iterable[Tensor] = (),
        error: TritonError | str | None = None,
        parameters: Mapping[str, Any] | str | None = None,
    ) -> None:
        tensors = arguments.sequence(output_tensors, "InferenceResponse output_tensors")
        for tensor in tensors:
            if not isinstance(tensor, Tensor):
                raise TritonModelException(
                    f"InferenceResponse output_tensors must be pb_utils.Tensor objects, got {type(tensor).__name__}"
                )
        self._output_tensors = tensors
        self._error = as_triton_error(error) if error is not None else None
        self._parameters = {} if parameters is None else parse_parameters(parameters, "response")

    def output_tensors(self) -> list[Tensor]:
        """The output tensors."""
        return self._output_tensors

    def has_error(self) -> bool:
        """Whether the response carries an error."""
        return self._error is not None

    def error(self) -> TritonError | None:
        """The error, or None."""
        return self._error

    def parameters(self) -> str:
        """The response parameters as a JSON object string."""
        return json.dumps(self._parameters, separators=(",", ":"))  # compact, as Triton writes it

    def __repr__(self) -> str:
        if self._error is not None:
            return f"InferenceResponse(error={self._error!r})"
        return f"InferenceResponse(output_tensors={self._output_tensors!r})"

    # -- conversions ---------------------------------------------------------------------------
    def to_server(self, received: Sequence[Tensor] = ()) -> InferResponse | InferError:
        """The server's response (or error) for this response, when the model hands it over
        (``received``: the input tensors of the request it answers). The outputs are the
        model's arrays where nothing of the model can still write them, else copies of them,
        BYTES elements as ``bytes`` (see ``tensor.owned_output``)."""
        if self._error is not None:
            return self._error.to_infer_error()
        tensors = self._output_tensors
        outputs = {tensors[index]._name: owned_output(tensors, index, received) for index in range(len(tensors))}
        return InferResponse(outputs, self._parameters or None)

    @classmethod
    def from_server(cls, result: InferResponse | InferError) -> InferenceResponse:
        """The model-side view of what another model answered (BLS)."""
        if isinstance(result, InferError):
            return cls(error=TritonError.from_infer_error(result))
        if result.error is not None:
            return cls(error=TritonError.from_infer_error(result.error))
        response = cls()
        response._output_tensors = [  # read-only views: the called model may still hold its arrays
            Tensor._wrap(name, server_array(_as_array(value))) for name, value in result.outputs.items()
        ]
        response._parameters = dict(result.parameters)
        return response


def _as_array(value: Any) -> Any:
    import numpy as np

    return value if isinstance(value, np.ndarray) else np.asarray(value)


class InferenceResponseSender:
    """Sends the responses of one request (Triton's ``InferenceResponseSender``).

    Callers may use it from any thread, also after ``execute`` returned. ``flags`` is 0 or
    ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``; every request must end with exactly one
    ``send(..., flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL)`` (with or without a response).
    A non-decoupled model sends exactly one response, as Triton >= 2.47 checks it: a second
    one, or the final flag before any response, raises. A send after the final flag raises.
    Every refusal raises ``TritonModelException`` with Triton's message.
    """

    __slots__ = ("__weakref__", "_decoupled", "_received", "_request", "_sender")

    def __init__(self, request: InferRequest, decoupled: bool = True, received: Sequence[Tensor] = ()) -> None:
        self._request = request
        self._decoupled = decoupled
        self._received = received  # the request's input tensors, as execute got them
        self._sender: BackendResponseSender = request.response_sender()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        """Send a response; ``flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL`` ends the request.

        :raises TritonModelException: an unknown flag; ``response`` is not an
            ``InferenceResponse``, or it is None without the final flag; a non-decoupled
            model sends a second response, or the final flag before any response; the
            request already ended.
        """
        if flags != TRITONSERVER_RESPONSE_COMPLETE_FINAL and flags != 0:
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        final = flags != 0
        if response is None:
            if not final:
                raise TritonModelException(
                    "Inference Response object must be provided when the response flags is set to zero."
                )
        elif not isinstance(response, InferenceResponse):
            raise TritonModelException(
                f"send() expects a pb_utils.InferenceResponse, got {type(response).__name__}"
            )
        sender = self._sender
        if not self._decoupled and (response is None or sender.responses_sent):  # the first response passes
            check_one_response(sender.responses_sent, response is not None, final)
        try:
            sender.send(response.to_server(self._received) if response is not None else None, final)
        except InferError:
            raise TritonModelException(CLOSED_MESSAGE) from None

    def is_cancelled(self) -> bool:
        """Whether the client cancelled the request (or went away)."""
        return self._sender.is_cancelled()

    @property
    def final_sent(self) -> bool:
        """Whether the final response went out (pyserve extension)."""
        return self._request.final_sent


CLOSED_MESSAGE = "Unable to send response. Response sender has been closed."
"""Triton's text for a send after the final flag (scripts compare it exactly)."""
MORE_THAN_ONE_MESSAGE = "Unable to send response. Non-decoupled model cannot send more than one response."
FINAL_FIRST_MESSAGE = (
    "Unable to send response. Non-decoupled model cannot send complete final before sending a response."
)


def check_one_response(sent: int, has_response: bool, final: bool) -> None:
    """Triton's rule for a non-decoupled model's sender, ``sent`` responses having gone out.

    :raises TritonModelException: a second response, or the final flag alone before any.
    """
    if has_response and sent > 0:
        raise TritonModelException(MORE_THAN_ONE_MESSAGE)
    if not has_response and final and sent == 0:
        raise TritonModelException(FINAL_FIRST_MESSAGE)


_END = object()


class ResponseIterator:
    """The responses of a decoupled BLS request, in arrival order (Triton's ``ResponseIterator``).

    Iterate it (``for r in it``, or ``async for r in it`` on an event loop) to receive every
    response; the last one carries the final flag, and when the called model ended the request
    without a response, that last one is an empty ``InferenceResponse`` (no output tensors), as
    in Triton. ``cancel()`` asks the called model to stop.
    """

    def __init__(self, request: InferRequest) -> None:
        self._request = request
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._done = False
        self.cancelled = False

    # -- fed by the BLS sender (server threads) ------------------------------------------------
    def put(self, response: InferenceResponse | None, final: bool) -> None:
        if response is not None:
            self._queue.put(response)
        elif final:
            self._queue.put(InferenceResponse())
        if final:
            self._queue.put(_END)

    # -- the model's side ------------------------------------------------------------------------
    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        return item

    def __aiter__(self) -> ResponseIterator:
        return self

    async def __anext__(self) -> InferenceResponse:
        if self._done:
            raise StopAsyncIteration
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            item = await asyncio.to_thread(self._queue.get)
        if item is _END:
            self._done = True
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        """Cancel the request; the called model sees ``is_cancelled()`` become True."""
        self.cancelled = True
        self._request.cancel()
