"""The worker process of ``execution_mode: "process"`` (see ``pyserve_backend_python.process``).

Messages from the parent: ``("init", args)``, ``("exec", arena_name, arena_size, requests)``,
``("finalize",)``, ``("stop",)``, and ``("auto_complete", config dict)`` (to a worker started
in an ``EXECUTION_ENV_PATH`` environment before the model loads; answered ``("ok", completed
config dict or None)`` or ``("error", message)``). Replies: ``("ok",)`` / ``("error", message)`` for init and
finalize; ``("results", segment_name, segment_size, responses)`` or
``("batch_error", message, code)`` for exec.

While it executes a batch, the worker may send ``("bls", request fields, decoupled)``; the parent
runs that request on the server and answers ``("bls_result", responses)`` (BLS from
``execute``; tensors travel both ways in shared-memory segments, ``process.share_arrays`` /
``take_arrays``: the receiver maps and unlinks each one). ``pb_utils.load_model`` /
``unload_model`` / ``is_model_ready`` send ``("control", operation, args)`` the same way and get
``("bls_result", ("ok", value))`` or ``("bls_result", ("error", message))``. A decoupled model's response
senders send ``("send", request key, response or None, final)`` at any time, from any thread.
Before a reply, the worker sends ``("metrics", families)`` when its custom metrics changed. The
parent sends ``("cancel", request key)`` when a request's client went away (``is_cancelled()``),
and ``("ready", token)`` when a client asks whether the model is ready: a thread of the worker
calls the model's ``is_ready()`` (if it has one; ``True`` otherwise), also while a batch executes,
and answers ``("ready_result", token, "ok", answer)``, ``("ready_result", token, "not_bool", type
name)`` or ``("ready_result", token, "error", traceback text)``.
"""

from __future__ import annotations

import inspect
import itertools
import mmap
from typing import Any

from pyserve import ErrorCode


