"""What a backend imports: requests, responses, contexts, errors and the batching helpers.

``pyserve`` re-exports every name here, so ``from pyserve import Backend`` and
``from pyserve.api import Backend`` are the same class. Importing this package loads no
transport, runtime, data-plane, hand-off or server module (tests/api/test_api_layer.py checks
``sys.modules``): a backend's tests and type checks need nothing of the server.

The submodules: ``backend`` (``Backend`` and the contexts), ``inference`` (``InferRequest``,
``InferResponse``), ``errors``, ``datatypes`` (Triton's datatype names and numpy), ``batching``
(``gather_inputs`` / ``split_outputs``), ``custom_metrics`` (``backend.metrics``), and
``backend_support`` (the shared parts of the framework backends).
"""

from __future__ import annotations

from pyserve.api.backend import Backend, BackendContext, InstanceContext, ModelContext
from pyserve.api.batching import gather_inputs, split_outputs
from pyserve.api.custom_metrics import CustomMetrics
from pyserve.api.errors import ErrorCode, InferError, ModelFileError, ModelFileNotFound
from pyserve.api.inference import SEQUENCE_END, SEQUENCE_START, InferRequest, InferResponse
from pyserve_hookspecs import hookimpl

__all__ = [
    "SEQUENCE_END",
    "SEQUENCE_START",
    "Backend",
    "BackendContext",
    "CustomMetrics",
    "ErrorCode",
    "InferError",
    "InferRequest",
    "InferResponse",
    "InstanceContext",
    "ModelContext",
    "ModelFileError",
    "ModelFileNotFound",
    "gather_inputs",
    "hookimpl",
    "split_outputs",
]
