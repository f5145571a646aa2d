"""Where a model instance's ``TritonPythonModel`` runs: the ``Runner`` interface and the
in-process (``"thread"``) implementation.

A runner owns one instance's model object. ``ThreadRunner`` keeps it in the server process:
``execute`` runs on the instance's execution thread, and coroutines (``async def execute``,
``async_exec``) run on the instance's own asyncio event loop, started on first use on a
thread of its own. The process-isolated runner (``execution_mode: "process"``, one worker
process per instance) is ``pyserve_backend_python.process.ProcessRunner``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Coroutine, Sequence
from types import ModuleType
from typing import Any, Protocol

from pyserve import InferError, InferRequest, InstanceContext
from pyserve.protocol.config_json import model_config_to_dict
from pyserve_backend_python import context, results
from pyserve_backend_python.loader import MODEL_CLASS, PythonModelError, format_failure, model_path_scope
from pyserve_backend_python.request import InferenceRequest

log = logging.getLogger("pyserve.python_backend")


class Runner(Protocol):
    """Runs one model instance's ``TritonPythonModel``; called by the backend's hooks."""

    def create(self) -> None:
        """Create the model object and call ``initialize(args)``.

        :raises PythonModelError: the model failed (the message has the traceback).
        """

    def execute(self, requests: Sequence[InferRequest]) -> results.ServerResults:
        """Run ``execute`` on the requests; returns what ``pyserve_execute`` returns.

        :raises InferError: the whole batch failed (the message names the model).
        """

    def finalize(self) -> None:
        """Call ``finalize()`` and release the instance's resources."""

    def ready(self) -> bool:
        """The model's ``is_ready()`` (True when it has none); called on a readiness thread.

        :raises Exception: ``is_ready()`` raised, or returned something other than a bool.
        """


def initialize_args(instance: InstanceContext) -> dict[str, str]:
    """The ``args`` dict Triton passes to ``initialize``."""
    model = instance.model
    return {
        "model_config": json.dumps(model_config_to_dict(model.config), separators=(",", ":")),  # as Triton
        "model_instance_kind": instance.kind,
        "model_instance_name": instance.name,
        "model_instance_device_id": str(instance.device_id),
        "model_repository": str(model.path),
        "model_version": str(model.version),
        "model_name": model.name,
    }


