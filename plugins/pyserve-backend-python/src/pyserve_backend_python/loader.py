"""Importing a model's ``model.py`` as its own module.

Each model version gets a fresh module with a unique name, so two models whose files are both
called model.py never share globals. The module sits in a package of its own whose path is the
version directory (``_pyserve_python_model_<n>_<name>_<version>.model``), as Triton imports it
as ``<version>.model``: relative imports (``from . import utils``, ``from .utils import f``)
find the files next to model.py. While the file runs
(and while ``initialize`` runs, see ``model_path_scope``), the version directory and the model
directory are at the front of ``sys.path``, as Triton's stub puts them, so the model can
import helper modules that sit next to it. Helper modules imported from the model directory
are then taken out of ``sys.modules`` again, so another model's ``utils.py`` does not resolve
to this one's; the model keeps its references to them. The model's own file is importable by
its name at any time (``import model``, as Triton's test models use it): see ``alias``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import re
import sys
import threading
import traceback
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from pyserve import ModelContext, ModelFileError, ModelFileNotFound
from pyserve_backend_python import alias

DEFAULT_MODEL_FILENAME = "model.py"
MODEL_CLASS = "TritonPythonModel"

_PREFIX = "_pyserve_python_model_"
_counter = itertools.count(1)
_import_lock = threading.RLock()


class PythonModelError(Exception):
    """A model.py could not be loaded or its ``TritonPythonModel`` failed; the message holds
    the Python traceback."""


class ModelFileProblem(PythonModelError, ModelFileError):
    """The model file itself does not import (a ``SyntaxError``, an import that fails, an
    exception at module level) or defines no ``TritonPythonModel``: the server reports the
    message as it is (``pyserve.ModelFileError``)."""


class ModelFileMissing(ModelFileProblem, ModelFileNotFound):
    """The version has no model file."""


_runtime_files: dict[int, Path] = {}
"""Model (by id) → the ``model.py`` of its Python-based backend (``based``), while it lives."""


def use_runtime_file(model: Any, path: Path) -> None:
    """Serve ``model`` with the ``model.py`` at ``path`` (a Python-based backend's, in the
    backend directory) instead of a file of its version directory."""
    key = id(model)
    if key not in _runtime_files:
        weakref.finalize(model, _runtime_files.pop, key, None)
    _runtime_files[key] = path


def runtime_file(model: Any) -> Path | None:
    """The Python-based backend's ``model.py`` serving ``model``, or None."""
    return _runtime_files.get(id(model))


def model_file(model: ModelContext) -> Path:
    """The Python file of a model version (``default_model_filename``, else model.py), or
    the ``model.py`` of its Python-based backend."""
    runtime = _runtime_files.get(id(model))
    if runtime is not None:
        return runtime
    return model.version_path / (model.config.default_model_filename or DEFAULT_MODEL_FILENAME)


def code_directory(model: ModelContext) -> Path:
    """Where the model's own Python code is: its version directory, or its Python-based
    backend's directory."""
    runtime = _runtime_files.get(id(model))
    return runtime.parent if runtime is not None else model.version_path


def check_source(model: ModelContext, compile_it: bool = True) -> list[str]:
    """What keeps the model file of a version from importing, found without running it: the
    file is missing, or (``compile_it``) it does not compile. One line per problem, naming the
    file (and the line of a ``SyntaxError``)."""
    path = model_file(model)
    if not path.is_file():
        return [f"model file '{path}' not found"]
    if not compile_it:
        return []
    try:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:  # IndentationError and TabError too
        where = f"{exc.filename or path}:{exc.lineno}" if exc.lineno else str(exc.filename or path)
        return [f"{where}: {type(exc).__name__}: {exc.msg}"]
    except (OSError, ValueError) as exc:  # unreadable, or NUL bytes in the source
        return [f"model file '{path}' cannot be compiled: {exc}"]
    return []


@contextlib.contextmanager
def model_path_scope(model: ModelContext) -> Iterator[None]:
    """Put the model's version and model directories on ``sys.path`` for the block, then
    forget the helper modules imported from them (see the module docstring)."""
    entries = [str(model.version_path), str(model.path)]
    runtime = _runtime_files.get(id(model))
    if runtime is not None:  # as Triton's stub, the backend's directory too
        entries.append(str(runtime.parent))
    before = set(sys.modules)
    for entry in reversed(entries):
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        for entry in entries:
            with contextlib.suppress(ValueError):
                sys.path.remove(entry)
        root = model.path.resolve()
        for name in set(sys.modules) - before:
            module = sys.modules.get(name)
            origin = getattr(module, "__file__", None)
            if origin and _is_within(Path(origin), root) and not name.startswith(_PREFIX):
                sys.modules.pop(name, None)


def _is_within(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root)
    except (ValueError, OSError):
        return False
    return True


def load_module(model: ModelContext) -> ModuleType:
    """Import the model version's file as a new module.

    :raises PythonModelError: the file is missing, fails to import (the message has the
        traceback), or defines no ``TritonPythonModel`` class.
    """
    path = model_file(model)
    if not path.is_file():
        raise ModelFileMissing(f"Failed to preinitialize Python stub: Python model file not found in '{path}'")
    safe = re.sub(r"\W", "_", model.name)
    package_name = f"{_PREFIX}{next(_counter)}_{safe}_{model.version}"
    package = ModuleType(package_name)
    package.__path__ = [str(path.parent)]  # relative imports of the model find its neighbours
    package.__package__ = package_name
    module_name = package_name + "." + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ModelFileProblem(f"model '{model.name}': cannot import '{path}'")
    module = importlib.util.module_from_spec(spec)
    sys.modules[package_name] = package
    sys.modules[module_name] = module  # dataclasses, pickle and typing look modules up by name
    try:
        with _import_lock, model_path_scope(model):
            spec.loader.exec_module(module)
    except BaseException as exc:
        unload_module(module)
        if not isinstance(exc, Exception):
            raise
        raise ModelFileProblem(
            format_failure(f"failed to load '{path.name}' of model '{model.name}' version {model.version}", exc)
        ) from None
    if not isinstance(getattr(module, MODEL_CLASS, None), type):
        unload_module(module)
        raise ModelFileProblem(f"'{path.name}' of model '{model.name}' defines no class '{MODEL_CLASS}'")
    alias.register(model, module)
    return module


def unload_module(module: ModuleType) -> None:
    """Forget a model module, its package and the modules it imported relatively (model finalize)."""
    package_name = module.__name__.rpartition(".")[0]
    if not package_name.startswith(_PREFIX):
        return
    alias.forget(module)
    names = list(sys.modules)  # one copy: other threads may import meanwhile
    for name in names:
        if name == package_name or name.startswith(package_name + "."):
            sys.modules.pop(name, None)


_OWN_DIR = str(Path(__file__).resolve().parent)


def format_failure(what: str, exc: BaseException) -> str:
    """``what`` plus the traceback of ``exc`` (for UNAVAILABLE reasons), without the frames of
    this backend and of importlib, so that it shows the model's own code."""
    frames = [
        frame for frame in traceback.extract_tb(exc.__traceback__)
        if not frame.filename.startswith(_OWN_DIR) and not frame.filename.startswith("<frozen importlib")
    ]
    text = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(type(exc), exc))
    return f"{what}:\nTraceback (most recent call last):\n{text}".rstrip()
