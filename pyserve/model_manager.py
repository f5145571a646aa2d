"""Loading, reloading and unloading models: config → backend → model → instances, and back.

One failing model never stops the others: its versions become UNAVAILABLE with a reason
naming the file, field, backend or exception. Loading at startup runs on a small thread pool
(``--model-load-thread-count``); unloading finalizes instances, then the model, and at
shutdown the backends, each in reverse order of creation.

Model control (``--model-control-mode``): ``none`` loads every model at startup and refuses
the load/unload API; ``poll`` does the same and re-scans the repositories every
``--repository-poll-secs``, reloading models whose directory changed; ``explicit`` loads the
``--load-model`` names at startup and everything else through the API.

A reload never interrupts serving: the new versions are built (and warmed up) on the side
while the old ones serve; then, on the event loop, the record's versions are swapped in one
assignment and the replaced versions stop taking requests, finish what they have queued and
are finalized. A reload that fails keeps the old versions serving.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import enum
import logging
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyserve import model_config
from pyserve.backend import BackendContext, InstanceContext, ModelContext
from pyserve.errors import ErrorCode, InferError, ModelConfigError
from pyserve.metrics import CustomMetrics
from pyserve.models import ModelRecord, ModelState, ModelVersion
from pyserve.plugins import BackendUnavailable, LoadedBackend, PluginHost
from pyserve.protocol import ModelConfig
from pyserve.protocol.config_json import model_config_from_json
from pyserve.repository import (
    Fingerprint,
    ModelSource,
    contained_path,
    fingerprint,
    scan,
    select_versions,
    version_numbers,
)
from pyserve.scheduling import InstanceWorker, scheduler_for
from pyserve.scheduling.ensemble import EnsembleScheduler, build_plan
from pyserve.warmup import WarmupError, run_warmup

log = logging.getLogger("pyserve.models")


class ControlMode(str, enum.Enum):
    """Triton's ``--model-control-mode`` values."""

    NONE = "none"
    POLL = "poll"
    EXPLICIT = "explicit"


CONTROL_NOT_ALLOWED = "explicit model load / unload is not allowed if polling is enabled"
"""Triton's message (503) for the load/unload API outside explicit mode."""

LOAD_ALL = "*"
"""``--load-model=*``: load every model at startup in explicit mode."""

FILE_PREFIX = "file:"
"""Load parameters named ``file:<path>`` carry a file of an override model directory."""


@dataclass
class _Built:
    """One model loaded from a source, not yet visible to requests.

    :ivar error: a model-level failure (nothing could be attempted); versions are empty then.
    """

    source: ModelSource
    fingerprint: Fingerprint | None = None
    override_dir: Path | None = None
    config: Any = None
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    error: str = ""


