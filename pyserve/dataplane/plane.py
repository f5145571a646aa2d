"""The transport-neutral core API both frontends call: health, metadata, config and infer.

Frontends decode the wire format, call the data plane, and encode what it returns; they
never touch models, schedulers or backends directly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import (
    FutureSender,
    InferRequest,
    InferResponse,
    RunningLoop,
)
from pyserve.dataplane.cache import ResponseCache, cache_enabled
from pyserve.dataplane.header_forwarding import HeaderForwarding
from pyserve.dataplane.shared_memory import SharedMemoryManager, cuda_available
from pyserve.metrics import select_versions, statistics_json
from pyserve.protocol.config_json import model_config_to_dict
from pyserve.runtime.manager import ModelManager
from pyserve.runtime.readiness import ReadinessChecks
from pyserve.runtime.versions import ModelVersion
from pyserve.tracing import TRACING, TraceManager

log = logging.getLogger("pyserve.dataplane.plane")

EXTENSIONS = (
    "classification", "sequence", "model_repository", "model_repository(unload_dependents)",
    "schedule_policy", "model_configuration", "system_shared_memory", "cuda_shared_memory",
    "binary_tensor_data", "parameters", "statistics", "trace", "logging",
)
"""The protocol extensions this server implements, in the order Triton 2.51 reports them
(``cuda_shared_memory`` is left out where it cannot be used: no cupy or no GPU)."""


class DataPlane:
    """Serves the KServe v2 API on top of a ``ModelManager``.

    Thread-safety: every method runs on the event loop; ``infer`` hands the request to an
    instance thread and awaits its response without blocking the loop.

    :param models: the server's models.
    :param server_name: reported as server metadata ``name`` (Triton's ``--id``).
    :param server_version: reported as server metadata ``version``.
    """

    def __init__(self, models: ModelManager, server_name: str, server_version: str) -> None:
        self.models = models
        self.server_name = server_name
        self.server_version = server_version
        self.live = False
        self.exiting = False
        """True from the start of shutdown: live answers "exiting" (HTTP 503, gRPC UNAVAILABLE), as Triton."""
        self.accepting = False
        self.starting = False
        """True while ``Server.start`` still opens listeners or starts frontend processes: the
        server is not ready until every port listens in every process."""
        self._open: set[InferRequest] = set()
        self._idle: asyncio.Event | None = None
        self._running_loop = RunningLoop()
        self.shared_memory = SharedMemoryManager()
        """The shared-memory regions clients registered with this server."""
        self.tracing = TraceManager()
        """Trace settings and export; the server replaces it with one built from ``--trace-config``."""
        self.strict_readiness = True  # --strict-readiness
        self.readiness = ReadinessChecks()
        """The backends' readiness checks behind the ready endpoints (``pyserve.runtime.readiness``)."""
        # --http-header-forward-pattern / --grpc-header-forward-pattern (pyserve.dataplane.header_forwarding)
        self.http_forwarding: HeaderForwarding | None = None
        self.grpc_forwarding: HeaderForwarding | None = None
        self.cache: ResponseCache | None = None
        """The response cache (``--cache-config``), or None."""
        self.model_control_listeners: list[Any] = []
        """Async callables awaited after a load or unload, before it is answered (frontend
        processes apply the change first: ``pyserve.handoff``)."""
        self.stats_sources: list[Any] = []
        """Async callables run before statistics are read: replicas in frontend processes
        report their counts (``pyserve.handoff``)."""
        self.replica_readiness: list[Callable[[list[ModelVersion]], Awaitable[set[ModelVersion]]]] = []
        """Async callables giving which of the versions (each passing its own instances' checks)
        fail the readiness checks of their replicas in other processes (``pyserve.handoff``)."""
        self.unloading_elsewhere: list[Callable[[], Collection[tuple[str, int]]]] = []
        """Callables giving (model, version) pairs that another process still unloads (frontend
        replicas whose executes outlast an unload): the index lists them UNLOADING, not
        UNAVAILABLE, until they report the unload done (``pyserve.handoff``)."""
        self._extensions: list[str] | None = None
        self._release = self._finished  # bound once: what each submitted request's release runs

    @property
    def extensions(self) -> list[str]:
        """What server metadata reports: ``EXTENSIONS``, CUDA shared memory only when usable
        (asked on first use, not at construction: asking starts CUDA, which must not happen
        before ``pyserve run`` forks its frontend processes)."""
        if self._extensions is None:
            self._extensions = [e for e in EXTENSIONS if e != "cuda_shared_memory" or cuda_available()]
        return self._extensions

    # -- health and metadata -----------------------------------------------------------------
    def is_ready(self) -> bool:
        """Live, accepting and started, and (strict readiness, Triton's default) every model
        version READY."""
        return (self.live and self.accepting and not self.starting
                and (not self.strict_readiness or self.models.all_ready()))

    def server_metadata(self) -> dict[str, Any]:
        return {"name": self.server_name, "version": self.server_version, "extensions": list(self.extensions)}

    def model(self, name: str, version: str | None = None) -> ModelVersion:
        """The version serving ``name`` (latest READY when ``version`` is None).

        :raises InferError: NOT_FOUND / UNAVAILABLE, with Triton's messages.
        """
        return self.models.get(name, version)

    def check_trace_model(self, name: str) -> None:
        """Per-model trace settings must name a model with a READY version, as Triton 2.51 asks
        (an unloaded one is unknown there too, checked side by side); its settings are kept
        while it is unloaded and apply again once it is loaded.

        :raises InferError: INVALID_ARG for an unknown or unloaded model, in Triton's words.
        """
        if not self.model_ready(name):
            raise InferError.invalid(f"Request for unknown model : {name}")

    def model_ready(self, name: str, version: str | None = None) -> bool:
        """Whether the version is READY (its state only; the endpoints use ``check_model_ready``)."""
        try:
            return self.models.get(name, version).ready
        except InferError:
            return False

    async def check_model_ready(self, name: str, version: str | None = None) -> bool:
        """What the model ready endpoints answer: READY, and every instance passes its backend's
        readiness check (``pyserve_instance_ready``, e.g. a Python model's ``is_ready()``)."""
        try:
            served = self.models.get(name, version)
        except (InferError, ValueError):  # unknown, not READY, or not a version number
            return False
        # both at once: a question joins (or starts) the checks in flight here and in the replicas,
        # so a slow is_ready() is not waited for twice, one after the other
        own, failed = await asyncio.gather(self.readiness.version_ready(served), self._replicas_not_ready([served]))
        return own and not failed

    async def check_server_ready(self) -> bool:
        """What the server ready endpoints answer: ``is_ready``, and with strict readiness every
        READY version's instances pass their readiness checks."""
        if not self.is_ready():
            return False
        if not self.strict_readiness:
            return True
        versions = [v for record in list(self.models.records.values()) for v in list(record.versions.values()) if v.ready]
        own, failed = await asyncio.gather(asyncio.gather(*(self.readiness.version_ready(v) for v in versions)),
                                           self._replicas_not_ready(versions))
        return all(own) and not failed

    async def _replicas_not_ready(self, versions: list[ModelVersion]) -> set[ModelVersion]:
        """Of ``versions``, those whose backend checks readiness and whose replicas elsewhere
        fail it (``replica_readiness``)."""
        checked = [v for v in versions if v.backend is not None and v.backend.hooks.checks_ready]
        failed: set[ModelVersion] = set()
        if checked:
            for source in self.replica_readiness:
                failed |= await source(checked)
        return failed

    def model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        """Triton's model metadata object for one model (all READY versions when unversioned)."""
        served = self.models.get(name, version)
        io = served.io
        assert io is not None and served.config is not None
        record = self.models.records[name]
        versions = [str(served.version)] if version else [str(v.version) for v in record.ready_versions()]
        batch = [-1] if io.batching else []

        def tensors(specs: Any) -> list[dict[str, Any]]:
            return [
                {"name": s.name, "datatype": s.datatype.name, "shape": batch + list(s.dims)}
                for s in specs.values()
            ]

        return {
            "name": name,
            "versions": versions,
            "platform": served.config.platform or served.config.backend,
            "inputs": tensors(io.inputs),
            "outputs": tensors(io.outputs),
        }

    def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        """The model's normalized config in Triton's JSON form."""
        served = self.models.get(name, version)
        return model_config_to_dict(served.config)

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """The repository index (``ModelManager.index``), with versions another process still
        unloads (``unloading_elsewhere``) listed UNLOADING."""
        entries = self.models.index(ready_only)
        if ready_only or not self.unloading_elsewhere:
            return entries
        unloading = {(name, str(version)) for source in self.unloading_elsewhere for name, version in source()}
        if unloading:
            for i, entry in enumerate(entries):
                if (entry.get("state") == "UNAVAILABLE" and entry.get("reason") == "unloaded"
                        and (entry["name"], entry.get("version")) in unloading):
                    entries[i] = {"name": entry["name"], "version": entry["version"], "state": "UNLOADING"}
        return entries

    def model_statistics(self, name: str = "", version: str | None = None) -> dict[str, Any]:
        """Triton's statistics ``{"model_stats": [...]}``: every READY version of every model
        (``name`` empty), of one model (``version`` None), or one version.

        :raises InferError: INVALID_ARG when the model or version is not loaded.
        """
        return statistics_json(select_versions(self.models.records, name, version))

    async def collect_statistics(self) -> None:
        """Bring in counts kept elsewhere (frontend replicas) before statistics are read."""
        for source in self.stats_sources:
            await source()

    async def load_model(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        """Load or reload a model (explicit mode), off the event loop; returns once READY.

        :param parameters: ``config`` and ``file:<path>`` load parameters.
        :raises InferError: with Triton's messages and codes.
        """
        try:
            await self.models.load_model_async(name, parameters)
        finally:
            for listener in self.model_control_listeners:
                await listener()

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Unload a model (explicit mode), off the event loop; returns once it is unloaded.

        :raises InferError: with Triton's messages and codes.
        """
        try:
            await self.models.unload_model_async(name, unload_dependents)
        finally:
            for listener in self.model_control_listeners:
                await listener()

    # -- inference -------------------------------------------------------------------------------
    def submit(self, model: ModelVersion, request: InferRequest) -> InferRequest:
        """Schedule a request whose sender is attached.

        :returns: the request, now held by the server until it is released: the caller calls
            ``request.release()`` once its final response is handled or it gives the request
            up, or submits as ``with dataplane.submit(model, request):`` to release it on
            leaving the block.
        :raises InferError: the request was refused (shutting down, not ready, queue full);
            nothing is held then.
        """
        if not self.accepting:
            raise InferError("Server is shutting down; no new requests are accepted", ErrorCode.UNAVAILABLE)
        model = model.serving()  # a version replaced by a reload hands its requests on
        if not model.ready:
            raise InferError.unavailable(f"model '{model.name}' version {model.version} is not ready")
        if self.tracing.active or request.trace is not None:  # the only cost of tracing while it is off;
            self.tracing.begin(request)  # a request with a trace is a traced request's child (BLS)
        request.stats = model.stats  # counted from here on: a cache hit never reaches enqueue
        if request.shm_regions is not None:  # in use until released (unregistering them fails)
            self.shared_memory.hold(request.shm_regions)
        self._open.add(request)  # before scheduling: a model answering inline may release it at once
        request.on_release(self._release)
        cache = self.cache
        try:
            if cache is None or not cache_enabled(model) or not cache.serve(request):
                model.enqueue(request)  # else answered from the cache: the scheduler is skipped
        except BaseException:  # refused (an InferError), or a bug: nothing stays held
            request.on_release(None)
            self._open.discard(request)
            self._let_go(request)
            if request.trace is not None:  # refused: no final response will record it
                TRACING.set(request.trace, False)
            raise
        return request

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet released."""
        return len(self._open)

    def _finished(self, request: InferRequest) -> None:
        """A submitted request got its final response (or was abandoned): what
        ``InferRequest.release`` runs, on the loop. Its shared-memory regions are no longer in
        use (its outputs are written by then)."""
        self._open.discard(request)
        if request.shm_regions is not None:
            self._let_go(request)
        if not self._open and self._idle is not None:
            self._idle.set()

    def _let_go(self, request: InferRequest) -> None:
        regions, request.shm_regions = request.shm_regions, None
        if regions is not None:
            self.shared_memory.let_go(regions)

    async def infer(self, model: ModelVersion, request: InferRequest) -> InferResponse | InferError:
        """Schedule a decoded request and wait for its single response.

        Cancelling the awaiting task (client disconnect) marks the request cancelled, so a
        request still queued never reaches execute.
        """
        loop = self._running_loop.get()
        assert loop is not None, "DataPlane.infer runs on the event loop"
        future: asyncio.Future[InferResponse | InferError] = loop.create_future()
        request.attach_sender(FutureSender(loop, future))
        try:
            self.submit(model, request)
        except InferError as error:
            return error
        with request:
            try:
                return await future
            except asyncio.CancelledError:
                request.cancel()
                raise

    async def drain(self, timeout: float) -> bool:
        """Stop accepting and wait up to ``timeout`` seconds for in-flight requests.

        :returns: True if every in-flight request finished in time.
        """
        self.accepting = False
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            self._abandon()
            return False

    def _abandon(self) -> None:
        """The exit timeout passed: answer every unfinished request with UNAVAILABLE."""
        log.warning("exit timeout reached with %d request(s) still in flight; answering them UNAVAILABLE", len(self._open))
        error = InferError.unavailable("Server is shutting down: the request did not finish within the exit timeout")
        for request in list(self._open):
            request.cancel()
            if not request.final_sent:
                request.reply(error)
        self._open.clear()
