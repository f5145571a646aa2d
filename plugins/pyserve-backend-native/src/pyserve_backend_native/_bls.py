"""Calls from native backends to the server that hosts them: BLS requests
(``TRITONSERVER_ServerInferAsync``), model and server queries (health, metadata, index,
statistics, metrics, model control) and the traces of BLS requests.

Callbacks here run on the backend's threads (ctypes takes the GIL); they never block the
server's event loop: requests are handed to it with ``ServerHandle.submit``, and only model
control calls (``TRITONSERVER_ServerLoadModel`` ...) wait for it.
"""

from __future__ import annotations

import ctypes
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from ctypes import POINTER, c_char_p, c_int32, c_int64, c_uint32, c_uint64, c_void_p
from typing import Any

import numpy as np

from pyserve.api import datatypes
from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.tracing import TRACING, RequestTrace, traceparent_of
from pyserve_backend_native._api import (
    CODE_TYPES,
    PARAM_BOOL,
    PARAM_DOUBLE,
    PARAM_INT,
    PARAM_STRING,
    QUERY_BATCH,
    QUERY_CONFIG,
    QUERY_INDEX,
    QUERY_LIVE,
    QUERY_LOAD,
    QUERY_METADATA,
    QUERY_METRICS,
    QUERY_READY,
    QUERY_SERVER_METADATA,
    QUERY_SERVER_READY,
    QUERY_STATISTICS,
    QUERY_TXN,
    QUERY_UNLOAD,
    QUERY_UNLOAD_DEPENDENTS,
    RESPONSE_FINAL,
    TRACE_ACTIVITIES,
    TYPE_CODES,
    OutputDesc,
    Param,
    deserialize_bytes,
    lib,
    new_key,
    read_params,
    serialize_bytes,
)

log = logging.getLogger("pyserve.native")

SERVERS: dict[int, Any] = {}
"""Server key (TRITONSERVER_Server of a model) → ``pyserve.dataplane.bls.ServerHandle``."""
_server_lock = threading.Lock()
_server_pointers: dict[int, tuple[Any, int]] = {}


def server_pointer(handle: Any) -> int | None:
    """The ``TRITONSERVER_Server*`` standing for a pyserve server (one per server handle)."""
    if handle is None:
        return None
    with _server_lock:
        entry = _server_pointers.get(id(handle))
        if entry is None or entry[0] is not handle:
            key = new_key()
            SERVERS[key] = handle
            entry = (handle, lib().pyshim_server_new(key))
            _server_pointers[id(handle)] = entry
        return entry[1]


def _decode(value: bytes | None) -> str:
    return (value or b"").decode("utf-8", "replace")


def _array_from_buffers(request: int, index: int, buffers: int, datatype: int, shape: tuple[int, ...]) -> np.ndarray:
    dt = CODE_TYPES.get(datatype)
    if dt is None:
        raise InferError.invalid(f"input {index} has unknown datatype {datatype}")
    chunks: list[tuple[int, int]] = []
    for j in range(buffers):
        base, size = c_void_p(), c_uint64()
        lib().pyshim_ireq_input_buffer(request, index, j, ctypes.byref(base), ctypes.byref(size))
        chunks.append((base.value or 0, int(size.value)))
    if dt.is_bytes:
        data = b"".join(ctypes.string_at(b, s) for b, s in chunks if s)
        return deserialize_bytes(data, shape)
    if len(chunks) == 1 and chunks[0][0]:
        # Borrowed, not copied: the backend keeps the data alive until the request is released,
        # which happens after its final response.
        address, length = chunks[0]
        array = np.frombuffer((ctypes.c_char * length).from_address(address), dtype=dt.dtype)  # type: ignore[call-overload]
    else:
        array = np.frombuffer(b"".join(ctypes.string_at(b, s) for b, s in chunks if s), dtype=dt.dtype)
    array = array.reshape(shape)
    array.flags.writeable = False
    return array


