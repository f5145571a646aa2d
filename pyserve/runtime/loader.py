"""Loading and unloading one model and its versions: config → backend → model → instances →
scheduler (and warmup), and back.

One failing model never stops the others: its versions become UNAVAILABLE with a reason
naming the file, field, backend or exception. Unloading finalizes instances, then the model,
each in reverse order of creation.

A reload never interrupts serving: the new versions are built (and warmed up) on the side
while the old ones serve; then, on the event loop, the record's versions are swapped in one
assignment and the replaced versions stop taking requests, finish what they have queued and
are finalized. A reload that fails keeps the old versions serving.

Retired versions (replaced or unloaded) drain on a thread of their own: the load or unload that
retired them waits for that at most ``unload_wait_secs`` (the server's ``--exit-timeout-secs``),
then returns while an execute that does not end keeps its instance (it is finalized when it ends,
or abandoned at exit); the model's lock is not held meanwhile, so other repository calls go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyserve.api.backend import BackendContext, InstanceContext, ModelContext
from pyserve.api.errors import ModelConfigError
from pyserve.host.plugins import BackendUnavailable, LoadedBackend, PluginHost
from pyserve.metrics import CustomMetrics
from pyserve.metrics.summaries import LatencySummaries
from pyserve.protocol import ModelConfig
from pyserve.repository import model_config
from pyserve.repository.ensemble_plan import build_plan
from pyserve.repository.scan import (
    Fingerprint,
    ModelSource,
    fingerprint,
    select_versions,
    version_numbers,
)
from pyserve.runtime import load_reasons
from pyserve.runtime.load_reasons import describe
from pyserve.runtime.scheduling import (
    InstanceWorker,
    LoopScheduler,
    LoopShortcut,
    scheduler_for,
)
from pyserve.runtime.scheduling.ensemble import EnsembleScheduler
from pyserve.runtime.scheduling.rate_limiter import RateLimiter, RateLimitError, instance_claim
from pyserve.runtime.versions import ModelRecord, ModelState, ModelVersion
from pyserve.runtime.warmup import WarmupError, run_warmup

log = logging.getLogger("pyserve.runtime")

STOP_GRACE_S = 0.1
"""Seconds a stopped worker gets to end even when the exit deadline has passed."""

STEPS_UNAVAILABLE = "ensemble contains models that are not available or no longer fit: "
"""How the reason of an ensemble version made UNAVAILABLE by a change of its step models starts."""


class NotForkSafe(Exception):
    """While preparing a model before a fork: it must be loaded after the fork (the message
    says why)."""


@dataclass
class Preparing:
    """How to load models before a fork (``ModelLoader.prepare``).

    :ivar refusal: called with a version whose model was created (config complete): why it
        must not be prepared (e.g. it will not be replicated), or None.
    :ivar config_refusal: the same question about the config as read, before the backend is
        even resolved (``""``: not wanted, quietly), or None.
    :ivar count_threads: the process's threads now (native ones too).
    :ivar threads: how many threads may run: those before the first load, plus what each
        backend that declared itself fork-safe started in its initialize (a model's load
        must start none).
    """

    refusal: Callable[[ModelVersion], str | None]
    config_refusal: Callable[[str, Any], str | None]
    count_threads: Callable[[], int]
    threads: int = 0

    def __post_init__(self) -> None:
        self.threads = self.count_threads()


def _asks_fork_safe(backend: LoadedBackend, context: BackendContext) -> bool:
    """The backend's ``pyserve_backend_fork_safe`` answer (False when it raises or is silent)."""
    try:
        return bool(backend.hooks.backend_fork_safe(backend=context))
    except Exception:
        log.exception("backend '%s' failed in pyserve_backend_fork_safe", backend.info.name)
        return False


def _ready_again(version: ModelVersion) -> None:
    version.state = ModelState.READY
    version.reason = ""


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
    prepared_fingerprint: Fingerprint | None = None
    """``prepare``: the model directory's fingerprint once its versions were built (what loading
    itself wrote there included), to tell later changes from it."""
    config_origin: Path | str = ""
    """Where the config came from, for messages: its file (or the model directory when there
    is none: auto-complete), or the load request that carried it."""


