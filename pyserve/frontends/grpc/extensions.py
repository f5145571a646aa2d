"""gRPC shared-memory, trace-setting and log-setting RPCs (message ⇄ data plane).

Each function takes the request message and returns the response message, raising
``InferError`` on failure; the servicer turns errors into gRPC statuses.
"""

from __future__ import annotations

from typing import Any

from pyserve import logs
from pyserve import protocol as pb
from pyserve.api.errors import InferError
from pyserve.dataplane.interface import ServingPlane


def system_shm_status(dataplane: ServingPlane, request: Any) -> Any:
    response = pb.SystemSharedMemoryStatusResponse()
    for entry in dataplane.shared_memory.status(request.name, "system"):
        region = response.regions[entry["name"]]
        region.name = entry["name"]
        region.key = entry["key"]
        region.offset = entry["offset"]
        region.byte_size = entry["byte_size"]
    return response


def system_shm_register(dataplane: ServingPlane, request: Any) -> Any:
    dataplane.shared_memory.register_system(request.name, request.key, request.offset, request.byte_size)
    return pb.SystemSharedMemoryRegisterResponse()


def system_shm_unregister(dataplane: ServingPlane, request: Any) -> Any:
    dataplane.shared_memory.unregister(request.name, "system")
    return pb.SystemSharedMemoryUnregisterResponse()


def cuda_shm_status(dataplane: ServingPlane, request: Any) -> Any:
    response = pb.CudaSharedMemoryStatusResponse()
    for entry in dataplane.shared_memory.status(request.name, "cuda"):
        region = response.regions[entry["name"]]
        region.name = entry["name"]
        region.device_id = entry["device_id"]
        region.byte_size = entry["byte_size"]
    return response


def cuda_shm_register(dataplane: ServingPlane, request: Any) -> Any:
    dataplane.shared_memory.register_cuda(request.name, request.raw_handle, request.device_id, request.byte_size)
    return pb.CudaSharedMemoryRegisterResponse()


def cuda_shm_unregister(dataplane: ServingPlane, request: Any) -> Any:
    dataplane.shared_memory.unregister(request.name, "cuda")
    return pb.CudaSharedMemoryUnregisterResponse()


def trace_setting(dataplane: ServingPlane, request: Any) -> Any:
    """``TraceSetting``: an empty value list clears a setting (per model: back to global)."""
    model = request.model_name or None
    if model is not None:
        dataplane.check_trace_model(model)
    changes: dict[str, Any] = {}
    for key, value in request.settings.items():
        values = list(value.value)
        if not values:
            changes[key] = None
        elif key == "trace_level":
            changes[key] = values
        elif len(values) == 1:
            changes[key] = values[0]
        else:
            raise InferError.invalid(f"trace setting '{key}' takes a single value")
    settings = dataplane.tracing.update(changes, model) if changes else dataplane.tracing.settings(model)
    response = pb.TraceSettingResponse()
    for key, value in settings.items():
        response.settings[key].value.extend(value if isinstance(value, list) else [value])
    return response


def log_settings(request: Any) -> Any:
    """``LogSettings``: bool/uint32/string parameters; returns every setting."""
    changes: dict[str, Any] = {}
    for key, value in request.settings.items():
        which = value.WhichOneof("parameter_choice")
        if which is None:
            raise InferError.invalid(f"log setting '{key}' has no value")
        changes[key] = getattr(value, which)
    settings = logs.update_settings(changes) if changes else logs.get_settings()
    response = pb.LogSettingsResponse()
    for key, value in settings.items():
        entry = response.settings[key]
        if isinstance(value, bool):
            entry.bool_param = value
        elif isinstance(value, int):
            entry.uint32_param = value
        else:
            entry.string_param = value
    return response
