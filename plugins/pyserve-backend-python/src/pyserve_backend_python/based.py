"""Python-based backends: ``<backend-directory>/<name>/model.py`` serving ``backend: "<name>"``.

As in Triton, a model whose backend has no ``libtriton_<name>.so`` is served by the
``model.py`` in the backend's folder of ``--backend-directory`` when there is one (Triton's
vLLM backend is one): the Python backend runs that file for every model of the backend, each
model's version folder holds only its own settings (``pb_utils.get_model_dir()`` points there,
e.g. at a ``model.json``), and the backend's folder is on ``sys.path`` while it runs.

``resolver`` is the server plugin (entry-point group ``pyserve.plugins``) that finds such a
file; each backend folder gets one ``PythonBasedBackend``, which hands every lifecycle hook to
the Python backend's own, with the model served by that file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyserve_backend_python as python_backend
from pyserve import BackendContext, InferRequest, InstanceContext, ModelContext
from pyserve_backend_python import loader
from pyserve_hookspecs import hookimpl

DEFAULT_BACKEND_DIRECTORY = "/opt/tritonserver/backends"
"""Triton's ``--backend-directory`` when none is given."""

RUNTIME = "model.py"


class PythonBasedBackend:
    """The backend of one ``<backend-directory>/<name>/`` folder: the Python backend, running
    its ``model.py`` for each model. Thread-safety and return values: the Python backend's.

    :param runtime: the folder's ``model.py``.
    """

    def __init__(self, runtime: Path) -> None:
        self.runtime = runtime

    def _serve(self, model: Any) -> None:
        loader.use_runtime_file(model, self.runtime)

    @hookimpl
    def pyserve_backend_fork_safe(self, backend: BackendContext) -> bool:
        return python_backend.pyserve_backend_fork_safe(backend)

    @hookimpl
    def pyserve_backend_initialize(self, backend: BackendContext) -> None:
        python_backend.pyserve_backend_initialize(backend)

    @hookimpl
    def pyserve_model_auto_complete(self, model: ModelContext) -> bool | None:
        self._serve(model)
        return python_backend.pyserve_model_auto_complete(model)

    @hookimpl
    def pyserve_model_validate(self, model: ModelContext) -> list[str]:
        self._serve(model)
        return python_backend.pyserve_model_validate(model)

    @hookimpl
    def pyserve_model_create(self, model: ModelContext) -> Any:
        self._serve(model)
        return python_backend.pyserve_model_create(model)

    @hookimpl
    def pyserve_model_finalize(self, model: ModelContext) -> None:
        python_backend.pyserve_model_finalize(model)

    @hookimpl
    def pyserve_instance_create(self, instance: InstanceContext) -> Any:
        return python_backend.pyserve_instance_create(instance)

    @hookimpl
    def pyserve_instance_finalize(self, instance: InstanceContext) -> None:
        python_backend.pyserve_instance_finalize(instance)

    @hookimpl
    def pyserve_execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> Any:
        return python_backend.pyserve_execute(instance=instance, requests=requests)

    @hookimpl
    def pyserve_instance_ready(self, instance: InstanceContext) -> bool:
        return python_backend.pyserve_instance_ready(instance)


def _native_library_placed(name: str, model_path: Path | None, version_paths: Sequence[Path], folder: Path) -> bool:
    """Whether a ``libtriton_<name>.so`` sits where Triton looks first (it wins, as in Triton)."""
    library = f"libtriton_{name}.so"
    places = [*version_paths, *([model_path] if model_path is not None else []), folder]
    return any((place / library).is_file() for place in places)


class PythonBasedResolver:
    """The server plugin offering ``<backend-directory>/<name>/model.py`` as backend ``name``."""

    def __init__(self) -> None:
        self._backends: dict[Path, PythonBasedBackend] = {}

    @hookimpl
    def pyserve_resolve_backend(
        self,
        name: str,
        runtime: str,
        model_path: Path | None,
        version_paths: list[Path],
        backend_directory: str | None,
    ) -> tuple[str, object] | None:
        if not name or name == "python" or runtime not in ("", RUNTIME) or "/" in name or name in (".", ".."):
            return None
        folder = Path(backend_directory or DEFAULT_BACKEND_DIRECTORY) / name
        file = folder / RUNTIME
        if not file.is_file() or _native_library_placed(name, model_path, version_paths, folder):
            return None
        resolved = file.resolve()
        backend = self._backends.get(resolved)
        if backend is None:
            backend = self._backends.setdefault(resolved, PythonBasedBackend(resolved))
        return f"python-based:{resolved.parent}", backend


resolver = PythonBasedResolver()
"""The instance registered through the ``pyserve.plugins`` entry point."""