def main(conn: Any, spec: dict[str, Any], out_prefix: str) -> None:
    """The worker's loop: serve the parent's messages until ``stop`` or the pipe closes."""
    import logging

    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [{spec['name']} worker %(process)d] %(message)s")
    from pyserve_backend_python import loader, metrics, process, results
    from pyserve_backend_python.constants import TRITONSERVER_REQUEST_RELEASE_ALL
    from pyserve_backend_python.errors import TritonModelException
    from pyserve_backend_python.request import InferenceRequest, InferenceTrace
    from pyserve_backend_python.response import InferenceResponse
    from pyserve_backend_python.tensor import Tensor

    def unsupported(what: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise TritonModelException(f"{what} is not supported in execution_mode 'process' (model "
                                       f"'{spec['name']}'); use execution_mode 'thread'")
        return refuse

    import asyncio
    import threading

    import numpy as np
    import triton_python_backend_utils

    from pyserve import InferError, InferResponse
    from pyserve_backend_python.response import ResponseIterator

    send_lock = threading.Lock()  # the main loop, BLS calls and response senders all send

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    import queue

    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # the main loop's messages
    bls_replies: queue.SimpleQueue[Any] = queue.SimpleQueue()
    cancelled: set[int] = set()  # keys of requests whose client went away

    def read() -> None:
        """Sort what the parent sends: BLS answers, cancellations, and the main loop's work."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                inbox.put(None)
                bls_replies.put(None)
                return
            if message[0] == "bls_result":
                bls_replies.put(message)
            elif message[0] == "cancel":
                cancelled.add(message[1])
            elif message[0] == "ready":
                threading.Thread(target=answer_ready, args=(message[1],), daemon=True,
                                 name="pyserve-python-worker-ready").start()
            else:
                inbox.put(message)

    def answer_ready(token: int) -> None:
        """Call the model's ``is_ready()`` (sync or ``async def``) and send the answer."""
        try:
            is_ready = getattr(obj, "is_ready", None)
            answer = True if is_ready is None else is_ready()
            if inspect.isawaitable(answer):
                answer = asyncio.run(_await(answer))
        except Exception as exc:
            send(("ready_result", token, "error", loader.format_failure(f"model '{spec['name']}': is_ready() raised", exc)))
            return
        if isinstance(answer, bool):
            send(("ready_result", token, "ok", answer))
        else:
            send(("ready_result", token, "not_bool", type(answer).__name__))

    class PipeSender:
        """A decoupled request's responses, sent to the parent as they come (any thread)."""

        def __init__(self, key: int) -> None:
            self.key = key
            self.final_sent = False

        def send(self, response: Any, final: bool) -> None:
            if self.final_sent:
                raise InferError("the final response was already sent", ErrorCode.INTERNAL)
            if isinstance(response, InferError):
                payload: Any = ("error", response.message, int(response.code))
            elif response is not None:
                payload = ("ok", [(n, np.asarray(a)) for n, a in response.outputs.items()],
                           dict(response.parameters))
            else:
                payload = None
            if final:
                self.final_sent = True
                cancelled.discard(self.key)
            send(("send", self.key, payload, bool(final)))

        def is_cancelled(self) -> bool:
            return self.key in cancelled

    class WorkerRequest:
        """What ``InferenceResponseSender`` needs of a server request, in the worker."""

        def __init__(self, key: int) -> None:
            self._sender = PipeSender(key)

        def response_sender(self) -> PipeSender:
            return self._sender

        def is_cancelled(self) -> bool:
            return self._sender.key in cancelled

        @property
        def final_sent(self) -> bool:
            return self._sender.final_sent

        def reschedule(self) -> None:
            raise InferError(f"rescheduling requests (TRITONSERVER_REQUEST_RELEASE_RESCHEDULE) is not supported "
                             f"in execution_mode 'process' (model '{spec['name']}'); use execution_mode 'thread'",
                             ErrorCode.UNSUPPORTED)

    if not spec.get("decoupled"):
        InferenceRequest.get_response_sender = unsupported("get_response_sender()")  # type: ignore[method-assign]
    bls_lock = threading.Lock()
    executing = threading.Event()

    def remote_exec(request: Any, decoupled: bool = False) -> Any:
        """BLS from the worker: the parent runs the request on the server and sends the answers."""
        if not executing.is_set():
            raise TritonModelException(f"BLS outside execute() is not supported in execution_mode 'process' "
                                       f"(model '{spec['name']}')")
        call = request._to_server()  # the same checks as in-process BLS
        fields = {
            "model_name": call.model_name, "model_version": call.model_version,
            "inputs": process.share_arrays(call.inputs, f"{out_prefix}i{next(counter)}"),
            "requested_outputs": list(call.requested_outputs), "id": call.id, "parameters": call.parameters,
            "flags": call.flags, "correlation_id": call.correlation_id, "timeout_us": call.timeout_us,
            "trace_parent": call.trace_parent,
            "trace_of": request._trace._origin if request._trace is not None else None,
        }
        with bls_lock:  # one call on the pipe at a time, whichever thread of execute() makes it
            send(("bls", fields, bool(decoupled)))
            reply = bls_replies.get()
        if reply is None:
            raise TritonModelException("the server process went away during a BLS call")
        answers: list[Any] = [
            InferResponse(process.take_arrays(item[1]), item[2]) if item[0] == "ok"
            else InferError(item[1], ErrorCode(item[2]))
            for item in reply[1]
        ]
        if decoupled:
            iterator = ResponseIterator(call)
            for answer in answers:
                iterator.put(InferenceResponse.from_server(answer), False)
            iterator.put(None, True)
            return iterator
        errors = [a for a in answers if isinstance(a, InferError)]
        if errors:
            return InferenceResponse.from_server(errors[0])
        if len(answers) != 1:
            return InferenceResponse.from_server(InferError(
                f"model '{call.model_name}' sent {len(answers)} responses to a non-decoupled BLS request; "
                "use exec(decoupled=True) to receive them all", ErrorCode.INTERNAL))
        return InferenceResponse.from_server(answers[0])

    def remote_async_exec(request: Any, decoupled: bool = False) -> Any:
        """``async_exec`` in the worker: a task on the running loop (``RuntimeError`` without one)."""
        async def call() -> Any:
            return remote_exec(request, decoupled)

        return asyncio.get_running_loop().create_task(call())

    def remote_control(operation: str, *args: Any) -> Any:
        """Model control from the worker: the server process runs it (``model_control.run_on``)."""
        with bls_lock:  # the same pipe turn-taking as BLS; allowed in initialize and finalize too
            send(("control", operation, args))
            reply = bls_replies.get()
        if reply is None:
            raise TritonModelException("the server process went away during a model control call")
        status, value = reply[1]
        if status != "ok":
            raise TritonModelException(value)
        return value

    def load_model(model_name: str, config: str = "", files: Any = None) -> None:
        remote_control("load", model_name, config, dict(files or {}))

    def unload_model(model_name: str, unload_dependents: bool = False) -> None:
        remote_control("unload", model_name, unload_dependents)

    def is_model_ready(model_name: str, model_version: str = "") -> bool:
        return bool(remote_control("ready", model_name, model_version))

    triton_python_backend_utils.load_model = load_model
    triton_python_backend_utils.unload_model = unload_model
    triton_python_backend_utils.is_model_ready = is_model_ready

    InferenceRequest.exec = remote_exec  # type: ignore[method-assign,assignment]
    InferenceRequest.async_exec = remote_async_exec  # type: ignore[method-assign,assignment]
    async_loop = asyncio.new_event_loop()  # runs ``async def execute`` (one batch at a time)
    reported: list[Any] = []

    def report_metrics() -> None:
        """Send the model's custom metrics to the server when they changed (before a reply)."""
        current = metrics.snapshot()
        if current != reported:
            reported[:] = current
            send(("metrics", current))

    model = process.model_stub(spec)
    name, instance_name = spec["name"], spec["instance_name"]
    obj: Any = None
    arena: mmap.mmap | None = None
    arena_name = ""
    counter = itertools.count()

    def make_request(meta: dict[str, Any], inputs: dict[str, Any]) -> InferenceRequest:
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
        request._server_request = WorkerRequest(meta["key"])  # type: ignore[assignment]  # duck-typed server request
        request._decoupled = True  # only decoupled models have response senders in a worker
        request._sender = None
        request._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        return request

    def run_batch(arena_msg: tuple[str, int], metas: list[dict[str, Any]]) -> tuple:
        nonlocal arena, arena_name
        if arena_msg[0] != arena_name:
            if arena is not None:
                try:
                    arena.close()
                except BufferError:
                    pass
            arena = process._open_segment(arena_msg[0], arena_msg[1]) if arena_msg[0] else None
            arena_name = arena_msg[0]
            if arena_msg[0]:  # mapped here and in the server: the name is not needed any more, and
                process._unlink(arena_msg[0])  # is then neither left in /dev/shm nor open to anyone
        requests = [make_request(m, process._unpack(m["inputs"], arena, False)) for m in metas]
        executing.set()
        try:
            outcome = obj.execute(requests)
            if inspect.isawaitable(outcome):
                outcome = async_loop.run_until_complete(outcome)
        except Exception as exc:
            error = results.execute_failure(name, instance_name, exc)
            return ("batch_error", error.message, int(error.code))
        finally:
            executing.clear()
        if not spec.get("decoupled"):
            for meta in metas:
                cancelled.discard(meta["key"])
        if spec.get("decoupled"):
            if outcome is None:
                return ("results", "", 0, None)  # the responses go through the response senders
            try:
                results.convert(name, [], outcome, True, instance_name)
            except InferError as exc:
                return ("batch_error", exc.message, int(exc.code))
        if not isinstance(outcome, (list, tuple)):
            return ("batch_error", f"Python model '{name}': execute() must return a list of "
                    f"pb_utils.InferenceResponse, got {type(outcome).__name__}", int(ErrorCode.INTERNAL))
        if len(outcome) != len(requests):
            return ("batch_error", f"Python model '{name}': execute() returned {len(outcome)} response(s) "
                    f"for {len(requests)} request(s); it must return exactly one InferenceResponse per "
                    "request", int(ErrorCode.INTERNAL))
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
                items.append(("error", f"Python model '{name}' returned {type(item).__name__} for a request; "
                              "expected pb_utils.InferenceResponse (response senders are not supported in "
                              "execution_mode 'process')", int(ErrorCode.INTERNAL)))
                outputs.append([])
        total = sum(process._fixed_size(a) for a in outputs)
        segment = None
        segment_name = ""
        if total:
            segment_name = f"{out_prefix}{next(counter)}"
            segment = process._create_segment(segment_name, total)
        offset = 0
        replies = []
        for item, arrays in zip(items, outputs):
            if item[0] == "ok":
                item = ("ok", item[1], process._pack(arrays, segment, offset))
                offset += process._fixed_size(arrays)
            replies.append(item)
        if segment is not None:
            segment.close()
        return ("results", segment_name, total, replies)

    threading.Thread(target=read, name="pyserve-python-worker-reader", daemon=True).start()
    while True:
        try:
            message = inbox.get()
        except KeyboardInterrupt:
            break
        if message is None:  # the parent went away
            break
        kind = message[0]
        if kind == "init":
            try:
                module = loader.load_module(model)  # type: ignore[arg-type]
                with loader.model_path_scope(model):  # type: ignore[arg-type]
                    obj = getattr(module, loader.MODEL_CLASS)()
                    initialize = getattr(obj, "initialize", None)
                    if initialize is not None:
                        initialize(message[1])
                report_metrics()
                send(("ok",))
            except loader.PythonModelError as exc:
                send(("error", str(exc)))
            except Exception as exc:
                send(("error", loader.format_failure(
                    f"model '{name}' version {spec['version']} instance '{instance_name}': "
                    "initialize() failed (worker process)", exc)))
        elif kind == "exec":
            try:
                reply = run_batch((message[1], message[2]), message[3])
            except Exception as exc:  # a failure of this worker's own code: fail the batch, keep serving
                error = results.execute_failure(name, instance_name, exc)
                reply = ("batch_error", error.message, int(error.code))
            report_metrics()
            send(reply)
        elif kind == "auto_complete":  # a worker in an EXECUTION_ENV_PATH environment, before load
            try:
                module = loader.load_module(model)  # type: ignore[arg-type]
                complete = getattr(getattr(module, loader.MODEL_CLASS), "auto_complete_config", None)
                if complete is None:
                    send(("ok", None))
                else:
                    from pyserve_backend_python.config import ModelConfig

                    returned = complete(ModelConfig(message[1]))
                    if not isinstance(returned, ModelConfig):
                        raise TypeError("auto_complete_config must return the pb_utils.ModelConfig it was "
                                        f"given, not {type(returned).__name__}")
                    send(("ok", returned.as_dict()))
            except loader.PythonModelError as exc:
                send(("error", str(exc)))
            except Exception as exc:
                send(("error", loader.format_failure(f"auto_complete_config of model '{name}' failed", exc)))
        elif kind == "finalize":
            try:
                finalize = getattr(obj, "finalize", None)
                if finalize is not None:
                    finalize()
                send(("ok",))
            except Exception as exc:
                send(("error", loader.format_failure(f"model '{name}': finalize() failed", exc)))
        elif kind == "stop":
            break
    if arena is not None:
        try:
            arena.close()
        except BufferError:
            pass


async def _await(awaitable: Any) -> Any:
    return await awaitable
