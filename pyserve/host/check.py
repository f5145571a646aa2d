"""``pyserve backends --check``: import every installed backend and check it against the contract.

Unlike the rest of ``pyserve backends`` (and the server's startup) this imports the backends.
For each one it reports, naming the distribution and the hook:

* the import failing, or the entry point naming neither a module, a ``Backend`` instance nor
  a ``Backend`` subclass;
* unknown hooks: functions or methods named ``pyserve_*`` that are no hookspec (a typo such
  as ``pyserve_exectue`` would otherwise be ignored silently);
* hooks without the ``@pyserve.hookimpl`` marker (pluggy ignores them);
* server-plugin hooks (``pyserve_model_ready``...) in a backend, where they are never called;
* required hooks missing: ``pyserve_execute`` (for a ``Backend`` subclass: ``execute`` not
  overridden);
* wrong signatures: arguments the hookspec does not have (the server could not pass them);
* whatever pluggy itself refuses when the plugin is registered in a ``PluginHost``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pyserve.api.backend import Backend
from pyserve.host.plugins import BackendInfo, BackendUnavailable, PluginHost
from pyserve_hookspecs import PROJECT_NAME, SPEC_MODULES, lifecycle

REQUIRED_HOOKS = ("pyserve_execute",)
"""Hooks every backend must implement."""

_IMPL_ATTR = f"{PROJECT_NAME}_impl"
_SPEC_ATTR = f"{PROJECT_NAME}_spec"
_PREFIX = f"{PROJECT_NAME}_"


@dataclass(frozen=True)
class Problem:
    """One way an installed backend breaks the plugin contract.

    :ivar backend: the backend name.
    :ivar distribution: the distribution providing it (``"<registered>"`` for programmatic ones).
    :ivar hook: the hook concerned, or ``None`` for the backend as a whole.
    :ivar message: what is wrong, for a person.
    """

    backend: str
    distribution: str
    hook: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.distribution}: backend '{self.backend}'"
        return f"{where}: {self.hook}: {self.message}" if self.hook else f"{where}: {self.message}"


def hookspecs() -> dict[str, inspect.Signature]:
    """Every hook name → its spec's signature (lifecycle and server hooks)."""
    specs: dict[str, inspect.Signature] = {}
    for module in SPEC_MODULES:
        for name, func in inspect.getmembers(module, inspect.isfunction):
            if hasattr(func, _SPEC_ATTR):
                specs[name] = inspect.signature(func)
    return specs


def check_installed(
    host: PluginHost | None = None, names: Iterable[str] | None = None
) -> tuple[list[BackendInfo], list[Problem]]:
    """Import and check every installed backend (or only ``names``).

    :returns: the backends checked and every problem found (empty when all are fine).
    """
    host = host if host is not None else PluginHost()
    wanted = set(names) if names is not None else None
    infos = [info for info in host.installed() if wanted is None or info.name in wanted]
    problems: list[Problem] = []
    for info in infos:
        try:
            plugin = host.import_backend(info.name)
        except (BackendUnavailable, TypeError) as exc:
            problems.append(Problem(info.name, info.distribution, None, str(exc)))
            continue
        problems.extend(check_plugin(info.name, plugin, info.distribution))
    return infos, problems


def check_plugin(name: str, plugin: object, distribution: str = "<registered>") -> list[Problem]:
    """Check one backend plugin object (a module or a ``Backend`` instance).

    Nothing is kept registered anywhere; the plugin is registered in a throw-away
    ``PluginHost`` at the end, so pluggy's own validation is reported too.
    """
    specs = hookspecs()
    found: list[Problem] = []

    def problem(hook: str | None, message: str) -> None:
        found.append(Problem(name, distribution, hook, message))

    implemented: set[str] = set()
    for attr, value in _hook_candidates(plugin):
        if attr not in specs:
            close = difflib.get_close_matches(attr, list(specs), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            problem(attr, f"unknown hook: no hookspec of this name, so it is never called{hint}")
            continue
        if not hasattr(value, _IMPL_ATTR):
            problem(attr, "not marked with @pyserve.hookimpl, so pluggy ignores it")
            continue
        implemented.add(attr)
        if attr not in _lifecycle_hooks():
            problem(
                attr,
                "a server-plugin hook: it is never called for a backend "
                "(register a pyserve.plugins entry point for it)",
            )
        extra = [p for p in _required_arguments(value) if p not in specs[attr].parameters]
        if extra:
            problem(
                attr,
                f"wrong signature: argument(s) {', '.join(repr(a) for a in extra)} not in the "
                f"hookspec {attr}{_plain(specs[attr])}",
            )
    for hook in REQUIRED_HOOKS:
        if hook not in implemented and not any(p.hook == hook for p in found):
            problem(hook, "required hook missing: every backend must implement it")
    if isinstance(plugin, Backend) and type(plugin).execute is Backend.execute:
        problem("pyserve_execute", f"{type(plugin).__name__} does not override execute()")
    if not found:
        try:
            PluginHost(extra_backends={name: plugin}, use_entry_points=False).backend(name)
        except BackendUnavailable as exc:
            problem(None, str(exc))
    return found


def _lifecycle_hooks() -> set[str]:
    return {n for n, f in inspect.getmembers(lifecycle, inspect.isfunction) if hasattr(f, _SPEC_ATTR)}


def _hook_candidates(plugin: object) -> list[tuple[str, Any]]:
    """``(name, callable)`` for every attribute named ``pyserve_*`` that is a function or method."""
    candidates = []
    for attr in sorted(dir(plugin)):
        if not attr.startswith(_PREFIX):
            continue
        try:
            static = inspect.getattr_static(plugin, attr)
        except AttributeError:
            continue
        if isinstance(static, (staticmethod, classmethod)):
            static = static.__func__
        if inspect.isfunction(static) or inspect.ismethod(static) or inspect.isbuiltin(static):
            candidates.append((attr, getattr(plugin, attr)))
    return candidates


def _required_arguments(func: Any) -> list[str]:
    """Arguments the caller must pass (pluggy passes exactly these by name)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return []
    kinds = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
    return [
        p.name
        for p in signature.parameters.values()
        if p.kind in kinds and p.default is inspect.Parameter.empty
    ]


def _plain(signature: inspect.Signature) -> str:
    return "(" + ", ".join(signature.parameters) + ")"