def _bls_request(request: int) -> InferRequest:
    model, rid, corr_str = c_char_p(), c_char_p(), c_char_p()
    version, flags, corr, priority, timeout = c_int64(), c_uint32(), c_uint64(), c_uint64(), c_uint64()
    n_in, n_out, n_params = c_uint32(), c_uint32(), c_uint32()
    lib().pyshim_ireq_info(
        request, ctypes.byref(model), ctypes.byref(version), ctypes.byref(rid), ctypes.byref(flags),
        ctypes.byref(corr), ctypes.byref(corr_str), ctypes.byref(priority), ctypes.byref(timeout),
        ctypes.byref(n_in), ctypes.byref(n_out), ctypes.byref(n_params),
    )
    inputs: dict[str, np.ndarray] = {}
    for i in range(n_in.value):
        name, datatype, shape_ptr = c_char_p(), c_int32(), POINTER(c_int64)()
        dims, buffers = c_uint32(), c_uint32()
        lib().pyshim_ireq_input(
            request, i, ctypes.byref(name), ctypes.byref(datatype), ctypes.byref(shape_ptr),
            ctypes.byref(dims), ctypes.byref(buffers),
        )
        shape = tuple(int(shape_ptr[d]) for d in range(dims.value))
        inputs[_decode(name.value)] = _array_from_buffers(request, i, buffers.value, datatype.value, shape)
    outputs = tuple(_decode(lib().pyshim_ireq_output(request, i)) for i in range(n_out.value))
    params = read_params(lib().pyshim_ireq_params(request), n_params.value) if n_params.value else {}
    correlation: int | str = _decode(corr_str.value) if corr_str.value is not None else int(corr.value)
    return InferRequest(
        _decode(model.value), int(version.value), inputs, outputs, id=_decode(rid.value), parameters=params,
        flags=int(flags.value), correlation_id=correlation, priority=int(priority.value),
        timeout_us=int(timeout.value),
    )


def output_descs(outputs: Mapping[str, Any]) -> tuple[Any, list[Any]]:
    """C descriptions of arrays (and what keeps their memory alive during the call)."""
    keep: list[Any] = []
    descs = (OutputDesc * max(len(outputs), 1))()
    for i, (name, value) in enumerate(outputs.items()):
        array = value if isinstance(value, np.ndarray) else np.asarray(value)
        dt = datatypes.from_numpy(array.dtype)
        if dt is None:
            raise InferError(f"output '{name}' has unsupported dtype {array.dtype}", ErrorCode.INTERNAL)
        if dt.is_bytes:
            data = np.frombuffer(serialize_bytes(array), dtype=np.uint8)
        else:
            data = np.ascontiguousarray(array, dtype=dt.dtype)
        shape = (c_int64 * max(array.ndim, 1))(*array.shape)
        name_bytes = name.encode()
        keep += [data, shape, name_bytes]
        descs[i].name = name_bytes
        descs[i].datatype = TYPE_CODES[dt.name]
        descs[i].dims_count = array.ndim
        descs[i].shape = ctypes.cast(shape, POINTER(c_int64))
        descs[i].buffer = data.ctypes.data if data.nbytes else None
        descs[i].byte_size = data.nbytes
    return descs, keep


def param_array(parameters: Mapping[str, Any]) -> tuple[Any, list[Any]]:
    keep: list[Any] = []
    array = (Param * max(len(parameters), 1))()
    for i, (key, value) in enumerate(parameters.items()):
        key_bytes = key.encode()
        keep.append(key_bytes)
        array[i].key = key_bytes
        if isinstance(value, bool):
            array[i].type, array[i].b = PARAM_BOOL, value
        elif isinstance(value, int):
            array[i].type, array[i].i = PARAM_INT, value
        elif isinstance(value, float):
            array[i].type, array[i].d = PARAM_DOUBLE, value
        else:
            text = str(value).encode()
            keep.append(text)
            array[i].type, array[i].str = PARAM_STRING, text
    return array, keep


class _UserTrace:
    """A trace a backend made for its BLS request (``TRITONSERVER_InferenceTraceNew``): pyserve
    stamps the request like a sampled one, and before the final response reports every stamp
    to the backend's activity callback (steady-clock ns, as Triton). Nothing is written to the
    server's trace file."""

    __slots__ = ("pointer", "trace")

    def __init__(self, pointer: int, trace: RequestTrace) -> None:
        self.pointer = pointer
        self.trace = trace
        TRACING.set(trace, True)  # instance workers stamp traced requests only while tracing is on

    def report(self, request: InferRequest) -> None:
        trace = self.trace
        trace.finish()
        TRACING.set(trace, False)
        lib().pyshim_trace_set_model(self.pointer, request.model_name.encode(), request.model_version,
                                     request.id.encode())
        to_steady = time.monotonic_ns() - time.time_ns()
        for name, ns in sorted(trace.timestamps.items(), key=lambda item: item[1]):
            code = TRACE_ACTIVITIES.get(name)
            if code is not None:
                lib().pyshim_trace_report(self.pointer, code, max(ns + to_steady, 0))

    def abandon(self) -> None:
        TRACING.set(self.trace, False)


