"""``pyserve validate``: every problem in a model repository, without loading any model.

Checks what can be checked without loading a model: config syntax and fields, normalization,
the version directories and policy, label files, whether the backend a model names is
installed, and each ensemble's steps against the configs of the models they name (the same plan
check the server runs when it loads the ensemble). Then each backend is asked what it can tell
about its models without loading them (``pyserve_model_validate``: the Python backend compiles
model.py and checks that its requirements resolve, the framework backends check that the
model file they would load is there).

A config may leave its inputs and outputs out when its backend auto-completes configs (as
``pyserve run`` lets backends do unless ``--disable-auto-complete-config``; to know whether it
does, the backend's plugin module is imported, never the model or its framework). Such a
model's tensors are only known once it is loaded, so ensembles naming it are not checked;
neither are ensembles naming a model whose own config has problems (those are reported under
that model's name). A config that declares tensors is taken as complete.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyserve.api.backend import BackendContext, ModelContext
from pyserve.api.errors import ErrorCode, InferError, ModelConfigError
from pyserve.host.plugins import BackendUnavailable, PluginHost
from pyserve.repository import model_config
from pyserve.repository.ensemble_plan import build_plan
from pyserve.repository.scan import scan, select_versions, version_numbers


@dataclass(frozen=True)
class _CheckedModel:
    """A model whose config passed every check: what an ensemble step is checked against."""

    config: Any
    path: Path
    versions: list[int]
    tensors_known: bool
    """False when auto-complete will fill in inputs or outputs the config leaves out."""


@dataclass(frozen=True)
class _StepTables:
    """What ``build_plan`` reads of a step model: its tensor tables and transaction policy."""

    io: model_config.ModelIO
    decoupled: bool = False


class _Unknowable(Exception):
    """A step model's tensors are not known before loading it."""


def validate_repositories(
    repositories: list[Path], host: PluginHost | None = None, config_name: str = "", auto_complete: bool = True,
    backend_config: Mapping[str, Mapping[str, str]] | None = None,
) -> list[str]:
    """One line per problem, each starting with the model name and the file it is about.

    :param config_name: ``--model-config-name``, as ``pyserve run`` reads the configs.
    :param auto_complete: as ``pyserve run`` without ``--disable-auto-complete-config``: a
        config may leave its tensors to a backend that auto-completes configs.
    :param backend_config: ``--backend-config`` settings per backend (``""``: every backend),
        given to the backends' ``pyserve_model_validate``.
    """
    host = host if host is not None else PluginHost()
    problems: list[str] = []
    try:
        sources = scan(repositories, config_name)
    except ModelConfigError as exc:
        return [str(exc)]
    if not sources:
        return [f"{', '.join(str(r) for r in repositories)}: no model directories found"]
    checked: dict[str, _CheckedModel] = {}
    for name, source in sorted(sources.items()):
        if source.conflict:
            problems.append(f"{name}: {source.conflict}")
            continue
        before = len(problems)
        path = source.config_path
        try:
            if path.is_file():
                config = model_config.parse_config(path.read_text(encoding="utf-8"), path)
            else:
                problems.append(f"{name}: {path}: file not found (the server can only serve this model "
                                "if its backend auto-completes the config)")
                continue
            model_config.normalize(config, source.path, host.platform_backend, path)
        except (ModelConfigError, UnicodeDecodeError) as exc:
            problems.append(f"{name}: {exc}")
            continue
        problems.extend(f"{name}: {path}: {p}" for p in model_config.validate(config, source.path))
        tensors_known = bool(config.input or config.output) or not (auto_complete and _completes_configs(host, config))
        versions = version_numbers(source.path)
        selected, policy_problems = select_versions(config.version_policy, versions)
        problems.extend(f"{name}: {path}: {p}" for p in policy_problems)
        if not versions:
            problems.append(f"{name}: {source.path}: no version directory (a numeric folder such as '1')")
        problems.extend(_missing_parts(host, name, path, config, sources))
        if len(problems) == before:
            checked[name] = _CheckedModel(config, source.path, selected, tensors_known)
            if config.platform != model_config.ENSEMBLE_PLATFORM:
                problems.extend(_backend_problems(host, name, config, source.path, selected, backend_config or {}))
    for name, model in sorted(checked.items()):
        if model.config.platform == model_config.ENSEMBLE_PLATFORM:
            problems.extend(f"{name}: {sources[name].config_path}: invalid ensemble: {p}"
                            for p in _ensemble_problems(model, checked))
    return problems


def _missing_parts(host: PluginHost, name: str, path: Path, config: Any, sources: Mapping[str, Any]) -> list[str]:
    """What the model needs that is not there: an ensemble's step models in the repository,
    another model's backend installed."""
    if config.platform != model_config.ENSEMBLE_PLATFORM:
        if host.is_installed(config.backend):
            return []
        return [f"{name}: {path}: backend '{config.backend}' is not installed "
                f"(pip install pyserve-backend-{config.backend.replace('_', '-')})"]
    return [
        f"{name}: {path}: ensemble step {index} names model '{step.model_name}', which is not in the repository"
        for index, step in enumerate(config.ensemble_scheduling.step) if step.model_name not in sources
    ]


def _backend_problems(host: PluginHost, name: str, config: Any, path: Path, versions: list[int],
                      backend_config: Mapping[str, Mapping[str, str]]) -> list[str]:
    """What the model's backend says about each selected version (``pyserve_model_validate``)."""
    try:
        backend = host.backend(config.backend)
    except BackendUnavailable as exc:
        return [f"{name}: backend '{config.backend}' cannot be imported: {exc}"]
    settings = {**backend_config.get("", {}), **backend_config.get(config.backend, {})}
    context = BackendContext(name=config.backend, config=settings)
    found: list[str] = []
    for version in versions:
        model = ModelContext(name=name, version=version, config=config, path=path, backend=context,
                             parameters=model_config.parameters(config))
        try:
            answers = backend.hooks.model_validate(model=model)
        except Exception as exc:  # noqa: BLE001 - a backend's bug is reported, the check goes on
            found.append(f"{name}: version {version}: backend '{config.backend}' could not check it: "
                         f"{type(exc).__name__}: {exc}")
            continue
        for answer in answers:
            found.extend(f"{name}: version {version}: {line}" for line in answer or ())
    return found


def _completes_configs(host: PluginHost, config: Any) -> bool:
    """Whether the model's backend implements auto-complete (imports its plugin module only)."""
    if config.platform == model_config.ENSEMBLE_PLATFORM or not host.is_installed(config.backend):
        return False
    try:
        return host.backend(config.backend).hooks.completes_configs
    except BackendUnavailable:
        return False


def _ensemble_problems(ensemble: _CheckedModel, checked: dict[str, _CheckedModel]) -> list[str]:
    """What the server's plan check would say when loading ``ensemble``; ``[]`` when it cannot
    be known before loading."""

    def lookup(step_name: str, version: int | None) -> Any:
        step = checked.get(step_name)
        if step is None or not step.tensors_known:
            raise _Unknowable(step_name)
        if version is not None and version not in step.versions:
            served = ", ".join(map(str, step.versions)) or "none"
            raise InferError(f"version {version} of model '{step_name}' is not served "
                             f"(its version policy serves: {served})", ErrorCode.NOT_FOUND)
        return _StepTables(model_config.model_io(step.config, step.path),
                           bool(step.config.model_transaction_policy.decoupled))

    try:
        build_plan(ensemble.config, model_config.model_io(ensemble.config, ensemble.path), lookup)
    except _Unknowable:
        return []
    except ValueError as exc:
        return str(exc).splitlines()
    return []
