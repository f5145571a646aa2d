"""Building the versions of one model: config → backend → model → instances → scheduler →
started (and warmed up); and finalizing what was built, in reverse order of creation.

Nothing built here is visible to requests: the loader (``pyserve.runtime.loader``) swaps the
versions in. A version that fails gets state UNAVAILABLE and a reason naming the file, field,
backend or exception; a failure never raises out of ``VersionBuilder.build`` except
``NotForkSafe`` while preparing models before a fork.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
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
from pyserve.repository.scan import Fingerprint, ModelSource, select_versions, version_numbers
from pyserve.runtime.load_reasons import describe
from pyserve.runtime.scheduling import (
    InstanceWorker,
    LoopScheduler,
    LoopShortcut,
    scheduler_for,
)
from pyserve.runtime.scheduling.ensemble import EnsembleScheduler
from pyserve.runtime.scheduling.rate_limiter import RateLimiter, RateLimitError, instance_claim
from pyserve.runtime.versions import ModelState, ModelVersion
from pyserve.runtime.warmup import WarmupError, run_warmup

log = logging.getLogger("pyserve.runtime.versions")

STOP_GRACE_S = 0.1
"""Seconds a stopped worker gets to end even when the exit deadline has passed."""


@dataclass(frozen=True)
class LoadSettings:
    """How models are loaded: the server's settings that every version build reads.

    :ivar auto_complete: let backends complete configs (off with ``--strict-model-config``).
    :ivar backend_config: ``--backend-config`` settings per backend name (``""`` = all).
    :ivar backend_directory: ``--backend-directory``, where server plugins look for native
        backend libraries.
    :ivar load_retries: further attempts for a version that fails (``--model-load-retry-count``).
    :ivar cpu_threads: ``BackendContext.cpu_threads`` of every backend (None: libraries' default).
    :ivar latency_summaries: versions record latency summaries (``--metrics-config
        summary_latencies=true``).
    :ivar rate_limiter: ``--rate-limit execution_count``'s limiter; None: not limited.
    :ivar custom_metrics: what backends and models receive as ``backend.metrics`` / ``model.metrics``.
    :ivar server_handle: what models receive as ``model.server`` (BLS); None: no server.
    """

    auto_complete: bool = True
    backend_config: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    backend_directory: str | None = None
    load_retries: int = 0
    cpu_threads: int | None = None
    latency_summaries: bool = False
    rate_limiter: RateLimiter | None = None
    custom_metrics: CustomMetrics = field(default_factory=CustomMetrics)
    server_handle: Any = None


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

@dataclass
class Built:
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
    config_refused: bool = False
    """The config could not be read or is invalid (``error`` says why): as in Triton, such a
    model does not count for the server's readiness."""
    """Where the config came from, for messages: its file (or the model directory when there
    is none: auto-complete), or the load request that carried it."""


class VersionBuilder:
    """Builds, starts and finalizes model versions; owns the backends it initialized.

    Thread-safe: several models build at once (one thread each); each backend is initialized
    once, under its own lock.

    :param host: the plugin host that supplies backends.
    :param settings: how to load.
    :param get: how an ensemble finds the versions of its step models (``ModelRegistry.get``).
    """

    def __init__(self, host: PluginHost, settings: LoadSettings, get: Callable[..., ModelVersion]) -> None:
        self.host = host
        self._settings = settings
        self._get = get
        self._lock = threading.Lock()
        self._backend_contexts: dict[LoadedBackend, BackendContext] = {}
        self._initialized_backends: list[tuple[LoadedBackend, BackendContext]] = []
        self._preparing: Preparing | None = None

    @contextlib.contextmanager
    def preparing(self, rules: Preparing) -> Iterator[None]:
        """Within: build versions for a process that forks next (created, never started),
        following ``rules``; ``build`` raises ``NotForkSafe`` for a model that must wait."""
        self._preparing = rules
        try:
            yield
        finally:
            self._preparing = None

    def build(self, built: Built, override_config: Any) -> None:
        """Load every selected version of ``built.source`` into ``built.versions``."""
        source = built.source
        if source.conflict:
            built.error = source.conflict
            built.config_refused = True
            return
        try:
            config, unavailable = self._config_of(built, override_config)
        except ModelConfigError as exc:
            built.error = str(exc)
            built.config_refused = True
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
                else f"at least one version must be available under the version policy of model "
                f"'{source.name}': no version directory (a numeric folder such as '1') in '{source.path}'"
            )
            return
        for problem in problems:  # Triton loads the versions that exist and logs the others
            log.error("model '%s': %s; loading the other versions", source.name, problem)
        if unavailable is not None:
            for number in selected:
                version = built.versions[number] = self._new_version(source.name, number)
                version.fail(unavailable)
            return
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
            for attempt in range(self._settings.load_retries + 1):  # --model-load-retry-count
                version = self._new_version(source.name, number)
                built.versions[number] = version
                self._load_version(built, config, number, version, backend, backend_ctx)
                if version.ready or version.prepared or attempt == self._settings.load_retries:
                    break
                log.warning("model '%s' version %d failed to load (%s); retry %d of %d",
                            source.name, number, version.reason, attempt + 1, self._settings.load_retries)

    def _config_of(self, built: Built, override_config: Any) -> tuple[Any, str | None]:
        """The normalized config of ``built`` (the load request's, else its file's), and what
        this machine lacks of the GPUs it asks for (its versions then fail to load with that,
        as in Triton), or None.

        :raises ModelConfigError: the config is refused.
        """
        source = built.source
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
        except model_config.DevicesUnavailable as exc:
            return exc.config, str(exc)
        return config, None

    def _build_ensemble(self, built: Built, config: Any, selected: list[int]) -> None:
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
                steps = build_plan(config, version.io, self._get)
            except ValueError as exc:
                version.fail(f"{built.config_origin}: invalid ensemble: " + "; ".join(str(exc).splitlines()))
                continue
            version.scheduler = EnsembleScheduler(source.name, steps, version.io, self._get)
            _metric_options(version, config)
            version.stats.load_duration_s = 0.0  # nothing to load: its steps are models of their own
            version.stats.ensemble = True
            version.state = ModelState.READY

    def _new_version(self, name: str, number: int) -> ModelVersion:
        version = ModelVersion(name, number)
        if self._settings.latency_summaries:
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
        elif self._settings.auto_complete:
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
            backend_directory=self._settings.backend_directory,
        )
        with backend.lock:
            context = self._backend_contexts.get(backend)
            if context is None:
                settings = {
                    "auto-complete-config": "true" if self._settings.auto_complete else "false",
                    "default-max-batch-size": "4",
                    **self._settings.backend_config.get("", {}),
                    **self._settings.backend_config.get(name, {}),
                }
                context = BackendContext(name=name, config=settings, metrics=self._settings.custom_metrics,
                                         cpu_threads=self._settings.cpu_threads)
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
        built: Built,
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
        self.start_version(version, built.source.path)

    def _create_version(
        self,
        built: Built,
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
            auto_complete=self._settings.auto_complete,
            server=self._settings.server_handle,
            metrics=self._settings.custom_metrics,
            statistics=version.stats,
        )
        hooks = backend.hooks
        if self._settings.auto_complete:
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
        limiter = self._settings.rate_limiter if any(c.needs for c in version.rate_claims) else None
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

    def start_version(self, version: ModelVersion, model_path: Path) -> None:
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
            stop_workers(version, None)
            self._finalize_instances(version)
            self._finalize_model(version)
            if isinstance(exc, WarmupError):
                version.fail(str(exc))
            else:
                version.fail(*describe(f"model '{version.name}' version {version.version} could not start", exc))
            return
        version.stats.load_duration_s = (version.stats.load_duration_s or 0.0) + (time.monotonic_ns() - started) / 1e9
        version.state = ModelState.READY
        self.notify("pyserve_model_ready", version.context)

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
                    if self._settings.rate_limiter is not None:  # --rate-limit execution_count
                        version.rate_claims.append(instance_claim(
                            instance.name, kind, device, group.rate_limiter))
                    index += 1
                    in_group += 1

    # -- finalizing ---------------------------------------------------------------------------
    def finalize(self, version: ModelVersion) -> None:
        """Finalize a version's instances (reverse order), then its model; errors are logged."""
        self._finalize_instances(version)
        self._finalize_model(version)

    def _finalize_instances(self, version: ModelVersion) -> None:
        assert version.backend is not None
        if self._settings.rate_limiter is not None and version.rate_claims:
            self._settings.rate_limiter.unregister(version.rate_claims)
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

    def notify(self, hook_name: str, context: ModelContext) -> None:
        """Call the server plugins' ``hook_name`` hook for a model (not where the host does not
        observe models: a frontend's replicas); their errors are logged."""
        if not self.host.observes_models:
            return
        try:
            self.host.server_hook(hook_name)(model=context)
        except Exception:
            log.exception("a server plugin failed in %s for model '%s'", hook_name, context.name)


    def finalize_backends(self, stuck: set[str], all_stuck: bool = False) -> None:
        """At shutdown: finalize the initialized backends (reverse order), except those named
        in ``stuck`` (some of their models are still executing) or every one if ``all_stuck``
        (a load still running may be using any)."""
        with self._lock:
            backends = list(reversed(self._initialized_backends))
            self._initialized_backends.clear()
        for backend, context in backends:
            if backend.info.name in stuck or all_stuck:
                log.error("backend '%s' not finalized: some of its models are still executing", backend.info.name)
                continue
            try:
                backend.hooks.backend_finalize(backend=context)
            except Exception:
                log.exception("backend '%s' failed to finalize", backend.info.name)
            backend.initialized = False


def stop_workers(version: ModelVersion, deadline: float | None) -> bool:
    """Stop a version that never became READY (failed warmup) and wait for its workers."""
    if version.scheduler is not None:
        version.scheduler.stop(len(version.workers))
    return join_workers(version, deadline)


def join_workers(version: ModelVersion, deadline: float | None) -> bool:
    """Wait for a stopped version's workers to end; past ``deadline`` (``time.monotonic()``;
    None: no limit) each still gets ``STOP_GRACE_S``, the time an idle worker needs to see its
    stop (only an executing one takes longer). :returns: False if one is still executing."""
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


def _metric_options(version: ModelVersion, config: Any) -> None:
    """Apply the config's ``model_metrics`` (first-response histogram buckets) to the version."""
    buckets = model_config.histogram_buckets(config, "nv_inference_first_response_histogram_ms")
    if buckets is not None:
        version.stats.use_first_response_buckets(buckets)
