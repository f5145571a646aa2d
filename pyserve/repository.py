"""Reading a Triton model repository from disk: which models exist and which versions.

A repository is a directory of model directories; each holds an optional ``config.pbtxt``
and numeric version directories (names that are not numbers, or that start with ``0``,
are ignored, as Triton does).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pyserve.errors import ModelConfigError

CONFIG_FILENAME = "config.pbtxt"


@dataclass(frozen=True)
class ModelSource:
    """A model directory found in a repository.

    :ivar name: the model name (directory name).
    :ivar path: the model directory.
    :ivar repository: the repository it was found in.
    :ivar conflict: set when the same name exists in several repositories; the model then
        cannot be loaded and this says where.
    """

    name: str
    path: Path
    repository: Path
    conflict: str | None = None

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILENAME


def scan(repositories: list[Path]) -> dict[str, ModelSource]:
    """Every model directory in the given repositories, by name.

    :raises ModelConfigError: a repository path does not exist or is not a directory.
    """
    found: dict[str, list[ModelSource]] = {}
    for repo in repositories:
        if not repo.is_dir():
            raise ModelConfigError(f"model repository '{repo}' does not exist or is not a directory")
        for entry in sorted(repo.iterdir()):
            if entry.is_dir() and not entry.name.startswith("."):
                found.setdefault(entry.name, []).append(ModelSource(entry.name, entry, repo))
    models: dict[str, ModelSource] = {}
    for name, sources in found.items():
        if len(sources) == 1:
            models[name] = sources[0]
        else:
            where = ", ".join(f"'{s.repository}'" for s in sources)
            models[name] = ModelSource(
                name, sources[0].path, sources[0].repository,
                conflict=f"model name '{name}' is not unique: it exists in repositories {where}",
            )
    return models


def version_numbers(model_dir: Path) -> list[int]:
    """The numeric version directories of a model, ascending."""
    versions = []
    for entry in model_dir.iterdir():
        name = entry.name
        if entry.is_dir() and name.isdigit() and not (name.startswith("0")):
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
