"""Plugin discovery and the scoped hook callers the core calls backends through.

* Backends come from the entry-point group ``pyserve.backends`` (name = backend name). Only
  the entry-point *metadata* is read at startup; a backend's package is imported the first
  time a model needs it.
* Server plugins come from ``pyserve.plugins`` and are loaded at startup; they take part in
  every model's hook calls (e.g. to wrap ``pyserve_execute``).
* ``pyserve.platforms`` entry points map a config ``platform`` to a backend name, on top of
  Triton's own platform table.

One ``PluginHost`` belongs to one server; there is no module-level plugin manager.
"""

from __future__ import annotations

import importlib.metadata as metadata
import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pluggy

from pyserve.api.backend import Backend
from pyserve.host.platforms import TRITON_PLATFORMS
from pyserve_hookspecs import (
    BACKEND_ENTRY_POINT_GROUP,
    PLATFORM_ENTRY_POINT_GROUP,
    PROJECT_NAME,
    SERVER_PLUGIN_ENTRY_POINT_GROUP,
    SPEC_MODULES,
)

log = logging.getLogger("pyserve.host.plugins")

LIFECYCLE_HOOKS = (
    "pyserve_backend_fork_safe",
    "pyserve_backend_initialize",
    "pyserve_backend_finalize",
    "pyserve_model_auto_complete",
    "pyserve_model_validate",
    "pyserve_model_create",
    "pyserve_model_finalize",
    "pyserve_instance_create",
    "pyserve_instance_finalize",
    "pyserve_execute",
    "pyserve_instance_ready",
)


class BackendUnavailable(Exception):
    """A backend cannot be used; the message says why and what to install."""


@dataclass(frozen=True)
class BackendInfo:
    """What is known about an installed backend without importing it."""

    name: str
    distribution: str
    version: str
    platforms: tuple[str, ...]
    source: str  # the entry point's value, "<registered>", or a server plugin's key
    resolved: bool = False  # supplied by a server plugin (pyserve_resolve_backend)

    def origin(self) -> str:
        """Where the backend comes from, for people: ``plugin <distribution> <version>``, the
        key a server plugin gave (e.g. ``native:<library path>``), or ``registered``."""
        if self.resolved:
            return self.source
        if self.source == "<registered>":
            return "registered"
        return f"plugin {self.distribution} {self.version}".rstrip()


@dataclass(frozen=True)
class ServerPluginInfo:
    """An installed server plugin (entry-point group ``pyserve.plugins``), as ``pyserve
    backends`` lists it.

    :ivar resolves_backends: it implements ``pyserve_resolve_backend``: it supplies the backend
        of models it finds one for (e.g. a native ``libtriton_<name>.so`` library).
    """

    name: str
    distribution: str
    version: str
    summary: str
    source: str
    resolves_backends: bool


class BackendHooks:
    """Typed facade over the hook callers of one backend's own plugin manager.

    Each backend has a plugin manager of its own holding that backend and the server
    plugins, so every call reaches the owning backend (plus server-plugin wrappers and
    observers) and nothing else, whichever backends are loaded later or concurrently.
    """

    __slots__ = (*(name.removeprefix("pyserve_") for name in LIFECYCLE_HOOKS), "execute_direct", "checks_ready",
                 "completes_configs")

    def __init__(self, pm: pluggy.PluginManager) -> None:
        for hook_name in LIFECYCLE_HOOKS:
            setattr(self, hook_name.removeprefix("pyserve_"), getattr(pm.hook, hook_name))
        self.refresh()

    def refresh(self) -> None:
        """Recompute ``execute_direct``, ``checks_ready`` and ``completes_configs``; call after
        every plugin registered with the manager."""
        self.execute_direct = _direct_call(self.execute)
        self.checks_ready = _implemented(self.instance_ready, "instance_ready")
        self.completes_configs = _implemented(self.model_auto_complete, "auto_complete_config")

    checks_ready: bool
    """Whether any ``pyserve_instance_ready`` implementation can say anything: the ``Backend``
    base class's forwarding method counts only when a subclass overrides ``instance_ready``.
    The ready endpoints skip the check (and its thread) when this is False."""

    completes_configs: bool
    """Whether any ``pyserve_model_auto_complete`` implementation can change a config (the
    ``Backend`` base class's forwarding method counts only when a subclass overrides
    ``auto_complete_config``). ``pyserve validate`` reads it."""

    execute_direct: Callable[[Any, Any], Any] | None
    """``execute(instance, requests)`` without pluggy's dispatch, when the backend's
    ``pyserve_execute`` is the only implementation (no server plugin wraps it): the same result
    and exceptions as calling the hook, a few microseconds sooner per batch. None otherwise."""

    backend_fork_safe: Any
    backend_initialize: Any
    backend_finalize: Any
    model_auto_complete: Any
    model_validate: Any
    model_create: Any
    model_finalize: Any
    instance_create: Any
    instance_finalize: Any
    execute: Any
    instance_ready: Any