class ModelManager:
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
    :param control_mode: ``none``, ``poll`` or ``explicit`` (``--model-control-mode``).
    :param startup_models: the ``--load-model`` names (explicit mode; ``*`` = all).
    :param poll_secs: seconds between repository scans in poll mode.
    :param backend_directory: ``--backend-directory``, where server plugins look for native
        backend libraries (``<dir>/<backend>/libtriton_<backend>.so``).
    """

    def __init__(
        self,
        repositories: list[Path],
        host: PluginHost,
        *,
        auto_complete: bool = True,
        backend_config: Mapping[str, Mapping[str, str]] | None = None,
        load_threads: int = 4,
        control_mode: ControlMode | str = ControlMode.NONE,
        startup_models: Sequence[str] = (),
        poll_secs: float = 15.0,
        backend_directory: str | None = None,
    ) -> None:
        self.repositories = repositories
        self.host = host
        self.auto_complete = auto_complete
        self.backend_config = {k: dict(v) for k, v in (backend_config or {}).items()}
        self.load_threads = max(1, load_threads)
        self.control_mode = ControlMode(control_mode)
        self.startup_models = list(startup_models)
        self.poll_secs = poll_secs
        self.backend_directory = backend_directory
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
            ready = record.ready_versions()
            if ready:
                return ready[-1]
            reason = record.reason or "; ".join(
                f"version {v.version}: {v.reason}" for _, v in sorted(record.versions.items()) if v.reason
            )
            suffix = f" ({reason})" if reason else ""
            raise InferError.not_found(f"Request for unknown model: '{name}' has no available versions{suffix}")
        number = int(version)
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

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """The repository index: one entry per model version (or per model with no version),
        and, unless ``ready_only``, the name of every model on disk that was never loaded."""
        entries: list[dict[str, str]] = []
        names = set(self.records)
        if not ready_only:
            try:
                names.update(scan(self.repositories))
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

    # -- startup -----------------------------------------------------------------------------
    def load_all(self) -> None:
        """Load the startup models (failures are recorded, not raised).

        Every model in ``none`` and ``poll`` mode, and in ``explicit`` mode the
        ``startup_models`` (all of them for ``*``) together with the models their ensembles use.
        """
        sources = scan(self.repositories)
        if self.control_mode is ControlMode.EXPLICIT and self.startup_models != [LOAD_ALL]:
            wanted = self._with_composing(self.startup_models, sources)
            for name in wanted:
                if name not in sources:
                    message = f"failed to load '{name}', failed to poll from model repository"
                    log.error("%s", message)
                    self._commit(name, _Built(self._missing_source(name), error=message))
            sources = {name: sources[name] for name in wanted if name in sources}
        self._load_sources(sources)

    def _load_sources(self, sources: Mapping[str, ModelSource]) -> None:
        """Load models in parallel, then the ensembles among them in dependency order."""
        ensembles = {name: self._ensemble_steps(source) for name, source in sources.items()}
        ensembles = {name: steps for name, steps in ensembles.items() if steps is not None}
        plain = [source for name, source in sources.items() if name not in ensembles]
        with ThreadPoolExecutor(self.load_threads, thread_name_prefix="pyserve-load") as pool:
            list(pool.map(lambda source: self._load_quietly(source.name, source), plain))
        pending = dict(ensembles)
        while pending:
            ready = [name for name, steps in pending.items() if not steps & pending.keys()]
            if not ready:
                for name in sorted(pending):
                    self._commit(name, _Built(
                        sources[name], fingerprint(sources[name].path),
                        error="the ensemble depends on ensembles that depend on it (a cycle)",
                    ))
                return
            for name in sorted(ready):
                del pending[name]
                self._load_quietly(name, sources[name])

    def _load_quietly(self, name: str, source: ModelSource) -> None:
        """Load one model, logging (not raising) a failure."""
        with self._model_lock(name):
            self._load_locked(name, source)

    def _ensemble_steps(self, source: ModelSource) -> set[str] | None:
        """The models an ensemble's steps name, or None if ``source`` is not a readable ensemble."""
        try:
            config = self.read_config(source)
        except Exception:  # only a peek: the model's own load reports the problem
            return None
        if config.platform != model_config.ENSEMBLE_PLATFORM:
            return None
        return {step.model_name for step in config.ensemble_scheduling.step}

    def _with_composing(self, names: Iterable[str], sources: Mapping[str, ModelSource]) -> list[str]:
        """``names`` plus, recursively, the models their ensembles use (if on disk)."""
        wanted: list[str] = []
        todo = list(dict.fromkeys(names))
        while todo:
            name = todo.pop(0)
            if name in wanted:
                continue
            wanted.append(name)
            source = sources.get(name)
            steps = self._ensemble_steps(source) if source is not None else None
            todo.extend(sorted(s for s in steps or () if s in sources))
        return wanted

    def _missing_source(self, name: str) -> ModelSource:
        repository = self.repositories[0] if self.repositories else Path(".")
        return ModelSource(name, repository / name, repository)

    # -- polling -----------------------------------------------------------------------------
    def start_polling(self) -> None:
        """In poll mode, start re-scanning the repositories every ``poll_secs`` (a thread)."""
        if self.control_mode is not ControlMode.POLL or self._poller is not None:
            return
        self._poll_stop.clear()
        self._poller = threading.Thread(target=self._poll_loop, name="pyserve-poll", daemon=True)
        self._poller.start()

    def stop_polling(self) -> None:
        """Stop the poll thread, waiting for a scan in progress to finish."""
        self._poll_stop.set()
        poller, self._poller = self._poller, None
        if poller is not None and poller is not threading.current_thread():
            poller.join()

    def _poll_loop(self) -> None:
        while not self._poll_stop.wait(max(self.poll_secs, 0.01)):
            try:
                self.poll()
            except Exception:  # never let one bad scan end polling
                log.exception("polling the model repositories failed")

    def poll(self) -> None:
        """Apply the changes on disk since the last scan: load new models, reload changed
        ones (and the ensembles using them), unload removed ones."""
        try:
            sources = scan(self.repositories)
        except ModelConfigError as exc:
            log.error("cannot poll the model repositories: %s", exc)
            return
        for name in sorted(set(self.records) - set(sources)):
            if self._poll_stop.is_set():
                return
            log.info("model '%s' was removed from the repository; unloading it", name)
            self.unload_model(name, forget=True)
        records = dict(self.records)
        changed = {
            name for name, source in sources.items()
            if (record := records.get(name)) is None
            or record.fingerprint != fingerprint(source.path)
            or record.source.path != source.path
            or record.source.conflict != source.conflict
        }
        if not changed:
            return
        dependents = {
            name for name, record in list(self.records.items())
            if name in sources and self._composing(record) & changed
        }
        selected = {name: sources[name] for name in sorted(changed | dependents) if not self._poll_stop.is_set()}
        if selected:
            log.info("repository changes: (re)loading %s", ", ".join(f"'{n}'" for n in selected))
            self._load_sources(selected)

    # -- the load / unload API ---------------------------------------------------------------
    def check_control_allowed(self) -> None:
        """:raises InferError: UNAVAILABLE outside explicit mode, with Triton's message."""
        if self.control_mode is not ControlMode.EXPLICIT:
            raise InferError.unavailable(CONTROL_NOT_ALLOWED)

    async def load_model_async(self, name: str, parameters: Mapping[str, Any] | None = None) -> None:
        """``POST /v2/repository/models/{name}/load`` and ``RepositoryModelLoad``.

        Runs the load on a worker thread; returns once the model is READY.

        :param parameters: ``config`` (ModelConfig JSON text) and ``file:<path>`` (file
            contents: base64 text over HTTP, bytes over gRPC).
        :raises InferError: not in explicit mode (UNAVAILABLE), invalid parameters
            (INVALID_ARG), or a model that failed to load (INTERNAL).
        """
        self.check_control_allowed()
        config, files = parse_load_parameters(name, parameters or {})
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.load_model, name, config, files)

    async def unload_model_async(self, name: str, unload_dependents: bool = False) -> None:
        """``POST /v2/repository/models/{name}/unload`` and ``RepositoryModelUnload``.

        :raises InferError: not in explicit mode (UNAVAILABLE).
        """
        self.check_control_allowed()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.unload_model, name, unload_dependents)

    def load_model(self, name: str, config: str | None = None, files: Mapping[str, bytes] | None = None) -> None:
        """Load or reload one model (blocking); its ensembles' composing models come first.

        :param config: ModelConfig JSON used instead of config.pbtxt.
        :param files: relative path → contents of an override model directory (requires
            ``config``); the model is then loaded from a private copy of these files only.
        :raises InferError: the model does not exist, the override is invalid, or no
            version could be loaded (the previous versions, if any, keep serving).
        """
        with self._operation():
            override_config = None
            if config is not None:
                try:
                    override_config = model_config_from_json(config)
                except ValueError as exc:
                    raise InferError.invalid(f"failed to load '{name}': the 'config' parameter: {exc}") from None
            if files and override_config is None:
                raise InferError.invalid(
                    f"failed to load '{name}': file overrides ('{FILE_PREFIX}<path>' parameters) "
                    "require the 'config' parameter"
                )
            try:
                sources = scan(self.repositories)
            except ModelConfigError as exc:
                raise InferError(f"failed to load '{name}': {exc}", ErrorCode.INTERNAL) from None
            override_dir = _write_override(name, files) if files else None
            if override_dir is not None:
                source = ModelSource(name, override_dir / name, override_dir)
            elif name in sources:
                source = sources[name]
            else:
                raise InferError(f"failed to load '{name}', failed to poll from model repository", ErrorCode.INTERNAL)
            steps = self._steps_of(override_config) if override_config is not None else self._ensemble_steps(source)
            self._local.loading = {name}
            try:
                for step in sorted(steps or ()):
                    self._load_composing(step, sources)
            finally:
                self._local.loading = set()
            with self._model_lock(name):
                error = self._load_locked(name, source, override_config, override_dir)
            if error:
                raise InferError(f"load failed for model '{name}': {error}", ErrorCode.INTERNAL)

    def _load_composing(self, name: str, sources: Mapping[str, ModelSource]) -> None:
        """Load a model an ensemble uses, unless it is loaded (or being loaded) already."""
        record = self.records.get(name)
        if record is not None and record.ready_versions():
            return
        loading: set[str] = getattr(self._local, "loading", set())
        source = sources.get(name)
        if source is None or name in loading:
            return  # the ensemble's own load reports the missing step model
        self._local.loading = loading | {name}
        try:
            steps = self._ensemble_steps(source)
            for step in sorted(steps or ()):
                self._load_composing(step, sources)
            self._load_quietly(name, source)
        finally:
            self._local.loading = loading

    @staticmethod
    def _steps_of(config: Any) -> set[str] | None:
        if config.platform != model_config.ENSEMBLE_PLATFORM:
            return None
        return {step.model_name for step in config.ensemble_scheduling.step}

    def unload_model(self, name: str, unload_dependents: bool = False, *, forget: bool = False) -> None:
        """Unload every version of a model (blocking); unknown or unloaded models are a no-op.

        The versions stop taking requests, finish what they have queued, and are finalized;
        they stay listed as UNAVAILABLE with reason ``unloaded``.

        :param unload_dependents: also unload the ensembles that use the model (recursively),
            and, for an ensemble, the models it uses that no other loaded ensemble uses.
        :param forget: drop the model from the index as well (it left the repository).
        """
        with self._operation():
            self._unload(name, unload_dependents, forget, set())

    def _unload(self, name: str, dependents: bool, forget: bool, seen: set[str]) -> None:
        if name in seen:
            return
        seen.add(name)
        record = self.records.get(name)
        if record is None:
            return
        composing = self._composing(record)
        if dependents:
            for other, other_record in sorted(list(self.records.items()), key=lambda item: item[0]):
                if other not in seen and name in self._composing(other_record):
                    self._unload(other, True, False, seen)
        with self._model_lock(name):
            self._unload_record(record, forget)
        if dependents:
            still_used: set[str] = set()
            for other in list(self.records.values()):
                if other.ready_versions():
                    still_used |= self._composing(other)
            for step in sorted(composing - still_used):
                self._unload_down(step, seen)

    def _unload_down(self, name: str, seen: set[str]) -> None:
        """Unload a composing model of an unloaded ensemble, and its own composing models."""
        record = self.records.get(name)
        if name in seen or record is None:
            return
        seen.add(name)
        composing = self._composing(record)
        with self._model_lock(name):
            self._unload_record(record, False)
        still_used: set[str] = set()
        for other in list(self.records.values()):
            if other.ready_versions():
                still_used |= self._composing(other)
        for step in sorted(composing - still_used):
            self._unload_down(step, seen)

    @staticmethod
    def _composing(record: ModelRecord) -> set[str]:
        """The models the loaded versions of an ensemble use (empty for other models)."""
        names: set[str] = set()
        for v in list(record.versions.values()):
            if v.config is not None and v.config.platform == model_config.ENSEMBLE_PLATFORM:
                names.update(step.model_name for step in v.config.ensemble_scheduling.step)
        return names

    def _unload_record(self, record: ModelRecord, forget: bool) -> None:
        retiring = [v for v in record.versions.values() if v.ready]

        def swap() -> None:
            kept = {n: v for n, v in record.versions.items() if v.ready or v.reason == "unloaded"}
            record.versions = kept
            record.state = ModelState.UNAVAILABLE
            record.reason = "unloaded" if not kept else ""
            for version in retiring:
                self._retire(version)
            if forget or not kept:
                self.records.pop(record.name, None)

        self._on_loop(swap)
        for version in retiring:
            self._drain(version)
        if retiring:
            log.info("model '%s' unloaded", record.name)
        self._remove_override(record.override_dir)
        record.override_dir = None

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        """A runtime load or unload; refused once shutdown began, waited for by ``unload_all``."""
        with self._operations:
            if self._closing:
                raise InferError.unavailable("the server is shutting down")
            self._running_operations += 1
        try:
            yield
        finally:
            with self._operations:
                self._running_operations -= 1
                self._operations.notify_all()

    def _model_lock(self, name: str) -> threading.RLock:
        with self._lock:
            lock = self._model_locks.get(name)
            if lock is None:
                lock = self._model_locks[name] = threading.RLock()
            return lock

    # -- loading one model -------------------------------------------------------------------
    def _load_locked(
        self, name: str, source: ModelSource, override_config: Any = None, override_dir: Path | None = None
    ) -> str:
        """Build a model from ``source`` and swap it in (the model's lock is held).

        :returns: "" on success, else why the load failed (a model-level reason, or the
            reasons of the versions that did not load).
        """
        built = _Built(source, None if override_config is not None else fingerprint(source.path), override_dir)
        try:
            self._build(built, override_config)
        except Exception as exc:  # a bug in one model's load must not stop the others
            log.exception("model '%s' failed to load", name)
            built.error = f"{type(exc).__name__}: {exc}"
        return self._commit(name, built)

    def _build(self, built: _Built, override_config: Any) -> None:
        """Load every selected version of ``built.source`` into ``built.versions``."""
        source = built.source
        if source.conflict:
            built.error = source.conflict
            return
        try:
            if override_config is not None:
                config = ModelConfig()
                config.CopyFrom(override_config)
                model_config.normalize(config, source.path, self.host.platform_backend)
            else:
                config = self.read_config(source)
        except ModelConfigError as exc:
            built.error = str(exc)
            return
        built.config = config
        try:
            versions = version_numbers(source.path)
        except OSError as exc:
            built.error = f"cannot list versions in '{source.path}': {exc}"
            return
        selected, problems = select_versions(config.version_policy, versions)
        if not selected:
            built.error = (
                "; ".join(problems) if problems
                else f"no version directory (a numeric folder such as '1') in '{source.path}'"
            )
            return
        for problem in problems:  # Triton loads the versions that exist and logs the others
            log.error("model '%s': %s; loading the other versions", source.name, problem)
        if config.platform == model_config.ENSEMBLE_PLATFORM:
            self._build_ensemble(built, config, selected)
            return
        try:
            backend, backend_ctx = self._backend_for(config, source.path, selected)
        except BackendUnavailable as exc:
            built.error = str(exc)
            return
        for number in selected:
            version = ModelVersion(source.name, number)
            built.versions[number] = version
            self._load_version(source, config, number, version, backend, backend_ctx)

    def _build_ensemble(self, built: _Built, config: Any, selected: list[int]) -> None:
        source = built.source
        problems = model_config.validate(config, source.path)
        for number in selected:
            version = ModelVersion(source.name, number)
            built.versions[number] = version
            if problems:
                version.fail(f"{source.config_path}: " + "; ".join(problems))
                continue
            version.config = config
            version.io = model_config.model_io(config, source.path)
            try:
                steps = build_plan(config, version.io, self.get)
            except ValueError as exc:
                version.fail(f"{source.config_path}: invalid ensemble: " + "; ".join(str(exc).splitlines()))
                continue
            version.scheduler = EnsembleScheduler(source.name, steps, version.io, self.get)
            version.state = ModelState.READY

    def _commit(self, name: str, built: _Built) -> str:
        """Make a built model visible: swap its versions in, retire the ones they replace.

        A version that failed to load where the previous one of the same number is READY
        leaves the previous one serving; a model-level failure leaves every READY version
        serving. Runs the swap on the event loop, then drains the retired versions here.

        :returns: "" on success, else why the load failed.
        """
        record = self.records.get(name)
        old = dict(record.versions) if record is not None else {}
        old_ready = {n: v for n, v in old.items() if v.ready}
        failures = [v for v in built.versions.values() if not v.ready]
        for version in failures:
            log.error("model '%s' version %d is UNAVAILABLE: %s", name, version.version, version.reason)
        if built.error:
            log.error("model '%s' is UNAVAILABLE: %s", name, built.error)
        if built.error and old_ready:
            log.error("model '%s': the reload failed; the loaded versions keep serving", name)
            assert record is not None
            record.fingerprint = built.fingerprint
            self._remove_override(built.override_dir)
            return built.error
        versions: dict[int, ModelVersion] = {}
        retired: list[ModelVersion] = []
        for number, version in sorted(built.versions.items()):
            previous = old_ready.get(number)
            if previous is not None and not version.ready:
                log.error("model '%s' version %d: the reload failed; the loaded version keeps serving", name, number)
                versions[number] = previous
                continue
            versions[number] = version
            if previous is not None:
                retired.append(previous)
        if not built.error:
            for number, previous in sorted(old.items()):
                if number in built.versions:
                    continue
                if previous.ready:
                    retired.append(previous)
                    versions[number] = previous  # listed as unloaded once drained
                elif previous.reason == "unloaded":
                    versions[number] = previous
        previous_dir = record.override_dir if record is not None else None
        keeps_previous_dir = previous_dir is not None and any(
            v in old_ready.values() for v in versions.values() if v.ready
        )
        record_dir = previous_dir if keeps_previous_dir else built.override_dir
        stale_dir = None if keeps_previous_dir or previous_dir == built.override_dir else previous_dir
        if keeps_previous_dir and built.override_dir is not None:
            with self._lock:  # both copies serve now; the newer one goes at shutdown at the latest
                self._leftover_dirs.append(built.override_dir)
        target = record if record is not None else ModelRecord(name, built.source)
        ready_now = [v for v in versions.values() if v.ready]

        def swap() -> None:
            target.source = built.source
            target.fingerprint = built.fingerprint
            target.override_dir = record_dir
            target.versions = versions
            if built.error:
                target.fail(built.error)
            else:
                target.state = ModelState.READY if ready_now else ModelState.UNAVAILABLE
                target.reason = ""
            for version in retired:
                version.successor = _successor(version, ready_now)
                self._retire(version)
            self.records[name] = target

        with self._lock:
            self._load_order.extend(v for v in built.versions.values() if v.ready and v in ready_now)
        self._on_loop(swap)
        for version in retired:
            self._drain(version)
        self._remove_override(stale_dir)
        if built.error:
            return built.error
        if failures:
            return "; ".join(f"version {v.version} is at UNAVAILABLE state: {v.reason}" for v in failures)
        return ""

    def read_config(self, source: ModelSource) -> Any:
        """Parse and normalize a model's config.pbtxt (or start an empty one to auto-complete).

        :raises ModelConfigError: syntax, unknown field, missing config in strict mode, or a
            config that cannot be normalized.
        """
        path = source.config_path
        if path.is_file():
            config = model_config.parse_config(path.read_text(encoding="utf-8"), path)
        elif self.auto_complete:
            config = ModelConfig()
        else:
            raise ModelConfigError(
                f"{path}: file not found, and auto-complete is disabled (--strict-model-config / "
                "--disable-auto-complete-config)"
            )
        model_config.normalize(config, source.path, self.host.platform_backend)
        return config

    def _backend_for(self, config: Any, model_path: Path, versions: list[int]) -> tuple[LoadedBackend, BackendContext]:
        name = config.backend
        backend = self.host.resolve(
            name,
            runtime=config.runtime,
            model_path=model_path,
            version_paths=[model_path / str(v) for v in versions],
            backend_directory=self.backend_directory,
        )
        with backend.lock:
            context = self._backend_contexts.get(backend)
            if context is None:
                settings = {
                    "auto-complete-config": "true" if self.auto_complete else "false",
                    "default-max-batch-size": "4",
                    **self.backend_config.get("", {}),
                    **self.backend_config.get(name, {}),
                }
                context = BackendContext(name=name, config=settings, metrics=self.custom_metrics)
                self._backend_contexts[backend] = context
            if backend.init_error is not None:
                raise BackendUnavailable(backend.init_error)
            if not backend.initialized:
                try:
                    backend.hooks.backend_initialize(backend=context)
                except Exception as exc:
                    backend.init_error = f"backend '{name}' failed to initialize: {type(exc).__name__}: {exc}"
                    log.error("%s", backend.init_error)
                    raise BackendUnavailable(backend.init_error) from exc
                backend.initialized = True
                with self._lock:
                    self._initialized_backends.append((backend, context))
        return backend, context

    def _load_version(
        self,
        source: ModelSource,
        base_config: Any,
        number: int,
        version: ModelVersion,
        backend: LoadedBackend,
        backend_ctx: BackendContext,
    ) -> None:
        config = ModelConfig()
        config.CopyFrom(base_config)
        context = ModelContext(
            name=source.name,
            version=number,
            config=config,
            path=source.path,
            backend=backend_ctx,
            parameters=model_config.parameters(config),
            auto_complete=self.auto_complete,
            server=self.server_handle,
            metrics=self.custom_metrics,
        )
        hooks = backend.hooks
        if self.auto_complete:
            try:
                if hooks.model_auto_complete(model=context):
                    model_config.normalize(config, source.path, self.host.platform_backend)
            except Exception as exc:
                version.fail(f"auto-complete of the config failed: {_describe(exc)}")
                return
        problems = model_config.validate(config, source.path)
        if problems:
            where = source.config_path if source.config_path.exists() else source.path
            version.fail(f"{where}: " + "; ".join(problems))
            return
        version.config = config
        version.io = model_config.model_io(config, source.path)
        version.context = context
        version.backend = backend
        try:
            context.state = hooks.model_create(model=context)
        except Exception as exc:
            version.fail(f"backend '{backend.info.name}' failed to create the model: {_describe(exc)}")
            return
        try:
            self._create_instances(version, context, backend)
        except Exception as exc:
            self._finalize_instances(version)
            self._finalize_model(version)
            version.fail(f"backend '{backend.info.name}' failed to create an instance: {_describe(exc)}")
            return
        try:
            scheduler = scheduler_for(config, version.io, len(version.instances), source.path)
        except ValueError as exc:
            self._finalize_instances(version)
            self._finalize_model(version)
            version.fail(f"{source.config_path}: {exc}")
            return
        version.scheduler = scheduler
        version.workers = [
            InstanceWorker(inst, backend, scheduler.batch_source(i), version.io, scheduler.observe)
            for i, inst in enumerate(version.instances)
        ]
        for worker in version.workers:
            worker.start()
        if config.model_warmup:
            try:
                run_warmup(version, source.path)
            except WarmupError as exc:
                version.state = ModelState.UNLOADING
                self._stop_workers(version, None)
                self._finalize_instances(version)
                self._finalize_model(version)
                version.fail(str(exc))
                return
        version.state = ModelState.READY
        self._notify("pyserve_model_ready", context)

    def _create_instances(self, version: ModelVersion, context: ModelContext, backend: LoadedBackend) -> None:
        index = 0
        for group in context.config.instance_group:
            kind = model_config.instance_kind(group)
            devices = list(group.gpus) if kind == "GPU" else [0]
            in_group = 0
            for device in devices:
                for _ in range(group.count):
                    instance = InstanceContext(
                        name=f"{group.name}_{in_group}", kind=kind, device_id=device, index=index, model=context
                    )
                    instance.state = backend.hooks.instance_create(instance=instance)
                    version.instances.append(instance)
                    index += 1
                    in_group += 1

    # -- unloading ---------------------------------------------------------------------------
    def unload_all(self, timeout: float | None = None) -> None:
        """Stop polling, refuse further loads, unload every READY version (reverse load
        order), then finalize the backends.

        :param timeout: seconds to wait, in all, for loads in progress and executes still
            running; ``None`` waits for them. A version whose instances are still executing
            when the time is up is left as it is (its instances, model and backend are not
            finalized, since the contract never finalizes during an execute), so that
            shutdown cannot hang on a stuck backend.
        """
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        self.stop_polling()
        with self._operations:
            self._closing = True
            while self._running_operations:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    log.error("shutting down while %d model load(s)/unload(s) are still running",
                              self._running_operations)
                    break
                self._operations.wait(remaining)
        with self._lock:
            order = list(reversed(self._load_order))
            self._load_order.clear()
        stuck: set[str] = set()
        for version in order:
            if not self.unload_version(version, deadline) and version.backend is not None:
                stuck.add(version.backend.info.name)
        for record in list(self.records.values()):
            self._remove_override(record.override_dir)
            record.override_dir = None
        with self._lock:
            leftovers, self._leftover_dirs = self._leftover_dirs, []
        for path in leftovers:
            self._remove_override(path)
        with self._lock:
            backends = list(reversed(self._initialized_backends))
            self._initialized_backends.clear()
        for backend, context in backends:
            if backend.info.name in stuck:
                log.error("backend '%s' not finalized: some of its models are still executing", backend.info.name)
                continue
            try:
                backend.hooks.backend_finalize(backend=context)
            except Exception:
                log.exception("backend '%s' failed to finalize", backend.info.name)
            backend.initialized = False

    def unload_version(self, version: ModelVersion, deadline: float | None = None) -> bool:
        """Stop a version's workers after queued work, then finalize instances and model.

        :param deadline: ``time.monotonic()`` value after which running executes are not
            waited for any more; ``None`` waits for them.
        :returns: False if an instance was still executing at the deadline; the version is
            then not finalized.
        """
        if version.state is not ModelState.READY:
            return True
        self._on_loop(lambda: self._retire(version))
        return self._drain(version, deadline)

    def _retire(self, version: ModelVersion) -> None:
        """Stop a READY version taking requests and let its workers finish what is queued.

        Called on the event loop, where requests are enqueued, so no request can reach the
        scheduler after it was told to stop.
        """
        if version.state is not ModelState.READY:
            return
        version.state = ModelState.UNLOADING
        if version.scheduler is not None:
            version.scheduler.stop(len(version.workers))
        with self._lock:
            with contextlib.suppress(ValueError):
                self._load_order.remove(version)

    def _drain(self, version: ModelVersion, deadline: float | None = None) -> bool:
        """Wait for a retired version's workers, then finalize its instances and model.

        :returns: False if an instance was still executing at the deadline (not finalized).
        """
        if not self._join_workers(version, deadline):
            return False
        if version.backend is not None:  # ensembles have no backend
            self._finalize_instances(version)
            self._finalize_model(version)
        version.state = ModelState.UNAVAILABLE
        version.reason = "unloaded"
        if version.context is not None:
            self._notify("pyserve_model_unloaded", version.context)
        return True

    def _stop_workers(self, version: ModelVersion, deadline: float | None) -> bool:
        """Stop a version that never became READY (failed warmup) and wait for its workers."""
        if version.scheduler is not None:
            version.scheduler.stop(len(version.workers))
        return self._join_workers(version, deadline)

    def _join_workers(self, version: ModelVersion, deadline: float | None) -> bool:
        for worker in version.workers:
            worker.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        busy = [w.instance.name for w in version.workers if w.is_alive()]
        if busy:
            log.error(
                "model '%s' version %d: instance(s) %s still executing at the exit timeout; "
                "not finalized", version.name, version.version, ", ".join(busy),
            )
            return False
        return True

    def _on_loop(self, action: Callable[[], None]) -> None:
        """Run ``action`` on the server's event loop and wait for it (inline without a loop,
        on the loop itself, or once the loop stopped)."""
        loop = self.loop
        if loop is None or loop.is_closed() or _running_on(loop):
            action()
            return
        done = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                action()
            except BaseException as exc:  # re-raised on the calling thread
                failure.append(exc)
            finally:
                done.set()

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:  # closed meanwhile
            action()
            return
        while not done.wait(0.05):
            if not loop.is_running():
                if not done.is_set():
                    run()
                break
        if failure:
            raise failure[0]

    @staticmethod
    def _remove_override(path: Path | None) -> None:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    def _finalize_instances(self, version: ModelVersion) -> None:
        assert version.backend is not None
        for instance in reversed(version.instances):
            try:
                version.backend.hooks.instance_finalize(instance=instance)
            except Exception:
                log.exception("model '%s' instance '%s' failed to finalize", version.name, instance.name)
        version.instances.clear()

    def _finalize_model(self, version: ModelVersion) -> None:
        assert version.backend is not None and version.context is not None
        try:
            version.backend.hooks.model_finalize(model=version.context)
        except Exception:
            log.exception("model '%s' version %d failed to finalize", version.name, version.version)

    def _notify(self, hook_name: str, context: ModelContext) -> None:
        try:
            self.host.server_hook(hook_name)(model=context)
        except Exception:
            log.exception("a server plugin failed in %s for model '%s'", hook_name, context.name)


