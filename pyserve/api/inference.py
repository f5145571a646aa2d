"""Transport-neutral inference requests and responses.

Frontends (HTTP, gRPC) decode the wire format into an ``InferRequest`` whose inputs are
already validated numpy arrays; backends answer with ``InferResponse`` objects. Responses
travel back through the request's ``ResponseSender``, which is how both the one-response
path and (later) decoupled models deliver results from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from pyserve.api.errors import ErrorCode, InferError

ParameterValue = bool | int | float | str
"""A request or response parameter value (the KServe v2 parameter types)."""

SEQUENCE_START = 1
"""Request flag: first request of a sequence (``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START``)."""
SEQUENCE_END = 2
"""Request flag: last request of a sequence (``TRITONSERVER_REQUEST_FLAG_SEQUENCE_END``)."""


def read_only(array: Any) -> Any:
    """A numpy array as a read-only view (no copy), for handing a tensor to another consumer
    (an ensemble step, a BLS callee or caller): one that wants to write copies first instead of
    changing what the others see. Read-only arrays and other array types pass as they are."""
    if isinstance(array, np.ndarray) and array.flags.writeable:
        view = array.view()
        view.flags.writeable = False
        return view
    return array


class ResponseSender(Protocol):
    """Where the responses of one request go.

    ``send`` may be called from any thread. A request gets exactly one call with
    ``final=True``. For a non-decoupled model that call usually carries its only response; a
    backend may also send the response with ``final=False`` and then ``final=True`` without
    one (Triton's flags). Frontends hold what comes before the final call and answer then:
    one response is the answer, more than one fails the request ("expected a single
    response, got N") as Triton's frontends do.
    """

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        """Deliver a response (or an error, or nothing with ``final=True``)."""

    def is_cancelled(self) -> bool:
        """Whether the client went away or cancelled the request."""


class _NullSender:
    """Drops what it is sent: the sender of a sequence batcher's null requests."""

    __slots__ = ()

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        """Drop the response."""

    def is_cancelled(self) -> bool:
        """Never cancelled: nobody waits for the answer."""
        return False


NULL_SENDER: ResponseSender = _NullSender()
"""The sender of null requests: requests that only hold a batch slot (``InferRequest.is_null``)."""


class InferResponse:
    """The answer to one request.

    :param outputs: output name → array (numpy, or any array numpy can view without a copy).
        BYTES outputs are object arrays of ``bytes`` (``str`` elements are UTF-8 encoded).
    :param parameters: response parameters sent back to the client.
    :param error: set instead of outputs when this request failed.
    """

    __slots__ = ("error", "outputs", "parameters")

    def __init__(
        self,
        outputs: Mapping[str, Any] | None = None,
        parameters: Mapping[str, ParameterValue] | None = None,
        error: InferError | None = None,
    ) -> None:
        self.outputs: dict[str, Any] = dict(outputs) if outputs else {}
        self.parameters: dict[str, ParameterValue] = dict(parameters) if parameters else {}
        self.error = error

    def __repr__(self) -> str:
        if self.error is not None:
            return f"InferResponse(error={self.error!r})"
        shapes = {k: getattr(v, "shape", None) for k, v in self.outputs.items()}
        return f"InferResponse(outputs={shapes})"


class InferRequest:
    """One inference request, as a backend sees it.

    Thread-safety: a request is owned by one execute at a time; ``cancel`` and
    ``is_cancelled`` may be called from any thread.

    :ivar model_name: the model the request is for.
    :ivar model_version: the version serving it.
    :ivar id: the client's request id (``""`` when none was given).
    :ivar inputs: input name → numpy array, validated against the model config. Arrays may be
        read-only views of the received bytes; copy before writing.
    :ivar requested_outputs: the output names to produce (all outputs when the client named
        none).
    :ivar parameters: the client's request parameters (reserved keys removed).
    :ivar flags: ``SEQUENCE_START`` / ``SEQUENCE_END`` bits.
    :ivar correlation_id: the sequence id (``0`` or ``""`` when not in a sequence).
    :ivar priority: the schedule priority level (0 = model default).
    :ivar timeout_us: the queue timeout the client asked for (0 = model default).
    :ivar batch_size: size of the leading batch dimension (1 for non-batching models).
    :ivar arrival_ns: ``time.monotonic_ns()`` when the request arrived: frontends set it to the
        moment they started decoding it; otherwise when the request was created.
    :ivar trace: the request's ``pyserve.tracing.RequestTrace`` when it is sampled, else None.
    :ivar stats: the ``pyserve.metrics.ModelStats`` the request is counted in (set when it is
        submitted; None for requests the server does not count, e.g. warmup).
    :ivar exec_start_ns: -1 before the request is queued, 0 while queued, then the
        ``time.monotonic_ns()`` at which an instance started executing it.
    :ivar exec_end_ns: when that execute call returned (0 until then).
    :ivar compute_ns: ``(compute_start_ns, compute_end_ns)`` when the backend reported where
        its computation began and ended inside the execute (``ModelStats.backend_compute``),
        else None.
    :ivar first_response_ns: when a first, non-final response was sent (0 = none yet).
    :ivar reply_ns: when the final response was handed to the frontend (0 = not yet). A
        frontend that reports when it sent the response out (``ModelStats.response_sent``)
        sets it to -1 before submitting the request.
    :ivar responses: how many responses were counted in ``response_stats`` so far.
    :ivar last_response_ns: when the last of those was sent (0 = none yet).
    :ivar shm_regions: the shared-memory regions (``pyserve.dataplane.shared_memory.Region``) its
        tensors use, or None: they are in use (cannot be unregistered) from when the request is
        submitted until it is released (``DataPlane.submit`` / ``InferRequest.release``).
    :ivar rescheduled: None unless the model runs iterative sequences (``sequence_batching {
        iterative_sequence: true }``); then False when an execute starts and True once the
        backend called ``reschedule()`` during it.
    """

    __slots__ = (
        "_backend_sender",
        "_cancelled",
        "_final_sent",
        "_release",
        "_sender",
        "arrival_ns",
        "finish",
        "batch_size",
        "compute_ns",
        "correlation_id",
        "exec_end_ns",
        "exec_start_ns",
        "first_response_ns",
        "flags",
        "last_response_ns",
        "id",
        "inputs",
        "model_name",
        "model_version",
        "parameters",
        "priority",
        "requested_outputs",
        "reply_ns",
        "rescheduled",
        "responses",
        "shm_regions",
        "stats",
        "timeout_us",
        "trace",
        "trace_parent",
    )

    def __init__(
        self,
        model_name: str,
        model_version: int,
        inputs: dict[str, np.ndarray],
        requested_outputs: tuple[str, ...],
        *,
        id: str = "",
        parameters: dict[str, ParameterValue] | None = None,
        flags: int = 0,
        correlation_id: int | str = 0,
        priority: int = 0,
        timeout_us: int = 0,
        batch_size: int = 1,
    ) -> None:
        self.model_name = model_name
        self.model_version = model_version
        self.inputs = inputs
        self.requested_outputs = requested_outputs
        self.id = id
        self.parameters: dict[str, ParameterValue] = parameters if parameters is not None else {}
        self.flags = flags
        self.correlation_id = correlation_id
        self.priority = priority
        self.timeout_us = timeout_us
        self.batch_size = batch_size
        self.arrival_ns = time.monotonic_ns()
        self._sender: ResponseSender | None = None
        self._backend_sender: BackendResponseSender | None = None
        self._cancelled = False
        self._final_sent = False
        self._release: Callable[[InferRequest], None] | None = None
        self.finish: Callable[[InferRequest, InferResponse], InferResponse | InferError] | None = None
        self.trace: Any = None  # pyserve.tracing.RequestTrace when this request is traced
        self.trace_parent: str | None = None  # the client's W3C traceparent (set only while tracing)
        self.stats: Any = None  # pyserve.metrics.ModelStats once submitted
        self.exec_start_ns = -1
        self.exec_end_ns = 0
        self.compute_ns: tuple[int, int] | None = None
        self.first_response_ns = 0
        self.reply_ns = 0
        self.responses = 0
        self.last_response_ns = 0
        self.rescheduled: bool | None = None
        self.shm_regions: list[Any] | None = None

    def __repr__(self) -> str:
        return f"InferRequest(model={self.model_name!r}, id={self.id!r}, inputs={list(self.inputs)})"

    def response_sender(self) -> BackendResponseSender:
        """The sender a backend answers this request through (any thread, any time).

        Decoupled models send any number of responses and then ``final=True`` (with or
        without a last response); other models may send exactly one response (with
        ``final=True``, or without it and then ``final=True`` alone) instead of returning it
        from ``pyserve_execute``. A request whose sender a backend took may be answered after
        ``pyserve_execute`` returned, from any thread (Triton lets a backend release a
        request and respond later); one whose sender was never taken must be answered by the
        returned list.
        """
        sender = self._backend_sender
        if sender is None:
            sender = self._backend_sender = BackendResponseSender(self)
        return sender

    def reschedule(self) -> None:
        """Execute this request again in a later batch instead of answering it now (Triton's
        ``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``). Call it during ``pyserve_execute`` and
        leave the request unanswered in that execute (``None`` in its place); the request comes
        back, with the same inputs, until an execute answers it with its final response.

        :raises InferError: INVALID_ARG when the model does not run iterative sequences
            (``sequence_batching { iterative_sequence: true }``).
        """
        if self.rescheduled is None:
            raise InferError.invalid(
                f"model '{self.model_name}' cannot reschedule requests: rescheduling needs "
                "sequence_batching { iterative_sequence: true } in its config"
            )
        self.rescheduled = True

    # -- core side ---------------------------------------------------------------------------
    def attach_sender(self, sender: ResponseSender) -> None:
        """Attach where responses go (the frontend's sender); called before scheduling."""
        self._sender = sender

    def attached_sender(self) -> ResponseSender:
        """The frontend's sender, for core code that wraps it."""
        if self._sender is None:
            raise InferError("request has no response sender attached", ErrorCode.INTERNAL)
        return self._sender

    def reply(self, response: InferResponse | InferError | None, final: bool = True, handed_ns: int = 0) -> None:
        """Send a response (already checked) or an error to the frontend.

        :param handed_ns: when the backend handed a non-final response over, before it was
            checked (its compute output starts there in ``response_stats``); 0: unknown.
        """
        stats = self.stats
        if stats is not None and not self._final_sent:  # count each request once, at its end
            if final:
                stats.request_done(self, response)
            elif response is not None:
                stats.response(self, response, handed_ns)
        if final:
            self._final_sent = True
        self.attached_sender().send(response, final)

    def on_release(self, release: Callable[[InferRequest], None] | None) -> None:
        """Core side: ``release(self)`` is to run once, when the frontend lets the request go
        (``DataPlane.submit`` registers what it holds for the request until then; None: nothing
        to run)."""
        self._release = release

    def release(self) -> None:
        """Frontend side: done with this submitted request (its final response was handled, or
        it was abandoned): the server stops counting it in flight and lets go of its
        shared-memory regions. Call on the event loop; idempotent, and a no-op for a request
        that was never submitted. ``with request:`` releases it on leaving the block."""
        release = self._release
        if release is not None:
            self._release = None
            release(self)

    def __enter__(self) -> InferRequest:
        return self

    def __exit__(self, *exc_info: object) -> None:
        release = self._release  # release(), inlined: the with-form is on the unary hot path
        if release is not None:
            self._release = None
            release(self)

    @property
    def is_null(self) -> bool:
        """Whether this is a null request: one the sequence batcher (direct strategy) puts in a
        batch slot that has no request queued, as Triton does, so that every other request sits
        in its sequence's slot. Its READY control is false and its inputs are zeros; a backend
        answers it like any request, its answer is dropped and it is counted nowhere."""
        return self._sender is NULL_SENDER

    @property
    def final_sent(self) -> bool:
        """Whether the request's final response went out."""
        return self._final_sent

    @property
    def sender_taken(self) -> bool:
        """Whether a backend took this request's response sender (``response_sender()``), so
        that it may still answer after ``pyserve_execute`` returned."""
        return self._backend_sender is not None

    def cancel(self) -> None:
        """Mark the request cancelled (client disconnect); a queued request is then dropped."""
        self._cancelled = True

    def is_cancelled(self) -> bool:
        """True once the client cancelled or went away."""
        if self._cancelled:
            return True
        sender = self._sender
        return sender is not None and sender.is_cancelled()


class BackendResponseSender:
    """What ``InferRequest.response_sender()`` returns: sends from any thread.

    Responses are checked like returned ones (requested outputs, datatypes) before they
    reach the client. ``responses_sent`` counts the responses (and errors) sent so far.

    :raises InferError: on ``send`` after the final response was sent.
    """

    __slots__ = ("_request", "responses_sent")

    def __init__(self, request: InferRequest) -> None:
        self._request = request
        self.responses_sent = 0

    def send(self, response: InferResponse | InferError | BaseException | None = None, final: bool = False) -> None:
        request = self._request
        if request._final_sent:
            if request._cancelled:
                return  # the server already answered it (client gone, or shutdown timeout)
            raise InferError(
                f"a final response was already sent for this request of model '{request.model_name}'",
                ErrorCode.INTERNAL,
            )
        handed = time.monotonic_ns() if request.stats is not None and not final else 0
        result: InferResponse | InferError | None
        if isinstance(response, InferResponse):
            if response.error is not None:
                result = response.error
            elif request.finish is not None:
                result = request.finish(request, response)
            else:
                result = response
        elif isinstance(response, BaseException):
            result = error_response(response, request.model_name)
        else:
            result = response
        if response is not None:
            self.responses_sent += 1
        request.reply(result, final, handed)

    def is_cancelled(self) -> bool:
        return self._request.is_cancelled()


def error_response(error: BaseException, model_name: str) -> InferError:
    """Turn anything a backend produced as an error into an ``InferError``."""
    if isinstance(error, InferError):
        return error
    return InferError(
        f"Failed to process the request(s) for model '{model_name}', message: "
        f"{type(error).__name__}: {error}",
        ErrorCode.INTERNAL,
    )


class FutureSender:
    """A ``ResponseSender`` for one-response requests awaited on an asyncio loop.

    ``send`` hands the response to the loop thread-safely; ``result`` is awaited by the
    frontend. Used for HTTP ``/infer``, gRPC ``ModelInfer`` and non-decoupled ensemble steps.
    Responses sent before the final call are held until it comes; then a single response is
    the result, and more than one an INTERNAL error "expected a single response, got N", as
    Triton's HTTP and gRPC frontends answer.
    """

    __slots__ = ("_future", "_held", "_loop")

    def __init__(self, loop: Any, future: Any) -> None:
        self._loop = loop
        self._future = future
        self._held: list[InferResponse | InferError] | None = None

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        if not final or self._held is not None:  # the one-call answer skips this
            response = self._single(response, final)
            if response is _WAITING:
                return
        if response is None:
            response = InferError("model sent no response for the request", ErrorCode.INTERNAL)
        if getattr(_delivery, "inline", None) is self._loop:
            _resolve(self._future, response)  # executed on the loop itself: no wake-up needed
            return
        pending: list[tuple[Any, Any, Any]] | None = getattr(_delivery, "pending", None)
        if pending is not None:
            pending.append((self._loop, self._future, response))
        else:
            self._loop.call_soon_threadsafe(_resolve, self._future, response)

    def is_cancelled(self) -> bool:
        return self._future.cancelled()

    def _single(self, response: InferResponse | InferError | None, final: bool) -> Any:
        """Hold ``response`` until the final call; then the one response, None for none, or
        the error for more than one (``_WAITING`` before the final call)."""
        held = self._held
        if held is None:
            held = self._held = []
        if response is not None:
            held.append(response)
        if not final:
            return _WAITING
        if len(held) > 1:
            return InferError(f"expected a single response, got {len(held)}", ErrorCode.INTERNAL)
        return held[0] if held else None


_WAITING = object()


def _resolve(future: Any, response: InferResponse | InferError) -> None:
    if not future.done():
        future.set_result(response)


_delivery = threading.local()


@contextlib.contextmanager
def coalesced_delivery() -> Iterator[None]:
    """Deliver the one-response results sent inside the block with one loop wake-up per loop.

    Used by instance threads around the replies of a batch: N responses cost one
    ``call_soon_threadsafe`` instead of N.
    """
    outer = getattr(_delivery, "pending", None)
    if outer is not None:  # already coalescing further up this thread
        yield
        return
    pending: list[tuple[Any, Any, Any]] = []
    _delivery.pending = pending
    try:
        yield
    finally:
        _delivery.pending = None
        by_loop: dict[Any, list[tuple[Any, Any]]] = {}
        for loop, future, response in pending:
            by_loop.setdefault(loop, []).append((future, response))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_resolve_many, items)


class RunningLoop:
    """The event loop running on the calling thread, remembered for the thread that asked last.

    ``asyncio._get_running_loop()`` makes a ``getpid`` system call on every call (Python 3.11
    checks for a fork); objects on the per-request path of one server (its data plane, a
    model's scheduler) are called on that server's loop thread, so they remember it once.
    Safe for any caller: another thread, or a loop no longer running, asks asyncio again.
    """

    __slots__ = ("_ident", "_loop")

    def __init__(self) -> None:
        self._ident = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> asyncio.AbstractEventLoop | None:
        """The running loop of this thread, or None when none runs here."""
        loop = self._loop
        if loop is not None and self._ident == threading.get_ident() and loop.is_running():
            return loop
        loop = asyncio._get_running_loop()
        if loop is not None:
            self._ident, self._loop = threading.get_ident(), loop
        return loop


def enter_inline_delivery(loop: asyncio.AbstractEventLoop) -> Any:
    """From here on, results sent from this thread to ``loop`` (the loop running on this thread)
    resolve at once (a model executed on the event loop: ``pyserve.runtime.scheduling.inline``).

    :returns: the previous setting, to hand to ``exit_inline_delivery`` (in a ``finally``).
    """
    outer = getattr(_delivery, "inline", None)
    _delivery.inline = loop
    return outer


def exit_inline_delivery(outer: Any) -> None:
    """Restore the setting ``enter_inline_delivery`` returned."""
    _delivery.inline = outer


def _resolve_many(items: list[tuple[Any, InferResponse | InferError]]) -> None:
    for future, response in items:
        if not future.done():
            future.set_result(response)