def _implemented(hook: Any, method: str) -> bool:
    """Whether ``hook`` has an implementation that does something: the ``Backend`` base class's
    forwarding to ``method`` counts only when a subclass overrides ``method``."""
    for impl in hook.get_hookimpls():
        plugin = impl.plugin
        if isinstance(plugin, Backend) and getattr(type(plugin), method) is getattr(Backend, method):
            continue
        return True
    return False


def _direct_call(hook: Any) -> Callable[[Any, Any], Any] | None:
    """The sole plain implementation of a ``firstresult`` hook taking ``(instance, requests)``,
    as a positional callable; None when anything else (a wrapper, a second impl) takes part."""
    impls = hook.get_hookimpls()
    if len(impls) != 1 or impls[0].wrapper or impls[0].hookwrapper:
        return None
    function = impls[0].function
    names = tuple(impls[0].argnames)
    if names == ("instance", "requests"):
        return cast(Callable[[Any, Any], Any], function)

    def call(instance: Any, requests: Any) -> Any:
        given = {"instance": instance, "requests": requests}
        return function(*(given[name] for name in names))

    return call


@dataclass(eq=False)
class LoadedBackend:
    """A backend whose plugin object is registered with the plugin manager."""

    info: BackendInfo
    plugin: object
    hooks: BackendHooks
    manager: pluggy.PluginManager
    initialized: bool = False
    init_error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def _as_plugin(obj: object) -> object:
    """Entry points may name a module, a Backend instance or a Backend subclass."""
    if inspect.isclass(obj):
        if issubclass(obj, Backend):
            return obj()
        raise TypeError(f"{obj!r} is a class but not a pyserve.Backend subclass")
    return obj


