"""Loading and unloading models: config → backend → model → instances, and back in reverse.

One failing model never stops the others: its versions become UNAVAILABLE with a reason
naming the file, field, backend or exception. Loading runs on a small thread pool
(``--model-load-thread-count``); unloading finalizes instances, then the model, and at
shutdown the backends, each in reverse order of creation.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pyserve import model_config
from pyserve.backend import BackendContext, InstanceContext, ModelContext
from pyserve.errors import InferError, ModelConfigError
from pyserve.models import ModelRecord, ModelState, ModelVersion
from pyserve.plugins import BackendUnavailable, LoadedBackend, PluginHost
from pyserve.protocol import ModelConfig
from pyserve.repository import ModelSource, scan, select_versions, version_numbers
from pyserve.scheduling import InstanceWorker, scheduler_for
from pyserve.scheduling.ensemble import EnsembleScheduler, build_plan

log = logging.getLogger("pyserve.models")


class ModelManager:
    """Owns every model of the server and their life cycle.

    Thread-safety: ``load_all`` and ``unload_all`` are called from one control thread;
    ``get`` is called on the event loop for every request and only reads dicts.

    :param repositories: the model repository directories.
    :param host: the plugin host that supplies backends.
    :param auto_complete: let backends complete configs (off with ``--strict-model-config``).
    :param backend_config: ``--backend-config`` settings per backend name (``""`` = all).
    :param load_threads: models loaded in parallel.
    """

    def __init__(
        self,
        repositories: list[Path],
        host: PluginHost,
        *,
        auto_complete: bool = True,
        backend_config: Mapping[str, Mapping[str, str]] | None = None,
        load_threads: int = 4,
    ) -> None:
        self.repositories = repositories
        self.host = host
        self.auto_complete = auto_complete
        self.backend_config = {k: dict(v) for k, v in (backend_config or {}).items()}
        self.load_threads = max(1, load_threads)
        self.records: dict[str, ModelRecord] = {}
        self._backend_contexts: dict[str, BackendContext] = {}
        self._initialized_backends: list[tuple[LoadedBackend, BackendContext]] = []
        self._load_order: list[ModelVersion] = []
        self._pending_ensembles: list[tuple[ModelRecord, Any]] = []
        self.server_handle: Any = None  # set by the server before loading (BLS)
        self._lock = threading.Lock()

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
        """Triton's strict readiness: every model has a version and every version is READY."""
        for record in self.records.values():
            if not record.versions:
                return False
            for v in record.versions.values():
                if v.state is not ModelState.READY and not (
                    v.state is ModelState.UNAVAILABLE and v.reason == "unloaded"
                ):
                    return False
        return True

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """The repository index, one entry per model version (or per model with no version)."""
        entries: list[dict[str, str]] = []
        for name in sorted(self.records):
            record = self.records[name]
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

    # -- loading -----------------------------------------------------------------------------
    def load_all(self) -> None:
        """Scan the repositories and load every model (failures are recorded, not raised)."""
        sources = scan(self.repositories)
        for name, source in sources.items():
            self.records[name] = ModelRecord(name, source)
        with ThreadPoolExecutor(self.load_threads, thread_name_prefix="pyserve-load") as pool:
            list(pool.map(self._load_record, self.records.values()))
        self._load_ensembles()

    def _load_ensembles(self) -> None:
        """Load ensembles once the models they name are loaded (ensembles of ensembles too)."""
        pending = list(self._pending_ensembles)
        self._pending_ensembles.clear()
        while pending:
            waiting_names = {record.name for record, _ in pending}
            ready = [
                (record, config) for record, config in pending
                if not any(step.model_name in waiting_names for step in config.ensemble_scheduling.step)
            ]
            if not ready:
                for record, _ in pending:
                    record.fail("the ensemble depends on ensembles that depend on it (a cycle)")
                return
            for item in ready:
                pending.remove(item)
                self._load_ensemble(*item)

    def _load_ensemble(self, record: ModelRecord, config: Any) -> None:
        source = record.source
        selected, _ = select_versions(config.version_policy, version_numbers(source.path))
        if not selected:
            record.fail(f"no version directory (a numeric folder such as '1') in '{source.path}'")
            return
        problems = model_config.validate(config, source.path)
        for number in selected:
            version = ModelVersion(record.name, number)
            record.versions[number] = version
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
            version.scheduler = EnsembleScheduler(record.name, steps, version.io, self.get)
            version.state = ModelState.READY
            with self._lock:
                self._load_order.append(version)
        record.state = ModelState.READY if record.ready_versions() else ModelState.UNAVAILABLE
        for v in record.versions.values():
            if v.state is not ModelState.READY:
                log.error("model '%s' version %d is UNAVAILABLE: %s", record.name, v.version, v.reason)

    def _load_record(self, record: ModelRecord) -> None:
        try:
            self._load_model(record)
        except Exception as exc:  # a bug in one model's load must not stop the others
            log.exception("model '%s' failed to load", record.name)
            record.fail(f"{type(exc).__name__}: {exc}")
        for v in record.versions.values():
            if v.state is not ModelState.READY:
                log.error("model '%s' version %d is UNAVAILABLE: %s", record.name, v.version, v.reason)
        if record.state is ModelState.UNAVAILABLE:
            log.error("model '%s' is UNAVAILABLE: %s", record.name, record.reason)

    def _load_model(self, record: ModelRecord) -> None:
        source = record.source
        if source.conflict:
            record.fail(source.conflict)
            return
        try:
            config = self.read_config(source)
        except ModelConfigError as exc:
            record.fail(str(exc))
            return
        if config.platform == model_config.ENSEMBLE_PLATFORM:
            with self._lock:
                self._pending_ensembles.append((record, config))
            return  # loaded after every other model, see _load_ensembles
        try:
            versions = version_numbers(source.path)
        except OSError as exc:
            record.fail(f"cannot list versions in '{source.path}': {exc}")
            return
        selected, problems = select_versions(config.version_policy, versions)
        if not selected:
            record.fail(
                "; ".join(problems) if problems
                else f"no version directory (a numeric folder such as '1') in '{source.path}'"
            )
            return
        for problem in problems:  # Triton loads the versions that exist and logs the others
            log.error("model '%s': %s; loading the other versions", record.name, problem)
        try:
            backend, backend_ctx = self._backend_for(config.backend)
        except BackendUnavailable as exc:
            record.fail(str(exc))
            return
        for number in selected:
            version = ModelVersion(record.name, number)
            record.versions[number] = version
            self._load_version(source, config, number, version, backend, backend_ctx)
        record.state = ModelState.READY if record.ready_versions() else ModelState.UNAVAILABLE

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

    def _backend_for(self, name: str) -> tuple[LoadedBackend, BackendContext]:
        backend = self.host.backend(name)
        with backend.lock:
            context = self._backend_contexts.get(name)
            if context is None:
                settings = {
                    "auto-complete-config": "true" if self.auto_complete else "false",
                    "default-max-batch-size": "4",
                    **self.backend_config.get("", {}),
                    **self.backend_config.get(name, {}),
                }
                context = BackendContext(name=name, config=settings)
                self._backend_contexts[name] = context
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
        version.state = ModelState.READY
        with self._lock:
            self._load_order.append(version)
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
        """Unload every READY version (reverse load order), then finalize the backends.

        :param timeout: seconds to wait, in all, for executes still running; ``None`` waits
            for them. A version whose instances are still executing when the time is up is
            left as it is (its instances, model and backend are not finalized, since the
            contract never finalizes during an execute), so that shutdown cannot hang on a
            stuck backend.
        """
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._lock:
            order = list(reversed(self._load_order))
            self._load_order.clear()
        stuck: set[str] = set()
        for version in order:
            if not self.unload_version(version, deadline) and version.backend is not None:
                stuck.add(version.backend.info.name)
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
        version.state = ModelState.UNLOADING
        if version.scheduler is not None:
            version.scheduler.stop(len(version.workers))
        for worker in version.workers:
            worker.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        busy = [w.instance.name for w in version.workers if w.is_alive()]
        if busy:
            log.error(
                "model '%s' version %d: instance(s) %s still executing at the exit timeout; "
                "not finalized", version.name, version.version, ", ".join(busy),
            )
            return False
        if version.backend is not None:  # ensembles have no backend
            self._finalize_instances(version)
            self._finalize_model(version)
        version.state = ModelState.UNAVAILABLE
        version.reason = "unloaded"
        if version.context is not None:
            self._notify("pyserve_model_unloaded", version.context)
        return True

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


def _describe(exc: BaseException) -> str:
    """An exception as one reason string: type, message and the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"

