"""``execution_mode: "process"``: one worker process per model instance.

The parent (``ProcessRunner``, in the server) starts the worker with the ``spawn`` context
(never ``fork``: the server has gRPC threads). The worker imports the model file and runs
``initialize`` / ``execute`` / ``finalize``. Tensors never go through pickle:

* Inputs: the parent copies each batch's input bytes once into the instance's reusable
  shared-memory *input arena* (grown, under a new name, when a batch does not fit) and sends
  only names, offsets, dtypes and shapes over a pipe. The worker wraps them as read-only numpy
  views, valid for the duration of ``execute`` (the arena is overwritten by the next batch).
* Outputs: the worker writes a batch's outputs into one fresh shared-memory segment and sends
  the layout. The parent maps it, unlinks its name at once (nothing is left in ``/dev/shm``)
  and wraps the outputs as numpy views of the mapping, without copying; the memory is released
  when the last of these arrays is garbage collected (after the responses were sent).
* BYTES tensors go over the pipe serialized as length-prefixed bytes.

If the worker dies, the batch in flight fails with "the worker process of model 'x' instance
'y' exited with code N; restarting" and a new worker (``initialize`` again) serves the next
batch. BLS (``exec``, ``async_exec``, decoupled BLS) works from ``execute``: the worker sends the
request to the parent, which runs it on the server and sends the answers back (tensors pickled
through the pipe). ``async def execute`` runs on an event loop of the worker. Not supported in
process mode: decoupled models (refused at load) and response senders (raise
``TritonModelException`` in the worker), BLS from threads outside ``execute``, custom metrics
(they stay in the worker).
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import secrets
import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import _posixshmem  # CPython's POSIX shared-memory primitives (as multiprocessing.shared_memory)
import multiprocessing
import numpy as np

from pyserve import ErrorCode, InferError, InferRequest, InferResponse, InstanceContext

from pyserve_backend_python import results
from pyserve_backend_python.loader import PythonModelError
from pyserve_backend_python.runner import initialize_args

log = logging.getLogger("pyserve.python_backend")

SHM_PREFIX = "pyserve_py_"
"""Prefix of every shared-memory segment name this backend creates."""

STOP_TIMEOUT_S = 10.0
"""Seconds ``finalize()`` in the worker and the worker's exit may take before it is killed."""
_SHM_DIR = "/dev/shm"
_BYTES = "BYTES"


# -- shared memory helpers (untracked: the owner unlinks explicitly) ------------------------------
def _create_segment(name: str, size: int) -> mmap.mmap:
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _open_segment(name: str, size: int) -> mmap.mmap:
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0o600)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


def _unlink_prefix(prefix: str) -> None:
    """Unlink leftover segments whose names start with ``prefix`` (a worker that died mid-batch)."""
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix):
            _unlink(name)


def _align(n: int) -> int:
    return (n + 63) & ~63


def _pack(arrays: Sequence[tuple[str, np.ndarray]], segment: mmap.mmap | None, base: int = 0) -> list[tuple]:
    """Layout entries for ``arrays``; fixed-size ones are copied into ``segment`` at offsets."""
    from pyserve_backend_python.tensor import serialize_byte_tensor

    entries = []
    offset = base
    for name, array in arrays:
        if array.dtype == np.object_:
            packed = serialize_byte_tensor(array)  # a 0-d object array holding the bytes
            entries.append((name, _BYTES, array.shape, packed.item() if packed.ndim == 0 else b""))
            continue
        array = np.ascontiguousarray(array)
        nbytes = array.nbytes
        if segment is not None and nbytes:
            np.frombuffer(segment, np.uint8, nbytes, offset)[:] = array.reshape(-1).view(np.uint8)
        entries.append((name, array.dtype, array.shape, offset))
        offset = _align(offset + nbytes)
    return entries


def _fixed_size(arrays: Sequence[tuple[str, np.ndarray]]) -> int:
    return sum(_align(a.nbytes) for _, a in arrays if a.dtype != np.object_)


def _unpack(entries: Sequence[tuple], segment: mmap.mmap | None, writeable: bool) -> dict[str, np.ndarray]:
    from pyserve_backend_python.tensor import deserialize_bytes_tensor

    out: dict[str, np.ndarray] = {}
    for name, dtype, shape, where in entries:
        if isinstance(dtype, str) and dtype == _BYTES:
            out[name] = deserialize_bytes_tensor(where).reshape(shape)
            continue
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0 or segment is None:
            array = np.empty(shape, dtype)
        else:
            array = np.frombuffer(segment, dtype, count, where).reshape(shape)
            if not writeable:
                array.flags.writeable = False
        out[name] = array
    return out


