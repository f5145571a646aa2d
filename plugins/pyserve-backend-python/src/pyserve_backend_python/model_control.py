"""``pb_utils.load_model`` / ``unload_model`` / ``is_model_ready``: model control from a model.

They act on the server that runs the calling model, like its repository API: loading and
unloading need ``--model-control-mode explicit`` (Triton's rule), and both block until done.
Errors are raised as ``TritonModelException`` with the server's message. In process mode the
worker sends each call to the server process, which runs it with ``run_on``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pyserve import InferError
from pyserve_backend_python import context
from pyserve_backend_python.errors import TritonModelException


def _server() -> object:
    try:
        return context.current_server()
    except RuntimeError as exc:
        raise TritonModelException(str(exc)) from None


def load_model(model_name: str, config: str = "", files: Mapping[str, bytes] | None = None) -> None:
    """Load (or reload) ``model_name``; ``config`` is ModelConfig JSON, ``files`` maps
    ``"file:<relative path>"`` to the file's bytes (as the repository load API).

    :raises TritonModelException: not in explicit mode, a bad config or file, or the load failed.
    """
    run_on(_server(), "load", (model_name, config, dict(files or {})))


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload ``model_name`` (and, with ``unload_dependents``, the ensembles using it).

    :raises TritonModelException: not in explicit mode.
    """
    run_on(_server(), "unload", (model_name, unload_dependents))


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    """Whether ``model_name`` (``model_version``, or its latest version) is READY."""
    return bool(run_on(_server(), "ready", (model_name, model_version)))


def run_on(server: Any, operation: str, args: tuple[Any, ...]) -> Any:
    """One model-control call on ``server`` (a ``ServerHandle``): ``load`` (name, config JSON,
    files), ``unload`` (name, unload dependents) or ``ready`` (name, version or ""); what the
    process-mode parent runs for its workers too.

    :raises TritonModelException: the server refused or failed (its message), or an unknown
        operation.
    """
    try:
        if operation == "load":
            name, config, files = args
            parameters: dict[str, object] = {"config": config} if config else {}
            parameters.update(files)
            server.load_model(name, parameters)
            return None
        if operation == "unload":
            server.unload_model(args[0], bool(args[1]))
            return None
        if operation == "ready":
            return bool(server.model_ready(args[0], args[1] or None))
    except InferError as exc:
        raise TritonModelException(exc.message) from None
    raise TritonModelException(f"unknown model control operation '{operation}'")