class EventLoopThread:
    """An asyncio event loop running on a daemon thread of its own."""

    def __init__(self, name: str, instance: InstanceContext) -> None:
        self.loop = asyncio.new_event_loop()
        self._instance = instance
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        context.set_current(self._instance.model)
        self.loop.run_forever()

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return self.submit(coroutine).result()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what still runs on the loop, then stop and close it."""
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.submit(cancel_all()).result(timeout)
        except Exception:  # a task that ignores cancellation must not block unloading
            log.warning("instance '%s': coroutines still running at finalize", self._instance.name)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


class ThreadRunner:
    """The in-process runner (``execution_mode`` ``"thread"``, the default).

    :param instance: the instance's context.
    :param module: the model's imported module (``loader.load_module``).
    """

    def __init__(self, instance: InstanceContext, module: ModuleType) -> None:
        self._instance = instance
        self._model = instance.model
        self._module = module
        self._decoupled = bool(instance.model.config.model_transaction_policy.decoupled)
        self._object: Any = None
        self._loop: EventLoopThread | None = None
        self._loop_lock = threading.Lock()
        self._initialized_in = 0  # the process that ran initialize() (a forked frontend inherits it)

    def _event_loop(self) -> EventLoopThread:
        with self._loop_lock:
            if self._loop is None:
                self._loop = EventLoopThread(f"pyserve-python-loop-{self._instance.name}", self._instance)
            return self._loop

    def _settle(self, value: Any) -> Any:
        """Run a coroutine returned by the model on the instance's loop and return its result."""
        if inspect.isawaitable(value):
            return self._event_loop().run(_await(value))
        return value

    def create(self) -> None:
        model = self._model
        try:
            with context.calling(model), model_path_scope(model):
                self._object = getattr(self._module, MODEL_CLASS)()
                initialize = getattr(self._object, "initialize", None)
                if initialize is not None:
                    self._settle(initialize(initialize_args(self._instance)))
            self._initialized_in = os.getpid()
        except Exception as exc:
            self._stop_loop()
            raise PythonModelError(format_failure(
                f"model '{model.name}' version {model.version} instance '{self._instance.name}': "
                "initialize() failed", exc,
            )) from None

    def execute(self, requests: Sequence[InferRequest]) -> results.ServerResults:
        model = self._model
        wrap = InferenceRequest._from_server
        decoupled = self._decoupled
        wrapped = [wrap(request, decoupled) for request in requests]
        token = context.enter(model)
        compute_start = time.monotonic_ns()
        try:
            outcome = self._object.execute(wrapped)
            # A list (the usual answer) is never awaitable: skip the ABC check for it.
            if type(outcome) is not list and inspect.isawaitable(outcome):
                if self._decoupled:
                    future = self._event_loop().submit(_await(outcome))
                    future.add_done_callback(lambda f: self._async_done(f, requests))
                    return None
                outcome = self._event_loop().run(_await(outcome))
        except Exception as exc:  # the server logs it once, with this traceback (the cause)
            raise results.execute_failure(model.name, self._instance.name, exc) from exc
        finally:
            context.leave(token)
        _report_compute(requests, compute_start, time.monotonic_ns())
        return results.convert(model.name, requests, outcome, decoupled, self._instance.name, wrapped)

    def _async_done(self, future: concurrent.futures.Future[Any], requests: Sequence[InferRequest]) -> None:
        """A decoupled ``async def execute`` finished: answer what it left unanswered on failure."""
        error: InferError | None = None
        if future.cancelled():
            error = results.execute_failure(self._model.name, self._instance.name,
                                            RuntimeError("execute() was cancelled"))
        elif future.exception() is not None:
            exc = future.exception()
            assert exc is not None
            log.error("Python model '%s' instance '%s': async execute() raised", self._model.name,
                      self._instance.name, exc_info=exc)
            error = results.execute_failure(self._model.name, self._instance.name, exc)
        else:
            try:
                results.convert(self._model.name, requests, future.result(), True, self._instance.name)
            except InferError as exc:
                error = exc
        if error is None:
            return
        for request in requests:
            if not request.final_sent:
                try:
                    request.response_sender().send(error, final=True)
                except InferError:
                    pass  # answered concurrently

    def ready(self) -> bool:
        is_ready = getattr(self._object, "is_ready", None)
        if is_ready is None:
            return True
        with context.calling(self._model):
            answer = self._settle(is_ready())
        if not isinstance(answer, bool):
            raise TypeError(f"is_ready() of model '{self._model.name}' returned {type(answer).__name__}, expected bool")
        return answer

    def finalize(self) -> None:
        """Call the model's ``finalize()`` in the process that ran its ``initialize()`` only: a
        frontend forked with the instance (``pyserve.handoff.prefork``) drops its copy without
        it, so a model's clean-up (files, connections) runs once per ``initialize()``, as in
        Triton, and not under the feet of the process still serving."""
        model = self._model
        finalize = getattr(self._object, "finalize", None)
        if self._initialized_in != os.getpid():
            finalize = None
        try:
            if finalize is not None:
                with context.calling(model):
                    self._settle(finalize())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        with self._loop_lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.stop()


def _report_compute(requests: Sequence[InferRequest], start_ns: int, end_ns: int) -> None:
    """Tell the statistics where ``execute()`` ran inside the backend's execute: wrapping the
    requests before it is compute input, converting the responses after it compute output (the
    phases Triton's Python backend reports)."""
    stats = requests[0].stats if requests else None
    if stats is not None:
        stats.backend_compute(requests, requests[0].exec_start_ns, start_ns, end_ns, end_ns)


async def _await(awaitable: Any) -> Any:
    return await awaitable