def parse_load_parameters(name: str, parameters: Mapping[str, Any]) -> tuple[str | None, dict[str, bytes]]:
    """The ``config`` text and ``file:<path>`` contents of a load request.

    :param parameters: the request's parameters: HTTP gives base64 text for files, gRPC
        bytes (``bytes_param``); other keys are ignored.
    :raises InferError: INVALID_ARG for a ``config`` that is not text or a file that is not
        valid base64.
    """
    config = parameters.get("config")
    if isinstance(config, bytes):
        try:
            config = config.decode("utf-8")
        except UnicodeDecodeError:
            raise InferError.invalid(f"failed to load '{name}': the 'config' parameter is not UTF-8 text") from None
    if config is not None and not isinstance(config, str):
        raise InferError.invalid(f"failed to load '{name}': the 'config' parameter must be a string of ModelConfig JSON")
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


def _write_override(name: str, files: Mapping[str, bytes]) -> Path:
    """Write the files of a load's override model directory into a new private directory.

    :returns: the directory holding ``<name>/`` (removed by the caller when done with it).
    :raises InferError: INVALID_ARG for a model name or a file path that would leave the model
        directory (absolute, ``..``, through a link), before anything is written.
    """
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise InferError.invalid(f"failed to load '{name}': invalid model name for a file override")
    root = Path(tempfile.mkdtemp(prefix="pyserve-override-"))
    try:
        model_dir = root / name
        model_dir.mkdir()
        targets: list[tuple[Path, bytes]] = []
        for relative, content in files.items():
            try:
                targets.append((contained_path(model_dir, relative), content))
            except ValueError as exc:
                raise InferError.invalid(
                    f"failed to load '{name}': invalid file override '{FILE_PREFIX}{relative}': {exc}"
                ) from None
        for target, content in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
            contained_path(model_dir, target.relative_to(model_dir).as_posix())  # no link appeared
            target.write_bytes(content)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root


def _successor(version: ModelVersion, ready: Sequence[ModelVersion]) -> ModelVersion | None:
    """The new version that takes requests still holding a replaced ``version``: the one
    with the same number, else the latest, provided it has the same inputs, outputs and
    transaction policy (those requests were checked against the old ones)."""
    candidates = [v for v in ready if v is not version]
    same = [v for v in candidates if v.version == version.version]
    chosen = same[0] if same else (max(candidates, key=lambda v: v.version) if candidates else None)
    if chosen is None or chosen.io != version.io or chosen.decoupled != version.decoupled:
        return None
    return chosen


def _running_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _describe(exc: BaseException) -> str:
    """An exception as one reason string: type, message and the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"
