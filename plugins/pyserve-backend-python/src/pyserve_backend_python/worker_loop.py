"""The main loop of a worker process (``execution_mode: "process"``): one ``TritonPythonModel``.

``Worker.serve`` takes the parent's messages (``pyserve_backend_python.worker`` describes
them) one at a time and hands each kind to its handler; ``exec`` is the hot path: map the
input arena, wrap the requests, run ``execute``, write the outputs into one new segment.
Imported by ``worker.main`` in the worker only (after logging is set up).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import mmap
from collections.abc import Callable
from typing import Any

from pyserve import ErrorCode, InferError
from pyserve_backend_python import context, loader, metrics, process, results
from pyserve_backend_python.constants import TRITONSERVER_REQUEST_RELEASE_ALL
from pyserve_backend_python.request import InferenceRequest, InferenceTrace
from pyserve_backend_python.response import InferenceResponse
from pyserve_backend_python.segments import create_segment, fixed_size, open_segment, pack, unlink, unpack
from pyserve_backend_python.tensor import Tensor
from pyserve_backend_python.worker_calls import RemoteCalls
from pyserve_backend_python.worker_pipe import WorkerPipe, WorkerRequest

Message = tuple[Any, ...]


class Worker:
    """One worker process's model and its conversation with the parent.

    Installs the worker's ``pb_utils`` BLS and model-control calls when created.
    Thread-safety: the handlers run on the main loop's thread only; readiness questions are
    answered on threads of their own (``_answer_ready``).

    :param conn: the worker's end of the pipe.
    :param spec: ``process.worker_spec``: the model's name, version, paths, instance name.
    :param out_prefix: prefix of the shared-memory segments this worker creates.
    """

    def __init__(self, conn: Any, spec: dict[str, Any], out_prefix: str) -> None:
        self._spec = spec
        self._name: str = spec["name"]
        self._instance_name: str = spec["instance_name"]
        self._decoupled = bool(spec.get("decoupled"))
        self._out_prefix = out_prefix
        self._counter = itertools.count()
        self._pipe = WorkerPipe(conn, self._answer_ready)
        self._calls = RemoteCalls(self._pipe, self._name, out_prefix, self._counter)
        self._calls.install(self._decoupled)
        self._async_loop = asyncio.new_event_loop()  # runs ``async def execute`` (one batch at a time)
        self._reported: list[Any] = []
        self._model = process.model_stub(spec)
        context.set_process_model(self._model)  # pb_utils.get_model_dir() in every thread
        self._obj: Any = None
        self._arena: mmap.mmap | None = None
        self._arena_name = ""
        self._handlers: dict[str, Callable[[Message], None]] = {
            "init": self._on_init,
            "exec": self._on_exec,
            "auto_complete": self._on_auto_complete,
            "finalize": self._on_finalize,
        }

    def serve(self) -> None:
        """Serve the parent's messages until ``stop`` or the pipe closes; unknown kinds are ignored."""
        self._pipe.start_reader()
        inbox = self._pipe.inbox
        handlers = self._handlers
        while True:
            try:
                message = inbox.get()
            except KeyboardInterrupt:
                break
            if message is None or message[0] == "stop":  # None: the parent went away
                break
            handler = handlers.get(message[0])
            if handler is not None:
                handler(message)
        self._close_arena()

    # -- the handlers, one per message kind

    def _on_init(self, message: Message) -> None:
        """``("init", args)``: import model.py, create the model object, call ``initialize(args)``."""
        try:
            module = loader.load_module(self._model)  # type: ignore[arg-type]
            with loader.model_path_scope(self._model):  # type: ignore[arg-type]
                self._obj = getattr(module, loader.MODEL_CLASS)()
                initialize = getattr(self._obj, "initialize", None)
                if initialize is not None:
                    initialize(message[1])
            self._report_metrics()
            self._pipe.send(("ok",))
        except loader.PythonModelError as exc:
            self._pipe.send(("error", str(exc)))
        except Exception as exc:
            self._pipe.send(("error", loader.format_failure(
                f"model '{self._name}' version {self._spec['version']} instance '{self._instance_name}': "
                "initialize() failed (worker process)", exc)))

    def _on_exec(self, message: Message) -> None:
        """``("exec", arena name, arena size, request metadata)``: run one batch, send the reply."""
        try:
            reply = self._run_batch(message[1], message[2], message[3])
        except Exception as exc:  # a failure of this worker's own code: fail the batch, keep serving
            error = results.execute_failure(self._name, self._instance_name, exc)
            reply = ("batch_error", error.message, int(error.code))
        self._report_metrics()
        self._pipe.send(reply)

    def _on_auto_complete(self, message: Message) -> None:
        """``("auto_complete", config dict)``: a worker in an EXECUTION_ENV_PATH environment,
        before the model loads, runs the model class's ``auto_complete_config``."""
        try:
            module = loader.load_module(self._model)  # type: ignore[arg-type]
            complete = getattr(getattr(module, loader.MODEL_CLASS), "auto_complete_config", None)
            if complete is None:
                self._pipe.send(("ok", None))
                return
            from pyserve_backend_python.config import ModelConfig

            returned = complete(ModelConfig(message[1]))
            if not isinstance(returned, ModelConfig):
                raise TypeError("auto_complete_config must return the pb_utils.ModelConfig it was "
                                f"given, not {type(returned).__name__}")
            self._pipe.send(("ok", returned.as_dict()))
        except loader.PythonModelError as exc:
            self._pipe.send(("error", str(exc)))
        except Exception as exc:
            self._pipe.send(("error", loader.format_failure(f"auto_complete_config of model '{self._name}' failed",
                                                            exc)))

    def _on_finalize(self, message: Message) -> None:
        """``("finalize",)``: call the model's ``finalize()``."""
        try:
            finalize = getattr(self._obj, "finalize", None)
            if finalize is not None:
                finalize()
            self._pipe.send(("ok",))
        except Exception as exc:
            self._pipe.send(("error", loader.format_failure(f"model '{self._name}': finalize() failed", exc)))

    # -- readiness and metrics

    def _answer_ready(self, token: int) -> None:
        """Call the model's ``is_ready()`` (sync or ``async def``) and send the answer."""
        try:
            is_ready = getattr(self._obj, "is_ready", None)
            answer = True if is_ready is None else is_ready()
            if inspect.isawaitable(answer):
                answer = asyncio.run(_await(answer))
        except Exception as exc:
            self._pipe.send(("ready_result", token, "error",
                             loader.format_failure(f"model '{self._name}': is_ready() raised", exc)))
            return
        if isinstance(answer, bool):
            self._pipe.send(("ready_result", token, "ok", answer))
        else:
            self._pipe.send(("ready_result", token, "not_bool", type(answer).__name__))

    def _report_metrics(self) -> None:
        """Send the model's custom metrics to the server when they changed (before a reply)."""
        current = metrics.snapshot()
        if current != self._reported:
            self._reported[:] = current
            self._pipe.send(("metrics", current))

    # -- one batch

    def _run_batch(self, arena_name: str, arena_size: int, metas: list[dict[str, Any]]) -> Message:
        """Run ``execute`` on one batch; the ``results`` or ``batch_error`` reply."""
        if arena_name != self._arena_name:
            self._map_arena(arena_name, arena_size)
        arena, make_request = self._arena, self._make_request
        requests = [make_request(m, unpack(m["inputs"], arena, False)) for m in metas]
        executing = self._calls.executing
        executing.set()
        try:
            outcome = self._obj.execute(requests)
            if inspect.isawaitable(outcome):
                outcome = self._async_loop.run_until_complete(outcome)
        except Exception as exc:
            error = results.execute_failure(self._name, self._instance_name, exc)
            return ("batch_error", error.message, int(error.code))
        finally:
            executing.clear()
        if self._decoupled:
            refused = self._decoupled_outcome(outcome)
            if refused is not None:
                return refused
        else:
            cancelled = self._pipe.cancelled
            for meta in metas:
                cancelled.discard(meta["key"])
        refused = self._check_outcome(outcome, len(requests))
        if refused is not None:
            return refused
        return self._results_reply(outcome)

    def _map_arena(self, name: str, size: int) -> None:
        """Map the parent's new input arena (and drop the previous one)."""
        self._close_arena()
        self._arena = open_segment(name, size) if name else None
        self._arena_name = name
        if name:  # mapped here and in the server: the name is not needed any more, and
            unlink(name)  # is then neither left in /dev/shm nor open to anyone

    def _close_arena(self) -> None:
        if self._arena is not None:
            try:
                self._arena.close()
            except BufferError:
                pass

    def _make_request(self, meta: dict[str, Any], inputs: dict[str, Any]) -> InferenceRequest:
        """The ``pb_utils.InferenceRequest`` ``execute`` gets for one request of the batch."""
        request = InferenceRequest.__new__(InferenceRequest)
        request._model_name = meta["model_name"]
        request._model_version = meta["model_version"]
        request._inputs = [Tensor._wrap(n, a) for n, a in inputs.items()]
        request._requested_output_names = tuple(meta["requested_outputs"])
        request._request_id = meta["id"]
        request._correlation_id = meta["correlation_id"]
        request._flags = meta["flags"]
        request._timeout = meta["timeout"]
        request._preferred_memory = None
        request._trace = InferenceTrace(meta.get("trace_context"), meta["key"] if meta.get("traced") else None)
        request._parameters = meta["parameters"]
        # a duck-typed server request
        request._server_request = WorkerRequest(meta["key"], self._pipe, self._name)  # type: ignore[assignment]
        request._decoupled = True  # only decoupled models have response senders in a worker
        request._sender = None
        request._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        return request

    def _decoupled_outcome(self, outcome: Any) -> Message | None:
        """A decoupled model's ``execute`` result: None is the empty ``results`` reply (the
        responses go through the response senders); anything else is refused."""
        if outcome is None:
            return ("results", "", 0, None)
        try:
            results.convert(self._name, [], outcome, True, self._instance_name)
        except InferError as exc:
            return ("batch_error", exc.message, int(exc.code))
        return None

    def _check_outcome(self, outcome: Any, count: int) -> Message | None:
        """A ``batch_error`` reply unless ``outcome`` is a list of ``count`` items."""
        if not isinstance(outcome, (list, tuple)):
            return ("batch_error", f"Python model '{self._name}': execute() must return a list of "
                    f"pb_utils.InferenceResponse, got {type(outcome).__name__}", int(ErrorCode.INTERNAL))
        if len(outcome) != count:
            return ("batch_error", f"Python model '{self._name}': execute() returned {len(outcome)} response(s) "
                    f"for {count} request(s); it must return exactly one InferenceResponse per "
                    "request", int(ErrorCode.INTERNAL))
        return None

    def _results_reply(self, outcome: list[Any] | tuple[Any, ...]) -> Message:
        """The ``results`` reply: the responses' outputs in one new segment, errors as such."""
        items: list[Any] = []
        outputs: list[list[tuple[str, Any]]] = []
        for item in outcome:
            if isinstance(item, InferenceResponse):
                failure = item.error()
                if failure is not None:
                    items.append(("error", failure.message(), int(failure.code())))
                    outputs.append([])
                else:
                    arrays = [(t.name(), t._array) for t in item.output_tensors()]  # no copy of an echoed input
                    items.append(("ok", dict(item._parameters)))
                    outputs.append(arrays)
            else:
                items.append(("error", f"Python model '{self._name}' returned {type(item).__name__} for a "
                              "request; expected pb_utils.InferenceResponse (response senders are not supported "
                              "in execution_mode 'process')", int(ErrorCode.INTERNAL)))
                outputs.append([])
        total = sum(fixed_size(a) for a in outputs)
        segment = None
        segment_name = ""
        if total:
            segment_name = f"{self._out_prefix}{next(self._counter)}"
            segment = create_segment(segment_name, total)
        offset = 0
        replies = []
        for item, arrays in zip(items, outputs):
            if item[0] == "ok":
                item = ("ok", item[1], pack(arrays, segment, offset))
                offset += fixed_size(arrays)
            replies.append(item)
        if segment is not None:
            segment.close()
        return ("results", segment_name, total, replies)


async def _await(awaitable: Any) -> Any:
    return await awaitable