class ModelLoader:
    """Builds, swaps in, retires and finalizes the versions of one model at a time; the base
    of ``ModelManager``, which sets the state below in its ``__init__``."""

    host: PluginHost
    auto_complete: bool
    backend_config: dict[str, dict[str, str]]
    backend_directory: str | None
    load_retries: int
    records: dict[str, ModelRecord]
    repositories: list[Path]  # the model repositories: reasons name files relative to them
    server_handle: Any
    loop: asyncio.AbstractEventLoop | None
    custom_metrics: CustomMetrics
    get: Callable[..., ModelVersion]  # ``ModelManager.get``: how ensemble steps find their models
    _backend_contexts: dict[LoadedBackend, BackendContext]
    _initialized_backends: list[tuple[LoadedBackend, BackendContext]]
    _load_order: list[ModelVersion]
    _lock: threading.Lock
    _leftover_dirs: list[Path]
    _closing: bool  # shutdown began: no more ensemble re-checks
    latency_summaries: bool  # --metrics-config summary_latencies=true: versions record them
    rate_limiter: RateLimiter | None
    unload_wait_secs: float  # how long a load or unload waits for the versions it retired
    _draining: dict[threading.Thread, list[ModelVersion]]  # retired versions still draining
    cpu_threads: int | None  # ``BackendContext.cpu_threads`` of every backend
    _preparing: Preparing | None  # set while ``prepare`` loads a model before a fork
    prepared: dict[str, _Built]  # models ``prepare`` built, waiting for ``start_prepared``

    # -- loading before a fork -----------------------------------------------------------------
    def prepare(self, name: str, source: ModelSource, rules: Preparing) -> str | None:
        """Build a model's versions without starting them, for a process that forks next.

        Call on the main thread while no other thread runs. Failures are not recorded: a model
        that cannot be prepared (or fails) is loaded again, normally, after the fork.

        :returns: None when every selected version is prepared (kept in ``prepared``), else
            why the model is left for after the fork: ``NotForkSafe``'s reason, or "" when it
            failed to load (the load after the fork reports that).
        """
        built = _Built(source, fingerprint(source.path))
        self._preparing = rules
        try:
            self._build(built, None)
        except NotForkSafe as exc:
            self.discard_prepared(built)
            return str(exc)
        except Exception:  # a bug in one model's load: the normal load reports it
            self.discard_prepared(built)
            return ""
        finally:
            self._preparing = None
        if built.error or not built.versions or not all(v.prepared for v in built.versions.values()):
            self.discard_prepared(built)
            return ""
        built.prepared_fingerprint = fingerprint(source.path)
        self.prepared[name] = built
        return None

    def discard_prepared(self, built: _Built) -> None:
        """Finalize the versions of ``built`` that were prepared and never started."""
        for version in built.versions.values():
            if version.prepared and version.backend is not None:
                version.prepared = False
                self._finalize_instances(version)
                self._finalize_model(version)

    def start_prepared(self, name: str, config: Any = None) -> bool:
        """Start and swap in the prepared versions of ``name`` (the model's lock is held).

        :param config: the config the caller expects (a replica: the owner's); the prepared
            model is used only if its config is the same. None: any.
        :returns: False when nothing is prepared for ``name`` (or it differs): load it normally.
        """
        built = self.prepared.pop(name, None)
        if built is None:
            return False
        configs = [v.config for v in built.versions.values()]
        if (config is not None and any(c != config for c in configs)) or (
                config is None and built.prepared_fingerprint != fingerprint(built.source.path)):
            self.discard_prepared(built)  # changed since: a normal load reads it again
            return False
        for version in built.versions.values():
            self._start_version(version, built.source.path)
        self._commit(name, built)
        return True

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
                built.config_origin = model_config.LOAD_REQUEST_CONFIG
                config = ModelConfig()
                config.CopyFrom(override_config)
                model_config.normalize(config, source.path, self.host.platform_backend, built.config_origin)
            else:
                path = source.config_path
                built.config_origin = path if path.exists() else source.path
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
        if self._preparing is not None:
            refusal = self._preparing.config_refusal(source.name, config)
            if refusal is not None:
                raise NotForkSafe(refusal)
        try:
            backend, backend_ctx = self._backend_for(config, source.path, selected)
        except BackendUnavailable as exc:
            built.error = str(exc)
            return
        for number in selected:
            for attempt in range(self.load_retries + 1):  # --model-load-retry-count
                version = self._new_version(source.name, number)
                built.versions[number] = version
                self._load_version(built, config, number, version, backend, backend_ctx)
                if version.ready or version.prepared or attempt == self.load_retries:
                    break
                log.warning("model '%s' version %d failed to load (%s); retry %d of %d",
                            source.name, number, version.reason, attempt + 1, self.load_retries)

    def _build_ensemble(self, built: _Built, config: Any, selected: list[int]) -> None:
        source = built.source
        problems = model_config.validate(config, source.path)
        for number in selected:
            version = self._new_version(source.name, number)
            built.versions[number] = version
            if problems:
                version.fail(f"{built.config_origin}: " + "; ".join(problems))
                continue
            version.config = config
            version.io = model_config.model_io(config, source.path)
            try:
                steps = build_plan(config, version.io, self.get)
            except ValueError as exc:
                version.fail(f"{built.config_origin}: invalid ensemble: " + "; ".join(str(exc).splitlines()))
                continue
            version.scheduler = EnsembleScheduler(source.name, steps, version.io, self.get)
            _metric_options(version, config)
            version.stats.load_duration_s = 0.0  # nothing to load: its steps are models of their own
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
        roots = self.repositories
        for version in failures:  # the log gets the full text, clients the reason (load_reasons)
            full = version.detail or version.reason
            log.error("model '%s' version %d is UNAVAILABLE: %s", name, version.version, full)
            version.reason, version.detail = load_reasons.public(version.reason, roots), full
        error_detail = built.error
        if built.error:
            log.error("model '%s' is UNAVAILABLE: %s", name, built.error)
            built.error = load_reasons.public(built.error, roots)
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
                target.fail(built.error, error_detail)
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
        self._drain_retired(name, retired, lambda: self._remove_override(stale_dir))
        self._recheck_ensembles(name)
        if built.error:
            return built.error
        if failures:
            return "; ".join(f"version {v.version} is at UNAVAILABLE state: {v.reason}" for v in failures)
        return ""

    def _new_version(self, name: str, number: int) -> ModelVersion:
        version = ModelVersion(name, number)
        if self.latency_summaries:
            version.stats.summaries = LatencySummaries()
        return version

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
        model_config.normalize(config, source.path, self.host.platform_backend, path)
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
                context = BackendContext(name=name, config=settings, metrics=self.custom_metrics,
                                         cpu_threads=self.cpu_threads)
                self._backend_contexts[backend] = context
            if backend.init_error is not None:
                raise BackendUnavailable(backend.init_error)
            if self._preparing is not None and not backend.initialized:
                if not _asks_fork_safe(backend, context):
                    raise NotForkSafe(f"backend '{name}' does not say its models can be loaded before a fork")
            if not backend.initialized:
                try:
                    backend.hooks.backend_initialize(backend=context)
                except Exception as exc:
                    backend.init_error = f"backend '{name}' failed to initialize: {type(exc).__name__}: {exc}"
                    log.error("%s", backend.init_error)
                    raise BackendUnavailable(backend.init_error) from exc
                backend.initialized = True
                if self._preparing is not None:  # its own threads (a library's timer): declared safe
                    self._preparing.threads = self._preparing.count_threads()
                with self._lock:
                    self._initialized_backends.append((backend, context))
        return backend, context

    def _load_version(
        self,
        built: _Built,
        base_config: Any,
        number: int,
        version: ModelVersion,
        backend: LoadedBackend,
        backend_ctx: BackendContext,
    ) -> None:
        """Create one version and start it; while preparing (``prepare``), only create it."""
        if not self._create_version(built, base_config, number, version, backend, backend_ctx):
            return
        if self._preparing is not None:
            version.prepared = True
            return
        self._start_version(version, built.source.path)

    def _create_version(
        self,
        built: _Built,
        base_config: Any,
        number: int,
        version: ModelVersion,
        backend: LoadedBackend,
        backend_ctx: BackendContext,
    ) -> bool:
        """Auto-complete, validate, create the model, its instances, scheduler and workers
        (not started). :returns: False when the version failed (its reason is set).

        :raises NotForkSafe: while preparing, a model that must be loaded after the fork
            (its model was finalized).
        """
        started = time.monotonic_ns()
        source = built.source
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
            statistics=version.stats,
        )
        hooks = backend.hooks
        if self.auto_complete:
            try:
                if hooks.model_auto_complete(model=context):
                    model_config.normalize(config, source.path, self.host.platform_backend, built.config_origin)
            except Exception as exc:
                version.fail(*describe("auto-complete of the config failed", exc))
                return False
        problems = model_config.validate(config, source.path)
        if problems:
            version.fail(f"{built.config_origin}: " + "; ".join(problems))
            return False
        version.config = config
        version.io = model_config.model_io(config, source.path)
        _metric_options(version, config)
        version.context = context
        version.backend = backend
        context.fork_safe = self._preparing is not None
        try:
            context.state = hooks.model_create(model=context)
        except Exception as exc:
            version.fail(*describe(f"backend '{backend.info.name}' failed to create the model", exc))
            return False
        if self._preparing is not None:
            refusal = self._preparing.refusal(version)
            if refusal is not None:
                self._finalize_model(version)
                raise NotForkSafe(refusal)
        try:
            self._create_instances(version, context, backend)
        except Exception as exc:
            self._finalize_instances(version)
            self._finalize_model(version)
            version.fail(*describe(f"backend '{backend.info.name}' failed to create an instance", exc))
            return False
        limiter = self.rate_limiter if any(c.needs for c in version.rate_claims) else None
        if limiter is not None:
            try:
                limiter.register(version.rate_claims)
            except RateLimitError as exc:
                version.rate_claims = []
                self._finalize_instances(version)
                self._finalize_model(version)
                version.fail(f"rate limiter: {exc}")
                return False
        try:
            scheduler = scheduler_for(
                config, version.io, len(version.instances), source.path, inline_allowed=limiter is None,
                adaptive_default=context.compute_only and all(i.kind == "CPU" for i in version.instances),
            )
        except ValueError as exc:
            self._finalize_instances(version)
            self._finalize_model(version)
            version.fail(f"{built.config_origin}: {exc}")
            return False
        version.scheduler = scheduler
        version.workers = [
            InstanceWorker(inst, backend, scheduler.batch_source(i), version.io, scheduler.observe,
                           getattr(scheduler, "iterations", None),
                           rate=(limiter, version.rate_claims[i]) if limiter is not None else None)
            for i, inst in enumerate(version.instances)
        ]
        if isinstance(scheduler, (LoopScheduler, LoopShortcut)):  # they execute on the loop
            scheduler.attach(version.workers)
        version.stats.load_duration_s = (time.monotonic_ns() - started) / 1e9  # _start_version adds its part
        return True

    def _start_version(self, version: ModelVersion, model_path: Path) -> None:
        """Start a created version's instance threads, warm it up, and make it READY (or
        UNAVAILABLE with the reason, everything it made finalized)."""
        assert version.config is not None and version.context is not None
        started = time.monotonic_ns()
        version.prepared = False
        try:
            for worker in version.workers:
                worker.start()
            if version.config.model_warmup:
                run_warmup(version, model_path)
        except Exception as exc:  # a thread that would not start, a failed warmup, MemoryError...
            version.state = ModelState.UNLOADING
            self._stop_workers(version, None)
            self._finalize_instances(version)
            self._finalize_model(version)
            if isinstance(exc, WarmupError):
                version.fail(str(exc))
            else:
                version.fail(*describe(f"model '{version.name}' version {version.version} could not start", exc))
            return
        version.stats.load_duration_s = (version.stats.load_duration_s or 0.0) + (time.monotonic_ns() - started) / 1e9
        version.state = ModelState.READY
        self._notify("pyserve_model_ready", version.context)

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
                    if self.rate_limiter is not None:  # --rate-limit execution_count
                        version.rate_claims.append(instance_claim(
                            instance.name, kind, device, group.rate_limiter))
                    index += 1
                    in_group += 1

    # -- unloading ---------------------------------------------------------------------------
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
        """Wait for the workers to end; past the deadline each still gets ``STOP_GRACE_S``, the
        time an idle worker needs to see its stop (only an executing one takes longer)."""
        started = [w for w in version.workers if w.started()]
        for worker in started:
            worker.join(None if deadline is None else max(deadline - time.monotonic(), STOP_GRACE_S))
        busy = [w.instance.name for w in started if w.is_alive()]
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
        override_dir, record.override_dir = record.override_dir, None
        if self._drain_retired(record.name, retiring, lambda: self._remove_override(override_dir)) and retiring:
            log.info("model '%s' unloaded", record.name)
        self._recheck_ensembles(record.name)

    def _drain_retired(self, name: str, versions: list[ModelVersion], then: Callable[[], None]) -> bool:
        """Drain retired ``versions`` (then run ``then``) on a thread of their own; wait for it
        ``unload_wait_secs`` at most. True if it finished in that time.

        An execute that never ends keeps only its own version and the thread: the caller returns
        and the model's lock is free for the next load or unload.
        """
        if not versions:
            then()
            return True

        def drain() -> None:
            try:
                for version in versions:
                    self._drain(version)
                then()
            except Exception:  # finalize errors are logged by _drain's hooks; anything else too
                log.exception("model '%s': draining its retired versions failed", name)
            finally:
                with self._lock:
                    self._draining.pop(thread, None)

        thread = threading.Thread(target=drain, name=f"pyserve-drain-{name}", daemon=True)
        with self._lock:
            self._draining[thread] = list(versions)
        thread.start()
        thread.join(self.unload_wait_secs)
        if thread.is_alive():
            log.warning("model '%s': %s still executing after %g s; they stop taking requests, and are "
                        "finalized once their executes end", name,
                        ", ".join(f"version {v.version}" for v in versions), self.unload_wait_secs)
            return False
        return True

    def _recheck_ensembles(self, changed: str, seen: frozenset[str] = frozenset()) -> None:
        """Check the ensembles that use ``changed`` against the step models as they are now.

        As Triton: an ensemble whose step model was unloaded, or reloaded with other tensors,
        becomes UNAVAILABLE (reason ``STEPS_UNAVAILABLE`` + the problems); one that became
        UNAVAILABLE this way is READY again once its step models fit. An ensemble that changed
        state has the ensembles using it checked in turn. Not at shutdown.
        """
        if self._closing:
            return
        seen = seen | {changed}
        flipped: set[str] = set()
        for name, record in sorted(list(self.records.items())):
            for version in list(record.versions.values()):
                config = version.config
                if (config is None or version.io is None or version.scheduler is None
                        or config.platform != model_config.ENSEMBLE_PLATFORM
                        or all(step.model_name != changed for step in config.ensemble_scheduling.step)
                        or not (version.ready or version.reason.startswith(STEPS_UNAVAILABLE))):
                    continue
                try:
                    build_plan(config, version.io, self.get)
                except ValueError as exc:
                    reason = STEPS_UNAVAILABLE + "; ".join(str(exc).splitlines())
                    if version.ready:
                        log.error("ensemble '%s' version %d is UNAVAILABLE: %s", name, version.version, reason)
                        flipped.add(name)
                    self._on_loop(lambda v=version, r=reason: v.fail(r))  # type: ignore[misc]
                    continue
                if not version.ready:
                    log.info("ensemble '%s' version %d is READY again: its step models fit", name, version.version)
                    flipped.add(name)
                    self._on_loop(lambda v=version: _ready_again(v))  # type: ignore[misc]
        for name in sorted(flipped - seen):  # ensembles of ensembles
            self._recheck_ensembles(name, seen)

    @staticmethod
    def _remove_override(path: Path | None) -> None:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    def _finalize_instances(self, version: ModelVersion) -> None:
        assert version.backend is not None
        if self.rate_limiter is not None and version.rate_claims:
            self.rate_limiter.unregister(version.rate_claims)
            version.rate_claims = []
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


def _metric_options(version: ModelVersion, config: Any) -> None:
    """Apply the config's ``model_metrics`` (first-response histogram buckets) to the version."""
    buckets = model_config.histogram_buckets(config, "nv_inference_first_response_histogram_ms")
    if buckets is not None:
        version.stats.use_first_response_buckets(buckets)
