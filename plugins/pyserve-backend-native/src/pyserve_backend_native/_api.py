"""The Python side of the TRITON API: ctypes bindings of the shim, and the callbacks it makes.

The shim calls Python for what needs the server: delivering a response to the pyserve request
(one call per ``TRITONBACKEND_ResponseSend``, with all outputs), request life events, log
lines, cancellation checks and BLS (``TRITONSERVER_ServerInferAsync`` and model queries).
Callbacks may come from any thread (ctypes takes the GIL); the shim holds none of its locks
while calling, so a callback may call the shim again.

Output buffers are malloc'd by the shim (``TRITONBACKEND_OutputBuffer``); at send their
ownership passes to Python, and each becomes the memory of the response's numpy array
(``_CBuffer`` frees it when the array is collected): outputs cross without a copy.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import struct
import threading
import time
from collections.abc import Iterator
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_bool,
    c_char_p,
    c_double,
    c_int32,
    c_int64,
    c_uint32,
    c_uint64,
    c_void_p,
)
from typing import Any

import numpy as np
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pyserve.api import datatypes
from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.tracing import next_trace_id
from pyserve_backend_native import loader

log = logging.getLogger("pyserve.native")

# -- constants (TRITONSERVER_*) ------------------------------------------------------------
TYPE_CODES: dict[str, int] = {
    "BOOL": 1, "UINT8": 2, "UINT16": 3, "UINT32": 4, "UINT64": 5, "INT8": 6, "INT16": 7,
    "INT32": 8, "INT64": 9, "FP16": 10, "FP32": 11, "FP64": 12, "BYTES": 13, "BF16": 14,
}
CODE_TYPES: dict[int, datatypes.DataType] = {
    code: dt for name, code in TYPE_CODES.items() if (dt := datatypes.from_name(name)) is not None
}
PARAM_STRING, PARAM_INT, PARAM_BOOL, PARAM_DOUBLE, PARAM_BYTES = range(5)
KIND_CODES = {"AUTO": 0, "CPU": 1, "GPU": 2, "MODEL": 3}
RESPONSE_FINAL = 1
RELEASE_ALL, RELEASE_RESCHEDULE = 1, 2
EVENT_RELEASED, EVENT_DONE = 1, 2
QUERY_READY, QUERY_TXN, QUERY_CONFIG, QUERY_METADATA, QUERY_BATCH = 1, 2, 3, 4, 5
QUERY_LIVE, QUERY_SERVER_READY, QUERY_SERVER_METADATA, QUERY_INDEX, QUERY_STATISTICS = 6, 7, 8, 9, 10
QUERY_METRICS, QUERY_LOAD, QUERY_UNLOAD, QUERY_UNLOAD_DEPENDENTS = 11, 12, 13, 14
TRACE_ACTIVITIES = {
    "REQUEST_START": 0, "QUEUE_START": 1, "COMPUTE_START": 2, "COMPUTE_INPUT_END": 3,
    "COMPUTE_OUTPUT_START": 4, "COMPUTE_END": 5, "REQUEST_END": 6,
}
"""pyserve's trace stamps → ``TRITONSERVER_InferenceTraceActivity``."""


# -- structures shared with the shim (keep in step with shim_internal.h) -------------------------
class OutputDesc(Structure):
    _fields_ = [
        ("name", c_char_p),
        ("datatype", c_int32),
        ("dims_count", c_uint32),
        ("shape", POINTER(c_int64)),
        ("buffer", c_void_p),
        ("byte_size", c_uint64),
    ]


class Param(Structure):
    _fields_ = [
        ("key", c_char_p),
        ("type", c_int32),
        ("str", c_char_p),
        ("i", c_int64),
        ("b", c_bool),
        ("d", c_double),
        ("bytes", c_void_p),
        ("size", c_uint64),
    ]


class Result(Structure):
    _fields_ = [("ival", c_int64), ("sval", c_void_p), ("err_code", c_int32), ("err_msg", c_void_p)]


