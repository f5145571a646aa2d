"""Model control (``--model-control-mode``): which models load, when, and in what order.

``none`` loads every model at startup and refuses the load/unload API; ``poll`` does the same
and re-scans the repositories every ``--repository-poll-secs``, reloading models whose
directory changed; ``explicit`` loads the ``--load-model`` names at startup and everything
else through the API. Loading at startup runs on a small thread pool
(``--model-load-thread-count``); ensembles load after the models they use. At shutdown every
version is unloaded and the backends are finalized, each in reverse order of creation.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyserve.api.errors import ErrorCode, InferError, ModelConfigError
from pyserve.protocol.config_json import model_config_from_json
from pyserve.repository import model_config
from pyserve.repository.scan import ModelSource, fingerprint, scan
from pyserve.runtime.builder import Built
from pyserve.runtime.load_request import FILE_PREFIX, parse_load_parameters, write_override
from pyserve.runtime.loader import ModelLoader
from pyserve.runtime.registry import ModelRegistry, composing
from pyserve.runtime.versions import ModelState

log = logging.getLogger("pyserve.runtime")


class ControlMode(str, enum.Enum):
    """Triton's ``--model-control-mode`` values."""

    NONE = "none"
    POLL = "poll"
    EXPLICIT = "explicit"


CONTROL_NOT_ALLOWED = "explicit model load / unload is not allowed if polling is enabled"
"""Triton's message (503) for the load/unload API outside explicit mode."""

LOAD_ALL = "*"
"""``--load-model=*``: load every model at startup in explicit mode."""


@dataclass(frozen=True)
class ControlSettings:
    """Which models load and when.

    :ivar repositories: the model repository directories.
    :ivar config_name: ``--model-config-name``: models that have ``configs/<name>.pbtxt`` are
        read from it instead of ``config.pbtxt``.
    :ivar control_mode: ``--model-control-mode`` at startup.
    :ivar startup_models: the ``--load-model`` names (explicit mode; ``*`` = all).
    :ivar poll_secs: seconds between repository scans in poll mode.
    :ivar load_threads: models loaded in parallel at startup.
    """

    repositories: Sequence[Path]
    config_name: str = ""
    control_mode: ControlMode = ControlMode.NONE
    startup_models: Sequence[str] = ()
    poll_secs: float = 15.0
    load_threads: int = 4


