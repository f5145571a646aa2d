"""``execution_mode: "process"``: one worker process per model instance.

The parent (``ProcessRunner``, in the server) starts the worker with the ``spawn`` context
(never ``fork``: the server has gRPC threads), or, for a model with ``EXECUTION_ENV_PATH``,
with that environment's interpreter (``environment_worker.start_in_environment``; see
``pyserve_backend_python.environment``). The worker imports the model file and runs
``initialize`` / ``execute`` / ``finalize``. Tensors never go through pickle:

* Inputs: the parent copies each batch's input bytes once into the instance's reusable
  shared-memory *input arena* (grown, under a new name, when a batch does not fit) and sends
  only names, offsets, dtypes and shapes over a pipe; the worker unlinks the arena's name as soon
  as it has mapped it (nothing is left in ``/dev/shm``, even when a stuck worker is abandoned). The worker wraps them as read-only numpy
  views, valid for the duration of ``execute`` (the arena is overwritten by the next batch);
  ``as_numpy()`` hands the model a copy of such a view, made on its first call.
* Outputs: the worker writes a batch's outputs into one fresh shared-memory segment and sends
  the layout. The parent maps it, unlinks its name at once (nothing is left in ``/dev/shm``)
  and wraps the outputs as read-only numpy views of the mapping, without copying; the memory is released
  when the last of these arrays is garbage collected (after the responses were sent).
* BYTES tensors go over the pipe serialized as length-prefixed bytes.

If the worker dies, the batch in flight fails with "the worker process of model 'x' instance
'y' exited with code N; restarting" and a new worker (``initialize`` again) serves the next
batch. BLS (``exec``, ``async_exec``, decoupled BLS) works from ``execute``: the worker sends the
request to the parent, which runs it on the server and sends the answers back (tensors in
shared-memory segments both ways: ``segments.share_arrays`` / ``take_arrays``). Decoupled models work: their response senders send each response to the
parent as it comes, from any thread of the worker, also after ``execute`` returned (a reader
thread in the parent forwards them; a worker that dies ends its open requests with an error).
``async def execute`` runs on an event loop of the worker. Not supported in process mode:
response senders of non-decoupled models, BLS from threads outside ``execute``. A request
whose client goes away is reported to the worker within ~50 ms (``is_cancelled()``). Custom metrics (``pb_utils.MetricFamily``)
are reported by the worker after ``initialize`` and after each batch when they changed, and the
server shows them on its metrics page (values of several workers add up).
"""

from __future__ import annotations

import itertools
import logging
import mmap
import multiprocessing
import os
import queue
import secrets
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from pyserve import (
    ErrorCode,
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelContext,
)
from pyserve.tracing import child_trace
from pyserve_backend_python import loader, metrics, model_control, results
from pyserve_backend_python.bls import refused
from pyserve_backend_python.environment import ExecutionEnvironment
from pyserve_backend_python.environment_worker import STOP_TIMEOUT_S, start_in_environment
from pyserve_backend_python.errors import TritonModelException
from pyserve_backend_python.loader import PythonModelError
from pyserve_backend_python.runner import initialize_args
from pyserve_backend_python.segments import (
    SHM_PREFIX,
    create_segment,
    fixed_size,
    open_segment,
    pack,
    share_arrays,
    take_arrays,
    unlink,
    unlink_prefix,
    unpack,
)

log = logging.getLogger("pyserve.python_backend")

READY_REPLY_TIMEOUT_S = 60.0
"""The longest a readiness thread waits for the worker (the ready endpoints give up after 5 s)."""


_EOF = object()


