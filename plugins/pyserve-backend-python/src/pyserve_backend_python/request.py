"""``InferenceRequest`` (both what ``execute`` receives and the BLS request a model builds),
with ``PreferredMemory`` and ``InferenceTrace``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from typing import Any

from pyserve import InferError, InferRequest
from pyserve.tracing import RequestTrace, child_trace, traceparent_of
from pyserve_backend_python import arguments
from pyserve_backend_python.constants import (
    TRITONSERVER_MEMORY_CPU,
    TRITONSERVER_REQUEST_RELEASE_ALL,
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
)
from pyserve_backend_python.errors import TritonModelException
from pyserve_backend_python.response import (
    InferenceResponse,
    InferenceResponseSender,
    ResponseIterator,
    parse_parameters,
)
from pyserve_backend_python.tensor import Tensor, server_array


class PreferredMemory:
    """Where a BLS caller would like output tensors (informational: pyserve answers in host memory).

    :param preferred_memory_type: ``TRITONSERVER_MEMORY_CPU`` or ``TRITONSERVER_MEMORY_GPU``.
    :param preferred_device_id: the device id for GPU memory.
    """

    __slots__ = ("preferred_device_id", "preferred_memory_type")

    def __init__(self, preferred_memory_type: int = TRITONSERVER_MEMORY_CPU, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = int(preferred_memory_type)
        self.preferred_device_id = int(preferred_device_id)


class InferenceTrace:
    """The trace a request belongs to: ``get_context()`` is the request's OpenTelemetry context
    while the server traces it in OpenTelemetry mode (``--trace-config mode=opentelemetry``), as a
    JSON object string ``{"traceparent": "00-<trace id>-<span id>-01"}``, and None otherwise.
    Passed to a BLS request (``InferenceRequest(..., trace=request.trace())``) while the request
    is traced, it makes the BLS request a traced child of this request, as Triton does: its trace
    names this one's id as ``parent_id`` and, in OpenTelemetry mode, its span is a child of this
    request's span."""

    __slots__ = ("_context", "_origin")

    def __init__(self, context: str | None = None, _origin: Any = None) -> None:
        self._context = context
        self._origin = _origin
        """The traced request's server-side trace (thread mode) or its key in the batch its
        worker runs (process mode); None when not traced."""

    def get_context(self) -> str | None:
        """The OpenTelemetry context as a JSON string, or None when not traced."""
        return self._context


