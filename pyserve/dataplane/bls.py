"""Calling models of this server from inside it (BLS), without the network and without copies.

Backends reach it as ``model.server`` (a ``ServerHandle``). Calls may come from instance
threads (blocking ``infer`` / ``stream``) or from coroutines on any loop (``infer_async``).
Requests go straight to the target model's scheduler on the server's event loop, so they get
the same batching, sequence and ensemble handling as requests from clients; input arrays are
passed by reference.
"""

from __future__ import annotations

import asyncio
import os
import queue
from collections.abc import Callable, Iterator
from typing import Any

from pyserve.api import datatypes
from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import InferRequest, InferResponse, ResponseSender
from pyserve.repository.tensor_checks import (
    check_input,
    check_input_count,
    check_outputs_requested,
    finish_inputs,
)

_DONE = object()


class _QueueSender:
    """Collects a request's responses for a waiting thread."""

    __slots__ = ("_cancelled", "queue")

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._cancelled = False

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        if response is not None:
            self.queue.put(response)
        if final:
            self.queue.put(_DONE)

    def is_cancelled(self) -> bool:
        return self._cancelled


class ServerHandle:
    """The in-process API of one running server.

    Thread-safety: every method may be called from any thread except the server's event
    loop thread itself for the blocking ones (they would wait on the loop they block).

    :param dataplane: the server's data plane.
    :param loop: the server's event loop (None until ``bind``).
    :param metrics: renders the server's ``/metrics`` page (None: the process has none).
    """

    def __init__(
        self, dataplane: Any, loop: asyncio.AbstractEventLoop | None, metrics: Callable[[], bytes] | None = None
    ) -> None:
        self._dataplane = dataplane
        self._loop: Any = loop
        self._metrics = metrics
        self._pid = os.getpid()

    def bind(
        self, dataplane: Any, loop: asyncio.AbstractEventLoop | None, metrics: Callable[[], bytes] | None = None
    ) -> None:
        """Serve through ``dataplane`` on ``loop`` from now on: a handle made before the loop
        ran (models loaded before a fork keep the handle they were given). ``metrics``, when
        given, renders the ``/metrics`` page ``metrics_text`` returns."""
        self._dataplane = dataplane
        self._loop = loop
        self._pid = os.getpid()
        if metrics is not None:
            self._metrics = metrics

    # -- the server as a whole (what the health, metadata, index and statistics endpoints answer)
    def is_live(self) -> bool:
        """Whether the server is live (not yet shutting down)."""
        return bool(self._dataplane.live and not self._dataplane.exiting)

    def is_ready(self) -> bool:
        """The server's readiness by state (the backends' own readiness checks are not run)."""
        return bool(self._dataplane.is_ready())

    def server_metadata(self) -> dict[str, Any]:
        """``{"name", "version", "extensions"}``, as the metadata endpoint answers."""
        return dict(self._dataplane.server_metadata())

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """The repository index, as the repository API answers it."""
        return list(self._dataplane.repository_index(ready_only))

    def model_statistics(self, name: str = "", version: str | None = None) -> dict[str, Any]:
        """Triton's ``{"model_stats": [...]}`` (every model when ``name`` is empty).

        :raises InferError: the model or version is not loaded.
        """
        return dict(self._dataplane.model_statistics(name, version))

    def metrics_text(self) -> str:
        """The server's metrics in Prometheus text format (as ``/metrics`` shows them).

        :raises InferError: UNAVAILABLE when this process renders no metrics.
        """
        if self._metrics is None:
            raise InferError.unavailable("metrics are not available in this process")
        return self._metrics().decode("utf-8")

    @property
    def tracing(self) -> Any:
        """The server's ``pyserve.tracing.TraceManager``."""
        return self._dataplane.tracing

    def model_ready(self, name: str, version: str | None = None) -> bool:
        """Whether a model (version) is READY."""
        return bool(self._dataplane.model_ready(name, version))

    def model_config(self, name: str, version: str | None = None) -> Any:
        """The ``ModelConfig`` message of a READY model.

        :raises InferError: unknown or unavailable model.
        """
        return self._dataplane.model(name, version).config

    def is_decoupled(self, name: str, version: str | None = None) -> bool:
        return bool(self._dataplane.model(name, version).decoupled)

    def load_model(self, name: str, parameters: dict[str, Any] | None = None, timeout: float | None = None) -> None:
        """Load or reload a model, as the repository API does (explicit mode); blocks until READY.

        :param parameters: ``config`` (ModelConfig JSON) and ``file:<path>`` contents (bytes).
        :raises InferError: not in explicit mode, bad parameters, the load failed, or called on
            the server's event loop.
        """
        self._blocking_call(self._dataplane.load_model(name, parameters or {}), timeout)

    def unload_model(self, name: str, unload_dependents: bool = False, timeout: float | None = None) -> None:
        """Unload a model (explicit mode); blocks until it is unloaded.

        :raises InferError: not in explicit mode, or called on the server's event loop.
        """
        self._blocking_call(self._dataplane.unload_model(name, unload_dependents), timeout)

    def _forked_error(self) -> InferError | None:
        """An error when called from a process forked off the server's (a model's
        ``multiprocessing`` pool): the server's event loop does not run there, so the call would
        wait for ever."""
        if os.getpid() == self._pid:
            return None
        return InferError(
            f"in-process server calls (BLS, model control) cannot be made from process {os.getpid()}, "
            f"which was forked off the server's process {self._pid}: the server does not run there. "
            "Make them from the model's own threads (e.g. concurrent.futures.ThreadPoolExecutor)",
            ErrorCode.INTERNAL)

    def _blocking_call(self, coroutine: Any, timeout: float | None) -> None:
        forked = self._forked_error()
        if forked is not None:
            coroutine.close()
            raise forked
        if _on_loop(self._loop):
            coroutine.close()
            raise InferError("blocking in-process calls cannot be made on the server's event loop", ErrorCode.INTERNAL)
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise InferError.unavailable("the model control call did not finish in time") from None

    def submit(self, request: InferRequest, sender: ResponseSender,
               rejected: Callable[[InferError], InferError] | None = None) -> None:
        """Send a request without waiting; its responses go to ``sender`` (any thread).

        The building block for callers that need more than ``infer`` / ``stream`` offer
        (e.g. whether the final flag came with a response, or delivery onto their own loop).
        ``sender.send(response, final)`` is called from the server's threads: 0..N
        responses, then exactly one call with ``final=True`` (with or without a response).
        Errors (unknown model, invalid inputs) arrive the same way, as an ``InferError``
        with ``final=True``. Safe to call from any thread, the event loop included.
        ``rejected``, when given, rewrites the error of a request refused before it was queued
        (unknown model, invalid inputs) before it is sent (e.g. a caller's own prefix).
        """
        self._submit(request, sender, rejected)

    def _submit(self, request: InferRequest, sender: Any,
                rejected: Callable[[InferError], InferError] | None = None) -> None:
        forked = self._forked_error()
        if forked is not None:
            sender.send(forked, True)
            return
        version = None if request.model_version in (-1, 0) else str(request.model_version)

        def submit() -> None:
            try:
                model = self._dataplane.model(request.model_name, version)
                _validate(request, model)
                request.model_version = model.version
                request.attach_sender(_Finishing(sender, request, self._loop))
                self._dataplane.submit(model, request)
            except InferError as exc:
                sender.send(rejected(exc) if rejected is not None else exc, True)

        if _on_loop(self._loop):
            submit()
        else:
            self._loop.call_soon_threadsafe(submit)

    def stream(self, request: InferRequest, timeout: float | None = None,
               rejected: Callable[[InferError], InferError] | None = None) -> Iterator[InferResponse | InferError]:
        """Send a request and yield its responses as they come (decoupled models: 0..N).

        :param timeout: seconds to wait for each response; on expiry the request is cancelled
            and an UNAVAILABLE error is yielded.
        :param rejected: as for ``submit``.
        """
        if _on_loop(self._loop):
            raise InferError(
                "blocking in-process calls cannot be made on the server's event loop (the calling model "
                "executes there: a compute-only model while one client sends, or one with parameter "
                "'pyserve_inline_execute'; set that parameter to \"false\" to keep its instance threads)",
                ErrorCode.INTERNAL,
            )
        sender = _QueueSender()
        self._submit(request, sender, rejected)
        while True:
            try:
                item = sender.queue.get(timeout=timeout)
            except queue.Empty:
                request.cancel()
                yield InferError.unavailable(f"request to model '{request.model_name}' timed out")
                return
            if item is _DONE:
                return
            yield item

    def infer(self, request: InferRequest, timeout: float | None = None) -> InferResponse | InferError:
        """Send a request and wait for its one response (blocking)."""
        results = list(self.stream(request, timeout))
        errors = [r for r in results if isinstance(r, InferError)]
        if errors:
            return errors[0]
        if len(results) != 1:
            return InferError(
                f"model '{request.model_name}' sent {len(results)} responses; use a decoupled call to read them all",
                ErrorCode.INTERNAL,
            )
        return results[0]

    async def infer_async(self, request: InferRequest) -> InferResponse | InferError:
        """Await one response from a coroutine running on any event loop."""
        caller = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = caller.create_future()
        collected: list[Any] = []

        def settle() -> None:
            if not future.done():
                future.set_result(collected)

        class _Sender:
            def send(self, response: Any, final: bool) -> None:
                if response is not None:
                    collected.append(response)
                if final:
                    caller.call_soon_threadsafe(settle)

            def is_cancelled(self) -> bool:
                return future.cancelled()

        self._submit(request, _Sender())
        results = await future
        errors = [r for r in results if isinstance(r, InferError)]
        if errors:
            return errors[0]
        if len(results) != 1:
            return InferError(f"model '{request.model_name}' sent {len(results)} responses", ErrorCode.INTERNAL)
        return results[0]


