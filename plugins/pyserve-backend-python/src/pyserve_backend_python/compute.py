"""Whether a Python model may be declared compute-only (``ModelContext.compute_only``).

A compute-only model's short executes may run on the server's event loop while one client
alone sends requests (``pyserve.runtime.scheduling.adaptive``): that saves the two thread hand-offs
that cost more than a small ``execute`` does. The server times the executes and keeps slow
ones on the instance threads, so what must be ruled out here is what cannot run on the loop
at all, or waits for something else than its own computation:

* ``execution_mode: "process"`` and ``EXECUTION_ENV_PATH`` models execute in a worker process;
* decoupled models answer through a response sender, often from threads of their own;
* an ``async def execute`` waits on its own event loop;
* BLS calls and model control from ``execute`` (``InferenceRequest(...).exec()``,
  ``async_exec``, ``load_model`` / ``unload_model``) block on the server's loop, which refuses
  them there; a model whose Python files (``model.py`` and the helper files beside it) mention
  them is never declared compute-only.

Config parameter ``pyserve_inline_execute`` still decides for any model that sets it
(``"false"`` keeps the threads).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import ModuleType

from pyserve import ModelContext
from pyserve_backend_python.loader import MODEL_CLASS, code_directory

CALLS_THE_SERVER = ("exec(", "async_exec", "InferenceRequest(", "load_model(", "unload_model(")
"""Source text meaning the model calls the server (BLS or model control) from its code."""

_MAX_SOURCE_BYTES = 4 * 1024 * 1024
"""Python files larger than this are not read (the model is then not declared compute-only)."""


KEEPS_COUNTS = ("MetricFamily",)
"""Source text meaning the model keeps custom metrics (shown only by the process that counts)."""


def mentions(version_path: Path, markers: tuple[str, ...]) -> str | None:
    """The first of ``markers`` that a ``.py`` file in the model's version directory
    (recursively) mentions, or None; ``"?"`` when a file cannot be read (assume the worst)."""
    for path in sorted(version_path.rglob("*.py")):
        try:
            if path.stat().st_size > _MAX_SOURCE_BYTES:
                return "?"
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "?"
        for marker in markers:
            if marker in text:
                return marker
    return None


def calls_the_server(version_path: Path) -> bool:
    """Whether the model's Python files mention BLS or model control (``CALLS_THE_SERVER``)."""
    return mentions(version_path, CALLS_THE_SERVER) is not None


def single_process_reason(model: ModelContext) -> str:
    """``ModelContext.single_process_reason`` of a thread-mode model: what in its files ties it
    to the process holding every model (BLS, model control, custom metrics), or ""."""
    marker = mentions(code_directory(model), CALLS_THE_SERVER + KEEPS_COUNTS)
    if marker is None:
        return ""
    if marker == "?":
        return "a Python file of the model cannot be read (it may call the server)"
    what = "keeps custom metrics" if marker in KEEPS_COUNTS else "calls the server (BLS or model control)"
    return f"its Python files use '{marker.rstrip('(')}': it {what}"


def only_computes(model: ModelContext, module: ModuleType | None, execution_mode: str) -> bool:
    """Whether ``model`` (its module imported, thread mode) may be declared compute-only."""
    if module is None or execution_mode != "thread":
        return False
    if model.config.model_transaction_policy.decoupled:
        return False
    execute = getattr(getattr(module, MODEL_CLASS, None), "execute", None)
    if execute is None or inspect.iscoroutinefunction(execute):
        return False
    return not calls_the_server(code_directory(model))
