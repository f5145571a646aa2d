"""What a load request carries besides the model name: a config and the files of an override
model directory (``config`` and ``file:<path>`` parameters), checked and written out privately."""

from __future__ import annotations

import base64
import binascii
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pyserve.api.errors import InferError
from pyserve.repository.scan import contained_path

FILE_PREFIX = "file:"
"""Load parameters named ``file:<path>`` carry a file of an override model directory."""


def parse_load_parameters(name: str, parameters: Mapping[str, Any]) -> tuple[str | None, dict[str, bytes]]:
    """The ``config`` text and ``file:<path>`` contents of a load request.

    :param parameters: the request's parameters: HTTP gives base64 text for files, gRPC
        bytes (``bytes_param``).
    :raises InferError: INVALID_ARG, in Triton's words, for a key that is neither ``config``
        nor ``file:<path>`` and for a ``config`` that is not a string (a gRPC ``bytes_param``
        included, as Triton refuses it); also for a file that is not valid base64.
    """
    for key in parameters:
        if key != "config" and not key.startswith(FILE_PREFIX):
            raise InferError.invalid(f"unrecognized load parameter '{key}'.")
    config = parameters.get("config")
    if config is not None and not isinstance(config, str):
        raise InferError.invalid(
            "invalid value type for load parameter 'config', expected string_param. "
            f"(failed to load '{name}': the 'config' parameter must be a string of ModelConfig JSON)"
        )
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        if not key.startswith(FILE_PREFIX):
            continue
        path = key[len(FILE_PREFIX):]
        if isinstance(value, bytes):
            files[path] = value
        elif isinstance(value, str):
            try:
                files[path] = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise InferError.invalid(
                    f"failed to load '{name}': the content of '{key}' is not valid base64"
                ) from None
        else:
            raise InferError.invalid(f"failed to load '{name}': '{key}' must carry the file content")
    return config, files


NAME_MAX = 255
"""The longest file name (one path component, in bytes) the override directory can hold."""


def _override_problem(relative: str, files: Mapping[str, bytes]) -> str:
    """Why a ``file:<path>`` key cannot be written as a file of the override directory, or ""."""
    if relative.endswith("/"):
        return "the path ends with '/': it must name a file"
    for part in relative.split("/"):
        if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX:
            return f"a path component is longer than {NAME_MAX} bytes"
    parent = relative
    while "/" in parent:
        parent = parent.rsplit("/", 1)[0]
        if parent in files:
            return f"'{FILE_PREFIX}{parent}' is a file, so it cannot also be a directory"
    return ""


def _inside_model_directory(name: str, files: Mapping[str, bytes]) -> dict[str, str]:
    """Each file override's path inside the model directory, by its key's path: a leading
    ``/`` is dropped as Triton, which joins the path to the model directory, reads
    ``file:/1/model.py`` as ``file:1/model.py``.

    :raises InferError: two keys name the same file that way.
    """
    inside: dict[str, str] = {}
    for relative in files:
        path = relative.lstrip("/")
        if path in inside.values():
            raise InferError.invalid(
                f"failed to load '{name}': file overrides '{FILE_PREFIX}{relative}' and "
                f"'{FILE_PREFIX}{next(k for k, v in inside.items() if v == path)}' name the same file"
            )
        inside[relative] = path
    return inside


def write_override(name: str, files: Mapping[str, bytes]) -> Path:
    """Write the files of a load's override model directory into a new private directory.

    :returns: the directory holding ``<name>/`` (removed by the caller when done with it).
    :raises InferError: INVALID_ARG for a model name or a file path that would leave the model
        directory (``..``, through a link; a leading ``/`` is the model directory's), that is
        too long, ends with ``/`` or uses a file as a directory, before anything is written;
        also (still INVALID_ARG, and without the private directory's path) for a file the
        system refuses to write.
    """
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise InferError.invalid(f"failed to load '{name}': invalid model name for a file override")
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        raise InferError.invalid(f"failed to load model: the name is longer than {NAME_MAX} bytes")
    paths = _inside_model_directory(name, files)
    inside = {paths[relative]: content for relative, content in files.items()}
    root = Path(tempfile.mkdtemp(prefix="pyserve-override-"))
    try:
        model_dir = root / name
        model_dir.mkdir()
        targets: list[tuple[str, Path, bytes]] = []
        for relative, content in files.items():
            try:
                problem = _override_problem(paths[relative], inside)
                if problem:
                    raise ValueError(problem)
                targets.append((relative, contained_path(model_dir, paths[relative]), content))
            except ValueError as exc:
                raise InferError.invalid(
                    f"failed to load '{name}': invalid file override '{FILE_PREFIX}{relative}': {exc}"
                ) from None
        for relative, target, content in targets:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                contained_path(model_dir, target.relative_to(model_dir).as_posix())  # no link appeared
                target.write_bytes(content)
            except (OSError, ValueError) as exc:  # the message names no path of this machine
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
                raise InferError.invalid(
                    f"failed to load '{name}': file override '{FILE_PREFIX}{relative}' cannot be written: {reason}"
                ) from None
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root
