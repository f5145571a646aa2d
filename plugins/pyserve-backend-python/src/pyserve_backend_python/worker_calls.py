"""BLS and model control from a worker process: the server process runs them.

``RemoteCalls.install`` points ``pb_utils.InferenceRequest.exec`` / ``async_exec`` and
``pb_utils.load_model`` / ``unload_model`` / ``is_model_ready`` at the pipe to the parent
(messages ``("bls", call id, request fields, decoupled)`` and ``("control", call id, operation,
args)``, see ``pyserve_backend_python.worker``; calls from several threads are in flight at once). Input tensors of a BLS request and the tensors of its
responses travel in shared-memory segments (``segments.share_arrays`` / ``take_arrays``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from typing import Any

import triton_python_backend_utils

from pyserve import ErrorCode, InferError, InferResponse
from pyserve_backend_python.errors import TritonModelException
from pyserve_backend_python.request import InferenceRequest
from pyserve_backend_python.response import InferenceResponse, ResponseIterator
from pyserve_backend_python.segments import share_arrays, take_arrays
from pyserve_backend_python.worker_pipe import WorkerPipe


def _unsupported(what: str, model_name: str) -> Any:
    """A method that raises: ``what`` does not work in process mode."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise TritonModelException(f"{what} is not supported in execution_mode 'process' (model "
                                   f"'{model_name}'); use execution_mode 'thread'")
    return refuse


class RemoteCalls:
    """The worker's BLS and model-control calls, over ``pipe``.

    :param model_name: the worker's model, for messages.
    :param out_prefix: prefix of the shared-memory segments the worker creates.
    :param counter: numbers those segments (shared with the worker's output segments).
    """

    def __init__(self, pipe: WorkerPipe, model_name: str, out_prefix: str, counter: itertools.count[int]) -> None:
        self._pipe = pipe
        self._model_name = model_name
        self._out_prefix = out_prefix
        self._counter = counter
        self.executing = threading.Event()
        """Set while ``execute`` runs: BLS is allowed only then."""
        self._pid = os.getpid()

    def _refuse_forked(self) -> None:
        """A process the model forked (``multiprocessing``) has no reader of the pipe: its call
        would wait for ever."""
        if os.getpid() != self._pid:
            raise TritonModelException(
                f"BLS and model control cannot be called from process {os.getpid()}, which model "
                f"'{self._model_name}' forked off its worker {self._pid}; call them from the model's own threads")

    def install(self, model_decoupled: bool) -> None:
        """Make the ``pb_utils`` calls go to the parent (and, for a model that is not
        decoupled, ``get_response_sender()`` refuse)."""
        calls = self

        def remote_exec(request: Any, decoupled: bool = False) -> Any:
            return calls.exec(request, decoupled)

        def remote_async_exec(request: Any, decoupled: bool = False) -> Any:
            return calls.async_exec(request, decoupled)

        if not model_decoupled:
            refuse = _unsupported("get_response_sender()", self._model_name)
            InferenceRequest.get_response_sender = refuse  # type: ignore[method-assign]
        triton_python_backend_utils.load_model = self.load_model
        triton_python_backend_utils.unload_model = self.unload_model
        triton_python_backend_utils.is_model_ready = self.is_model_ready
        InferenceRequest.exec = remote_exec  # type: ignore[method-assign,assignment]
        InferenceRequest.async_exec = remote_async_exec  # type: ignore[method-assign,assignment]

    def exec(self, request: Any, decoupled: bool = False) -> Any:
        """BLS from the worker: the parent runs the request on the server and sends the answers.

        :raises TritonModelException: called outside ``execute``, or the parent went away.
        """
        self._refuse_forked()
        if not self.executing.is_set():
            raise TritonModelException(f"BLS outside execute() is not supported in execution_mode 'process' "
                                       f"(model '{self._model_name}')")
        call = request._to_server()  # the same checks as in-process BLS
        fields = {
            "model_name": call.model_name, "model_version": call.model_version,
            "inputs": share_arrays(call.inputs, f"{self._out_prefix}i{next(self._counter)}"),
            "requested_outputs": list(call.requested_outputs), "id": call.id, "parameters": call.parameters,
            "flags": call.flags, "correlation_id": call.correlation_id, "timeout_us": call.timeout_us,
            "trace_parent": call.trace_parent,
            "trace_of": request._trace._origin if request._trace is not None else None,
        }
        reply = self._pipe.call(("bls", fields, bool(decoupled)))  # whichever thread of execute() makes it
        if reply is None:
            raise TritonModelException("the server process went away during a BLS call")
        answers: list[Any] = [
            InferResponse(take_arrays(item[1]), item[2]) if item[0] == "ok"
            else InferError(item[1], ErrorCode(item[2]))
            for item in reply[1]
        ]
        if decoupled:
            iterator = ResponseIterator(call)
            for answer in answers:
                iterator.put(InferenceResponse.from_server(answer), False)
            iterator.put(None, True)
            return iterator
        return _one_answer(call.model_name, answers)

    def async_exec(self, request: Any, decoupled: bool = False) -> Any:
        """``async_exec`` in the worker: a future on the running loop (``RuntimeError`` without
        one); the blocking call runs on an executor thread, as Triton's stub runs it, so that
        the model's other coroutines go on meanwhile."""
        return asyncio.get_running_loop().run_in_executor(None, self.exec, request, decoupled)

    def control(self, operation: str, *args: Any) -> Any:
        """Model control from the worker: the server process runs it (``model_control.run_on``);
        allowed in ``initialize`` and ``finalize`` too.

        :raises TritonModelException: it failed (its message), or the parent went away.
        """
        self._refuse_forked()
        reply = self._pipe.call(("control", operation, args))
        if reply is None:
            raise TritonModelException("the server process went away during a model control call")
        status, value = reply[1]
        if status != "ok":
            raise TritonModelException(value)
        return value

    def load_model(self, model_name: str, config: str = "", files: Any = None) -> None:
        """``pb_utils.load_model``."""
        self.control("load", model_name, config, dict(files or {}))

    def unload_model(self, model_name: str, unload_dependents: bool = False) -> None:
        """``pb_utils.unload_model``."""
        self.control("unload", model_name, unload_dependents)

    def is_model_ready(self, model_name: str, model_version: str = "") -> bool:
        """``pb_utils.is_model_ready``."""
        return bool(self.control("ready", model_name, model_version))


def _one_answer(model_name: str, answers: list[Any]) -> InferenceResponse:
    """The response of a non-decoupled BLS call: its first error, else its one response."""
    errors = [a for a in answers if isinstance(a, InferError)]
    if errors:
        return InferenceResponse.from_server(errors[0])
    if len(answers) != 1:
        return InferenceResponse.from_server(InferError(
            f"model '{model_name}' sent {len(answers)} responses to a non-decoupled BLS request; "
            "use exec(decoupled=True) to receive them all", ErrorCode.INTERNAL))
    return InferenceResponse.from_server(answers[0])