class _Finishing:
    """Forwards to the caller's sender and releases the request after its final response."""

    __slots__ = ("_inner", "_loop", "_request")

    def __init__(self, inner: Any, request: InferRequest, loop: asyncio.AbstractEventLoop) -> None:
        self._inner = inner
        self._request = request
        self._loop = loop

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        self._inner.send(response, final)
        if final:
            if _on_loop(self._loop):
                self._request.release()
            else:
                self._loop.call_soon_threadsafe(self._request.release)

    def is_cancelled(self) -> bool:
        return self._inner.is_cancelled()


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _validate(request: InferRequest, model: Any) -> None:
    """The checks a frontend's codec makes, for a request built in-process.

    :raises InferError: unknown/missing inputs or outputs, wrong datatype or shape.
    """
    io = model.io
    shapes = {}
    check_input_count(model.name, io, len(request.inputs), lambda: request.inputs)
    for name, array in request.inputs.items():
        spec = io.inputs.get(name)
        if spec is None:
            raise InferError.invalid(f"unexpected inference input '{name}' for model '{model.name}'")
        dtype = datatypes.from_numpy(array.dtype)
        _, shape = check_input(model.name, io, name, dtype.name if dtype else str(array.dtype), list(array.shape))
        shapes[name] = shape
    request.batch_size = finish_inputs(model.name, io, request.inputs, shapes)
    request.requested_outputs = check_outputs_requested(model.name, io, list(request.requested_outputs))