class _Link:
    """The pipe to one worker. A reader thread sorts what the worker sends: responses of
    decoupled requests and BLS calls are handled as they come (``on_send``, ``on_bls``), every
    other message is a reply to ``call`` (one outstanding call at a time)."""

    def __init__(self, conn: Any, on_send: Any, on_bls: Any, on_eof: Any, on_metrics: Any, on_ready: Any) -> None:
        self.conn = conn
        self.replies: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        self._on_send, self._on_bls, self._on_eof, self._on_metrics = on_send, on_bls, on_eof, on_metrics
        self._on_ready = on_ready
        self.closed = threading.Event()
        """Set once the worker's end of the pipe closed (it exited, or is exiting)."""
        self._thread = threading.Thread(target=self._read, name="pyserve-python-link", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self.closed.set()  # before the requests left open are ended: their clients may retry at once
                self.replies.put(_EOF)
                self._on_eof()
                return
            kind = message[0]
            if kind == "send":
                self._on_send(message)
            elif kind in ("bls", "control"):
                self._on_bls(message)
            elif kind == "metrics":
                self._on_metrics(message[1])
            elif kind == "ready_result":
                self._on_ready(message)
            else:
                self.replies.put(message)

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self.conn.send(message)

    def reply(self, timeout: float | None = None) -> tuple[Any, ...]:
        """The worker's next reply. :raises EOFError: the worker is gone. :raises queue.Empty: timeout."""
        item = self.replies.get(timeout=timeout)
        if item is _EOF:
            self.replies.put(_EOF)  # every later call sees it too
            raise EOFError
        return item

    def close(self) -> None:
        self.conn.close()


def worker_spec(model: ModelContext, instance_name: str = "") -> dict[str, Any]:
    """What a worker needs to find and name the model (``worker.main``'s ``spec``)."""
    return {
        "name": model.name,
        "version": int(model.version),
        "path": str(model.path),
        "version_path": str(model.version_path),
        "default_model_filename": model.config.default_model_filename,
        "runtime_file": str(runtime) if (runtime := loader.runtime_file(model)) is not None else "",
        "instance_name": instance_name,
        "decoupled": bool(model.config.model_transaction_policy.decoupled),
    }


class ProcessRunner:
    """Runs one instance's ``TritonPythonModel`` in a worker process (see the module docstring).

    :param environment: the model's ``EXECUTION_ENV_PATH`` environment, whose interpreter
        starts the workers; None: the server's own (``multiprocessing``'s spawn).
    """

    def __init__(self, instance: InstanceContext, environment: ExecutionEnvironment | None = None) -> None:
        model = instance.model
        self._instance = instance
        self._model_name = model.name
        self._environment = environment
        self._spec = worker_spec(model, instance.name)
        self._decoupled = self._spec["decoupled"]
        self._open: dict[int, InferRequest] = {}  # decoupled requests not yet ended, by key
        self._open_lock = threading.Lock()
        self._in_batch: set[int] = set()
        self._batch: dict[int, InferRequest] = {}  # the batch executing now, by key
        self._notified: set[int] = set()  # keys whose cancellation the worker was told
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self._keys = itertools.count(1)
        self._bls_pool: ThreadPoolExecutor | None = None
        self._link: _Link | None = None
        self._args = initialize_args(instance)
        self._prefix = f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(4)}_"
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._process: Any = None
        self._conn: Any = None
        self._arena: mmap.mmap | None = None
        self._arena_name = ""
        self._arena_size = 0
        self._ready_tokens = itertools.count(1)
        self._ready_waiters: dict[int, queue.SimpleQueue[tuple[Any, ...]]] = {}
        self._ready_lock = threading.Lock()

    # lifecycle
    def _start(self) -> None:
        process: Any
        self._release_arena()  # the worker unlinks the arena's name once mapped: a new one needs a new arena
        if self._environment is not None:
            process, parent = start_in_environment(self._environment, self._spec, self._prefix + "o")
        else:
            ctx = multiprocessing.get_context("spawn")
            parent, child = ctx.Pipe()
            from pyserve_backend_python import worker

            process = ctx.Process(
                target=worker.main, args=(child, self._spec, self._prefix + "o"),
                name=f"pyserve-python-{self._model_name}-{self._instance.name}", daemon=True,
            )
            process.start()
            child.close()
        self._process, self._conn = process, parent
        self._link = _Link(parent, self._on_send, self._on_bls, self._on_eof, self._on_metrics, self._on_ready)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_cancellations, daemon=True,
                                             name=f"pyserve-python-cancel-{self._instance.name}")
            self._watcher.start()
        reply = self._call(("init", self._args))
        if reply[0] != "ok":
            self._stop(kill=True)
            raise PythonModelError(reply[1])

    def create(self) -> None:
        with self._lock:
            try:
                self._start()
            except InferError as exc:  # died during initialize
                raise PythonModelError(exc.message.replace("; restarting", " while initializing")) from None

    def _call(self, message: tuple[Any, ...]) -> tuple[Any, ...]:
        """Send a message and wait for the reply.

        :raises InferError: the worker exited (it is reaped; the next call restarts it).
        """
        link = self._link
        assert link is not None
        try:
            link.send(message)
            return link.reply()
        except (EOFError, OSError):
            self._process.join(STOP_TIMEOUT_S)
            code = self._process.exitcode
            self._reap()
            raise InferError(
                f"the worker process of model '{self._model_name}' instance '{self._instance.name}' "
                f"exited with code {code}; restarting",
                ErrorCode.INTERNAL,
            ) from None

    # messages the reader thread hands over
    def _on_send(self, message: tuple[Any, ...]) -> None:
        """A response of a decoupled request, from the worker's response sender."""
        _, key, payload, final = message
        with self._open_lock:
            request = self._open.pop(key, None) if final else self._open.get(key)
        if request is None:
            return
        response: Any = None
        if payload is not None:
            if payload[0] == "error":
                response = InferError(payload[1], _code(payload[2]))
            else:
                response = InferResponse(dict(payload[1]), payload[2] or None)
        try:
            request.response_sender().send(response, final)
        except InferError as exc:
            log.error("model '%s': a response of the worker could not be sent: %s", self._model_name, exc.message)

    def _on_bls(self, message: tuple[Any, ...]) -> None:
        """A BLS or model-control call of the worker: run it on a pool thread, answer on the pipe."""
        link = self._link
        if self._bls_pool is None:
            self._bls_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="pyserve-python-bls")

        def run() -> None:
            kind, call_id, first, second = message
            reply = self._control(first, second) if kind == "control" else self._bls(first, second)
            if link is not None:
                try:
                    link.send((reply[0], call_id, reply[1]))
                except (OSError, ValueError):
                    pass  # the worker is gone

        self._bls_pool.submit(run)

    def _watch_cancellations(self) -> None:
        """Tell the worker, within ~50 ms, about requests whose client went away."""
        while not self._closing.wait(0.05):
            with self._open_lock:
                watched = list(self._open.items()) + list(self._batch.items())
            live = set()
            for key, request in watched:
                live.add(key)
                if key not in self._notified and request.is_cancelled():
                    self._notified.add(key)
                    link = self._link
                    if link is not None:
                        try:
                            link.send(("cancel", key))
                        except (OSError, ValueError):
                            pass
            self._notified &= live

    def _on_metrics(self, report: list[Any]) -> None:
        """The worker's custom metrics: shown on the server's metrics page."""
        metrics.mirror(self._prefix, (self._model_name, int(self._spec["version"])), report)

    def _forget(self, keys: list[int]) -> None:
        with self._open_lock:
            for key in keys:
                self._open.pop(key, None)

    def _on_ready(self, message: tuple[Any, ...]) -> None:
        """The worker's answer to a readiness question."""
        with self._ready_lock:
            waiter = self._ready_waiters.pop(message[1], None)
        if waiter is not None:
            waiter.put(message[2:])

    def _on_eof(self) -> None:
        """The worker is gone: end every decoupled request it had not ended (those of a batch
        still executing fail with the batch), and answer the readiness questions waiting."""
        with self._ready_lock:
            waiters, self._ready_waiters = self._ready_waiters, {}
        for waiter in waiters.values():
            waiter.put(("exited", None))
        with self._open_lock:
            pending = {k: r for k, r in self._open.items() if k not in self._in_batch}
            for key in pending:
                del self._open[key]
        error = InferError(
            f"the worker process of model '{self._model_name}' instance '{self._instance.name}' exited "
            "before ending the request", ErrorCode.INTERNAL,
        )
        for request in pending.values():
            if not request.final_sent:
                try:
                    request.response_sender().send(error, True)
                except InferError:
                    pass

    def _control(self, operation: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``pb_utils.load_model`` / ``unload_model`` / ``is_model_ready`` of the worker, run on
        the server (a pool thread; loads and unloads block until done)."""
        try:
            return ("bls_result", ("ok", model_control.run_on(self._instance.model.server, operation, args)))
        except TritonModelException as exc:
            return ("bls_result", ("error", str(exc)))
        except Exception as exc:  # noqa: BLE001 - reported to the calling model as its exception
            return ("bls_result", ("error", f"model control '{operation}' failed: {type(exc).__name__}: {exc}"))

    def _bls(self, fields: dict[str, Any], decoupled: bool) -> tuple[Any, ...]:
        """Run a BLS request of the worker on the server (this is an instance thread)."""
        answers: list[Any]
        try:  # input tensors arrive in a shared-memory segment, outputs leave in one: no pickling
            request = InferRequest(
                fields["model_name"], fields["model_version"], take_arrays(fields["inputs"]),
                tuple(fields["requested_outputs"]), id=fields["id"], parameters=fields["parameters"],
                flags=fields["flags"], correlation_id=fields["correlation_id"], timeout_us=fields["timeout_us"],
            )
            request.trace_parent = fields.get("trace_parent")
            with self._open_lock:
                parent = self._batch.get(int(fields.get("trace_of") or -1))  # trace=request.trace() of a traced request
            if parent is not None and parent.trace is not None:
                request.trace = child_trace(parent.trace, request)
            timeout = request.timeout_us / 1e6 if request.timeout_us > 0 else None
            answers = list(self._instance.model.server.stream(request, timeout, refused(request.model_name)))
        except InferError as exc:
            answers = [exc]
        except Exception as exc:  # noqa: BLE001 - reported to the calling model as an error response
            answers = [InferError(f"BLS request to model '{fields['model_name']}' failed: {exc}", ErrorCode.INTERNAL)]
        items: list[tuple[Any, ...]] = []
        for answer in answers:
            if isinstance(answer, InferResponse) and answer.error is not None:
                answer = answer.error
            if isinstance(answer, InferError):
                items.append(("error", answer.message, int(answer.code)))
            else:
                try:
                    shared = share_arrays(answer.outputs, f"{self._prefix}or{next(self._counter)}")
                except OSError as exc:  # e.g. /dev/shm full
                    items.append(("error", f"BLS response of model '{fields['model_name']}' could not be "
                                  f"shared with the worker: {exc}", int(ErrorCode.INTERNAL)))
                    continue
                items.append(("ok", shared, dict(answer.parameters)))
        return ("bls_result", items)

    def _reap(self) -> None:
        metrics.forget(self._prefix)  # a new worker starts its metrics from zero
        if self._link is not None:
            self._link.close()
        self._process = self._conn = self._link = None
        unlink_prefix(self._prefix + "o")

    def ready(self) -> bool:
        """False while the worker process is not running (it restarts with the next batch);
        otherwise the model's ``is_ready()``, called by a thread of the worker.

        :raises PythonModelError: ``is_ready()`` raised (the traceback is in the message).
        :raises TypeError: it returned something other than a bool.
        :raises TimeoutError: no answer within ``READY_REPLY_TIMEOUT_S``.
        """
        process, link = self._process, self._link
        if process is None or link is None or not process.is_alive():
            return False
        token = next(self._ready_tokens)
        waiter: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        with self._ready_lock:
            self._ready_waiters[token] = waiter
        try:
            link.send(("ready", token))
            status, value = waiter.get(timeout=READY_REPLY_TIMEOUT_S)
        except OSError:
            return False
        except queue.Empty:
            raise TimeoutError(f"is_ready() of model '{self._model_name}' did not answer within "
                               f"{READY_REPLY_TIMEOUT_S:.0f} s") from None
        finally:
            with self._ready_lock:
                self._ready_waiters.pop(token, None)
        if status == "ok":
            return bool(value)
        if status == "not_bool":
            raise TypeError(f"is_ready() of model '{self._model_name}' returned {value}, expected bool")
        if status == "exited":
            return False
        raise PythonModelError(value)

    def execute(self, requests: Sequence[InferRequest]) -> results.ServerResults:
        with self._lock:
            gone = self._link is not None and self._link.closed.is_set()  # may not be reaped yet
            if self._process is None or gone or not self._process.is_alive():
                if self._process is not None:
                    self._process.join(STOP_TIMEOUT_S if gone else 1.0)
                    if self._process.is_alive():  # closed its pipe but does not end
                        self._process.kill()
                        self._process.join(1.0)
                    log.warning("worker of model '%s' instance '%s' exited with code %s; restarting",
                                self._model_name, self._instance.name, self._process.exitcode)
                    self._reap()
                try:
                    self._start()
                except PythonModelError as exc:
                    raise InferError(str(exc), ErrorCode.UNAVAILABLE) from None
            return self._execute(requests)

    def _ensure_arena(self, size: int) -> None:
        if size <= self._arena_size:
            return
        new_size = max(1 << 20, 1 << (size - 1).bit_length())
        name = f"{self._prefix}i{next(self._counter)}"
        arena = create_segment(name, new_size)
        self._release_arena()
        self._arena, self._arena_name, self._arena_size = arena, name, new_size

    def _release_arena(self) -> None:
        if self._arena is not None:
            unlink(self._arena_name)
            try:
                self._arena.close()
            except BufferError:
                pass  # still viewed; freed with the views
        self._arena, self._arena_name, self._arena_size = None, "", 0

    def _execute(self, requests: Sequence[InferRequest]) -> results.ServerResults:
        arrays = [list(r.inputs.items()) for r in requests]
        total = sum(fixed_size(a) for a in arrays)
        self._ensure_arena(total)
        metas: list[dict[str, Any]] = []
        offset = 0
        for request, inputs in zip(requests, arrays):
            key = next(self._keys)
            if self._decoupled:
                with self._open_lock:
                    self._open[key] = request
            metas.append({
                "key": key,
                "model_name": request.model_name,
                "model_version": int(request.model_version),
                "id": request.id,
                "correlation_id": request.correlation_id,
                "flags": int(request.flags),
                "timeout": int(request.timeout_us),
                "parameters": dict(request.parameters),
                "requested_outputs": list(request.requested_outputs),
                "trace_context": request.trace.context if request.trace is not None else None,
                "traced": request.trace is not None,
                "inputs": pack(inputs, self._arena, offset),
            })
            offset += fixed_size(inputs)
        keys = [m["key"] for m in metas]
        self._in_batch = set(keys)  # failed by the caller, not by _on_eof, if the worker dies now
        with self._open_lock:
            self._batch = dict(zip(keys, requests))
        try:
            reply = self._call(("exec", self._arena_name, self._arena_size, metas))
        except InferError:
            self._forget(keys)
            raise
        finally:
            self._in_batch = set()
            with self._open_lock:
                self._batch = {}
        if reply[0] == "batch_error":
            self._forget(keys)
            raise InferError(reply[1], ErrorCode(reply[2]))
        _, segment_name, segment_size, responses = reply
        if responses is None:  # a decoupled model: its response senders answer
            return None
        segment = None
        if segment_name:
            segment = open_segment(segment_name, segment_size)
            unlink(segment_name)  # the mapping lives on while output arrays view it
        out: list[InferResponse | InferError] = []
        for item in responses:
            if item[0] == "error":
                out.append(InferError(item[1], _code(item[2])))
            else:
                # read-only, as thread mode's outputs: whoever receives them copies before writing
                out.append(InferResponse(unpack(item[2], segment, False), item[1] or None))
        return out

    def finalize(self) -> None:
        with self._lock:
            try:
                if self._process is not None and self._process.is_alive() and self._link is not None:
                    self._link.send(("finalize",))
                    try:
                        reply = self._link.reply(STOP_TIMEOUT_S)
                    except queue.Empty:
                        log.error("model '%s' instance '%s': finalize() did not return within %.0f s; "
                                  "killing the worker", self._model_name, self._instance.name, STOP_TIMEOUT_S)
                        self._stop(kill=True)
                        return
                    if reply[0] != "ok":
                        log.error("%s", reply[1])
            except (EOFError, OSError) as exc:
                log.error("model '%s' instance '%s': the worker exited during finalize (%s)",
                          self._model_name, self._instance.name, exc or type(exc).__name__)
            finally:
                self._stop(kill=False)
                self._release_arena()
                if self._bls_pool is not None:
                    self._bls_pool.shutdown(wait=False)
                    self._bls_pool = None
                self._closing.set()

    def _stop(self, kill: bool) -> None:
        process = self._process
        if process is None:
            return
        if not kill and self._link is not None:
            try:
                self._link.send(("stop",))
            except (OSError, ValueError):
                pass
            process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(STOP_TIMEOUT_S)
        self._reap()


def _code(value: int) -> ErrorCode:
    try:
        return ErrorCode(value)
    except ValueError:
        return ErrorCode.INTERNAL


class _ModelStub(SimpleNamespace):
    """A ``SimpleNamespace`` that can be weakly referenced and hashed by identity (``alias``
    keys a ``WeakKeyDictionary`` on the model)."""

    __hash__ = object.__hash__  # type: ignore[assignment]
    __eq__ = object.__eq__


def model_stub(spec: dict[str, Any]) -> SimpleNamespace:
    """What ``loader`` needs of a ``ModelContext``, rebuilt in the worker."""
    from pathlib import Path

    stub = _ModelStub(
        name=spec["name"], version=spec["version"], path=Path(spec["path"]),
        version_path=Path(spec["version_path"]),
        config=SimpleNamespace(default_model_filename=spec["default_model_filename"]), server=None,
    )
    if spec.get("runtime_file"):
        loader.use_runtime_file(stub, Path(spec["runtime_file"]))
    return stub
