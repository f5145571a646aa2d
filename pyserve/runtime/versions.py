"""Runtime objects for loaded models: one ``ModelVersion`` per served version.

A ``ModelVersion`` ties a version's config, its backend context, its instances and its
scheduler together. ``ModelRecord`` groups the versions of one model name with the
model-level reason shown when no version could even be attempted.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyserve.api.backend import InstanceContext, ModelContext
from pyserve.api.errors import InferError
from pyserve.api.inference import InferRequest
from pyserve.host.plugins import LoadedBackend
from pyserve.metrics import ModelStats
from pyserve.repository.model_config import ModelIO
from pyserve.repository.scan import ModelSource
from pyserve.runtime.scheduling import InstanceWorker, Scheduler
from pyserve.runtime.scheduling.rate_limiter import ResourceClaim


class ModelState(str, enum.Enum):
    """Triton's model version states, as the repository index reports them."""

    UNKNOWN = "UNKNOWN"
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(eq=False)
class ModelVersion:
    """One version of a model and everything that serves it.

    ``enqueue`` is the hot path: it is called on the event loop for every request.

    :ivar successor: set when a reload replaced this version while requests may still hold
        it: ``serving`` then hands those requests to the version that replaced it.
    :ivar stats: the version's statistics (statistics extension and ``nv_inference_*`` metrics).
    :ivar prepared: built before a fork: its model and instances exist, its instance threads
        do not run yet (``ModelLoader.start_prepared`` finishes it in the process that serves it).
    """

    name: str
    version: int
    state: ModelState = ModelState.LOADING
    reason: str = ""
    detail: str = ""
    """The full text of ``reason`` (tracebacks, server paths) for the log; "" when the same."""
    config: Any = None
    io: ModelIO | None = None
    context: ModelContext | None = None
    backend: LoadedBackend | None = None
    instances: list[InstanceContext] = field(default_factory=list)
    workers: list[InstanceWorker] = field(default_factory=list)
    rate_claims: list[ResourceClaim] = field(default_factory=list)
    scheduler: Scheduler | None = None
    successor: ModelVersion | None = None
    stats: ModelStats = field(default_factory=ModelStats)
    prepared: bool = False

    @property
    def ready(self) -> bool:
        return self.state is ModelState.READY

    def serving(self) -> ModelVersion:
        """The version that takes this version's requests now: itself while it is READY, else
        the version that replaced it in a reload (when one did, with the same inputs and
        outputs), so that a request resolved just before the swap is still served."""
        version = self
        while version.successor is not None and version.state is not ModelState.READY:
            version = version.successor
        return version

    @property
    def decoupled(self) -> bool:
        return bool(self.config is not None and self.config.model_transaction_policy.decoupled)

    def enqueue(self, request: InferRequest) -> None:
        """Queue a request and count it in this version's statistics (event loop only).

        :raises InferError: the scheduler refused it (counted as a REJECTED failure).
        """
        assert self.scheduler is not None
        stats = self.stats
        request.stats = stats
        request.exec_start_ns = 0
        stats.enqueued += 1  # written only here, on the event loop (see ModelStats)
        try:
            self.scheduler.enqueue(request)
        except InferError:
            stats.enqueued -= 1
            stats.rejected(request)
            request.stats = None
            raise

    def fail(self, reason: str, detail: str = "") -> None:
        """Make the version UNAVAILABLE: ``reason`` for clients, ``detail`` (the full text,
        default the reason) for the log (``pyserve.runtime.load_reasons``)."""
        self.state = ModelState.UNAVAILABLE
        self.reason = reason
        self.detail = detail


@dataclass(eq=False)
class ModelRecord:
    """All versions of one model name, plus a model-level reason when none could load.

    :ivar fingerprint: what the model directory looked like when it was last loaded (poll mode
        reloads the model when it changes); None for a model loaded from file overrides.
    :ivar override_dir: the private directory holding the files of a load with file
        overrides; removed when the versions loaded from it are unloaded.
    :ivar clean_load: every version of the last load loaded: a plain load request of such a
        model whose files have not changed since (``fingerprint``) is not reloaded, as in Triton.
    :ivar config_refused: its last load stopped at its config (unreadable, invalid, or the name in
        two repositories): it has no versions and, as Triton never registers such a model, it
        does not hold the server's strict readiness back.
    """

    name: str
    source: ModelSource
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    state: ModelState = ModelState.LOADING
    reason: str = ""
    detail: str = ""
    fingerprint: Any = None
    override_dir: Path | None = None
    clean_load: bool = False
    config_refused: bool = False

    def fail(self, reason: str, detail: str = "") -> None:
        """Make the model UNAVAILABLE: ``reason`` for clients, ``detail`` (the full text,
        default the reason) for the log (``pyserve.runtime.load_reasons``)."""
        self.state = ModelState.UNAVAILABLE
        self.reason = reason
        self.detail = detail

    def ready_versions(self) -> list[ModelVersion]:
        return [v for _, v in sorted(self.versions.items()) if v.ready]

    def latest_ready(self) -> ModelVersion | None:
        """The READY version with the highest number (what a request without a version gets)."""
        latest: ModelVersion | None = None
        for version in self.versions.values():  # no sort: this runs for every request
            if version.state is ModelState.READY and (latest is None or version.version > latest.version):
                latest = version
        return latest
