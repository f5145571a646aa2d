"""Triton's ``triton_python_backend_utils`` API for Python models served by pyserve.

Models import it as in Triton (``import triton_python_backend_utils as pb_utils``); names,
signatures and behaviour follow Triton's Python backend. pyserve specifics:

* Tensors are host-memory numpy arrays (``is_cpu()`` is always True); BF16 tensors are
  ``ml_dtypes.bfloat16`` arrays, so ``as_numpy()`` works for them too.
* BLS (``InferenceRequest.exec`` / ``async_exec``) calls the server that runs the calling model,
  in-process (see ``pyserve_backend_python.context``).
* Custom metrics are collected in ``REGISTRY`` (a ``prometheus_client.CollectorRegistry``).
* ``Logger`` writes to Python's ``logging`` (logger ``pyserve.python_model``).
* ``load_model`` / ``unload_model`` / ``is_model_ready`` act on the server that runs the calling
  model (loading and unloading need ``--model-control-mode explicit``, as in Triton).
* Not available in pyserve yet: request rescheduling (``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``)
  and tracing contexts.
"""

from __future__ import annotations

from pyserve_backend_python.config import (
    ModelConfig,
    get_input_config_by_name,
    get_output_config_by_name,
    using_decoupled_model_transaction_policy,
)
from pyserve_backend_python.constants import (
    TRITONSERVER_MEMORY_CPU,
    TRITONSERVER_MEMORY_CPU_PINNED,
    TRITONSERVER_MEMORY_GPU,
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_END,
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
    TRITONSERVER_REQUEST_RELEASE_ALL,
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
    TRITONSERVER_RESPONSE_COMPLETE_FINAL,
)
from pyserve_backend_python.errors import TritonError, TritonModelException
from pyserve_backend_python.logger import Logger, LogLevel
from pyserve_backend_python.metrics import REGISTRY, Metric, MetricFamily
from pyserve_backend_python.model_control import is_model_ready, load_model, unload_model
from pyserve_backend_python.request import InferenceRequest, InferenceTrace, PreferredMemory
from pyserve_backend_python.response import InferenceResponse, InferenceResponseSender, ResponseIterator
from pyserve_backend_python.tensor import (
    TRITON_STRING_TO_NUMPY,
    Tensor,
    deserialize_bytes_tensor,
    numpy_to_triton_type,
    serialize_byte_tensor,
    triton_string_to_numpy,
    triton_to_numpy_type,
)


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    """The request's input tensor called ``name``, or None."""
    for tensor in inference_request.inputs():
        if tensor._name == name:  # the attribute, not name(): this runs for every input of every request
            return tensor
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    """The response's output tensor called ``name``, or None."""
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def get_model_dir() -> str:
    """The version directory of the model whose code is running (Triton's stub function; a
    Python-based backend's ``model.py`` finds its model's files there, e.g. ``model.json``).

    :raises TritonModelException: no model's code is running in this thread.
    """
    from pyserve_backend_python import context

    model = context.current_model() or context.process_model()
    if model is None:
        raise TritonModelException("get_model_dir() is available while a model's code runs")
    return str(model.version_path)


__all__ = [
    "REGISTRY",
    "TRITONSERVER_MEMORY_CPU",
    "TRITONSERVER_MEMORY_CPU_PINNED",
    "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "TRITON_STRING_TO_NUMPY",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceResponseSender",
    "InferenceTrace",
    "LogLevel",
    "Logger",
    "Metric",
    "MetricFamily",
    "ModelConfig",
    "PreferredMemory",
    "ResponseIterator",
    "Tensor",
    "TritonError",
    "TritonModelException",
    "deserialize_bytes_tensor",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_model_dir",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "is_model_ready",
    "load_model",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "unload_model",
    "using_decoupled_model_transaction_policy",
]