class _BlsSender:
    """Answers a backend's TRITONSERVER_InferenceRequest from pyserve's responses."""

    __slots__ = ("_done", "_lock", "_origin", "_request", "_trace")

    def __init__(self, request: int, origin: InferRequest | None, trace: _UserTrace | None = None) -> None:
        self._request = request
        self._origin = origin  # its model_version is the serving version once submitted
        self._trace = trace
        self._lock = threading.Lock()
        self._done = False

    @property
    def _version(self) -> int:
        return max(self._origin.model_version, 0) if self._origin is not None else 0

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        with self._lock:
            if self._done:
                return
            flags = RESPONSE_FINAL if final else 0
            if final and self._trace is not None and self._origin is not None:
                try:  # while the request (and its trace) still exist: the final respond releases both
                    self._trace.report(self._origin)
                except Exception:
                    log.exception("BLS: reporting the trace of a request for model '%s' failed",
                                  self._origin.model_name)
            if isinstance(response, InferResponse) and response.error is not None:
                response = response.error
            try:
                if isinstance(response, InferError):
                    lib().pyshim_ireq_respond(
                        self._request, flags, 1, self._version, int(response.code), response.message.encode(),
                        0, None, 0, None,
                    )
                elif isinstance(response, InferResponse):
                    descs, keep = output_descs(response.outputs)
                    params, keep_params = param_array(response.parameters)
                    lib().pyshim_ireq_respond(
                        self._request, flags, 1, self._version, -1, None, len(response.outputs), descs,
                        len(response.parameters), params,
                    )
                    del keep, keep_params
                else:
                    lib().pyshim_ireq_respond(self._request, flags, 0, self._version, -1, None, 0, None, 0, None)
            except InferError as exc:
                lib().pyshim_ireq_respond(
                    self._request, flags, 1, self._version, int(exc.code), exc.message.encode(), 0, None, 0, None,
                )
            if final:
                self._done = True  # the backend released (and may have freed) the request

    def is_cancelled(self) -> bool:
        with self._lock:
            return not self._done and bool(lib().pyshim_ireq_is_cancelled(self._request))


def _trace_bls_request(handle: Any, request: int, infer_request: InferRequest) -> _UserTrace | None:
    """Trace a BLS request submitted with a trace: a backend's own (its callbacks get the
    activities) or a child of the calling request's trace (recorded by the server's tracing,
    with the parent's id and, in OpenTelemetry mode, as a span under the parent's)."""
    pointer = lib().pyshim_ireq_trace(request)
    if not pointer:
        return None
    trace_id, parent_id, context, callbacks = c_uint64(), c_uint64(), c_char_p(), c_int32()
    lib().pyshim_trace_info(pointer, ctypes.byref(trace_id), ctypes.byref(parent_id), ctypes.byref(context),
                            ctypes.byref(callbacks))
    parent = traceparent_of(_decode(context.value)) if context.value else None
    if callbacks.value:
        trace = RequestTrace(int(trace_id.value), infer_request, parent, None, parent_id=int(parent_id.value),
                             export=False)
        infer_request.trace = trace
        return _UserTrace(pointer, trace)
    tracing = handle.tracing
    if tracing.active:  # else tracing was turned off since the calling request was sampled
        infer_request.trace = RequestTrace(int(trace_id.value), infer_request, parent, None,
                                           tracing.mode == "opentelemetry", parent_id=int(parent_id.value))
    return None


