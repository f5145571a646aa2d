"""pyserve: a Python-native inference server, wire-compatible with Triton Inference Server.

The public API for backend authors is what this module exports; everything else is the
server's own and may change.
"""

from __future__ import annotations

import os

# Backends may fork helper processes from their own threads (Triton's Python backend starts
# a stub per instance) while gRPC's threads are running; gRPC's fork handlers then abort the
# whole process. The children exec at once, so the handlers are not needed. Set before grpc
# is imported; an explicit setting in the environment wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from pyserve_hookspecs import hookimpl  # noqa: E402

from pyserve.batching import gather_inputs, split_outputs  # noqa: E402
from pyserve.backend import Backend, BackendContext, InstanceContext, ModelContext  # noqa: E402
from pyserve.errors import ErrorCode, InferError, ModelFileError, ModelFileNotFound  # noqa: E402
from pyserve.inference import SEQUENCE_END, SEQUENCE_START, InferRequest, InferResponse  # noqa: E402

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
    "ModelFileError",
    "ModelFileNotFound",
    "__version__",
    "gather_inputs",
    "hookimpl",
    "split_outputs",
]
