"""pyserve-backend-native: host Triton's native backends (``libtriton_<name>.so``) in pyserve.

A server plugin (entry-point group ``pyserve.plugins``) implementing
``pyserve_resolve_backend``: for every model with a ``backend`` it looks for the library where
Triton does (version folder, model folder, ``--backend-directory``; the config's ``runtime``
when it names a ``.so``) and, when one is there, serves the model with it through pyserve's
TRITON API shim (TRITONBACKEND API 1.19, TRITONSERVER API 1.34), even where a Python backend
of the same name is installed (as in Triton, the library the user placed wins).

Importing this package is cheap: the shim is compiled (gcc) and loaded only when a model
first needs a native backend.
"""

from __future__ import annotations

from pathlib import Path

from pyserve_backend_native import loader
from pyserve_backend_native._build import include_dir
from pyserve_backend_native.loader import BACKEND_API_VERSION, SERVER_API_VERSION, BackendLoadError
from pyserve_hookspecs import hookimpl

__all__ = [
    "BACKEND_API_VERSION",
    "SERVER_API_VERSION",
    "BackendLoadError",
    "NativeBackendResolver",
    "include_dir",
    "metrics_text",
    "resolver",
]


class NativeBackendResolver:
    """The server plugin: finds a model's backend library and offers it as a pyserve backend."""

    @hookimpl
    def pyserve_resolve_backend(
        self,
        name: str,
        runtime: str,
        model_path: Path | None,
        version_paths: list[Path],
        backend_directory: str | None,
    ) -> tuple[str, object] | None:
        path = loader.find_library(name, runtime, model_path, list(version_paths), backend_directory)
        if path is None:
            if runtime.endswith(".so"):
                places = ", ".join(
                    str(p) for p in loader.candidates(name, runtime, model_path, list(version_paths), backend_directory)
                )
                raise BackendLoadError(f"backend '{name}': runtime library '{runtime}' not found (looked in: {places})")
            return None
        library = loader.load_library(path)
        from pyserve_backend_native.native_backend import NativeBackend

        return f"native:{library.path}", NativeBackend(library, name, backend_directory)


resolver = NativeBackendResolver()
"""The instance registered through the ``pyserve.plugins`` entry point."""


def metrics_text() -> str:
    """Custom metrics the native backends created, in Prometheus text format."""
    from pyserve_backend_native import _api

    return _api.metrics_text()
