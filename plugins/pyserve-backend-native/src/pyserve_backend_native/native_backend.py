"""A native Triton backend library as a pyserve backend plugin.

``NativeBackend`` implements pyserve's lifecycle hooks by calling the library's
``TRITONBACKEND_*`` entry points through ctypes, with the server-side objects made by the shim:

=====================================  ==========================================================
pyserve hook                           TRITONBACKEND entry point
=====================================  ==========================================================
``pyserve_backend_initialize``         ``Initialize`` (+ ``GetBackendAttribute``)
``pyserve_model_auto_complete``        ``ModelInitialize`` with auto-complete on (the backend may
                                       call ``ModelSetConfig``; the completed config comes back)
``pyserve_model_create``               ``ModelInitialize`` (unless auto-complete already ran it)
``pyserve_instance_create``            ``ModelInstanceInitialize``
``pyserve_execute``                    ``ModelInstanceExecute``
``pyserve_instance_ready``             ``ModelInstanceReady`` (when exported; an error = not ready)
``pyserve_instance_finalize``          ``ModelInstanceFinalize``
``pyserve_model_finalize``             ``ModelFinalize``
``pyserve_backend_finalize``           ``Finalize``
=====================================  ==========================================================

Ownership of requests follows Triton: when ``ModelInstanceExecute`` succeeds the backend owns
every request and releases it (``TRITONBACKEND_RequestRelease``); when it fails, pyserve keeps
them, frees them, and answers each with the backend's error.
"""

from __future__ import annotations

import ctypes
import json
import logging
from collections.abc import Sequence
from ctypes import c_int64, c_void_p
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pyserve.api import datatypes
from pyserve.api.backend import BackendContext, InstanceContext, ModelContext
from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import InferRequest
from pyserve.protocol.config_json import model_config_from_dict, model_config_to_dict
from pyserve_backend_native import _api, _bls
from pyserve_backend_native.loader import NativeLibrary
from pyserve_hookspecs import hookimpl

log = logging.getLogger("pyserve.native")


class NativeBackendError(RuntimeError):
    """A backend entry point returned an error; the message names the library and the call."""


@dataclass(eq=False)
class NativeModel:
    """The shim's TRITONBACKEND_Model of one model version."""

    pointer: int
    name: str
    initialized: bool = False
    keep: list[Any] = field(default_factory=list)

    def statistics(self) -> dict[str, int]:
        """What the backend reported through ModelInstanceReport(Batch)Statistics."""
        stats = _api.Stats()
        _api.lib().pyshim_model_stats(self.pointer, ctypes.byref(stats))
        return {field[0]: int(getattr(stats, field[0])) for field in _api.Stats._fields_}


@dataclass(eq=False)
class NativeInstance:
    """The shim's TRITONBACKEND_ModelInstance."""

    pointer: int
    model: NativeModel
    reports: Any = None  # ctypes array of _api.Report, grown to the largest batch
    batch_report: _api.Report = field(default_factory=_api.Report)


