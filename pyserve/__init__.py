"""pyserve: a Python-native inference server, wire-compatible with Triton Inference Server.

The public API for backend authors is what this module exports (the names of ``pyserve.api``);
everything else is the server's own and may change.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# Backends may fork helper processes from their own threads (Triton's Python backend starts
# a stub per instance) while gRPC's threads are running; gRPC's fork handlers then abort the
# whole process. The children exec at once, so the handlers are not needed. Set before grpc
# is imported; an explicit setting in the environment wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

if TYPE_CHECKING:  # the names are loaded on first use (``__getattr__``), for type checkers here
    from pyserve.api import (
        SEQUENCE_END,
        SEQUENCE_START,
        Backend,
        BackendContext,
        CustomMetrics,
        ErrorCode,
        InferError,
        InferRequest,
        InferResponse,
        InstanceContext,
        ModelContext,
        ModelFileError,
        ModelFileNotFound,
        gather_inputs,
        hookimpl,
        split_outputs,
    )

__version__ = "0.1.0"

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
    "__version__",
    "gather_inputs",
    "hookimpl",
    "split_outputs",
]


def __getattr__(name: str) -> Any:
    """The API's names, imported on first use: ``import pyserve.<module>`` alone (the keeper of
    ``pyserve run``, ``pyserve.handoff.keeper``) does not load numpy and the API with it."""
    if name in __all__ and name != "__version__":
        import pyserve.api

        value = getattr(pyserve.api, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pyserve' has no attribute '{name}'")
