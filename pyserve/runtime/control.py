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
import base64
import binascii
import contextlib
import enum
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pyserve.api.errors import ErrorCode, InferError, ModelConfigError
from pyserve.protocol.config_json import model_config_from_json
from pyserve.repository import model_config
from pyserve.repository.scan import (
    ModelSource,
    contained_path,
    fingerprint,
    scan,
)
from pyserve.runtime.loader import ModelLoader, _Built
from pyserve.runtime.versions import ModelRecord

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

FILE_PREFIX = "file:"
"""Load parameters named ``file:<path>`` carry a file of an override model directory."""


class ModelControl(ModelLoader):
    """The control modes, the poller, the load/unload API and shutdown, on top of
    ``ModelLoader``; the base of ``ModelManager``, which sets the state below in its
    ``__init__``."""

    repositories: list[Path]
    load_threads: int
    control_mode: ControlMode
    startup_models: list[str]
    missing_startup_models: list[str]
    """``--load-model`` names the repositories do not hold (``--exit-on-error`` counts them)."""
    poll_secs: float
    config_name: str
    _model_locks: dict[str, threading.RLock]
    _operations: threading.Condition
    _running_operations: int
    _poll_stop: threading.Event
    _poller: threading.Thread | None
    _local: threading.local

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
        sources = scan(self.repositories, self.config_name)
        if self.control_mode is ControlMode.EXPLICIT and self.startup_models != [LOAD_ALL]:
            wanted = self._with_composing(self.startup_models, sources)
            for name in wanted:
                if name not in sources and report:  # as Triton: logged, no index entry, readiness unaffected
                    log.error("failed to load '%s', failed to poll from model repository", name)
                    self.missing_startup_models.append(name)
            sources = {name: sources[name] for name in wanted if name in sources}
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
                    self._commit(name, _Built(
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
            if not self.start_prepared(name):
                self._load_locked(name, source)

    def ensemble_steps(self, source: ModelSource) -> set[str] | None:
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
            sources = scan(self.repositories, self.config_name)
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

    def adopt_prepared(self, name: str, config: Any) -> bool:
        """Start the versions of ``name`` that ``prepare`` built before the fork, provided they
        were built with ``config`` (a replica following its owner's config); blocking.

        :returns: False when none were (or with another config): ``load_model`` it instead.
        """
        with self._operation(), self._model_lock(name):
            return self.start_prepared(name, config)

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
                sources = scan(self.repositories, self.config_name)
            except ModelConfigError as exc:
                raise InferError(f"failed to load '{name}': {exc}", ErrorCode.INTERNAL) from None
            override_dir = _write_override(name, files) if files else None
            if override_dir is not None:
                source = ModelSource(name, override_dir / name, override_dir)
            elif name in sources:
                source = sources[name]
            else:
                raise InferError(f"failed to load '{name}', failed to poll from model repository", ErrorCode.INTERNAL)
            steps = self._steps_of(override_config) if override_config is not None else self.ensemble_steps(source)
            self._local.loading = {name}
            try:
                for step in sorted(steps or ()):
                    self._load_composing(step, sources)
            finally:
                self._local.loading = set()
            with self._model_lock(name):
                error = self._load_locked(name, source, override_config, override_dir)
            if error:  # Triton 2.51 answers a model that fails to load with 400 / INVALID_ARGUMENT
                raise InferError(f"load failed for model '{name}': {error}", ErrorCode.INVALID_ARG)

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
            for user in list(self.records.values()):
                if user.ready_versions():
                    still_used |= self._composing(user)
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
            while self._running_operations:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    log.error("shutting down while %d model load(s)/unload(s) are still running",
                              self._running_operations)
                    unfinished.append(f"{self._running_operations} model load(s)/unload(s)")
                    break
                self._operations.wait(remaining)
        with self._lock:
            order = list(reversed(self._load_order))
            self._load_order.clear()
        stuck: set[str] = set()
        for version in order:
            if not self.unload_version(version, deadline) and version.backend is not None:
                stuck.add(version.backend.info.name)
                unfinished.append(f"model '{version.name}' version {version.version}")
        with self._lock:
            draining = list(self._draining.items())
        for thread, versions in draining:  # versions retired by an unload or reload earlier
            thread.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            if thread.is_alive():
                for version in versions:
                    unfinished.append(f"model '{version.name}' version {version.version}")
                    if version.backend is not None:
                        stuck.add(version.backend.info.name)
        self.unfinished = unfinished
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
        loads_left = bool(unfinished) and unfinished[0].endswith("load(s)/unload(s)")
        for backend, context in backends:
            if backend.info.name in stuck or loads_left:  # a load still running may be using any
                log.error("backend '%s' not finalized: some of its models are still executing", backend.info.name)
                continue
            try:
                backend.hooks.backend_finalize(backend=context)
            except Exception:
                log.exception("backend '%s' failed to finalize", backend.info.name)
            backend.initialized = False


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


NAME_MAX = 255
"""The longest file name (one path component, in bytes) the override directory can hold."""


def _override_problem(relative: str, files: Mapping[str, bytes]) -> str:
    """Why a ``file:<path>`` key cannot be written as a file of the override directory, or ""."""
    if relative.endswith("/"):
        return "the path ends with '/': it must name a file"
    for part in relative.split("/"):
        if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX:
            return f"a path component is longer than {NAME_MAX} bytes"
    parent = relative
    while "/" in parent:
        parent = parent.rsplit("/", 1)[0]
        if parent in files:
            return f"'{FILE_PREFIX}{parent}' is a file, so it cannot also be a directory"
    return ""


def _write_override(name: str, files: Mapping[str, bytes]) -> Path:
    """Write the files of a load's override model directory into a new private directory.

    :returns: the directory holding ``<name>/`` (removed by the caller when done with it).
    :raises InferError: INVALID_ARG for a model name or a file path that would leave the model
        directory (absolute, ``..``, through a link), that is too long, ends with ``/`` or uses a
        file as a directory, before anything is written; also (still INVALID_ARG, and without
        the private directory's path) for a file the system refuses to write.
    """
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise InferError.invalid(f"failed to load '{name}': invalid model name for a file override")
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        raise InferError.invalid(f"failed to load model: the name is longer than {NAME_MAX} bytes")
    root = Path(tempfile.mkdtemp(prefix="pyserve-override-"))
    try:
        model_dir = root / name
        model_dir.mkdir()
        targets: list[tuple[str, Path, bytes]] = []
        for relative, content in files.items():
            try:
                problem = _override_problem(relative, files)
                if problem:
                    raise ValueError(problem)
                targets.append((relative, contained_path(model_dir, relative), content))
            except ValueError as exc:
                raise InferError.invalid(
                    f"failed to load '{name}': invalid file override '{FILE_PREFIX}{relative}': {exc}"
                ) from None
        for relative, target, content in targets:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                contained_path(model_dir, target.relative_to(model_dir).as_posix())  # no link appeared
                target.write_bytes(content)
            except (OSError, ValueError) as exc:  # the message names no path of this machine
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
                raise InferError.invalid(
                    f"failed to load '{name}': file override '{FILE_PREFIX}{relative}' cannot be written: {reason}"
                ) from None
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root