class NativeBackend:
    """One backend library, for one pyserve server (a plugin object per server and library).

    :param library: the loaded library (process-wide).
    :param name: the backend name configs use (``backend: "<name>"``).
    :param backend_directory: ``--backend-directory``, passed on in the backend config.
    """

    def __init__(self, library: NativeLibrary, name: str, backend_directory: str | None) -> None:
        self.library = library
        self.name = name
        self.backend_directory = backend_directory or ""
        self._backend: int | None = None
        self._pending_models: dict[int, NativeModel] = {}  # auto-completed, not yet created

    def __repr__(self) -> str:
        return f"NativeBackend({self.name!r}, {str(self.library.path)!r})"

    # -- helpers ---------------------------------------------------------------------------
    def _entry(self, name: str) -> Any:
        return self.library.entry_points.get(f"TRITONBACKEND_{name}")

    def _call(self, name: str, *args: Any) -> None:
        function = self._entry(name)
        if function is None:
            return
        error = _api.take_error(function(*args))
        if error is not None:
            raise NativeBackendError(f"{self.library.path}: TRITONBACKEND_{name} failed: {error.message}")

    # -- backend ------------------------------------------------------------------------------
    @hookimpl
    def pyserve_backend_initialize(self, backend: BackendContext) -> None:
        lib = _api.lib()
        cmdline = {
            "auto-complete-config": "true",
            "backend-directory": self.backend_directory,
            "min-compute-capability": "6.000000",
            "default-max-batch-size": "4",
            **backend.config,
        }
        config = json.dumps({"cmdline": cmdline})
        pointer = lib.pyshim_backend_new(
            self.name.encode(), config.encode(), str(self.library.path.parent).encode()
        )
        try:
            self._call("Initialize", pointer)
        except NativeBackendError:
            lib.pyshim_backend_delete(pointer)
            raise
        attributes = self._entry("GetBackendAttribute")
        if attributes is not None:
            attribute = lib.pyshim_backend_attribute_new()
            error = _api.take_error(attributes(pointer, attribute))
            lib.pyshim_free(attribute)
            if error is not None:
                log.warning("%s: TRITONBACKEND_GetBackendAttribute failed: %s", self.library.path, error.message)
        self._backend = pointer
        backend.state = self
        _api.include_metrics(backend.metrics)
        log.info("native backend '%s' initialized from %s", self.name, self.library.path)

    @hookimpl
    def pyserve_backend_finalize(self, backend: BackendContext) -> None:
        if self._backend is not None:
            _api.exclude_metrics(backend.metrics)
        for model in list(self._pending_models.values()):  # auto-completed but never created
            self._finalize_model(model)
        self._pending_models.clear()
        if self._backend is None:
            return
        try:
            self._call("Finalize", self._backend)
        finally:
            _api.lib().pyshim_backend_delete(self._backend)
            self._backend = None

    # -- models ---------------------------------------------------------------------------------
    def _new_model(self, model: ModelContext, auto_complete: bool) -> NativeModel:
        if self._backend is None:
            raise NativeBackendError(f"{self.library.path}: the backend is not initialized")
        config = json.dumps(model_config_to_dict(model.config)).encode()
        server = _bls.server_pointer(model.server)
        pointer = _api.lib().pyshim_model_new(
            self._backend, server, model.name.encode(), model.version, str(model.path).encode(), config,
            auto_complete,
        )
        native = NativeModel(pointer, model.name)
        lib = _api.lib()
        lib.pyshim_model_set_initializing(pointer, True)
        try:
            self._call("ModelInitialize", pointer)
        except NativeBackendError:
            lib.pyshim_model_delete(pointer)
            raise
        finally:
            lib.pyshim_model_set_initializing(pointer, False)
        native.initialized = True
        return native

    @hookimpl
    def pyserve_model_auto_complete(self, model: ModelContext) -> bool:
        native = self._new_model(model, auto_complete=True)
        self._pending_models[id(model)] = native
        changed = ctypes.c_bool()
        text = _api.lib().pyshim_model_config(native.pointer, ctypes.byref(changed))
        if not changed.value:
            return False
        try:
            completed = model_config_from_dict(json.loads(text))
        except ValueError as exc:
            raise NativeBackendError(
                f"{self.library.path}: TRITONBACKEND_ModelSetConfig gave an invalid config: {exc}"
            ) from exc
        model.config.CopyFrom(completed)
        return True

    @hookimpl
    def pyserve_model_create(self, model: ModelContext) -> NativeModel:
        model.single_process_reason = self.library.single_process_reason()
        native = self._pending_models.pop(id(model), None)
        if native is None:
            return self._new_model(model, auto_complete=False)
        # the server normalized the completed config again: that is what the backend sees now
        config = json.dumps(model_config_to_dict(model.config)).encode()
        _api.lib().pyshim_model_set_config(native.pointer, config)
        return native

    def _finalize_model(self, native: NativeModel) -> None:
        try:
            if native.initialized:
                self._call("ModelFinalize", native.pointer)
        finally:
            _api.lib().pyshim_model_delete(native.pointer)

    @hookimpl
    def pyserve_model_finalize(self, model: ModelContext) -> None:
        native = model.state
        if isinstance(native, NativeModel):
            self._finalize_model(native)

    # -- instances --------------------------------------------------------------------------------
    @hookimpl
    def pyserve_instance_create(self, instance: InstanceContext) -> NativeInstance:
        model = instance.model.state
        assert isinstance(model, NativeModel)
        lib = _api.lib()
        pointer = lib.pyshim_instance_new(
            model.pointer, instance.name.encode(), _api.KIND_CODES.get(instance.kind, 1), instance.device_id
        )
        try:
            self._call("ModelInstanceInitialize", pointer)
        except NativeBackendError:
            lib.pyshim_instance_delete(pointer)
            raise
        return NativeInstance(pointer, model)

    @hookimpl
    def pyserve_instance_finalize(self, instance: InstanceContext) -> None:
        native = instance.state
        if not isinstance(native, NativeInstance):
            return
        try:
            self._call("ModelInstanceFinalize", native.pointer)
        finally:
            _api.lib().pyshim_instance_delete(native.pointer)

    @hookimpl
    def pyserve_instance_ready(self, instance: InstanceContext) -> bool | None:
        """``TRITONBACKEND_ModelInstanceReady`` when the library exports it (an optional entry
        point): ready unless it returns an error. None (no opinion) when it does not.

        :raises NativeBackendError: the backend says the instance is not ready (its message).
        """
        native = instance.state
        if self._entry("ModelInstanceReady") is None or not isinstance(native, NativeInstance):
            return None
        self._call("ModelInstanceReady", native.pointer)
        return True

    # -- execute ------------------------------------------------------------------------------------
    @hookimpl
    def pyserve_execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> None:
        native = instance.state
        assert isinstance(native, NativeInstance)
        decoupled = bool(instance.model.config.model_transaction_policy.decoupled)
        lib = _api.lib()
        count = len(requests)
        pointers = (c_void_p * count)()
        pendings: list[_api.Pending] = []
        try:
            for i, request in enumerate(requests):
                pending = _api.Pending(_api.new_key(), request, decoupled)
                _api.PENDING[pending.key] = pending
                pendings.append(pending)
                pointers[i] = _build_request(lib, pending, native.pointer)
        except BaseException:
            self._abandon(pendings, pointers)
            raise
        execute = self.library.entry_points["TRITONBACKEND_ModelInstanceExecute"]
        error = _api.take_error(execute(native.pointer, pointers, count))
        if error is not None:
            # The requests are still ours: free them; every request gets the backend's error.
            self._abandon(pendings, pointers)
            raise error
        if not decoupled:
            # A one-response model may answer from another thread after execute returns (Triton
            # allows it): wait until every request has its final response or can get none.
            with _api.CHANGED:
                while not all(p.final or p.done for p in pendings):
                    _api.CHANGED.wait()
        _take_reports(lib, native, pendings)
        return None

    @staticmethod
    def _abandon(pendings: list[_api.Pending], pointers: Any) -> None:
        lib = _api.lib()
        for i, pending in enumerate(pendings):
            pending.abandoned = True
            if pointers[i] and not pending.released:
                lib.pyshim_request_delete(pointers[i])
            _api.PENDING.pop(pending.key, None)