class Stats(Structure):
    _fields_ = [
        (name, c_uint64)
        for name in (
            "success_count", "failure_count", "compute_input_ns", "compute_infer_ns",
            "compute_output_ns", "execution_count", "inference_count", "batch_compute_input_ns",
            "batch_compute_infer_ns", "batch_compute_output_ns",
        )
    ]


class Report(Structure):
    """One ModelInstanceReport(Batch)Statistics call (``pyshim_report``)."""

    _fields_ = [
        (name, c_uint64)
        for name in ("key", "success", "exec_start_ns", "compute_start_ns", "compute_end_ns", "exec_end_ns")
    ]


LOG_FN = CFUNCTYPE(None, c_int32, c_char_p, c_int32, c_char_p)
RESPONSE_FN = CFUNCTYPE(
    None, c_uint64, c_uint32, c_int32, c_uint32, POINTER(OutputDesc), c_uint32, POINTER(Param), c_int32, c_char_p
)
EVENT_FN = CFUNCTYPE(None, c_uint64, c_int32, c_uint32)
CANCELLED_FN = CFUNCTYPE(c_int32, c_uint64)
INFER_FN = CFUNCTYPE(c_int32, c_uint64, c_void_p)
QUERY_FN = CFUNCTYPE(c_int32, c_uint64, c_int32, c_char_p, c_int64, POINTER(Result))
TRACE_ACTIVITY_FN = CFUNCTYPE(None, c_uint64, c_uint64, c_char_p)
TRACE_ID_FN = CFUNCTYPE(c_uint64)


class Callbacks(Structure):
    _fields_ = [
        ("log", LOG_FN),
        ("response", RESPONSE_FN),
        ("request_event", EVENT_FN),
        ("is_cancelled", CANCELLED_FN),
        ("infer_async", INFER_FN),
        ("server_query", QUERY_FN),
        ("trace_activity", TRACE_ACTIVITY_FN),
        ("trace_id", TRACE_ID_FN),
    ]


