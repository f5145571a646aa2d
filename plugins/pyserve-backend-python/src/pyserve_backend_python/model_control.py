"""``pb_utils.load_model`` / ``unload_model`` / ``is_model_ready``: model control from a model.

They act on the server that runs the calling model, like its repository API: loading and
unloading need ``--model-control-mode explicit`` (Triton's rule), and both block until done.
Errors are raised as ``TritonModelException`` with the server's message.
"""

from __future__ import annotations

from collections.abc import Mapping

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
    parameters: dict[str, object] = {}
    if config:
        parameters["config"] = config
    for key, content in (files or {}).items():
        parameters[key] = content
    try:
        _server().load_model(model_name, parameters)  # type: ignore[attr-defined]
    except InferError as exc:
        raise TritonModelException(exc.message) from None


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload ``model_name`` (and, with ``unload_dependents``, the ensembles using it).

    :raises TritonModelException: not in explicit mode.
    """
    try:
        _server().unload_model(model_name, unload_dependents)  # type: ignore[attr-defined]
    except InferError as exc:
        raise TritonModelException(exc.message) from None


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    """Whether ``model_name`` (``model_version``, or its latest version) is READY."""
    return bool(_server().model_ready(model_name, model_version or None))  # type: ignore[attr-defined]