class PluginHost:
    """Owns the pluggy manager, the backend registry and the server plugins.

    Thread-safety: ``backend`` may be called from several model-loading threads at once.

    :param extra_backends: name → plugin object, registered as if they were installed
        (tests and embedding applications).
    :param server_plugins: extra server plugins, in addition to the entry points.
    :param use_entry_points: read the ``pyserve.*`` entry-point groups.
    """

    def __init__(
        self,
        *,
        extra_backends: Mapping[str, object] | None = None,
        server_plugins: Iterable[object] = (),
        use_entry_points: bool = True,
    ) -> None:
        self.pm = self._new_manager()  # the server plugins only; each backend gets its own
        self._lock = threading.RLock()
        self._loaded: dict[str, LoadedBackend] = {}
        self._entry_points: dict[str, list[metadata.EntryPoint]] = {}
        self._extra: dict[str, object] = dict(extra_backends or {})
        self._platforms: dict[str, str] = dict(TRITON_PLATFORMS)
        self.server_plugins: list[object] = []
        self._server_plugin_names: list[str | None] = []
        self._server_plugin_infos: list[ServerPluginInfo] = []
        self._loaded_everywhere: set[int] = set()  # ids of the plugins read from entry points
        self.observes_models = True
        """Whether the server plugins' ``pyserve_model_ready`` / ``pyserve_model_unloaded`` are
        called. False in a frontend process: its replicas stand for the owner's versions, whose
        loads and unloads the owner reports, so a plugin hears of each version once, as from
        one process."""
        if use_entry_points:
            self._read_entry_points()
        for plugin in server_plugins:
            self.add_server_plugin(plugin)

    # -- discovery -----------------------------------------------------------------------
    def _read_entry_points(self) -> None:
        for ep in metadata.entry_points(group=BACKEND_ENTRY_POINT_GROUP):
            self._entry_points.setdefault(ep.name, []).append(ep)
        for ep in metadata.entry_points(group=PLATFORM_ENTRY_POINT_GROUP):
            self._platforms[ep.name] = ep.value.strip()
        for ep in metadata.entry_points(group=SERVER_PLUGIN_ENTRY_POINT_GROUP):
            try:
                plugin = _as_plugin(ep.load())
                self.add_server_plugin(plugin, name=f"{ep.name} ({_dist_label(ep)})")
                self._loaded_everywhere.add(id(plugin))
            except Exception as exc:  # a broken optional plugin must not stop the server
                log.error("server plugin '%s' from %s failed to load: %s", ep.name, _dist_label(ep), exc)
                continue
            self._server_plugin_infos.append(_server_plugin_info(ep, plugin, self.pm))

    def add_server_plugin(self, plugin: object, name: str | None = None) -> None:
        """Register a server-wide plugin; it may only wrap ``pyserve_execute``."""
        with self._lock:
            self.pm.register(plugin, name=name)
            try:
                for impl in self.pm.hook.pyserve_execute.get_hookimpls():
                    if impl.plugin is plugin and not impl.wrapper:
                        raise pluggy.PluginValidationError(
                            plugin,
                            f"server plugin {name or plugin!r} implements pyserve_execute without "
                            "wrapper=True; server plugins may only wrap execute",
                        )
                self.pm.check_pending()
            except pluggy.PluginValidationError:
                # A rejected plugin must not stay registered: it would take part in hook
                # calls, and every later check_pending would fail on it.
                self.pm.unregister(plugin)
                raise
            self.server_plugins.append(plugin)
            self._server_plugin_names.append(name)
            for loaded in self._loaded.values():
                loaded.manager.register(plugin, name=name)
                loaded.hooks.refresh()

    def in_process_execute_wrappers(self) -> list[str]:
        """The server plugins handed to this host as objects (``server_plugins=``,
        ``add_server_plugin``) that wrap ``pyserve_execute``, by name (the class name when
        registered without one).

        Such a plugin lives in this process only: an execute in a frontend process's replica
        would run past it (or past a forked copy whose state this process never sees), so
        ``--replicate-models auto`` keeps every model in the owner while one is registered.
        Plugins read from entry points are not listed: every process loads its own.
        """
        with self._lock:
            wrappers = {id(impl.plugin) for impl in self.pm.hook.pyserve_execute.get_hookimpls()}
            return [name or type(plugin).__name__
                    for plugin, name in zip(self.server_plugins, self._server_plugin_names)
                    if id(plugin) in wrappers and id(plugin) not in self._loaded_everywhere]

    def in_process_only_backend(self, name: str) -> bool:
        """Whether backend ``name`` was handed to this host as an object (``extra_backends``)
        and is not installed (whether or not this host reads the entry points): another
        process reading them has no such backend."""
        if name not in self._extra or name in self._entry_points:
            return False
        return not metadata.entry_points(group=BACKEND_ENTRY_POINT_GROUP, name=name)

    def platform_backend(self, platform: str) -> str | None:
        """The backend name that serves a config ``platform``, if any."""
        return self._platforms.get(platform)

    def is_installed(self, name: str) -> bool:
        """Whether a backend of this name is installed or registered (no import happens)."""
        return name in self._extra or name in self._entry_points or name in self._loaded

    def installed_server_plugins(self) -> list[ServerPluginInfo]:
        """The server plugins loaded from entry points, by name."""
        return sorted(self._server_plugin_infos, key=lambda info: info.name)

    def installed(self) -> list[BackendInfo]:
        """Every installed backend, from metadata alone (nothing is imported)."""
        return [self._info(name) for name in sorted(set(self._entry_points) | set(self._extra))]

    def _info(self, name: str) -> BackendInfo:
        platforms = tuple(sorted(p for p, b in self._platforms.items() if b == name))
        if name in self._extra:
            return BackendInfo(name, "<registered>", "", platforms, "<registered>")
        ep = self._entry_points[name][0]
        dist = ep.dist
        return BackendInfo(
            name,
            dist.name if dist else "<unknown>",
            dist.version if dist else "",
            platforms,
            ep.value,
        )

    # -- loading ---------------------------------------------------------------------------
    def backend(self, name: str) -> LoadedBackend:
        """The loaded backend ``name``, importing and registering it on first use.

        :raises BackendUnavailable: not installed, installed twice, or failed to import.
        """
        loaded = self._loaded.get(name)
        if loaded is not None:
            return loaded
        with self._lock:
            loaded = self._loaded.get(name)
            if loaded is not None:
                return loaded
            return self._register(name, self._import(name), self._info(name))

    def resolve(
        self,
        name: str,
        *,
        runtime: str = "",
        model_path: Path | None = None,
        version_paths: Sequence[Path] = (),
        backend_directory: str | None = None,
    ) -> LoadedBackend:
        """The backend serving a model: a server plugin's (e.g. a native library), else an
        installed Python backend.

        The ``pyserve_resolve_backend`` hook of the server plugins is asked first: a native
        ``libtriton_<name>.so`` that the user placed where Triton looks (version folder, model
        folder, ``--backend-directory``) wins over an installed Python backend of the same
        name, as in Triton. Only when no plugin supplies one does the Python backend ``name``
        serve the model; a config ``runtime`` naming a shared library (``*.so``) must be
        supplied by a plugin. Each key a plugin returns is registered once, so every model
        resolving to the same library shares one backend.

        :raises BackendUnavailable: nothing serves the backend, or the resolver failed.
        """
        native_runtime = runtime.endswith(".so")
        try:
            found = self.server_hook("pyserve_resolve_backend")(
                name=name, runtime=runtime, model_path=model_path, version_paths=list(version_paths),
                backend_directory=backend_directory,
            )
        except Exception as exc:
            raise BackendUnavailable(str(exc)) from exc
        if found is None:
            if native_runtime:
                raise BackendUnavailable(
                    f"backend '{name}': runtime '{runtime}' names a native backend library, but no "
                    "installed server plugin hosts native backends (pip install pyserve-backend-native)"
                )
            return self.backend(name)  # an installed Python backend, or the usual "not installed" error
        key, plugin = found
        loaded = self._loaded.get(key)
        if loaded is not None:
            return loaded
        with self._lock:
            loaded = self._loaded.get(key)
            if loaded is not None:
                return loaded
            return self._register(key, plugin, _resolved_info(name, key, plugin))

    def _register(self, key: str, plugin: object, info: BackendInfo) -> LoadedBackend:
        """Register a backend's plugin under ``key`` (call with ``self._lock`` held)."""
        name = info.name
        for other_key, other in self._loaded.items():
            if other.plugin is plugin:
                raise BackendUnavailable(
                    f"backend '{name}' from {info.distribution} is the same plugin object as "
                    f"'backend:{other_key}'; each backend needs its own module or Backend instance"
                )
        manager = self._new_manager()
        try:
            for server_plugin, server_name in zip(self.server_plugins, self._server_plugin_names):
                manager.register(server_plugin, name=server_name)
            manager.register(plugin, name=f"backend:{key}")
            manager.check_pending()
        except pluggy.PluginValidationError as exc:
            raise BackendUnavailable(
                f"backend '{name}' from {info.distribution} does not follow the pyserve "
                f"plugin contract: {exc}"
            ) from exc
        loaded = LoadedBackend(info, plugin, BackendHooks(manager), manager)
        self._loaded[key] = loaded
        log.debug("loaded backend '%s' from %s", name, info.distribution)
        return loaded

    def import_backend(self, name: str) -> object:
        """Import backend ``name``'s plugin object without registering it (``backends --check``).

        :raises BackendUnavailable: not installed, installed twice, or failed to import.
        :raises TypeError: the entry point names a class that is not a ``Backend`` subclass.
        """
        return self._import(name)

    def loaded_backends(self) -> list[LoadedBackend]:
        """Backends imported so far, in load order."""
        return list(self._loaded.values())

    def _import(self, name: str) -> object:
        if name in self._extra:
            return _as_plugin(self._extra[name])
        eps = self._entry_points.get(name)
        if not eps:
            raise BackendUnavailable(
                f"backend '{name}' is not installed; install the package that provides it "
                f"(for a first-party backend: pip install pyserve-backend-{name.replace('_', '-')})"
            )
        if len(eps) > 1:
            sources = ", ".join(_dist_label(ep) for ep in eps)
            raise BackendUnavailable(f"backend '{name}' is provided by more than one package: {sources}")
        ep = eps[0]
        try:
            return _as_plugin(ep.load())
        except Exception as exc:
            raise BackendUnavailable(
                f"backend '{name}' from {_dist_label(ep)} failed to import "
                f"({ep.value}): {type(exc).__name__}: {exc}"
            ) from exc

    @staticmethod
    def _new_manager() -> pluggy.PluginManager:
        manager = pluggy.PluginManager(PROJECT_NAME)
        for module in SPEC_MODULES:
            manager.add_hookspecs(module)
        return manager

    def server_hook(self, name: str) -> Any:
        """A hook caller reaching the server plugins only (observer and resolver hooks)."""
        return getattr(self.pm.hook, name)


def _resolved_info(name: str, key: str, plugin: object) -> BackendInfo:
    """What is known about a backend a server plugin supplied (``key`` is its source)."""
    package = type(plugin).__module__.split(".")[0]
    distribution, version = package.replace("_", "-"), ""
    try:
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        distribution = package
    return BackendInfo(name, distribution, version, (), key, resolved=True)


def _server_plugin_info(ep: metadata.EntryPoint, plugin: object, pm: pluggy.PluginManager) -> ServerPluginInfo:
    dist = ep.dist
    resolves = any(impl.plugin is plugin for impl in pm.hook.pyserve_resolve_backend.get_hookimpls())
    return ServerPluginInfo(
        ep.name,
        dist.name if dist else "<unknown>",
        dist.version if dist else "",
        str(dist.metadata.json.get("summary") or "") if dist else "",
        ep.value,
        resolves,
    )


def _dist_label(ep: metadata.EntryPoint) -> str:
    dist = ep.dist
    return f"{dist.name} {dist.version}" if dist else ep.value