_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "pyshim_set_callbacks": (None, [POINTER(Callbacks)]),
    "pyshim_set_log_verbose": (None, [ctypes.c_int]),
    "pyshim_free": (None, [c_void_p]),
    "pyshim_api_version": (None, [POINTER(c_uint32)]),
    "pyshim_take_error": (c_int32, [c_void_p, POINTER(c_void_p)]),
    "pyshim_metrics_text": (c_void_p, []),
    "pyshim_result_set": (None, [POINTER(Result), c_int64, c_char_p]),
    "pyshim_result_error": (None, [POINTER(Result), c_int32, c_char_p]),
    "pyshim_backend_new": (c_void_p, [c_char_p, c_char_p, c_char_p]),
    "pyshim_backend_delete": (None, [c_void_p]),
    "pyshim_backend_attribute_new": (c_void_p, []),
    "pyshim_server_new": (c_void_p, [c_uint64]),
    "pyshim_model_new": (c_void_p, [c_void_p, c_void_p, c_char_p, c_uint64, c_char_p, c_char_p, c_bool]),
    "pyshim_model_set_initializing": (None, [c_void_p, c_bool]),
    "pyshim_model_config": (c_char_p, [c_void_p, POINTER(c_bool)]),
    "pyshim_model_set_config": (None, [c_void_p, c_char_p]),
    "pyshim_model_stats": (None, [c_void_p, POINTER(Stats)]),
    "pyshim_model_delete": (None, [c_void_p]),
    "pyshim_instance_new": (c_void_p, [c_void_p, c_char_p, c_int32, c_int32]),
    "pyshim_instance_delete": (None, [c_void_p]),
    "pyshim_instance_take_reports": (c_uint32, [c_void_p, POINTER(Report), c_uint32, POINTER(Report)]),
    "pyshim_request_new": (
        c_void_p, [c_uint64, c_void_p, c_char_p, c_uint64, c_char_p, c_uint32, c_uint64, c_uint32, c_uint32],
    ),
    "pyshim_request_set_input": (
        None, [c_void_p, c_uint32, c_char_p, c_int32, POINTER(c_int64), c_uint32, c_void_p, c_uint64],
    ),
    "pyshim_request_set_output": (None, [c_void_p, c_uint32, c_char_p]),
    "pyshim_request_add_param": (None, [c_void_p, c_char_p, c_int32, c_char_p, c_int64, c_bool, c_double]),
    "pyshim_request_delete": (None, [c_void_p]),
    "pyshim_ireq_info": (
        None,
        [c_void_p, POINTER(c_char_p), POINTER(c_int64), POINTER(c_char_p), POINTER(c_uint32), POINTER(c_uint64),
         POINTER(c_char_p), POINTER(c_uint64), POINTER(c_uint64), POINTER(c_uint32), POINTER(c_uint32),
         POINTER(c_uint32)],
    ),
    "pyshim_ireq_input": (
        None,
        [c_void_p, c_uint32, POINTER(c_char_p), POINTER(c_int32), POINTER(POINTER(c_int64)), POINTER(c_uint32),
         POINTER(c_uint32)],
    ),
    "pyshim_ireq_input_buffer": (None, [c_void_p, c_uint32, c_uint32, POINTER(c_void_p), POINTER(c_uint64)]),
    "pyshim_ireq_output": (c_char_p, [c_void_p, c_uint32]),
    "pyshim_ireq_params": (POINTER(Param), [c_void_p]),
    "pyshim_ireq_is_cancelled": (c_int32, [c_void_p]),
    "pyshim_ireq_trace": (c_void_p, [c_void_p]),
    "pyshim_request_set_trace": (None, [c_void_p, c_uint64, c_uint64, c_char_p, c_int64, c_char_p, c_char_p]),
    "pyshim_trace_info": (
        None, [c_void_p, POINTER(c_uint64), POINTER(c_uint64), POINTER(c_char_p), POINTER(c_int32)],
    ),
    "pyshim_trace_set_model": (None, [c_void_p, c_char_p, c_int64, c_char_p]),
    "pyshim_trace_report": (None, [c_void_p, c_int32, c_uint64]),
    "pyshim_ireq_respond": (
        None,
        [c_void_p, c_uint32, c_int32, c_int64, c_int32, c_char_p, c_uint32, POINTER(OutputDesc), c_uint32,
         POINTER(Param)],
    ),
}


class _Lib:
    """The shim with typed pyshim_* functions; created once per process."""

    def __init__(self) -> None:
        self.cdll = loader.shim()
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = getattr(self.cdll, name)
            function.restype = restype
            function.argtypes = argtypes
            setattr(self, name, function)

    def __getattr__(self, name: str) -> Any:  # typed above; for the type checker only
        raise AttributeError(name)


_lib: _Lib | None = None
_lib_lock = threading.Lock()
_callbacks: Callbacks | None = None  # kept alive: the shim holds the function pointers


def lib() -> Any:
    """The shim, loaded and wired to this module's callbacks.

    :raises loader.BackendLoadError: the shim cannot be built or loaded.
    """
    global _lib, _callbacks
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is None:
            from pyserve_backend_native import _bls

            shim = _Lib()
            _callbacks = Callbacks(
                LOG_FN(_on_log), RESPONSE_FN(_on_response), EVENT_FN(_on_event),
                CANCELLED_FN(_on_is_cancelled), INFER_FN(_bls._on_infer_async), QUERY_FN(_bls._on_server_query),
                TRACE_ACTIVITY_FN(_on_trace_activity), TRACE_ID_FN(next_trace_id),
            )
            shim.pyshim_set_callbacks(ctypes.byref(_callbacks))
            shim.pyshim_set_log_verbose(1 if log.isEnabledFor(logging.DEBUG) else 0)
            _lib = shim
    return _lib


