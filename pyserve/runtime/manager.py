"""The ``ModelManager``: every model of the server, as the data plane and the server see it.

Lookups (``get``, ``index``, readiness) live here; loading and unloading one model is in
``pyserve.runtime.loader``, the control modes, the poller, the load/unload API and shutdown in
``pyserve.runtime.control``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pyserve.api.backend import BackendContext
from pyserve.api.errors import InferError, ModelConfigError
from pyserve.host.plugins import LoadedBackend, PluginHost
from pyserve.metrics import CustomMetrics
from pyserve.repository.scan import is_version_number, scan
from pyserve.runtime.control import (
    CONTROL_NOT_ALLOWED,
    FILE_PREFIX,
    LOAD_ALL,
    ControlMode,
    ModelControl,
    parse_load_parameters,
)
from pyserve.runtime.scheduling.rate_limiter import RateLimiter
from pyserve.runtime.versions import ModelRecord, ModelState, ModelVersion

__all__ = [
    "CONTROL_NOT_ALLOWED",
    "FILE_PREFIX",
    "LOAD_ALL",
    "ControlMode",
    "ModelManager",
    "parse_load_parameters",
]


class ModelManager(ModelControl):
    """Owns every model of the server and their life cycle.

    Thread-safety: ``get``, ``index`` and ``all_ready`` run on the event loop for requests and
    only read; loads and unloads run on worker threads, one at a time per model, and make
    their changes visible on the event loop (``loop``), so a request never reaches a version
    that stopped taking requests.

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
    ) -> None:
        self.repositories = repositories
        self.host = host
        self.auto_complete = auto_complete
        self.backend_config = {k: dict(v) for k, v in (backend_config or {}).items()}
        self.load_threads = max(1, load_threads)
        self.load_retries = max(0, load_retries)
        self.control_mode = ControlMode(control_mode)
        self.startup_models = list(startup_models)
        self.missing_startup_models = []
        self.latency_summaries = False  # the server turns it on with its metrics settings
        self.poll_secs = poll_secs
        self.backend_directory = backend_directory
        self.config_name = config_name
        self.rate_limiter = rate_limiter
        self.cpu_threads = cpu_threads
        self.records: dict[str, ModelRecord] = {}
        self._backend_contexts: dict[LoadedBackend, BackendContext] = {}
        self._initialized_backends: list[tuple[LoadedBackend, BackendContext]] = []
        self._load_order: list[ModelVersion] = []
        self.server_handle: Any = None  # set by the server before loading (BLS)
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the server: where swaps happen
        self.custom_metrics = CustomMetrics()  # the server sets its own (backend.metrics / model.metrics)
        self._lock = threading.Lock()
        self._model_locks: dict[str, threading.RLock] = {}
        self._operations = threading.Condition(threading.Lock())
        self._running_operations = 0
        self._closing = False
        self._poll_stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._local = threading.local()
        self._leftover_dirs: list[Path] = []
        self._preparing = None
        self.prepared = {}
        self.unload_wait_secs = unload_wait_secs
        self._draining: dict[threading.Thread, list[ModelVersion]] = {}
        self.unfinished: list[str] = []
        """What ``unload_all`` left running at its deadline (empty after a clean shutdown)."""

    # -- lookups (event loop) --------------------------------------------------------------
    def get(self, name: str, version: str | int | None = None) -> ModelVersion:
        """The version that serves a request, as Triton picks it.

        :param version: a version number, or None / "" for the latest READY version.
        :raises InferError: NOT_FOUND for an unknown model or version, UNAVAILABLE for a
            version that is not READY.
        """
        record = self.records.get(name)
        if record is None:
            raise InferError.not_found(f"Request for unknown model: '{name}' is not found")
        if version is None or version == "":
            latest = record.latest_ready()
            if latest is not None:
                return latest
            reason = record.reason or "; ".join(
                f"version {v.version}: {v.reason}" for _, v in sorted(record.versions.items()) if v.reason
            )
            suffix = f" ({reason})" if reason else ""
            raise InferError.not_found(f"Request for unknown model: '{name}' has no available versions{suffix}")
        if isinstance(version, int):
            number = version
        elif is_version_number(version):
            number = int(version)
        else:
            raise InferError.not_found(f"Request for unknown model: '{name}' version '{version}' is not found")
        found = record.versions.get(number)
        if found is None:
            raise InferError.not_found(f"Request for unknown model: '{name}' version {number} is not found")
        if not found.ready:
            detail = f": {found.reason}" if found.reason else ""
            raise InferError.unavailable(
                f"Request for unknown model: '{name}' version {number} is not at ready state{detail}"
            )
        return found

    def all_ready(self) -> bool:
        """Triton's strict readiness: every model has a version and every version is READY
        (versions UNAVAILABLE because they were unloaded are tolerated)."""
        for record in list(self.records.values()):
            if not record.versions:
                return False
            for v in list(record.versions.values()):
                if v.state is not ModelState.READY and not (
                    v.state is ModelState.UNAVAILABLE and v.reason == "unloaded"
                ):
                    return False
        return True

    def startup_failures(self) -> list[str]:
        """One line per model (version) that is not READY after the startup load, with its
        reason, and per ``--load-model`` name the repositories lack (what ``all_ready`` and
        ``missing_startup_models`` count)."""
        lines = [f"  '{name}': not found in the model repositories" for name in self.missing_startup_models]
        for name, record in sorted(self.records.items()):
            if not record.versions:
                lines.append(f"  '{name}': {record.reason or record.state.value}")
            for number, v in sorted(record.versions.items()):
                if v.state is not ModelState.READY and not (v.state is ModelState.UNAVAILABLE and v.reason == "unloaded"):
                    lines.append(f"  '{name}' version {number}: {v.reason or v.state.value}")
        return lines

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """The repository index: one entry per model version (or per model with no version),
        and, unless ``ready_only``, the name of every model on disk that was never loaded."""
        entries: list[dict[str, str]] = []
        names = set(self.records)
        if not ready_only:
            try:
                names.update(scan(self.repositories, self.config_name))
            except (ModelConfigError, OSError):
                pass  # a repository that vanished: list what is loaded
        for name in sorted(names):
            record = self.records.get(name)
            if record is None:
                entries.append({"name": name})
                continue
            if not record.versions:
                if not ready_only:
                    entry = {"name": name, "state": record.state.value}
                    if record.reason:
                        entry["reason"] = record.reason
                    entries.append(entry)
                continue
            for number, v in sorted(record.versions.items()):
                if ready_only and not v.ready:
                    continue
                entry = {"name": name, "version": str(number), "state": v.state.value}
                if v.reason:
                    entry["reason"] = v.reason
                entries.append(entry)
        return entries
