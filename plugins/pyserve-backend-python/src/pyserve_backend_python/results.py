"""What a ``TritonPythonModel.execute`` returned, turned into what ``pyserve_execute`` returns.

Default mode: a list with one ``InferenceResponse`` per request. A ``None`` entry is allowed
for a request the model answered through its response sender; if any entry is None (or any
request was already answered), the other responses are sent through the senders too and the
hook returns None, so that no request is answered twice. Decoupled mode: execute returns
None and every request is answered through its sender.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pyserve import ErrorCode, InferError, InferRequest, InferResponse

from pyserve_backend_python.response import InferenceResponse

log = logging.getLogger("pyserve.python_backend")

ServerResults = list[InferResponse | InferError] | None


def execute_failure(model_name: str, instance_name: str, exc: BaseException) -> InferError:
    """The error every request of a batch gets when execute raised: the message names the
    exception class as Triton's does (``TritonModelException: boom``, ``ValueError: boom``),
    except for an ``InferError``, whose message and code are kept."""
    code = exc.code if isinstance(exc, InferError) else ErrorCode.INTERNAL
    detail = exc.message if isinstance(exc, InferError) else str(exc)
    kind = "" if isinstance(exc, InferError) else f"{type(exc).__name__}: "
    return InferError(
        f"Failed to process the request(s) for model '{model_name}' instance '{instance_name}', "
        f"message: {kind}{detail}",
        code,
    )


def convert(model_name: str, requests: Sequence[InferRequest], result: Any, decoupled: bool) -> ServerResults:
    """Check and convert execute's return value.

    :raises InferError: the return value is unusable for the whole batch (not a list, wrong
        length, or not None in decoupled mode); every unanswered request gets the error.
    """
    if decoupled:
        if result is not None:
            raise InferError(
                f"Python model '{model_name}' uses the decoupled transaction policy, so execute() must "
                f"return None and answer through the response senders; it returned {type(result).__name__}",
                ErrorCode.INTERNAL,
            )
        return None
    if result is None:
        return None  # the core checks that every request was answered through its sender
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
    converted: list[InferResponse | InferError | None] = [_one(model_name, item) for item in result]
    if all(item is not None for item in converted) and not any(r.final_sent for r in requests):
        return converted  # type: ignore[return-value]
    for request, item in zip(requests, converted):
        if request.final_sent:
            if item is not None:
                log.error("Python model '%s' returned a response for a request it had already answered "
                          "through its response sender; the returned response is dropped", model_name)
            continue
        if item is None:
            if request.rescheduled:  # set_release_flags(RESCHEDULE): it comes back in a later execute
                continue
            item = InferError(
                f"Python model '{model_name}' returned None for a request it did not answer through "
                "its response sender",
                ErrorCode.INTERNAL,
            )
        request.response_sender().send(item, final=True)
    return None


def _one(model_name: str, item: Any) -> InferResponse | InferError | None:
    if item is None:
        return None
    if isinstance(item, InferenceResponse):
        return item.to_server()
    return InferError(
        f"Python model '{model_name}' returned {type(item).__name__} for a request; expected "
        "pb_utils.InferenceResponse",
        ErrorCode.INTERNAL,
    )