def take_error(error: int | None) -> InferError | None:
    """Turn a ``TRITONSERVER_Error*`` the caller owns into an ``InferError`` and delete it."""
    if not error:
        return None
    message = c_void_p()
    code = lib().pyshim_take_error(error, ctypes.byref(message))
    text = ctypes.string_at(message.value).decode("utf-8", "replace") if message.value else ""
    lib().pyshim_free(message)
    try:
        error_code = ErrorCode(code)
    except ValueError:
        error_code = ErrorCode.UNKNOWN
    return InferError(text, error_code)


def metrics_text() -> str:
    """The backends' custom metrics (TRITONSERVER_Metric*) in Prometheus text format."""
    pointer = lib().pyshim_metrics_text()
    try:
        return ctypes.string_at(pointer).decode("utf-8", "replace")
    finally:
        lib().pyshim_free(pointer)


class ShimMetricsCollector:
    """A ``prometheus_client`` collector of the backends' custom metrics (one per process).

    The shim keeps ``TRITONSERVER_MetricFamily`` / ``TRITONSERVER_Metric`` values in one
    process-wide registry; every scrape reads them (``pyshim_metrics_text``) and yields them
    under the names, kinds and labels the backends gave. Native backends include it in their
    server's ``/metrics`` page (``backend.metrics.include``) while at least one of them is
    initialized there.
    """

    def collect(self) -> Iterator[Metric]:
        if _lib is None:  # the shim was never loaded: no backend made a metric
            return
        text = metrics_text()
        created = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
        for family in text_string_to_metric_families(text):
            if not family.samples:
                continue
            if family.type == "counter":
                # the parser drops a counter's "_total" (or adds it to the samples); Triton shows
                # the name as the backend created it, with or without "_total"
                name = family.name + "_total" if family.name + "_total" in created else family.name
                renamed = Metric(name, family.documentation, "counter")
                renamed.samples = [sample._replace(name=name) for sample in family.samples]
                family = renamed
            yield family


SHIM_METRICS = ShimMetricsCollector()
"""The process's collector of native custom metrics."""

_included: dict[int, list[Any]] = {}  # id(CustomMetrics) → [metrics, native backends using it]
_included_lock = threading.Lock()


def include_metrics(metrics: Any) -> None:
    """A native backend starts on a server: show the custom metrics on its ``/metrics``."""
    with _included_lock:
        entry = _included.setdefault(id(metrics), [metrics, 0])
        entry[1] += 1
        if entry[1] == 1:
            metrics.include(SHIM_METRICS)


def exclude_metrics(metrics: Any) -> None:
    """A native backend finalized: stop showing them when it was the server's last one."""
    with _included_lock:
        entry = _included.get(id(metrics))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _included[id(metrics)]
            metrics.exclude(SHIM_METRICS)


# -- tensors ---------------------------------------------------------------------------------
class _CBuffer:
    """Owns one malloc'd buffer from the shim; numpy arrays made from it keep it alive."""

    __slots__ = ("__array_interface__", "_pointer")

    def __init__(self, pointer: int, size: int) -> None:
        self._pointer = pointer
        self.__array_interface__ = {"data": (pointer, False), "shape": (size,), "typestr": "|u1", "version": 3}

    def __del__(self) -> None:
        if self._pointer and _lib is not None:
            _lib.pyshim_free(self._pointer)
            self._pointer = 0


