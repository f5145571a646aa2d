"""What backends receive (contexts) and the class-based way to write one (``Backend``).

A backend is a pluggy plugin implementing the hooks of ``pyserve_hookspecs.lifecycle``.
Two ways to write one:

* hook functions in a module, each decorated with ``pyserve.hookimpl``;
* a subclass of ``Backend`` overriding plain methods (``execute``, ``create_model``, ...).
  The base class carries the ``@hookimpl`` methods and forwards to the plain ones, so an
  override never loses its hook marker (a pluggy pitfall when subclassing decorated methods).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pyserve.api.custom_metrics import CustomMetrics
from pyserve_hookspecs import hookimpl

if TYPE_CHECKING:
    from pyserve.api.errors import InferError
    from pyserve.api.inference import InferRequest, InferResponse


@dataclass(eq=False)
class BackendContext:
    """A backend as the server knows it; passed to backend hooks.

    :ivar name: the backend name (entry-point name, as configs spell it).
    :ivar config: the ``--backend-config <name>,<key>=<value>`` settings, plus the server-wide
        keys Triton passes (``auto-complete-config``, ``default-max-batch-size``).
    :ivar state: free for the backend; the server never reads it.
    :ivar metrics: custom metric families shown on the server's ``/metrics`` page
        (``counter``, ``gauge``, ``histogram``, ``include``; see ``pyserve.metrics.CustomMetrics``).
    :ivar cpu_threads: how many threads a model's own CPU thread pool should use when its
        config sets none, because the server's processes share the machine's CPUs (``pyserve
        run`` with frontend processes: the CPUs per process); None: the library's default.
    """

    name: str
    config: dict[str, str] = field(default_factory=dict)
    state: Any = None
    metrics: CustomMetrics = field(default_factory=CustomMetrics)
    cpu_threads: int | None = None


@dataclass(eq=False)
class ModelContext:
    """One loaded version of a model; passed to model hooks and reachable from instances.

    :ivar name: the model name (its directory name).
    :ivar version: the version number.
    :ivar config: the ``ModelConfig`` protobuf message, normalized; read-only after create.
    :ivar path: the model directory.
    :ivar version_path: the version directory (``path / str(version)``).
    :ivar backend: the owning backend's context.
    :ivar parameters: the config's ``parameters`` map as ``dict[str, str]``.
    :ivar auto_complete: whether the backend may complete the config (auto-complete hook).
    :ivar server: the in-process API of the server (``pyserve.dataplane.bls.ServerHandle``) for
        calling other models (BLS); None outside a running server.
    :ivar state: what ``pyserve_model_create`` returned.
    :ivar metrics: custom metric families shown on the server's ``/metrics`` page (the same
        object as ``backend.metrics``; see ``pyserve.metrics.CustomMetrics``).
    :ivar compute_only: set by the backend (in ``pyserve_model_create``) when this model's
        execute only computes: it never sleeps, waits for I/O, a lock held elsewhere or another
        request, and never calls the server (BLS). The server may then run the model's short
        executes on its event loop when nothing else waits for it (``pyserve_inline_execute``
        ``"auto"``, the default for such a model on CPU instances). Default False.
    :ivar single_process_reason: set by the backend (in ``pyserve_model_create``) when this
        model's executes need the process that holds every model: it calls the server (BLS,
        model control) or keeps counts that only this process shows (custom metrics). The
        server then never replicates it in frontend processes (``--replicate-models auto``) and
        logs this text as the reason. Default "" (nothing known against replicas).
    :ivar fork_safe: True while the model is loaded in a process that forks afterwards (its
        backend answered ``pyserve_backend_fork_safe``); the backend may set it to False in
        ``pyserve_model_create`` for a model that cannot be inherited by a forked process.
        False otherwise.
    :ivar statistics: the version's ``pyserve.metrics.ModelStats`` (None outside a server);
        backends report through ``report_memory_usage``.
    """

    name: str
    version: int
    config: Any
    path: Path
    backend: BackendContext
    parameters: dict[str, str] = field(default_factory=dict)
    auto_complete: bool = True
    server: Any = None
    state: Any = None
    metrics: CustomMetrics = field(default_factory=CustomMetrics)
    compute_only: bool = False
    single_process_reason: str = ""
    fork_safe: bool = False
    statistics: Any = None

    def report_memory_usage(self, usage: Iterable[tuple[str, int, int]]) -> None:
        """Report what this version holds: ``(type, device id, bytes)`` rows, type ``"CPU"``,
        ``"CPU_PINNED"`` or ``"GPU"`` (the ``memory_usage`` of Triton's statistics). Replaces an
        earlier report; any thread; a no-op outside a server.

        :raises ValueError: an unknown type, or a negative id or size.
        """
        if self.statistics is not None:
            self.statistics.report_memory_usage(usage)

    @property
    def version_path(self) -> Path:
        return self.path / str(self.version)

    @property
    def max_batch_size(self) -> int:
        return int(self.config.max_batch_size)

    @property
    def default_model_filename(self) -> str:
        return str(self.config.default_model_filename)


@dataclass(eq=False)
class InstanceContext:
    """One model instance; passed to instance hooks and to ``pyserve_execute``.

    :ivar name: Triton's instance name, ``<group name>_<n>`` (e.g. ``ident_0_0``).
    :ivar kind: ``"CPU"``, ``"GPU"`` or ``"MODEL"``.
    :ivar device_id: the GPU id for GPU instances, else 0.
    :ivar index: position among all instances of the model version.
    :ivar model: the model version's context.
    :ivar state: what ``pyserve_instance_create`` returned.
    """

    name: str
    kind: str
    device_id: int
    index: int
    model: ModelContext
    state: Any = None


class Backend:
    """Base class for class-style backends.

    Subclass it, override the methods you need (``execute`` is required), and register an
    instance — or the class itself, which the server instantiates with no arguments — under
    the entry-point group ``pyserve.backends``. Every method is called exactly when the
    hook of the same role is (see ``pyserve_hookspecs.lifecycle`` for threads and errors).

    :cvar platforms: config ``platform`` values this backend serves (informational; the
        mapping the server uses comes from the ``pyserve.platforms`` entry points).
    :cvar fork_safe: what ``pyserve_backend_fork_safe`` answers: True when ``initialize``,
        ``create_model`` and ``create_instance`` start no threads and what they make stays
        valid in a forked process (see the hook). Default False.
    """

    platforms: ClassVar[tuple[str, ...]] = ()
    fork_safe: ClassVar[bool] = False

    # -- methods to override -------------------------------------------------------------
    def initialize(self, backend: BackendContext) -> None:
        """Called once before the backend's first model is created."""

    def finalize(self, backend: BackendContext) -> None:
        """Called once at shutdown, after all the backend's models were finalized."""

    def auto_complete_config(self, model: ModelContext) -> bool | None:
        """Complete ``model.config`` in place from the model files; return True if changed."""
        return None

    def create_model(self, model: ModelContext) -> Any:
        """Load one model version; the return value becomes ``model.state``."""
        return None

    def validate_model(self, model: ModelContext) -> list[str] | None:
        """``pyserve validate``: what would keep this model version from loading (one line per
        problem), found without loading it; None: nothing to say."""
        return None

    def finalize_model(self, model: ModelContext) -> None:
        """Release one model version."""

    def create_instance(self, instance: InstanceContext) -> Any:
        """Create one instance; the return value becomes ``instance.state``."""
        return None

    def finalize_instance(self, instance: InstanceContext) -> None:
        """Release one instance."""

    def execute(
        self, instance: InstanceContext, requests: Sequence[InferRequest]
    ) -> Sequence[InferResponse | InferError | BaseException] | None:
        """Answer the gathered requests: one response or error per request, in order."""
        raise NotImplementedError(f"{type(self).__name__} does not implement execute()")

    def instance_ready(self, instance: InstanceContext) -> bool | None:
        """Whether a READY instance can serve now (the ready endpoints ask); None: no opinion."""
        return None

    # -- the hook implementations (do not override) --------------------------------------
    @hookimpl
    def pyserve_backend_fork_safe(self, backend: BackendContext) -> bool | None:
        return self.fork_safe

    @hookimpl
    def pyserve_backend_initialize(self, backend: BackendContext) -> None:
        self.initialize(backend)

    @hookimpl
    def pyserve_backend_finalize(self, backend: BackendContext) -> None:
        self.finalize(backend)

    @hookimpl
    def pyserve_model_auto_complete(self, model: ModelContext) -> bool | None:
        return self.auto_complete_config(model)

    @hookimpl
    def pyserve_model_validate(self, model: ModelContext) -> list[str] | None:
        return self.validate_model(model)

    @hookimpl
    def pyserve_model_create(self, model: ModelContext) -> Any:
        return self.create_model(model)

    @hookimpl
    def pyserve_model_finalize(self, model: ModelContext) -> None:
        self.finalize_model(model)

    @hookimpl
    def pyserve_instance_create(self, instance: InstanceContext) -> Any:
        return self.create_instance(instance)

    @hookimpl
    def pyserve_instance_finalize(self, instance: InstanceContext) -> None:
        self.finalize_instance(instance)

    @hookimpl
    def pyserve_execute(
        self, instance: InstanceContext, requests: Sequence[InferRequest]
    ) -> Sequence[InferResponse | InferError | BaseException] | None:
        return self.execute(instance, requests)

    @hookimpl
    def pyserve_instance_ready(self, instance: InstanceContext) -> bool | None:
        return self.instance_ready(instance)