class InferenceRequest:
    """A request as a Python model sees it (Triton's ``pb_utils.InferenceRequest``).

    Two ways to get one:

    * ``execute(requests)`` receives them (wrapping the server's requests). ``inputs()``
      are the request tensors (not copied; a read-only one is copied when the model first
      calls its ``as_numpy()``), ``get_response_sender()`` answers them.
    * A model builds one to call another model (BLS):
      ``InferenceRequest(model_name=..., inputs=[Tensor...], requested_output_names=[...])``,
      then ``exec()`` (blocking; returns an ``InferenceResponse`` whose ``has_error()`` tells
      failure, nothing is raised for inference errors), ``exec(decoupled=True)`` (a
      ``ResponseIterator``), or ``await async_exec(...)``. ``timeout`` is in microseconds.
    """

    def __init__(
        self,
        model_name: str,
        inputs: Iterable[Tensor],
        requested_output_names: Iterable[str],
        request_id: str = "",
        correlation_id: int | str = 0,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: PreferredMemory | None = None,
        trace: InferenceTrace | None = None,
        parameters: Mapping[str, Any] | str | None = None,
    ) -> None:
        tensors = arguments.sequence(inputs, "InferenceRequest inputs")
        for tensor in tensors:
            if not isinstance(tensor, Tensor):
                raise TritonModelException(
                    f"InferenceRequest inputs must be pb_utils.Tensor objects, got {type(tensor).__name__}"
                )
        if not isinstance(correlation_id, (int, str)):
            raise TypeError(f"correlation_id must be an int or a str, got {type(correlation_id).__name__}")
        self._model_name = arguments.text(model_name, "model_name")
        self._model_version = arguments.integer(model_version, "model_version")
        self._inputs = tensors
        self._requested_output_names = arguments.texts(requested_output_names, "requested_output_names")
        self._request_id = arguments.text(request_id, "request_id")
        self._correlation_id = correlation_id
        self._flags = arguments.integer(flags, "flags")
        self._timeout = arguments.integer(timeout, "timeout")
        self._preferred_memory: PreferredMemory | None = preferred_memory or PreferredMemory()
        self._trace: InferenceTrace | None = trace or InferenceTrace()
        self._parameters = parse_parameters(parameters, "request")
        self._server_request: InferRequest | None = None
        self._decoupled = False
        self._sender: InferenceResponseSender | None = None
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL

    @classmethod
    def _from_server(cls, request: InferRequest, decoupled: bool = False) -> InferenceRequest:
        """Wrap a request the server hands to ``execute`` (no copies) of a model that is
        ``decoupled`` or not (its response sender checks Triton's one-response rule)."""
        self = cls.__new__(cls)
        self._decoupled = decoupled
        self._model_name = request.model_name
        self._model_version = int(request.model_version)
        self._inputs = [Tensor._wrap(name, array) for name, array in request.inputs.items()]
        self._requested_output_names = tuple(request.requested_outputs)
        self._request_id = request.id
        self._correlation_id = request.correlation_id
        self._flags = int(request.flags)
        self._timeout = int(request.timeout_us)
        self._preferred_memory = None  # made on first access: execute rarely asks
        self._trace = None
        self._parameters = request.parameters
        self._server_request = request
        self._sender = None
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        return self

    # -- accessors -------------------------------------------------------------------------------
    def inputs(self) -> list[Tensor]:
        """The input tensors."""
        return self._inputs

    def requested_output_names(self) -> set[str]:
        """The outputs to produce, as a new ``set`` (as in Triton) on every call; for served
        requests all outputs when the client named none."""
        return set(self._requested_output_names)

    def request_id(self) -> str:
        """The client's request id (``""`` when none)."""
        return self._request_id

    def correlation_id(self) -> int | str:
        """The sequence id (0 when not in a sequence)."""
        return self._correlation_id

    def flags(self) -> int:
        """``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START`` / ``_END`` bits."""
        return self._flags

    def set_flags(self, flags: int) -> None:
        """Set the request flags (BLS requests)."""
        self._flags = int(flags)

    def timeout(self) -> int:
        """The request timeout in microseconds (0 = none)."""
        return self._timeout

    def parameters(self) -> str:
        """The request parameters as a JSON object string."""
        return json.dumps(self._parameters, separators=(",", ":"))  # compact, as Triton writes it

    def trace(self) -> InferenceTrace:
        """The request's trace (its OpenTelemetry context while the server traces it)."""
        if self._trace is None:
            server_trace = getattr(self._server_request, "trace", None)
            self._trace = InferenceTrace(getattr(server_trace, "context", None), server_trace)
        return self._trace

    def model_name(self) -> str:
        """The model the request is for."""
        return self._model_name

    def model_version(self) -> int:
        """The model version (-1 = the latest, for BLS requests)."""
        return self._model_version

    def preferred_memory(self) -> PreferredMemory:
        """Where the caller prefers outputs (BLS requests)."""
        if self._preferred_memory is None:
            self._preferred_memory = PreferredMemory()
        return self._preferred_memory

    def is_cancelled(self) -> bool:
        """Whether the client cancelled the request."""
        return self._server_request is not None and self._server_request.is_cancelled()

    def get_response_sender(self) -> InferenceResponseSender:
        """The sender for this request's responses (one object per request).

        :raises TritonModelException: on a BLS request the model built itself.
        """
        if self._server_request is None:
            raise TritonModelException("only requests passed to execute() have a response sender")
        if self._sender is None:
            self._sender = InferenceResponseSender(self._server_request, self._decoupled, self._inputs)
        return self._sender

    def set_release_flags(self, flags: int) -> None:
        """``TRITONSERVER_REQUEST_RELEASE_ALL`` or ``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``:
        the request is executed again in a later batch (models with ``sequence_batching {
        iterative_sequence: true }``); in default mode put ``None`` in its place in the list
        ``execute`` returns.

        :raises TritonModelException: rescheduling a request that was not passed to
            ``execute``, or of a model without iterative sequences; an unknown flag.
        """
        if flags == TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
            if self._server_request is None:
                raise TritonModelException("only requests passed to execute() can be rescheduled")
            try:
                self._server_request.reschedule()
            except InferError as exc:
                raise TritonModelException(exc.message) from None
        elif flags != TRITONSERVER_REQUEST_RELEASE_ALL:
            raise TritonModelException(f"unknown release flags {flags}")
        self._release_flags = flags

    def release_flags(self) -> int:
        """The release flags set by the model."""
        return self._release_flags

    # -- BLS --------------------------------------------------------------------------------------
    def exec(self, decoupled: bool = False) -> InferenceResponse | ResponseIterator:
        """Run this request on the named model and wait (blocking).

        :returns: the ``InferenceResponse`` (errors as ``has_error()``), or with
            ``decoupled=True`` a ``ResponseIterator`` over all responses.
        """
        from pyserve_backend_python import bls

        return bls.exec_request(self, decoupled)

    def async_exec(self, decoupled: bool = False) -> asyncio.Future[InferenceResponse | ResponseIterator]:
        """Like ``exec``, for ``async def execute``: an ``asyncio.Future`` (a task) on the running
        event loop, started at once, as Triton returns (``await`` it, ``asyncio.gather`` /
        ``asyncio.wait`` it, or add done callbacks).

        :raises RuntimeError: no event loop is running in this thread (as in Triton).
        """
        from pyserve_backend_python import bls

        loop = asyncio.get_running_loop()
        return loop.create_task(bls.async_exec_request(self, decoupled))

    def _to_server(self) -> InferRequest:
        """The server request for a BLS call: input arrays as read-only views (no copy; the
        called model copies before writing), BYTES elements as ``bytes`` (``tensor.server_array``)."""
        inputs: dict[str, Any] = {}
        for tensor in self._inputs:
            if tensor.name() in inputs:
                raise TritonModelException(f"input '{tensor.name()}' is given more than once")
            inputs[tensor.name()] = server_array(tensor._array)  # not as_numpy: no copy of a received input
        call = InferRequest(
            self._model_name,
            self._model_version,
            inputs,
            self._requested_output_names,
            id=self._request_id,
            parameters=dict(self._parameters),
            flags=self._flags,
            correlation_id=self._correlation_id,
            timeout_us=self._timeout,
        )
        if self._trace is not None:  # trace=request.trace(): the call is traced as that request's child
            call.trace_parent = traceparent_of(self._trace.get_context())
            origin = self._trace._origin
            if isinstance(origin, RequestTrace):
                call.trace = child_trace(origin, call)
        return call

    def __repr__(self) -> str:
        return f"InferenceRequest(model_name={self._model_name!r}, inputs={[t.name() for t in self._inputs]})"
