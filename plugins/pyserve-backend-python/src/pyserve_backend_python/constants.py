"""Triton's numeric constants for Python models (same names and values as Triton)."""

from __future__ import annotations

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
"""Request flag: the request starts a sequence."""
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
"""Request flag: the request ends a sequence."""

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
"""Response flag: this is the last response of the request."""

TRITONSERVER_REQUEST_RELEASE_ALL = 1
"""Release flag: the request is done (the default)."""
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
"""Release flag: give the request back to the scheduler (iterative sequences)."""

TRITONSERVER_MEMORY_CPU = 0
"""Memory type: host memory."""
TRITONSERVER_MEMORY_CPU_PINNED = 1
"""Memory type: pinned host memory."""
TRITONSERVER_MEMORY_GPU = 2
"""Memory type: GPU memory."""
