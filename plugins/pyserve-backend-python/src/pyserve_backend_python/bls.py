"""Business Logic Scripting: ``InferenceRequest.exec`` / ``async_exec`` on the running server.

Requests go through ``ServerHandle.submit`` of the server the calling model belongs to (see
``pyserve_backend_python.context``), so they are scheduled, batched and validated exactly like
client requests, and input arrays are passed by reference. Inference errors come back as
responses with ``has_error()``; only misuse (no server known) raises.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pyserve import ErrorCode, InferError, InferResponse
from pyserve_backend_python import context
from pyserve_backend_python.errors import TritonModelException
from pyserve_backend_python.response import InferenceResponse, ResponseIterator

if TYPE_CHECKING:
    from pyserve_backend_python.request import InferenceRequest


class _OneResponse:
    """Collects the responses of a non-decoupled call and signals completion."""

    def __init__(self) -> None:
        self.results: list[InferResponse | InferError] = []
        self.done = threading.Event()
        self.on_done: Any = None

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        if response is not None:
            self.results.append(response)
        if final:
            self.done.set()
            if self.on_done is not None:
                self.on_done()

    def is_cancelled(self) -> bool:
        return False

    def response(self, model_name: str) -> InferenceResponse:
        errors = [r for r in self.results if isinstance(r, InferError)]
        if errors:
            return InferenceResponse.from_server(errors[0])
        if len(self.results) != 1:
            return InferenceResponse.from_server(InferError(
                f"model '{model_name}' sent {len(self.results)} responses to a non-decoupled BLS "
                "request; use exec(decoupled=True) to receive them all",
                ErrorCode.INTERNAL,
            ))
        return InferenceResponse.from_server(self.results[0])


class _IteratorSender:
    """Feeds a ``ResponseIterator`` from the server's threads."""

    def __init__(self, iterator: ResponseIterator, on_first: Callable[[], object] | None = None) -> None:
        self._iterator = iterator
        self._on_first = on_first

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        converted = InferenceResponse.from_server(response) if response is not None else None
        self._iterator.put(converted, final)
        if self._on_first is not None:  # the server sends a request's responses one at a time
            on_first, self._on_first = self._on_first, None
            on_first()

    def is_cancelled(self) -> bool:
        return self._iterator.cancelled


def refused(model_name: str) -> Callable[[InferError], InferError]:
    """How a BLS request to ``model_name`` the server refused before queueing it (unknown model,
    invalid inputs) is reported, in the words of Triton's stub: "Model <name> - Error when
    running inference: <message>"."""
    return lambda error: InferError(f"Model {model_name} - Error when running inference: {error.message}", error.code)


def _server() -> Any:
    try:
        return context.current_server()
    except RuntimeError as exc:
        raise TritonModelException(str(exc)) from None


def exec_request(request: InferenceRequest, decoupled: bool) -> InferenceResponse | ResponseIterator:
    """Blocking BLS call; see ``InferenceRequest.exec``."""
    server = _server()
    server_request = request._to_server()
    if decoupled:  # as Triton's stub: returns once the first response (or the end) is there
        iterator = ResponseIterator(server_request)
        first = threading.Event()
        server.submit(server_request, _IteratorSender(iterator, first.set), refused(server_request.model_name))
        first.wait(request.timeout() / 1e6 if request.timeout() > 0 else None)
        return iterator
    sender = _OneResponse()
    server.submit(server_request, sender, refused(server_request.model_name))
    timeout = request.timeout() / 1e6 if request.timeout() > 0 else None
    if not sender.done.wait(timeout):
        server_request.cancel()
        return InferenceResponse.from_server(InferError.unavailable(
            f"BLS request to model '{request.model_name()}' timed out"
        ))
    return sender.response(request.model_name())


async def async_exec_request(request: InferenceRequest, decoupled: bool) -> InferenceResponse | ResponseIterator:
    """Awaitable BLS call on the running event loop; see ``InferenceRequest.async_exec``."""
    server = _server()
    server_request = request._to_server()
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    if decoupled:  # as Triton: awaited until the first response (or the end) is there, so that
        # iterating it with a plain ``for`` does not block the event loop the model's coroutines share
        iterator = ResponseIterator(server_request)
        sender: Any = _IteratorSender(iterator, lambda: loop.call_soon_threadsafe(_set_done, finished))
    else:
        sender = _OneResponse()
        sender.on_done = lambda: loop.call_soon_threadsafe(_set_done, finished)
    server.submit(server_request, sender, refused(server_request.model_name))
    try:
        await finished
    except asyncio.CancelledError:
        server_request.cancel()
        raise
    if decoupled:
        return iterator
    return sender.response(request.model_name())


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