def _on_infer_async(server: int, request: int) -> int:
    handle = SERVERS.get(server)
    try:
        if handle is None:
            raise InferError.unavailable("the server that owns this model is not running")
        infer_request = _bls_request(request)
        user_trace = _trace_bls_request(handle, request, infer_request)
    except BaseException as exc:
        error = exc if isinstance(exc, InferError) else InferError(f"{type(exc).__name__}: {exc}", ErrorCode.INTERNAL)
        try:
            _BlsSender(request, None).send(error, True)
        except BaseException:
            log.exception("BLS: answering a malformed request failed")
        return 0
    try:
        handle.submit(infer_request, _BlsSender(request, infer_request, user_trace))
    except BaseException:
        log.exception("BLS: submitting a request for model '%s' failed", infer_request.model_name)
        if user_trace is not None:
            user_trace.abandon()
        return 1
    return 0


def _model_metadata(config: Any, name: str, version: str | None) -> dict[str, Any]:
    from pyserve.protocol import data_type_name

    def tensors(items: Any) -> list[dict[str, Any]]:
        out = []
        for t in items:
            dt = datatypes.from_config_name(data_type_name(t.data_type))
            dims = list(t.dims)
            if config.max_batch_size > 0:
                dims = [-1, *dims]
            out.append({"name": t.name, "datatype": dt.name if dt else "", "shape": dims})
        return out

    return {
        "name": name, "versions": [version] if version else [], "platform": config.platform or config.backend,
        "inputs": tensors(config.input), "outputs": tensors(config.output),
    }


def _config_json(handle: Any, name: str, version: str | None) -> str:
    from pyserve.protocol.config_json import model_config_to_dict

    return json.dumps(model_config_to_dict(handle.model_config(name, version)))


def _loaded(action: Callable[[], None]) -> tuple[int, str | None]:
    action()
    return 0, None


Query = Callable[[Any, str, "str | None", int], "tuple[int, str | None]"]
"""(server handle, model name, version or None, the raw version / flags) → (number, text)."""

_QUERIES: dict[int, Query] = {
    QUERY_READY: lambda h, n, v, _: (int(h.model_ready(n, v)), None),
    QUERY_TXN: lambda h, n, v, _: (2 if h.is_decoupled(n, v) else 1, None),
    QUERY_BATCH: lambda h, n, v, _: (2 if h.model_config(n, v).max_batch_size > 0 else 1, None),
    QUERY_CONFIG: lambda h, n, v, _: (0, _config_json(h, n, v)),
    QUERY_METADATA: lambda h, n, v, _: (0, json.dumps(_model_metadata(h.model_config(n, v), n, v))),
    QUERY_LIVE: lambda h, n, v, _: (int(h.is_live()), None),
    QUERY_SERVER_READY: lambda h, n, v, _: (int(h.is_ready()), None),
    QUERY_SERVER_METADATA: lambda h, n, v, _: (0, json.dumps(h.server_metadata())),
    QUERY_INDEX: lambda h, n, v, flags: (0, json.dumps(h.repository_index(ready_only=bool(flags & 1)))),
    QUERY_STATISTICS: lambda h, n, v, _: (0, json.dumps(h.model_statistics(n, v))),
    QUERY_METRICS: lambda h, n, v, _: (0, h.metrics_text()),
    QUERY_LOAD: lambda h, n, v, _: _loaded(lambda: h.load_model(n)),
    QUERY_UNLOAD: lambda h, n, v, _: _loaded(lambda: h.unload_model(n)),
    QUERY_UNLOAD_DEPENDENTS: lambda h, n, v, _: _loaded(lambda: h.unload_model(n, unload_dependents=True)),
}
"""What each ``PYSHIM_QUERY_*`` of the shim asks of the server (``ServerHandle``)."""


def _on_server_query(server: int, op: int, model: bytes | None, version: int, result: Any) -> int:
    name = _decode(model)
    handle = SERVERS.get(server)
    try:
        if handle is None:
            raise InferError.unavailable("the server that owns this model is not running")
        query = _QUERIES.get(op)
        if query is None:
            raise InferError.unsupported(f"unknown server query {op}")
        number, text = query(handle, name, str(version) if version > 0 else None, version)
        lib().pyshim_result_set(result, number, text.encode() if text is not None else None)
    except InferError as exc:
        lib().pyshim_result_error(result, int(exc.code), exc.message.encode())
    except BaseException as exc:
        lib().pyshim_result_error(result, int(ErrorCode.INTERNAL), f"{type(exc).__name__}: {exc}".encode())
    return 0
