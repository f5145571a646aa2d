"""What a ``TritonPythonModel.execute`` returned, turned into what ``pyserve_execute`` returns.

Default mode: a list with one ``InferenceResponse`` per request. A ``None`` entry (or
``None`` for the whole list) leaves the request to the model's response sender, which may
answer it during or after execute (see ``watch_unanswered``); when any entry is None or any
request's sender was used, the returned responses are sent through the senders too and the
hook returns None, so that no request is answered twice. Decoupled mode: execute returns
None and every request is answered through its sender.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from pyserve import (
    ErrorCode,
    InferError,
    InferRequest,
    InferResponse,
)
from pyserve_backend_python.errors import TritonModelException
from pyserve_backend_python.response import InferenceResponse, check_one_response
from pyserve_backend_python.tensor import Tensor

log = logging.getLogger("pyserve.python_backend")

ServerResults = list[InferResponse | InferError] | None


def execute_failure(model_name: str, instance_name: str, exc: BaseException) -> InferError:
    """The error every request of a batch gets when execute raised, in the words of Triton's
    Python backend as Triton 2.51 answers it ("Failed to process the request(s) for model
    '<instance>', message: TritonModelException: boom"): the exception class is named, except for an ``InferError``,
    whose message and code are kept. ``model_name`` stands in for a missing instance name."""
    code = exc.code if isinstance(exc, InferError) else ErrorCode.INTERNAL
    detail = exc.message if isinstance(exc, InferError) else str(exc)
    kind = "" if isinstance(exc, InferError) else f"{type(exc).__name__}: "
    return InferError(
        f"Failed to process the request(s) for model '{instance_name or model_name}', "
        f"message: {kind}{detail}",
        code,
    )


def convert(
    model_name: str,
    requests: Sequence[InferRequest],
    result: Any,
    decoupled: bool,
    instance_name: str = "",
    wrapped: Sequence[Any] | None = None,
) -> ServerResults:
    """Check and convert execute's return value (``wrapped``: the ``pb_utils`` requests
    ``execute`` received, when it ran in this process).

    :raises InferError: the return value is unusable for the whole batch (not a list, wrong
        length, not None in decoupled mode, a response returned for a request whose sender
        already sent one, or for a request the model rescheduled); every unanswered request gets
        the error.
    """
    if decoupled:
        if result is not None:
            raise InferError(
                f"Python model '{instance_name or model_name}' is using the decoupled mode and the execute "
                f"function must return None. (It returned {type(result).__name__}; decoupled models answer "
                "through the response senders.)",
                ErrorCode.INTERNAL,
            )
        return None
    if result is None:  # every request left to its sender (usually answered already)
        for index, request in enumerate(requests):
            if not request.final_sent and not request.rescheduled:
                watch_unanswered(model_name, request, wrapped[index] if wrapped is not None else None)
        return None
    if not isinstance(result, (list, tuple)):
        raise InferError(
            f"Python model '{model_name}': execute() must return a list of pb_utils.InferenceResponse, "
            f"got {type(result).__name__}",
            ErrorCode.INTERNAL,
        )
    if len(result) != len(requests):
        raise InferError(
            f"Python model '{model_name}': execute() returned {len(result)} response(s) for "
            f"{len(requests)} request(s); it must return exactly one InferenceResponse per request",
            ErrorCode.INTERNAL,
        )
    for request, item in zip(requests, result):
        if request.rescheduled and item is not None:  # Triton's stub fails the execute (its wording)
            raise InferError(
                "Expected a None object in the execute function return list for reschduled request, "
                f"found type '{type(item)}'.",
                ErrorCode.INTERNAL,
            )
    converted: list[InferResponse | InferError | None] = [
        _one(model_name, item, wrapped[index]._inputs if wrapped is not None else ())
        for index, item in enumerate(result)
    ]
    if all(item is not None for item in converted) and not any(r.sender_taken for r in requests):
        return converted  # type: ignore[return-value]
    _answer_through_senders(model_name, requests, converted, instance_name, wrapped)
    return None


def _answer_through_senders(
    model_name: str,
    requests: Sequence[InferRequest],
    converted: Sequence[InferResponse | InferError | None],
    instance_name: str,
    wrapped: Sequence[Any] | None,
) -> None:
    """``convert`` when some request is left to (or was answered through) its response
    sender: the returned responses go through the senders too, the unanswered requests are
    watched (``watch_unanswered``).

    :raises InferError: a response was returned for a request whose sender already sent one.
    """
    for request, item in zip(requests, converted):
        if item is not None and request.sender_taken:
            # as Triton's stub: a returned response is one more sent with the final flag, so
            # after one sent through the sender it fails the batch
            try:
                check_one_response(request.response_sender().responses_sent, True, True)
            except TritonModelException as exc:
                raise execute_failure(model_name, instance_name or model_name, exc) from None
    for index, (request, item) in enumerate(zip(requests, converted)):
        if item is not None:
            if not request.final_sent:
                request.response_sender().send(item, final=True)
        elif not request.final_sent and not request.rescheduled:
            watch_unanswered(model_name, request, wrapped[index] if wrapped is not None else None)


def watch_unanswered(model_name: str, request: InferRequest, wrapper: Any) -> None:
    """A request execute left unanswered (``None`` in its place, or ``None`` returned): the
    model may answer it later through its response sender, from any thread (Triton >= 2.47).
    Once the model holds neither the request nor its sender (both garbage), nobody can:
    it is then ended, with the response already sent, or with an error. (Triton leaves such
    a request open for ever.)

    The ending runs on a thread of its own (``_Releaser``), not in the finalizer: the
    collector may free the sender on any thread at any allocation, also on one that holds a
    lock the ending takes (the model's statistics, a stream's), which would deadlock."""
    if wrapper is None:  # no pb_utils request to watch (process mode): fail it now
        _release(model_name, request)
        return
    sender = wrapper.get_response_sender()  # also tells the core the request is answered later
    _RELEASER.start()
    weakref.finalize(sender, _RELEASER.ended, model_name, request)


class _Releaser:
    """Ends the requests whose senders the collector freed, one at a time, on a daemon thread.

    ``ended`` only puts on a ``queue.SimpleQueue`` (safe in a finalizer: it takes no lock a
    thread could hold); ``start`` (from execute) starts the thread once per process, and again
    in a forked child, where the parent's thread is not alive."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[str, InferRequest]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread unless it runs. Two executes that start it at once may start two:
        both take from the one queue, each request once."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="pyserve-python-release", daemon=True)
            self._thread.start()

    def ended(self, model_name: str, request: InferRequest) -> None:
        self._queue.put((model_name, request))

    def _run(self) -> None:
        while True:
            model_name, request = self._queue.get()
            try:
                _release(model_name, request)
            except Exception:  # one failed ending must not stop the next ones
                log.exception("ending a request of Python model '%s' that its model released failed", model_name)


_RELEASER = _Releaser()


def _release(model_name: str, request: InferRequest) -> None:
    if request.final_sent:
        return
    sender = request.response_sender()
    try:
        if sender.responses_sent:
            log.warning("Python model '%s' released a request after sending its response without the final "
                        "flag; ending it", model_name)
            sender.send(None, final=True)
        else:
            sender.send(InferError(
                f"Python model '{model_name}' returned None for a request and released it without sending "
                "a response through its response sender",
                ErrorCode.INTERNAL,
            ), final=True)
    except InferError:
        pass  # answered meanwhile


def _one(model_name: str, item: Any, received: Sequence[Tensor]) -> InferResponse | InferError | None:
    if item is None:
        return None
    if isinstance(item, InferenceResponse):
        return item.to_server(received)
    return InferError(
        f"Python model '{model_name}' returned {type(item).__name__} for a request; expected "
        "pb_utils.InferenceResponse",
        ErrorCode.INTERNAL,
    )