class ModelControl:
    """The control modes, the poller, the load/unload API and shutdown, driving ``loader``.

    :param registry: the models as loaded (read to decide what to load or unload).
    :param loader: loads and unloads one model at a time (under the model's lock, taken here).
    :param settings: which models load and when.
    """

    def __init__(self, registry: ModelRegistry, loader: ModelLoader, settings: ControlSettings) -> None:
        self._registry = registry
        self._loader = loader
        self.repositories = list(settings.repositories)
        self.config_name = settings.config_name
        self.control_mode = ControlMode(settings.control_mode)
        self.startup_models = list(settings.startup_models)
        self.poll_secs = settings.poll_secs
        self.load_threads = max(1, settings.load_threads)
        self.missing_startup_models: list[str] = []
        """``--load-model`` names the repositories do not hold (``--exit-on-error`` counts them)."""
        self.unfinished: list[str] = []
        """What ``unload_all`` left running at its deadline (empty after a clean shutdown)."""
        self._lock = threading.Lock()
        self._model_locks: dict[str, threading.RLock] = {}
        self._operations = threading.Condition(threading.Lock())
        self._running_operations = 0
        self._closing = False
        self._poll_stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._local = threading.local()
        self._explicit: set[str] = set() if self.startup_models == [LOAD_ALL] else set(self.startup_models)
        """Models loaded by name (``--load-model``, the load API), not only as an ensemble's
        step: ``unload_dependents`` of an ensemble keeps them, as Triton does."""

    def follow_explicitly(self) -> None:
        """Switch to explicit mode: models load and unload only when asked (a frontend's copy of
        the owner's models follows the owner's snapshots that way)."""
        self.control_mode = ControlMode.EXPLICIT

    def scan(self) -> dict[str, ModelSource]:
        """The models in the repositories now, by name.

        :raises ModelConfigError: a repository cannot be read, or two hold the same model name
            in a way that cannot be told apart.
        """
        return scan(self.repositories, self.config_name)

    # -- startup -----------------------------------------------------------------------------
    def load_all(self) -> None:
        """Load the startup models (failures are recorded, not raised).

        Every model in ``none`` and ``poll`` mode, and in ``explicit`` mode the
        ``startup_models`` (all of them for ``*``) together with the models their ensembles use.
        """
        self._load_sources(self.startup_sources(report=True))

    def startup_sources(self, report: bool = False) -> dict[str, ModelSource]:
        """The models ``load_all`` loads, by name.

        :param report: log (and remember in ``missing_startup_models``) the ``--load-model``
            names the repositories do not hold.
        """
        sources = self.scan()
        if self.control_mode is ControlMode.EXPLICIT and self.startup_models != [LOAD_ALL]:
            wanted = self._with_composing(self.startup_models, sources)
            for name in wanted:
                if name not in sources and report:  # as Triton: logged, no index entry, readiness unaffected
                    log.error("failed to load '%s', failed to poll from model repository", name)
                    self.missing_startup_models.append(name)
            sources = {name: sources[name] for name in wanted if name in sources}
        elif self.control_mode is ControlMode.EXPLICIT:  # --load-model=*: each is loaded by name
            self._explicit.update(sources)
        return sources

    def _load_sources(self, sources: Mapping[str, ModelSource]) -> None:
        """Load models in parallel, then the ensembles among them in dependency order."""
        all_steps = {name: self.ensemble_steps(source) for name, source in sources.items()}
        ensembles = {name: steps for name, steps in all_steps.items() if steps is not None}
        plain = [source for name, source in sources.items() if name not in ensembles]
        with ThreadPoolExecutor(self.load_threads, thread_name_prefix="pyserve-load") as pool:
            list(pool.map(lambda source: self._load_quietly(source.name, source), plain))
        pending = dict(ensembles)
        while pending:
            ready = [name for name, steps in pending.items() if not steps & pending.keys()]
            if not ready:
                for name in sorted(pending):
                    self._loader.commit(name, Built(
                        sources[name], fingerprint(sources[name].path),
                        error="the ensemble depends on ensembles that depend on it (a cycle)",
                    ))
                return
            for name in sorted(ready):
                del pending[name]
                self._load_quietly(name, sources[name])

    def _load_quietly(self, name: str, source: ModelSource) -> None:
        """Load one model (or start what ``prepare`` built of it), logging (not raising) a failure."""
        with self._model_lock(name):
            if not self._loader.start_prepared(name):
                self._loader.load(name, source)

    def ensemble_steps(self, source: ModelSource) -> set[str] | None:
        """The models an ensemble's steps name, or None if ``source`` is not a readable ensemble."""
        try:
            config = self._loader.read_config(source)
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
            steps = self.ensemble_steps(source) if source is not None else None
            todo.extend(sorted(s for s in steps or () if s in sources))
        return wanted

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
            sources = self.scan()
        except ModelConfigError as exc:
            log.error("cannot poll the model repositories: %s", exc)
            return
        for name in sorted(set(self._registry.records) - set(sources)):
            if self._poll_stop.is_set():
                return
            log.info("model '%s' was removed from the repository; unloading it", name)
            self.unload_model(name, forget=True)
        records = dict(self._registry.records)
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
            name for name, record in list(self._registry.records.items())
            if name in sources and composing(record) & changed
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

    def adopt_prepared(self, name: str, config: Any) -> bool:
        """Start the versions of ``name`` that ``prepare`` built before the fork, provided they
        were built with ``config`` (a replica following its owner's config); blocking.

        :returns: False when none were (or with another config): ``load_model`` it instead.
        """
        with self._operation(), self._model_lock(name):
            return self._loader.start_prepared(name, config)

    def load_model(self, name: str, config: str | None = None, files: Mapping[str, bytes] | None = None) -> None:
        """Load or reload one model (blocking); its ensembles' composing models come first.

        :param config: ModelConfig JSON used instead of config.pbtxt.
        :param files: relative path → contents of an override model directory (requires
            ``config``); the model is then loaded from a private copy of these files only.
        :raises InferError: the model does not exist, the override is invalid, or no
            version could be loaded (the previous versions, if any, keep serving).
        """
        with self._operation():
            self._explicit.add(name)
            override_config = None
            if config is not None:
                try:
                    override_config = model_config_from_json(config)
                except ValueError as exc:
                    raise InferError.invalid(f"failed to load '{name}': the 'config' parameter: {exc}") from None
                if override_config.name and override_config.name != name:
                    raise InferError.invalid(
                        f"failed to load '{name}': the load request's 'config' parameter: field 'name': "
                        f"'{override_config.name}' does not match the model directory name '{name}'"
                    )
            if files and override_config is None:
                raise InferError.invalid(
                    f"failed to load '{name}': file overrides ('{FILE_PREFIX}<path>' parameters) "
                    "require the 'config' parameter"
                )
            try:
                sources = self.scan()
            except ModelConfigError as exc:
                raise InferError(f"failed to load '{name}': {exc}", ErrorCode.INTERNAL) from None
            override_dir = write_override(name, files) if files else None
            if override_dir is not None:
                source = ModelSource(name, override_dir / name, override_dir)
            elif name in sources:
                source = sources[name]
            else:
                raise InferError(f"failed to load '{name}', failed to poll from model repository", ErrorCode.INTERNAL)
            if override_config is None and override_dir is None and self._loaded_as_on_disk(name, source):
                log.debug("model '%s' is loaded and unchanged on disk: nothing to load", name)
                return
            steps = self._steps_of(override_config) if override_config is not None else self.ensemble_steps(source)
            self._local.loading = {name}
            try:
                for step in sorted(steps or ()):
                    self._load_composing(step, sources)
            finally:
                self._local.loading = set()
            with self._model_lock(name):
                error = self._loader.load(name, source, override_config, override_dir)
            if error:  # Triton 2.51 answers a model that fails to load with 400 / INVALID_ARGUMENT
                raise InferError(f"load failed for model '{name}': {error}", ErrorCode.INVALID_ARG)

    def _loaded_as_on_disk(self, name: str, source: ModelSource) -> bool:
        """Whether a plain load of ``name`` would change nothing, so that it is not reloaded, as
        Triton does not reload it: every version READY, loaded from ``source`` as its files are
        now, by a load that loaded every version (a config given by an earlier load request is
        kept, as in Triton, until the files change).
        """
        record = self._registry.records.get(name)
        return (
            record is not None
            and record.state is ModelState.READY
            and bool(record.versions)
            and all(version.ready for version in record.versions.values())
            and record.override_dir is None
            and record.source.path == source.path
            and record.source.conflict == source.conflict
            and record.clean_load
            and record.fingerprint is not None
            and record.fingerprint == fingerprint(source.path)
        )

    def _load_composing(self, name: str, sources: Mapping[str, ModelSource]) -> None:
        """Load a model an ensemble uses, unless it is loaded (or being loaded) already."""
        record = self._registry.records.get(name)
        if record is not None and record.ready_versions():
            return
        loading: set[str] = getattr(self._local, "loading", set())
        source = sources.get(name)
        if source is None or name in loading:
            return  # the ensemble's own load reports the missing step model
        self._local.loading = loading | {name}
        try:
            steps = self.ensemble_steps(source)
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
            and, for an ensemble, the models it uses that no other loaded ensemble uses and that
            were not loaded by name themselves (as Triton keeps those).
        :param forget: drop the model from the index as well (it left the repository).
        """
        with self._operation():
            self._unload(name, unload_dependents, forget, set())

    def _unload(self, name: str, dependents: bool, forget: bool, seen: set[str]) -> None:
        if name in seen:
            return
        seen.add(name)
        record = self._registry.records.get(name)
        if record is None:
            return
        uses = composing(record)
        if dependents:
            for other, other_record in sorted(list(self._registry.records.items()), key=lambda item: item[0]):
                if other not in seen and name in composing(other_record):
                    self._unload(other, True, False, seen)
        with self._model_lock(name):
            self._loader.unload_record(record, forget)
        self._explicit.discard(name)
        if dependents:
            for step in sorted(uses - self._registry.in_use()):
                self._unload_down(step, seen)

    def _unload_down(self, name: str, seen: set[str]) -> None:
        """Unload a composing model of an unloaded ensemble, and its own composing models."""
        record = self._registry.records.get(name)
        if name in seen or record is None or name in self._explicit:
            return
        seen.add(name)
        uses = composing(record)
        with self._model_lock(name):
            self._loader.unload_record(record, False)
        for step in sorted(uses - self._registry.in_use()):
            self._unload_down(step, seen)

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

    # -- shutdown ----------------------------------------------------------------------------
    def unload_all(self, timeout: float | None = None) -> None:
        """Stop polling, refuse further loads, unload every READY version (reverse load
        order), then finalize the backends.

        :param timeout: seconds to wait, in all, for loads in progress and executes still
            running; ``None`` waits for them. A version whose instances are still executing
            when the time is up is left as it is (its instances, model and backend are not
            finalized, since the contract never finalizes during an execute), so that
            shutdown cannot hang on a stuck backend. What is left running is listed in
            ``unfinished`` (the server then exits at once, as Triton does).
        """
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        self.stop_polling()
        unfinished: list[str] = []
        with self._operations:
            self._closing = True
            self._loader.begin_shutdown()
            while self._running_operations:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    log.error("shutting down while %d model load(s)/unload(s) are still running",
                              self._running_operations)
                    unfinished.append(f"{self._running_operations} model load(s)/unload(s)")
                    break
                self._operations.wait(remaining)
        unfinished += self._loader.shutdown(deadline, loads_running=bool(unfinished))
        self.unfinished = unfinished
