"""Triton's ``EXECUTION_ENV_PATH``: a model's own Python environment.

The model config parameter names a conda-pack archive (``.tar.gz``, ``.tgz``, ``.tar``, any
compression ``tarfile`` reads) or an unpacked environment directory; a leading
``$$TRITON_MODEL_DIRECTORY`` is the model's directory. An archive is unpacked once per model
version into a temporary directory, removed when the version is unloaded.

Such a model runs in ``execution_mode: "process"``: its worker processes are started with the
environment's ``bin/python``, whose own packages come first on the worker's ``sys.path``; the
server's import paths follow them, so the worker finds pyserve and whatever the environment
lacks. The environment's Python must therefore be the server's version (major.minor): the
worker runs pyserve's code and may import the server's compiled packages. Everything here runs
on the loading thread (model load), never on the event loop.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pyserve_backend_python.loader import PythonModelError

PARAMETER = "EXECUTION_ENV_PATH"
"""The model config parameter (Triton's name)."""
MODEL_DIRECTORY = "$$TRITON_MODEL_DIRECTORY"
"""A value starting with this starts at the model's directory (as in Triton)."""
VERSION_TIMEOUT_S = 30.0
"""How long the environment's interpreter may take to report its version."""


@dataclass(frozen=True)
class ExecutionEnvironment:
    """An unpacked environment a model's workers run in.

    :ivar configured: the parameter's value, ``$$TRITON_MODEL_DIRECTORY`` expanded (for
        messages); for a requirements environment, what it was made from.
    :ivar root: the environment's directory.
    :ivar python: its interpreter, which the worker processes are started with.
    :ivar unpacked: ``root`` is a temporary directory this backend unpacked (``close`` removes it).
    :ivar source: what asked for it: ``EXECUTION_ENV_PATH``, or ``requirements`` (a cached
        environment made from a requirements file: ``pyserve_backend_python.requirements``).
    """

    configured: str
    root: Path
    python: Path
    unpacked: bool
    source: str = PARAMETER

    @property
    def described(self) -> str:
        """How messages name it: ``EXECUTION_ENV_PATH '<path>'`` or what it was made from."""
        return f"{PARAMETER} '{self.configured}'" if self.source == PARAMETER else self.configured

    def close(self) -> None:
        """Remove the unpacked copy (an environment directory given as such is left alone)."""
        if self.unpacked:
            shutil.rmtree(self.root, ignore_errors=True)


def configured_path(parameters: Mapping[str, str], model_path: Path) -> str | None:
    """The parameter's value with ``$$TRITON_MODEL_DIRECTORY`` expanded, or None when unset."""
    value = (parameters.get(PARAMETER) or "").strip()
    if not value:
        return None
    if value.startswith(MODEL_DIRECTORY):
        value = str(model_path) + value[len(MODEL_DIRECTORY):]
    return value


def prepare(model_name: str, value: str) -> ExecutionEnvironment:
    """Unpack (if an archive) and check the environment ``value`` names.

    :raises PythonModelError: the path does not exist, the archive cannot be read, there is no
        ``bin/python``, or its Python version is not the server's.
    """
    what = f"model '{model_name}': {PARAMETER} '{value}'"
    path = Path(value)
    if path.is_dir():
        root, unpacked = path, False
    elif path.is_file():
        root, unpacked = _unpack(what, path, model_name), True
    else:
        raise PythonModelError(f"{what} is neither a directory nor an archive file")
    try:
        python = _interpreter(what, root)
        _check_version(what, python)
    except PythonModelError:
        if unpacked:
            shutil.rmtree(root, ignore_errors=True)
        raise
    return ExecutionEnvironment(value, root, python, unpacked)


def _unpack(what: str, archive: Path, model_name: str) -> Path:
    target = Path(tempfile.mkdtemp(prefix=f"pyserve-env-{_safe(model_name)}-"))
    try:
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "tar_filter"):
                # "tar", not "data": a packed environment's links may point outside it (e.g. a
                # venv's bin/python to its base interpreter); members cannot land outside it
                tar.extractall(target, filter="tar")
            else:  # Python before 3.10.12 / 3.11.4: the same member check by hand
                for member in tar.getmembers():
                    if member.name.startswith("/") or ".." in Path(member.name).parts:
                        raise tarfile.TarError(f"member '{member.name}' would land outside the target")
                tar.extractall(target)
    except (tarfile.TarError, OSError) as exc:
        shutil.rmtree(target, ignore_errors=True)
        raise PythonModelError(f"{what} cannot be unpacked: {exc}") from None
    return target


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40]


def _interpreter(what: str, root: Path) -> Path:
    for name in ("python3", "python"):
        candidate = root / "bin" / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise PythonModelError(f"{what} has no bin/python3 or bin/python")


def _check_version(what: str, python: Path) -> None:
    wanted = f"{sys.version_info.major}.{sys.version_info.minor}"
    try:
        done = subprocess.run(
            [str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True, timeout=VERSION_TIMEOUT_S, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PythonModelError(f"{what}: its bin/python cannot be run: {exc}") from None
    found = done.stdout.strip()
    if done.returncode != 0:
        raise PythonModelError(f"{what}: its bin/python failed: {done.stderr.strip()[-500:]}")
    if found != wanted:
        raise PythonModelError(
            f"{what} holds Python {found}, but pyserve runs on Python {wanted}: the model's worker "
            "runs pyserve's own code, so the environment needs the server's Python version"
        )