def _take_reports(lib: Any, native: NativeInstance, pendings: list[_api.Pending]) -> None:
    """Hand what the backend reported during this execute (``ModelInstanceReportStatistics``,
    ``ReportBatchStatistics``) to the model's statistics: where each request's computation
    began and ended (``ModelStats.backend_compute``). A request without a report of its own
    takes the batch report's; with neither, the core's numbers stay. Reports made after the
    execute returned (a decoupled backend answering later) are not used."""
    stats = pendings[0].request.stats
    count = len(pendings)
    reports = native.reports
    if reports is None or len(reports) < count:
        reports = native.reports = (_api.Report * max(count, 8))()
    batch = native.batch_report
    taken = lib.pyshim_instance_take_reports(native.pointer, reports, len(reports), ctypes.byref(batch))
    if stats is None or (taken == 0 and not batch.key):
        return
    backend_compute = stats.backend_compute
    reported = set()
    if taken:
        by_key = {p.key: p.request for p in pendings}
        for i in range(taken):
            report = reports[i]
            request = by_key.get(report.key)
            if request is not None and report.success:
                backend_compute((request,), report.exec_start_ns, report.compute_start_ns,
                                report.compute_end_ns, report.exec_end_ns)
                reported.add(report.key)
    if batch.key and len(reported) < count:
        backend_compute([p.request for p in pendings if p.key not in reported], batch.exec_start_ns,
                        batch.compute_start_ns, batch.compute_end_ns, batch.exec_end_ns)


def _build_request(lib: Any, pending: _api.Pending, instance: int) -> int:
    """A TRITONBACKEND_Request whose inputs point into the request's arrays (no copies)."""
    request = pending.request
    cid = request.correlation_id
    corr_string = cid.encode() if isinstance(cid, str) and cid != "" else None
    corr_number = cid if isinstance(cid, int) else 0
    pointer = lib.pyshim_request_new(
        pending.key, instance, request.id.encode(), corr_number, corr_string, request.flags,
        request.timeout_us, len(request.inputs), len(request.requested_outputs),
    )
    trace = request.trace
    if trace is not None:  # TRITONBACKEND_RequestTrace hands it out; custom activities come back
        lib.pyshim_request_set_trace(
            pointer, trace.id, trace.parent_id, request.model_name.encode(), request.model_version,
            request.id.encode(), trace.context.encode() if trace.context else None,
        )
    keep = pending.keep
    assert keep is not None
    for index, (name, array) in enumerate(request.inputs.items()):
        dt = datatypes.from_numpy(array.dtype)
        if dt is None:
            pending.abandoned = True  # pyserve answers it; the DONE event must not
            lib.pyshim_request_delete(pointer)
            raise InferError(f"input '{name}' has unsupported dtype {array.dtype}", ErrorCode.INVALID_ARG)
        if dt.is_bytes:
            data = np.frombuffer(_api.serialize_bytes(array), dtype=np.uint8)
        else:
            data = np.ascontiguousarray(array)
        shape = (c_int64 * max(array.ndim, 1))(*array.shape)
        address = data.__array_interface__["data"][0] if data.nbytes else None
        lib.pyshim_request_set_input(
            pointer, index, name.encode(), _api.TYPE_CODES[dt.name], shape, array.ndim, address, data.nbytes
        )
        keep.append(data)
    for index, name in enumerate(request.requested_outputs):
        lib.pyshim_request_set_output(pointer, index, name.encode())
    for key, value in request.parameters.items():
        if isinstance(value, bool):
            lib.pyshim_request_add_param(pointer, key.encode(), _api.PARAM_BOOL, None, 0, value, 0.0)
        elif isinstance(value, int):
            lib.pyshim_request_add_param(pointer, key.encode(), _api.PARAM_INT, None, value, False, 0.0)
        elif isinstance(value, float):
            lib.pyshim_request_add_param(pointer, key.encode(), _api.PARAM_DOUBLE, None, 0, False, value)
        else:
            lib.pyshim_request_add_param(pointer, key.encode(), _api.PARAM_STRING, str(value).encode(), 0, False, 0.0)
    return int(pointer)
