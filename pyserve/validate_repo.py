"""``pyserve validate``: every problem in a model repository, without loading any model.

Checks what can be checked without importing a backend: config syntax and fields,
normalization, the version directories and policy, label files, and whether the backend a
model names is installed.
"""

from __future__ import annotations

from pathlib import Path

from pyserve import model_config
from pyserve.errors import ModelConfigError
from pyserve.plugins import PluginHost
from pyserve.repository import scan, select_versions, version_numbers


def validate_repositories(repositories: list[Path], host: PluginHost | None = None, config_name: str = "") -> list[str]:
    """One line per problem, each starting with the model name and the file it is about
    (``config_name``: ``--model-config-name``, as ``pyserve run`` reads the configs)."""
    host = host if host is not None else PluginHost()
    problems: list[str] = []
    try:
        sources = scan(repositories, config_name)
    except ModelConfigError as exc:
        return [str(exc)]
    if not sources:
        return [f"{', '.join(str(r) for r in repositories)}: no model directories found"]
    for name, source in sorted(sources.items()):
        if source.conflict:
            problems.append(f"{name}: {source.conflict}")
            continue
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
        versions = version_numbers(source.path)
        selected, policy_problems = select_versions(config.version_policy, versions)
        problems.extend(f"{name}: {path}: {p}" for p in policy_problems)
        if not versions:
            problems.append(f"{name}: {source.path}: no version directory (a numeric folder such as '1')")
        if config.platform == model_config.ENSEMBLE_PLATFORM:
            for index, step in enumerate(config.ensemble_scheduling.step):
                if step.model_name not in sources:
                    problems.append(
                        f"{name}: {path}: ensemble step {index} names model '{step.model_name}', "
                        "which is not in the repository"
                    )
        elif not host.is_installed(config.backend):
            problems.append(
                f"{name}: {path}: backend '{config.backend}' is not installed "
                f"(pip install pyserve-backend-{config.backend})"
            )
    return problems