# -- parent side ------------------------------------------------------------------------------------
class ProcessRunner:
    """Runs one instance's ``TritonPythonModel`` in a worker process (see the module docstring)."""

    def __init__(self, instance: InstanceContext) -> None:
        model = instance.model
        self._instance = instance
        self._model_name = model.name
        self._spec = {
            "name": model.name,
            "version": int(model.version),
            "path": str(model.path),
            "version_path": str(model.version_path),
            "default_model_filename": model.config.default_model_filename,
            "instance_name": instance.name,
        }
        self._args = initialize_args(instance)
        self._prefix = f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(4)}_"
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._process: Any = None
        self._conn: Any = None
        self._arena: mmap.mmap | None = None
        self._arena_name = ""
        self._arena_size = 0

    # lifecycle
    def _start(self) -> None:
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

    def _call(self, message: tuple) -> tuple:
        """Send a message and wait for the reply.

        :raises InferError: the worker exited (it is reaped; the next call restarts it).
        """
        try:
            self._conn.send(message)
            while True:
                reply = self._conn.recv()
                if reply[0] != "bls":
                    return reply  # type: ignore[no-any-return]
                self._conn.send(self._bls(reply[1], reply[2]))
        except (EOFError, OSError):
            self._process.join(STOP_TIMEOUT_S)
            code = self._process.exitcode
            self._reap()
            raise InferError(
                f"the worker process of model '{self._model_name}' instance '{self._instance.name}' "
                f"exited with code {code}; restarting",
                ErrorCode.INTERNAL,
            ) from None

    def _bls(self, fields: dict[str, Any], decoupled: bool) -> tuple:
        """Run a BLS request of the worker on the server (this is an instance thread)."""
        request = InferRequest(
            fields["model_name"], fields["model_version"], dict(fields["inputs"]), tuple(fields["requested_outputs"]),
            id=fields["id"], parameters=fields["parameters"], flags=fields["flags"],
            correlation_id=fields["correlation_id"], timeout_us=fields["timeout_us"],
        )
        timeout = request.timeout_us / 1e6 if request.timeout_us > 0 else None
        try:
            answers: list[Any] = list(self._instance.model.server.stream(request, timeout))
        except InferError as exc:
            answers = [exc]
        except Exception as exc:  # noqa: BLE001 - reported to the calling model as an error response
            answers = [InferError(f"BLS request to model '{request.model_name}' failed: {exc}", ErrorCode.INTERNAL)]
        items: list[tuple] = []
        for answer in answers:
            if isinstance(answer, InferResponse) and answer.error is not None:
                answer = answer.error
            if isinstance(answer, InferError):
                items.append(("error", answer.message, int(answer.code)))
            else:
                items.append(("ok", [(n, np.asarray(a)) for n, a in answer.outputs.items()], dict(answer.parameters)))
        return ("bls_result", items)

    def _reap(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None
        _unlink_prefix(self._prefix + "o")

    def execute(self, requests: Sequence[InferRequest]) -> results.ServerResults:
        with self._lock:
            if self._process is None or not self._process.is_alive():
                if self._process is not None:
                    log.warning("worker of model '%s' instance '%s' exited with code %s; restarting",
                                self._model_name, self._instance.name, self._process.exitcode)
                    self._process.join(1.0)
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
        arena = _create_segment(name, new_size)
        self._release_arena()
        self._arena, self._arena_name, self._arena_size = arena, name, new_size

    def _release_arena(self) -> None:
        if self._arena is not None:
            _unlink(self._arena_name)
            try:
                self._arena.close()
            except BufferError:
                pass  # still viewed; freed with the views
        self._arena, self._arena_name, self._arena_size = None, "", 0

    def _execute(self, requests: Sequence[InferRequest]) -> results.ServerResults:
        arrays = [list(r.inputs.items()) for r in requests]
        total = sum(_fixed_size(a) for a in arrays)
        self._ensure_arena(total)
        metas = []
        offset = 0
        for request, inputs in zip(requests, arrays):
            metas.append({
                "model_name": request.model_name,
                "model_version": int(request.model_version),
                "id": request.id,
                "correlation_id": request.correlation_id,
                "flags": int(request.flags),
                "timeout": int(request.timeout_us),
                "parameters": dict(request.parameters),
                "requested_outputs": list(request.requested_outputs),
                "inputs": _pack(inputs, self._arena, offset),
            })
            offset += _fixed_size(inputs)
        reply = self._call(("exec", self._arena_name, self._arena_size, metas))
        if reply[0] == "batch_error":
            raise InferError(reply[1], ErrorCode(reply[2]))
        _, segment_name, segment_size, responses = reply
        segment = None
        if segment_name:
            segment = _open_segment(segment_name, segment_size)
            _unlink(segment_name)  # the mapping lives on while output arrays view it
        out: list[InferResponse | InferError] = []
        for item in responses:
            if item[0] == "error":
                out.append(InferError(item[1], _code(item[2])))
            else:
                out.append(InferResponse(_unpack(item[2], segment, True), item[1] or None))
        return out

    def finalize(self) -> None:
        with self._lock:
            try:
                if self._process is not None and self._process.is_alive():
                    self._conn.send(("finalize",))
                    if not self._conn.poll(STOP_TIMEOUT_S):
                        log.error("model '%s' instance '%s': finalize() did not return within %.0f s; "
                                  "killing the worker", self._model_name, self._instance.name, STOP_TIMEOUT_S)
                        self._stop(kill=True)
                        return
                    reply = self._conn.recv()
                    if reply[0] != "ok":
                        log.error("%s", reply[1])
            except (EOFError, OSError) as exc:
                log.error("model '%s' instance '%s': the worker exited during finalize (%s)",
                          self._model_name, self._instance.name, exc or type(exc).__name__)
            finally:
                self._stop(kill=False)
                self._release_arena()

    def _stop(self, kill: bool) -> None:
        process = self._process
        if process is None:
            return
        if not kill:
            try:
                self._conn.send(("stop",))
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


def model_stub(spec: dict[str, Any]) -> SimpleNamespace:
    """What ``loader`` needs of a ``ModelContext``, rebuilt in the worker."""
    from pathlib import Path

    return SimpleNamespace(
        name=spec["name"], version=spec["version"], path=Path(spec["path"]),
        version_path=Path(spec["version_path"]),
        config=SimpleNamespace(default_model_filename=spec["default_model_filename"]), server=None,
    )
