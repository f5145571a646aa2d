"""Which server (and model) the Python code running now belongs to.

Triton's ``pb_utils`` functions (BLS ``exec``, metrics) take no server argument: the stub
process has exactly one server. In-process, the backend sets a context variable around every
call into a model (``auto_complete_config``, ``initialize``, ``execute``, ``finalize``, and
coroutines on the instance's event loop), holding the calling model's ``ModelContext``; BLS
uses ``ModelContext.server`` from it. Threads the model starts itself do not inherit context
variables, so for them the server of the most recently entered model is used — correct as long
as one process runs one server, which is the Triton situation.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

from pyserve import ModelContext

_current: contextvars.ContextVar[ModelContext | None] = contextvars.ContextVar(
    "pyserve_python_model", default=None
)
_lock = threading.Lock()
_last_server: Any = None
_process_model: Any = None  # a worker process's one model (``execution_mode: "process"``)


@contextlib.contextmanager
def calling(model: ModelContext) -> Iterator[None]:
    """Mark ``model`` as the caller for the code run inside the ``with`` block."""
    token = enter(model)
    try:
        yield
    finally:
        leave(token)


def enter(model: ModelContext) -> contextvars.Token[ModelContext | None]:
    """``calling(model)`` without the context manager, for the per-execute hot path: hand the
    returned token to ``leave`` in a ``finally``."""
    remember(model)
    return _current.set(model)


def leave(token: contextvars.Token[ModelContext | None]) -> None:
    """Undo ``enter``."""
    _current.reset(token)


def remember(model: ModelContext) -> None:
    """Record the model's server as the fallback for threads without a context."""
    global _last_server
    server = model.server
    if server is not None and server is not _last_server:  # per execute: skip the lock when unchanged
        with _lock:
            _last_server = server


def set_current(model: ModelContext) -> None:
    """Set the caller for the rest of this thread's context (event-loop threads)."""
    remember(model)
    _current.set(model)


def current_model() -> ModelContext | None:
    """The model whose code is running now, if known."""
    return _current.get()


def set_process_model(model: Any) -> None:
    """A worker process serves this one model: ``process_model`` answers it in every thread."""
    global _process_model
    _process_model = model


def process_model() -> Any:
    """The model of this worker process (``set_process_model``), or None in the server."""
    return _process_model


def current_server() -> Any:
    """The ``pyserve.dataplane.bls.ServerHandle`` to send BLS requests to.

    :raises RuntimeError: no server is known (code running outside a served model).
    """
    model = _current.get()
    server = model.server if model is not None else None
    if server is None:
        server = _last_server
    if server is None:
        raise RuntimeError("no running pyserve server is known to this thread; BLS requests can "
                           "only be made by a model the server runs")
    return server
