"""pyserve: a Python-native inference server, wire-compatible with Triton Inference Server.

The public API for backend authors is what this module exports; everything else is the
server's own and may change.
"""

from __future__ import annotations

from pyserve_hookspecs import hookimpl

from pyserve.batching import gather_inputs, split_outputs
from pyserve.backend import Backend, BackendContext, InstanceContext, ModelContext
from pyserve.errors import ErrorCode, InferError
from pyserve.inference import SEQUENCE_END, SEQUENCE_START, InferRequest, InferResponse

__version__ = "0.1.0"

__all__ = [
    "SEQUENCE_END",
    "SEQUENCE_START",
    "Backend",
    "BackendContext",
    "ErrorCode",
    "InferError",
    "InferRequest",
    "InferResponse",
    "InstanceContext",
    "ModelContext",
    "__version__",
    "gather_inputs",
    "hookimpl",
    "split_outputs",
]
