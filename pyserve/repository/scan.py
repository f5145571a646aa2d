"""Reading a Triton model repository from disk: which models exist and which versions.

A repository is a directory of model directories; each holds an optional ``config.pbtxt``
(or, with ``--model-config-name NAME``, ``configs/NAME.pbtxt`` where that exists) and numeric
version directories (names that are not numbers, or that start with ``0`` other than ``0``,
are ignored, as Triton does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from pyserve.api.errors import ModelConfigError

CONFIG_FILENAME = "config.pbtxt"
CUSTOM_CONFIGS_DIRNAME = "configs"
"""The folder of a model directory holding named configs (``configs/<name>.pbtxt``)."""
WARMUP_DIRNAME = "warmup"
"""The folder of a model directory that holds ``input_data_file`` warmup data."""

_UNTRACKED_DIRS = frozenset({"__pycache__"})
"""Folders a backend may write into a model directory; changes there never trigger a reload."""

Fingerprint = tuple[tuple[str, int, int], ...]
"""What a model directory looks like: ``(relative path, mtime_ns, size)`` per file, and
``(relative path/, 0, 0)`` per folder."""


@dataclass(frozen=True)
class ModelSource:
    """A model directory found in a repository.

    :ivar name: the model name (directory name).
    :ivar path: the model directory.
    :ivar repository: the repository it was found in.
    :ivar conflict: set when the same name exists in several repositories; the model then
        cannot be loaded and this says where.
    :ivar config_name: ``--model-config-name``: read ``configs/<config_name>.pbtxt`` when the
        model has one ("" = always ``config.pbtxt``).
    """

    name: str
    path: Path
    repository: Path
    conflict: str | None = None
    config_name: str = ""

    @property
    def config_path(self) -> Path:
        """The config file this model is read from: the named custom config when it exists,
        else ``config.pbtxt`` (which need not exist: auto-complete)."""
        if self.config_name:
            custom = self.path / CUSTOM_CONFIGS_DIRNAME / f"{self.config_name}.pbtxt"
            if custom.is_file():
                return custom
        return self.path / CONFIG_FILENAME


def check_config_name(name: str) -> str:
    """``--model-config-name``: a file name without extension, as Triton takes it.

    :raises ValueError: a name with a path separator, or ``.``/``..``.
    """
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"--model-config-name must be a file name without '.pbtxt' (got {name!r})")
    return name


def scan(repositories: list[Path], config_name: str = "") -> dict[str, ModelSource]:
    """Every model directory in the given repositories, by name (``config_name``: see
    ``ModelSource``).

    :raises ModelConfigError: a repository path does not exist or is not a directory.
    """
    found: dict[str, list[ModelSource]] = {}
    for repo in repositories:
        if not repo.is_dir():
            raise ModelConfigError(f"model repository '{repo}' does not exist or is not a directory")
        for entry in sorted(repo.iterdir()):
            if entry.is_dir() and not entry.name.startswith("."):
                found.setdefault(entry.name, []).append(ModelSource(entry.name, entry, repo, config_name=config_name))
    models: dict[str, ModelSource] = {}
    for name, sources in found.items():
        if len(sources) == 1:
            models[name] = sources[0]
        else:
            where = ", ".join(f"'{s.repository}'" for s in sources)
            models[name] = ModelSource(
                name, sources[0].path, sources[0].repository,
                conflict=f"model name '{name}' is not unique: it exists in repositories {where}",
                config_name=config_name,
            )
    return models


def is_version_number(text: str) -> bool:
    """Whether ``text`` is written as a version number: ASCII digits only (``str.isdigit``
    alone takes '²' or '١', and ``int`` takes ' 1' or '١')."""
    return text.isascii() and text.isdigit()


def version_numbers(model_dir: Path) -> list[int]:
    """The numeric version directories of a model, ascending."""
    versions = []
    for entry in model_dir.iterdir():
        name = entry.name
        if entry.is_dir() and is_version_number(name) and not (name.startswith("0") and len(name) > 1):
            versions.append(int(name))
    return sorted(versions)


def select_versions(policy: object, available: list[int]) -> tuple[list[int], list[str]]:
    """Apply a ``ModelVersionPolicy`` message to the versions on disk.

    :returns: the versions to load, and problems (a ``specific`` version that is missing).
    """
    which = policy.WhichOneof("policy_choice")  # type: ignore[attr-defined]
    if which == "all":
        return list(available), []
    if which == "specific":
        wanted = sorted(set(int(v) for v in policy.specific.versions))  # type: ignore[attr-defined]
        missing = [v for v in wanted if v not in available]
        problems = [f"version {v} named by version_policy.specific does not exist" for v in missing]
        return [v for v in wanted if v in available], problems
    num = int(policy.latest.num_versions) if which == "latest" else 1  # type: ignore[attr-defined]
    return available[-max(num, 1):] if available else [], []


def fingerprint(model_dir: Path) -> Fingerprint:
    """Every file of a model directory with its modification time and size, sorted.

    Poll mode compares fingerprints to notice edited configs, label files, model files and
    added or removed version folders. Hidden names (editor swap files) and ``__pycache__``
    are left out, and folder times are not used, so that a backend writing caches next to
    its model does not cause a reload. An unreadable directory gives an empty fingerprint.
    """
    entries: list[tuple[str, int, int]] = []
    for root, dirs, files in os.walk(model_dir, onerror=lambda _: None):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _UNTRACKED_DIRS)
        base = Path(root).relative_to(model_dir)
        for name in dirs:
            entries.append(((base / name).as_posix() + "/", 0, 0))
        for name in files:
            if name.startswith("."):
                continue
            try:
                info = (Path(root) / name).stat()
            except OSError:  # removed while walking: the next poll sees the result
                continue
            entries.append(((base / name).as_posix(), info.st_mtime_ns, info.st_size))
    return tuple(sorted(entries))


def contained_path(base: Path, relative: str) -> Path:
    """``base / relative``, refusing any path that could leave ``base``.

    Used for the ``file:<path>`` overrides of a load request and for warmup data files.

    :raises ValueError: ``relative`` is empty, absolute, contains ``..`` or a backslash or a
        NUL, or resolves (through a symbolic link) outside ``base``.
    """
    if not relative or "\x00" in relative or "\\" in relative:
        raise ValueError(f"invalid path '{relative}'")
    pure = PurePosixPath(relative)
    if pure.is_absolute() or relative.startswith("/"):
        raise ValueError(f"path '{relative}' is absolute; it must be relative to the model directory")
    if ".." in pure.parts:
        raise ValueError(f"path '{relative}' contains '..'; it must stay inside the model directory")
    parts = [part for part in pure.parts if part != "."]
    if not parts:
        raise ValueError(f"path '{relative}' names the model directory itself, not a file in it")
    target = base.joinpath(*parts)
    root = base.resolve()
    resolved = target.resolve()
    if resolved != root and root not in resolved.parents:
        raise ValueError(f"path '{relative}' leads outside the model directory (through a symbolic link)")
    return target
