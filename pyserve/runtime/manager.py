"""The ``ModelManager``: every model of the server, as the data plane and the server see it.

A façade over three objects passed to each other at construction: the ``ModelRegistry``
(records and lookups, ``pyserve.runtime.registry``), the ``ModelLoader`` (loads and unloads one
model into the registry, ``pyserve.runtime.loader``, with the ``VersionBuilder`` of
``pyserve.runtime.builder``), and the ``ModelControl`` (control modes, poller, load/unload API
and shutdown, ``pyserve.runtime.control``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pyserve.api.errors import ModelConfigError
from pyserve.host.plugins import PluginHost
from pyserve.metrics import CustomMetrics
from pyserve.repository.scan import ModelSource
from pyserve.runtime.builder import Built, LoadSettings, Preparing, VersionBuilder
from pyserve.runtime.control import (
    CONTROL_NOT_ALLOWED,
    LOAD_ALL,
    ControlMode,
    ControlSettings,
    ModelControl,
)
from pyserve.runtime.event_loop import LoopRunner
from pyserve.runtime.load_request import FILE_PREFIX, parse_load_parameters
from pyserve.runtime.loader import ModelLoader
from pyserve.runtime.registry import ModelRegistry
from pyserve.runtime.scheduling.rate_limiter import RateLimiter
from pyserve.runtime.versions import ModelRecord, ModelVersion

__all__ = [
    "CONTROL_NOT_ALLOWED",
    "FILE_PREFIX",
    "LOAD_ALL",
    "ControlMode",
    "ModelManager",
    "parse_load_parameters",
]


class ModelManager:
    """Owns every model of the server and their life cycle.

    Thread-safety: ``get``, ``index`` and ``all_ready`` run on the event loop for requests and
    only read; loads and unloads run on worker threads, one at a time per model, and make
    their changes visible on the event loop (``attach_loop``), so a request never reaches a
    version that stopped taking requests.

    Everything is given to the constructor; afterwards the manager changes only through its
    methods.

    :param repositories: the model repository directories.
    :param host: the plugin host that supplies backends.
    :param auto_complete: let backends complete configs (off with ``--strict-model-config``).
    :param backend_config: ``--backend-config`` settings per backend name (``""`` = all).
    :param load_threads: models loaded in parallel at startup.
    :param load_retries: further attempts for a model version that fails to load
        (``--model-load-retry-count``).
    :param control_mode: ``none``, ``poll`` or ``explicit`` (``--model-control-mode``).
    :param startup_models: the ``--load-model`` names (explicit mode; ``*`` = all).
    :param poll_secs: seconds between repository scans in poll mode.
    :param backend_directory: ``--backend-directory``, where server plugins look for native
        backend libraries (``<dir>/<backend>/libtriton_<backend>.so``).
    :param config_name: ``--model-config-name``: models that have ``configs/<name>.pbtxt`` are
        read from it instead of ``config.pbtxt``.
    :param rate_limiter: ``--rate-limit execution_count``: the pool instances take their
        ``rate_limiter`` resources from before each execute; None: not limited.
    :param cpu_threads: the threads a model's own CPU pool should use when its config sets
        none (``BackendContext.cpu_threads``); None: each library's default.
    :param unload_wait_secs: how long a load or unload waits for the versions it retires to
        finish their executes before it returns (they go on finishing on their own).
    :param server_handle: what models receive as ``model.server`` (BLS); None: no server.
    :param custom_metrics: what backends and models receive as ``backend.metrics`` /
        ``model.metrics``; None: a registry of their own.
    :param latency_summaries: versions record latency summaries (``--metrics-config
        summary_latencies=true``).
    :param registry: the registry to fill (one the caller reads too, e.g. for metrics);
        None: a new one.
    """

    def __init__(
        self,
        repositories: list[Path],
        host: PluginHost,
        *,
        auto_complete: bool = True,
        backend_config: Mapping[str, Mapping[str, str]] | None = None,
        load_threads: int = 4,
        load_retries: int = 0,
        control_mode: ControlMode | str = ControlMode.NONE,
        startup_models: Sequence[str] = (),
        poll_secs: float = 15.0,
        backend_directory: str | None = None,
        config_name: str = "",
        rate_limiter: RateLimiter | None = None,
        cpu_threads: int | None = None,
        unload_wait_secs: float = 30.0,
        server_handle: Any = None,
        custom_metrics: CustomMetrics | None = None,
        latency_summaries: bool = False,
        registry: ModelRegistry | None = None,
    ) -> None:
        self._settings = LoadSettings(
            auto_complete=auto_complete,
            backend_config={k: dict(v) for k, v in (backend_config or {}).items()},
            backend_directory=backend_directory,
            load_retries=max(0, load_retries),
            cpu_threads=cpu_threads,
            latency_summaries=latency_summaries,
            rate_limiter=rate_limiter,
            custom_metrics=custom_metrics if custom_metrics is not None else CustomMetrics(),
            server_handle=server_handle,
        )
        self._registry = registry if registry is not None else ModelRegistry()
        self._loop = LoopRunner()
        self._host = host
        builder = VersionBuilder(host, self._settings, self._registry.get)
        self._loader = ModelLoader(self._registry, builder, self._loop, repositories, unload_wait_secs)
        self._control = ModelControl(self._registry, self._loader, ControlSettings(
            repositories=repositories,
            config_name=config_name,
            control_mode=ControlMode(control_mode),
            startup_models=startup_models,
            poll_secs=poll_secs,
            load_threads=load_threads,
        ))
        self.get: Callable[..., ModelVersion] = self._registry.get
        """``ModelRegistry.get``: the version that serves a request (bound here: the hot path)."""

    # -- the parts ---------------------------------------------------------------------------
    @property
    def registry(self) -> ModelRegistry:
        """The records and lookups."""
        return self._registry

    @property
    def loader(self) -> ModelLoader:
        """Loads and unloads one model at a time into the registry."""
        return self._loader

    @property
    def control(self) -> ModelControl:
        """The control modes, the poller, the load/unload API and shutdown."""
        return self._control

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make model changes visible on ``loop`` (the server's, where requests are enqueued)
        from now on; before, they are made inline."""
        self._loop.attach(loop)

    def follow_explicitly(self) -> None:
        """``ModelControl.follow_explicitly``: models load and unload only when asked."""
        self._control.follow_explicitly()

    # -- what the server reads -----------------------------------------------------------------
    @property
    def plugins(self) -> PluginHost:
        """The plugin host the versions are built with."""
        return self._host

    @property
    def records(self) -> dict[str, ModelRecord]:
        """The live model records by name (``ModelRegistry.records``); read only."""
        return self._registry.records

    @property
    def repositories(self) -> list[Path]:
        return self._control.repositories

    @property
    def control_mode(self) -> ControlMode:
        return self._control.control_mode

    @property
    def cpu_threads(self) -> int | None:
        return self._settings.cpu_threads

    @property
    def server_handle(self) -> Any:
        return self._settings.server_handle

    @property
    def missing_startup_models(self) -> list[str]:
        """``--load-model`` names the repositories do not hold (``--exit-on-error`` counts them)."""
        return self._control.missing_startup_models

    @property
    def unfinished(self) -> list[str]:
        """What ``unload_all`` left running at its deadline (empty after a clean shutdown)."""
        return self._control.unfinished

    @property
    def prepared(self) -> dict[str, Built]:
        """Models ``prepare`` built before a fork, waiting to be started (``ModelLoader.prepared``)."""
        return self._loader.prepared

    # -- lookups (event loop) --------------------------------------------------------------
    def all_ready(self) -> bool:
        """``ModelRegistry.all_ready``: Triton's strict readiness."""
        return self._registry.all_ready()

    def startup_failures(self) -> list[str]:
        """One line per model (version) that is not READY after the startup load, with its
        reason, and per ``--load-model`` name the repositories lack (what ``all_ready`` and
        ``missing_startup_models`` count)."""
        return self._registry.startup_failures(self._control.missing_startup_models)

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """The repository index: one entry per model version (or per model with no version),
        and, unless ``ready_only``, the name of every model on disk that was never loaded."""
        on_disk: list[str] = []
        if not ready_only:
            try:
                on_disk = list(self._control.scan())
            except (ModelConfigError, OSError):
                pass  # a repository that vanished: list what is loaded
        return self._registry.index(ready_only, on_disk)

    # -- loading before a fork (``pyserve.handoff.prefork``) -----------------------------------
    def startup_sources(self, report: bool = False) -> dict[str, ModelSource]:
        """``ModelControl.startup_sources``: the models ``load_all`` loads."""
        return self._control.startup_sources(report)

    def ensemble_steps(self, source: ModelSource) -> set[str] | None:
        """``ModelControl.ensemble_steps``: the models an ensemble's steps name, or None."""
        return self._control.ensemble_steps(source)

    def prepare(self, name: str, source: ModelSource, rules: Preparing) -> str | None:
        """``ModelLoader.prepare``: build a model's versions, not started, before a fork."""
        return self._loader.prepare(name, source, rules)

    def discard_prepared(self, built: Built) -> None:
        """``ModelLoader.discard_prepared``: finalize prepared versions never started."""
        self._loader.discard_prepared(built)

    def adopt_prepared(self, name: str, config: Any) -> bool:
        """``ModelControl.adopt_prepared``: start what ``prepare`` built of ``name`` with ``config``."""
        return self._control.adopt_prepared(name, config)

    # -- control ---------------------------------------------------------------------------
    def load_all(self) -> None:
        """``ModelControl.load_all``: load the startup models (failures recorded, not raised)."""
        self._control.load_all()

    def start_polling(self) -> None:
        """``ModelControl.start_polling`` (poll mode only)."""
        self._control.start_polling()

    def stop_polling(self) -> None:
        """``ModelControl.stop_polling``."""
        self._control.stop_polling()

    def poll(self) -> None:
        """``ModelControl.poll``: apply the repository changes since the last scan."""
        self._control.poll()

    def check_control_allowed(self) -> None:
        """``ModelControl.check_control_allowed``.

        :raises InferError: UNAVAILABLE outside explicit mode.
        """
        self._control.check_control_allowed()

    async def load_model_async(self, name: str, parameters: Mapping[str, Any] | None = None) -> None:
        """``ModelControl.load_model_async``: the load API (explicit mode)."""
        await self._control.load_model_async(name, parameters)

    async def unload_model_async(self, name: str, unload_dependents: bool = False) -> None:
        """``ModelControl.unload_model_async``: the unload API (explicit mode)."""
        await self._control.unload_model_async(name, unload_dependents)

    def load_model(self, name: str, config: str | None = None, files: Mapping[str, bytes] | None = None) -> None:
        """``ModelControl.load_model``: load or reload one model (blocking).

        :raises InferError: see ``ModelControl.load_model``.
        """
        self._control.load_model(name, config, files)

    def unload_model(self, name: str, unload_dependents: bool = False, *, forget: bool = False) -> None:
        """``ModelControl.unload_model``: unload every version of a model (blocking)."""
        self._control.unload_model(name, unload_dependents, forget=forget)

    def unload_all(self, timeout: float | None = None) -> None:
        """``ModelControl.unload_all``: shut every model and backend down (``unfinished``
        lists what was left running at ``timeout``)."""
        self._control.unload_all(timeout)