def serialize_bytes(array: np.ndarray) -> bytes:
    """Triton's BYTES layout: each element as a 4-byte little-endian length, then the bytes."""
    parts = []
    for item in array.reshape(-1):
        data = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of ``serialize_bytes``.

    :raises ValueError: the data does not hold ``prod(shape)`` well-formed elements.
    """
    count = int(np.prod(shape)) if shape else 1
    items: list[bytes] = []
    offset = 0
    for _ in range(count):
        if offset + 4 > len(data):
            raise ValueError(f"BYTES data ends after {len(items)} of {count} elements")
        (size,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if offset + size > len(data):
            raise ValueError(f"BYTES element {len(items)} is cut short")
        items.append(data[offset:offset + size])
        offset += size
    out = np.empty(count, dtype=object)
    out[:] = items
    return out.reshape(shape)


def tensor_from_output(desc: OutputDesc) -> tuple[str, np.ndarray]:
    """Wrap one sent output as a numpy array, taking ownership of its buffer.

    :raises ValueError: unknown datatype, or a buffer smaller than the shape needs.
    """
    name = (desc.name or b"").decode("utf-8", "replace")
    pointer = desc.buffer or 0
    size = int(desc.byte_size)
    owner = _CBuffer(pointer, size) if pointer else None
    shape = tuple(int(desc.shape[i]) for i in range(desc.dims_count))
    dtype = CODE_TYPES.get(desc.datatype)
    if dtype is None:
        raise ValueError(f"output '{name}' has unknown datatype {desc.datatype}")
    if dtype.is_bytes:
        data = ctypes.string_at(pointer, size) if pointer and size else b""
        return name, deserialize_bytes(data, shape)
    count = int(np.prod(shape)) if shape else 1
    needed = count * dtype.itemsize
    if needed == 0:
        return name, np.empty(shape, dtype=dtype.dtype)
    if owner is None or size < needed:
        raise ValueError(
            f"output '{name}' needs {needed} bytes for shape {list(shape)} of {dtype.name}, "
            f"but the backend provided {size if owner else 0}"
        )
    raw = np.asarray(owner)
    return name, raw[:needed].view(dtype.dtype).reshape(shape)


def read_params(params: Any, count: int) -> dict[str, bool | int | float | str]:
    out: dict[str, bool | int | float | str] = {}
    for i in range(count):
        p = params[i]
        key = (p.key or b"").decode("utf-8", "replace")
        if p.type == PARAM_STRING:
            out[key] = (p.str or b"").decode("utf-8", "replace")
        elif p.type == PARAM_INT:
            out[key] = int(p.i)
        elif p.type == PARAM_BOOL:
            out[key] = bool(p.b)
        elif p.type == PARAM_DOUBLE:
            out[key] = float(p.d)
    return out


# -- pending requests ------------------------------------------------------------------------
class Pending:
    """A pyserve request while a backend holds it (from execute to its last response).

    :ivar keep: the input arrays whose memory the backend reads; dropped at release.
    :ivar final: the final response went out.
    :ivar released: the backend released the request.
    :ivar done: no request, factory or response refers to it any more.
    :ivar abandoned: the execute failed, pyserve answers the request itself.
    :ivar rescheduled: released with ``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``: the request
        comes back in a later execute (iterative sequences), so no response is owed now.
    """

    __slots__ = ("abandoned", "decoupled", "done", "final", "keep", "key", "model_name", "released", "request",
                 "rescheduled")

    def __init__(self, key: int, request: InferRequest, decoupled: bool) -> None:
        self.key = key
        self.request = request
        self.decoupled = decoupled
        self.model_name = request.model_name
        self.keep: list[Any] | None = []
        self.final = False
        self.released = False
        self.done = False
        self.abandoned = False
        self.rescheduled = False


PENDING: dict[int, Pending] = {}
CHANGED = threading.Condition()
"""Notified whenever a pending request gets its final response or is done."""
_keys = itertools.count(1)


def new_key() -> int:
    return next(_keys)


def _finish(pending: Pending) -> None:
    if pending.final and pending.done:
        PENDING.pop(pending.key, None)


def _deliver(pending: Pending, result: InferResponse | InferError | None, final: bool) -> None:
    if pending.final:
        log.error("model '%s': the backend sent a response after the final one; dropped", pending.model_name)
        return
    if final:
        pending.final = True
    try:
        pending.request.response_sender().send(result, final=final)
    except Exception:
        log.exception("model '%s': delivering a response failed", pending.model_name)
    if final:
        with CHANGED:
            _finish(pending)
            CHANGED.notify_all()


def _on_response(
    key: int, flags: int, has_response: int, output_count: int, outputs: Any, param_count: int,
    params: Any, err_code: int, err_msg: bytes | None,
) -> None:
    arrays: dict[str, np.ndarray] = {}
    problem: str | None = None
    for i in range(output_count):  # take ownership of every buffer first, whatever happens
        try:
            name, array = tensor_from_output(outputs[i])
            arrays[name] = array
        except Exception as exc:
            problem = problem or str(exc)
    pending = PENDING.get(key)
    if pending is None:
        return
    try:
        result: InferResponse | InferError | None
        if err_code >= 0:
            try:
                code = ErrorCode(err_code)
            except ValueError:
                code = ErrorCode.UNKNOWN
            result = InferError((err_msg or b"").decode("utf-8", "replace"), code)
        elif not has_response:
            result = None
        elif problem is not None:
            result = InferError(f"model '{pending.model_name}': {problem}", ErrorCode.INTERNAL)
        else:
            result = InferResponse(arrays, read_params(params, param_count))
        _deliver(pending, result, bool(flags & RESPONSE_FINAL))
    except BaseException:
        log.exception("model '%s': handling a response failed", pending.model_name)


def _on_event(key: int, event: int, flags: int) -> None:
    pending = PENDING.get(key)
    if pending is None:
        return
    try:
        if event == EVENT_RELEASED:
            pending.released = True
            pending.keep = None
            if flags & RELEASE_RESCHEDULE:
                try:
                    pending.request.reschedule()  # iterative sequences: it comes back in a later execute
                    pending.rescheduled = True
                except InferError as exc:
                    log.error("model '%s': TRITONSERVER_REQUEST_RELEASE_RESCHEDULE: %s; the request is treated "
                              "as released", pending.model_name, exc.message)
            return
        if event != EVENT_DONE:
            return
        if not pending.final and not pending.abandoned and not pending.rescheduled:
            # Nothing can be sent any more. A decoupled request just ends; any other one
            # would otherwise wait forever for its response.
            if pending.decoupled:
                _deliver(pending, None, True)
            else:
                _deliver(pending, InferError(
                    f"model '{pending.model_name}': the backend released the request without "
                    "sending a response", ErrorCode.INTERNAL,
                ), True)
        with CHANGED:
            pending.done = True
            if pending.abandoned:
                pending.final = True
            _finish(pending)
            CHANGED.notify_all()
    except BaseException:
        log.exception("model '%s': handling a request event failed", pending.model_name)


def _on_is_cancelled(key: int) -> int:
    pending = PENDING.get(key)
    try:
        return int(pending is not None and pending.request.is_cancelled())
    except BaseException:
        return 0


def _on_trace_activity(key: int, timestamp_ns: int, name: bytes | None) -> None:
    """A backend's custom activity for a traced request (steady-clock ns → wall clock)."""
    pending = PENDING.get(key)
    trace = pending.request.trace if pending is not None else None
    if trace is None:
        return  # the request is answered: its trace was already recorded
    try:
        trace.activity((name or b"").decode("utf-8", "replace"), timestamp_ns + time.time_ns() - time.monotonic_ns())
    except BaseException:
        log.exception("model '%s': recording a trace activity failed", pending.model_name if pending else "")


_LEVELS = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}


def _on_log(level: int, filename: bytes | None, line: int, message: bytes | None) -> None:
    try:
        where = (filename or b"").decode("utf-8", "replace").rsplit("/", 1)[-1]
        text = (message or b"").decode("utf-8", "replace")
        log.log(_LEVELS.get(level, logging.INFO), "%s:%d] %s", where, line, text)
    except BaseException:
        pass
