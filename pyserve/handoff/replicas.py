"""Model replicas in frontend processes (``--replicate-models``).

Handing every request to the owner costs two process wake-ups per request; on small
machines that is more than a small model's execute. A frontend process may therefore load
its own replica of a model and answer that model's requests itself. Which models: the owner
decides (``replicable``) and marks them in the snapshot it sends; a frontend loads each marked
version with the owner's exact config (``load`` with a ``config`` override), and uses the
replica only while the owner still serves that same version (its generation) and the replica
is READY with the same inputs and outputs. Until then, and for every other model, requests
are handed to the owner as before, so answers never depend on which process took the
connection.

What a replica changes, and why the rules below exist:

* each replica has its own dynamic batcher and its own instances (``instance_group.count``
  is per process), so batches form per process;
* state lives per process: sequence-batched models, decoupled models and ensembles are never
  replicated (they stay with the owner, whose sequence slots and stream state are unique);
* a model that calls other models (BLS) or defines custom metrics would call or count in its
  own process: ``auto`` skips models whose backend says so (``ModelContext.single_process_reason``:
  the Python backend finds these APIs in a model's files, the native one in a library's imports);
* a dynamic batcher with a queue delay batches what its own process receives: split over
  processes, each batches about its share of the requests, and the replicas' instances run at
  the same time, which answers more than one batcher in the owner (``benchmarks/README.md``,
  ``batching.py``); ``auto`` does so only for queue delays up to ``LONG_QUEUE_DELAY_US``, as
  a longer one is there to fill batches from every client, and never for batchers with
  priority levels, ``preserve_ordering`` or a queue policy (``max_queue_size``, timeouts),
  which hold within one queue;
* GPU instance groups are not replicated by ``auto`` (one copy of the weights per process), nor
  are Python models with their own environment (``EXECUTION_ENV_PATH``, or a requirements file:
  they run in worker processes already);
* a server plugin object handed to an embedded server (``PluginHost(server_plugins=...)``)
  that wraps ``pyserve_execute`` exists in the owner only (a forked frontend holds a copy whose
  state the owner never sees): while one is registered, ``auto`` replicates nothing, so the
  plugin sees every execute; plugins read from entry points load in every process and do not
  hold replication back (a replica's load and unload are not reported to them: the owner
  reports its versions'); a backend object handed to an embedded server
  (``PluginHost(extra_backends=...)``) that is not also installed cannot be loaded by a
  frontend started afresh, so ``auto`` leaves its models with the owner;
* statistics and ``nv_inference_*`` metrics stay whole: the owner pulls each replica's
  counters (``counters_delta``) before it answers a statistics request or a metrics scrape;
  latency summaries (``--metrics-config summary_latencies=true``) keep each request's samples,
  which are not pulled, so with them ``auto`` replicates nothing.

A model's config parameter ``pyserve_replicate`` (``"true"`` / ``"false"``) overrides the
mode for that model, within the structural rules; so does naming it in ``--replicate-models``
(an in-process execute wrapper then runs on the frontend's copy for that model's replica).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyserve.runtime.versions import ModelState, ModelVersion

if TYPE_CHECKING:
    from pyserve.host.plugins import PluginHost

log = logging.getLogger("pyserve.handoff")

_DRAIN_POLL_S = 0.05
"""How often a frontend looks whether its retired replicas finished unloading."""

REPLICATE_PARAMETER = "pyserve_replicate"
"""Config parameter forcing (``"true"``) or forbidding (``"false"``) a model's replicas."""


class ReplicationMode:
    """``--replicate-models``: ``none``, ``auto``, or a comma-separated list of model names.

    :param plugins: the owner's ``PluginHost``, asked whenever a version's placement is
        decided: while an in-process server plugin wraps ``pyserve_execute``
        (``in_process_execute_wrappers``), ``auto`` replicates nothing, and it does not
        replicate a model whose backend only this process has (``in_process_only_backend``).
    :param owner_only: why ``auto`` replicates no model of this server ("": it may), e.g.
        latency summaries, whose samples are kept in one process.
    :raises ValueError: an empty name in the list.
    """

    def __init__(self, value: str, plugins: PluginHost | None = None, owner_only: str = "") -> None:
        self.plugins = plugins
        self.owner_only = owner_only
        self.value = value.strip()
        self.auto = self.value == "auto"
        self.none = self.value in ("none", "")
        names = () if self.auto or self.none else tuple(n.strip() for n in self.value.split(","))
        if any(not n for n in names):
            raise ValueError(f"--replicate-models: expected none, auto or model names, got '{value}'")
        self.names = frozenset(names)


def _structural_reason(version: ModelVersion) -> str | None:
    config = version.config
    if config is None:
        return "no config"
    if config.HasField("sequence_batching"):
        return "it uses the sequence batcher (sequence state lives in one process)"
    if config.model_transaction_policy.decoupled:
        return "it is decoupled (streams are served by the owner)"
    if config.platform == "ensemble" or config.HasField("ensemble_scheduling"):
        return "it is an ensemble"
    return None


def _server_reason(version: ModelVersion, mode: ReplicationMode) -> str | None:
    """Why ``auto`` keeps ``version`` with the owner because of this server, not the model."""
    if mode.owner_only:
        return mode.owner_only
    if mode.plugins is None:
        return None
    wrappers = mode.plugins.in_process_execute_wrappers()
    if wrappers:
        plural = len(wrappers) > 1
        return (f"the in-process server plugin{'s' if plural else ''} {', '.join(wrappers)} "
                f"wrap{'' if plural else 's'} pyserve_execute and would not see a frontend's executes")
    backend = version.context.backend.name if version.context is not None else ""
    if backend and mode.plugins.in_process_only_backend(backend):
        return (f"its backend '{backend}' was handed to this server as an object, which frontend "
                "processes started afresh do not have")
    return None


LONG_QUEUE_DELAY_US = 1000
"""A dynamic batcher whose ``max_queue_delay_microseconds`` is above this is not replicated by
``auto``: its config trades latency for full batches, and split over processes each batcher
would wait out the delay with its share of the requests (Triton's ``python_test.py`` batches 4
requests of 2 under a 12 s delay and a preferred size of 8 as one execute)."""


def _auto_reason(version: ModelVersion, mode: ReplicationMode) -> str | None:
    """Why ``auto`` keeps ``version`` with the owner (None: it replicates it)."""
    server = _server_reason(version, mode)
    if server is not None:
        return server
    config = version.config
    if any(group.kind == 1 for group in config.instance_group):  # KIND_GPU
        return "it has GPU instances"
    if config.response_cache.enable:
        return "it uses the response cache"
    if config.HasField("dynamic_batching"):
        reason = _one_queue_reason(config.dynamic_batching)
        if reason is not None:
            return reason
    if any(group.rate_limiter.resources for group in config.instance_group):
        return "its instances take rate-limiter resources (counted in one process)"
    if version.context is not None and version.context.single_process_reason:
        return version.context.single_process_reason
    return None


def _one_queue_reason(batching: Any) -> str | None:
    """Why a dynamic batcher's settings hold only for one queue of the model (None: none do):
    a long queue delay fills batches from every connection; priorities order, and
    ``preserve_ordering`` releases, the requests of one queue; a queue policy's
    ``max_queue_size`` bounds, and its timeouts time, the requests waiting for the model's
    instances. Split over processes, each would hold for a share of the requests only."""
    delay = batching.max_queue_delay_microseconds
    if delay > LONG_QUEUE_DELAY_US:
        return (f"its dynamic batcher waits up to {delay} us to fill a batch, which one batcher fills "
                "from every connection")
    if batching.priority_levels > 1:
        return "its dynamic batcher orders requests by priority level, which holds within one queue"
    if batching.preserve_ordering:
        return "its dynamic batcher preserves the order of responses, which holds within one queue"
    for policy in (batching.default_queue_policy, *batching.priority_queue_policy.values()):
        if policy.max_queue_size or policy.default_timeout_microseconds or policy.allow_timeout_override:
            return ("its queue policy (max_queue_size, timeouts) counts the requests waiting for the "
                    "model's instances, which holds within one queue")
    return None


def replicable(version: ModelVersion, mode: ReplicationMode, repositories: Any = ()) -> tuple[bool, str]:
    """Whether frontends may load a replica of ``version``, and why not.

    :param repositories: the owner's repository folders: a version loaded from elsewhere (files
        sent with a load request) cannot be loaded again by a frontend.
    """
    parameter = version.config.parameters.get(REPLICATE_PARAMETER) if version.config is not None else None
    override = parameter.string_value.strip().lower() if parameter is not None else ""
    if override == "false":
        return False, f"parameter '{REPLICATE_PARAMETER}' is false"
    structural = _structural_reason(version)
    if structural is not None:
        return False, structural
    if version.context is not None and repositories:
        folders = {Path(r).resolve() for r in repositories}
        if Path(version.context.path).resolve().parent not in folders:
            return False, "it was loaded from files sent with the load request"
    if override == "true" or version.name in mode.names:
        return True, ""
    if not mode.auto:
        return False, "not selected by --replicate-models"
    reason = _auto_reason(version, mode)
    return (False, reason) if reason is not None else (True, "")


def describe(versions: list[tuple[ModelVersion, bool, str]]) -> None:
    """Log once per version which models frontends replicate and why others are not."""
    for version, chosen, reason in versions:
        if chosen:
            log.info("model '%s' version %d: replicated in frontend processes", version.name, version.version)
        else:
            log.info("model '%s' version %d: served by the owner process only: %s", version.name, version.version, reason)


class ReplicaSet:
    """A frontend's own replicas of the versions the owner marked replicable.

    Event loop only; loads and unloads run on a worker thread. ``local_for`` is the hot-path
    lookup: the READY replica standing for one owner version, or None.

    :param settings: the frontend settings (``repositories``, ``backend_config``, ...).
    :param prepared: a forked frontend's copy of the owner's ``ModelManager`` from before the
        fork (``pyserve.handoff.prefork``): its prepared models are started instead of loaded,
        sharing their weights with the owner. None: a fresh manager that loads every replica.
    """

    def __init__(self, settings: dict[str, Any], prepared: Any = None) -> None:
        from pyserve import __version__
        from pyserve.dataplane.bls import ServerHandle
        from pyserve.dataplane.plane import DataPlane
        from pyserve.host.plugins import PluginHost
        from pyserve.runtime.manager import ModelManager

        self.loop = asyncio.get_running_loop()
        self.load_threads = max(1, int(settings.get("load_threads", 4)))
        """Replicas loaded at the same time."""
        if prepared is not None:
            self.models = prepared
            self.models.follow_explicitly()  # replicas follow the owner's snapshots
        else:
            self.models = ModelManager(
                [Path(p) for p in settings["repositories"]],
                PluginHost(),
                auto_complete=settings["auto_complete"],
                backend_config=settings["backend_config"],
                load_threads=1,
                control_mode="explicit",
                backend_directory=settings["backend_directory"],
                cpu_threads=settings.get("cpu_threads"),
                unload_wait_secs=float(settings.get("exit_timeout_secs", 30.0)),
                server_handle=ServerHandle(None, self.loop),
            )
        self.models.plugins.observes_models = False  # the owner reports its versions' loads and unloads
        self.dataplane = DataPlane(self.models, "pyserve", __version__)
        self.dataplane.live = self.dataplane.accepting = True
        self.models.server_handle.bind(self.dataplane, self.loop)
        self.models.attach_loop(self.loop)
        self.by_generation: dict[int, ModelVersion] = {}
        # model name → the owner config and owner generations it was loaded for: a new generation
        # under the same config (model.py edited, then reloaded) loads the replica again
        self._loaded_config: dict[str, tuple[bytes, frozenset[int]]] = {}
        self._wanted: dict[str, tuple[bytes, Any, dict[int, tuple[int, Any]]]] = {}
        self._sync: asyncio.Task[None] | None = None
        self._again = False
        self._sent: dict[int, dict[str, Any]] = {}
        self._unsent: list[list[Any]] = []
        self._retired: list[ModelVersion] = []  # replicas the owner no longer serves, until drained
        self._reported: tuple[list[int], list[list[Any]], bool] | None = None
        self._watching = False
        self._syncing = False  # a sync is due or running: a retired READY replica is still to unload
        self.on_change: Any = None
        """Called (on the loop) with the READY generations, ``unloading()`` and ``syncing``
        whenever one changed: as a snapshot starts a sync, after each sync, once a drain ends."""

    def local_for(self, generation: int) -> ModelVersion | None:
        """The READY replica of owner version ``generation``, or None."""
        replica = self.by_generation.get(generation)
        return replica if replica is not None and replica.ready else None

    def follow(self, entries: list[tuple[str, int, int, bytes, Any]]) -> None:
        """A new owner snapshot: ``(name, version, generation, config bytes, io)`` of every
        replicable READY version. Loads, reloads and unloads follow in the background."""
        wanted: dict[str, tuple[bytes, Any, dict[int, tuple[int, Any]]]] = {}
        for name, version, generation, config, io in entries:
            entry = wanted.setdefault(name, (config, io, {}))
            entry[2][version] = (generation, io)
        self._wanted = wanted
        known = {g for entry in wanted.values() for g, _ in entry[2].values()}
        for generation in [g for g in self.by_generation if g not in known]:
            self._retire(generation)
        self._syncing = True
        self._report()  # before the snapshot is acknowledged: the owner knows what still unloads
        if self._sync is None or self._sync.done():
            self._sync = asyncio.ensure_future(self._run_sync())
        else:
            self._again = True

    async def _run_sync(self) -> None:
        try:
            while True:
                self._again = False
                await self._apply(dict(self._wanted))
                if not self._again:
                    break
        except Exception:  # noqa: BLE001 - a bug in a load: the frontend hands those requests off
            log.exception("frontend: replicas could not follow the owner's models")
        finally:
            self._syncing = False
            self._report()

    def unloading(self) -> list[list[Any]]:
        """``[name, version]`` of every replica the owner no longer serves that has not finished
        unloading (queued or running executes): the owner lists those versions UNLOADING."""
        serving = {id(v) for v in self.by_generation.values()}
        self._retired = [v for v in self._retired if id(v) not in serving and (
            v.state is ModelState.UNLOADING or (v.state is ModelState.READY and self._syncing))]
        return [[v.name, v.version] for v in self._retired]

    def _report(self) -> None:
        """Call ``on_change`` if what it was last told changed; while replicas unload, look
        again every ``_DRAIN_POLL_S`` (a drain ends on a thread of its own)."""
        report = (sorted(self.by_generation), self.unloading(), self._syncing)
        if report != self._reported:
            self._reported = report
            if self.on_change is not None:
                self.on_change(*report)
        if self._retired and not self._watching:
            self._watching = True
            self.loop.call_later(_DRAIN_POLL_S, self._watch)

    def _watch(self) -> None:
        self._watching = False
        self._report()

    async def _apply(self, wanted: dict[str, tuple[bytes, Any, dict[int, tuple[int, Any]]]]) -> None:
        import orjson

        from pyserve import protocol as pb
        from pyserve.api.errors import InferError
        from pyserve.protocol.config_json import model_config_to_dict

        loop = self.loop
        for name in [n for n in self._loaded_config if n not in wanted]:
            del self._loaded_config[name]
            await loop.run_in_executor(None, self.models.unload_model, name)
        slots = asyncio.Semaphore(self.load_threads)

        async def load(name: str, config: bytes, generations: frozenset[int]) -> None:
            message = pb.ModelConfig.FromString(config)
            async with slots:
                try:
                    if not await loop.run_in_executor(None, self.models.adopt_prepared, name, message):
                        text = orjson.dumps(model_config_to_dict(message)).decode()
                        await loop.run_in_executor(None, self.models.load_model, name, text)
                except InferError as exc:
                    log.warning("frontend: no replica of model '%s': %s", name, exc.message)
                except Exception:  # noqa: BLE001 - a bug in one load: the others go on
                    log.exception("frontend: no replica of model '%s'", name)
            self._loaded_config[name] = (config, generations)  # loaded, or failed: not retried

        def generations_of(versions: dict[int, tuple[int, Any]]) -> frozenset[int]:
            return frozenset(generation for generation, _ in versions.values())

        # as the owner loads its models at the start: several at once (``--model-load-thread-count``)
        await asyncio.gather(*(load(name, config, generations_of(versions))
                               for name, (config, _, versions) in wanted.items()
                               if self._loaded_config.get(name) != (config, generations_of(versions))))
        for name, (_, _, versions) in wanted.items():
            record = self.models.records.get(name)
            for version, (generation, io) in versions.items():
                replica = record.versions.get(version) if record is not None else None
                if replica is None or not replica.ready:
                    continue
                if replica.io != io:
                    log.warning("frontend: replica of model '%s' version %d differs from the owner's; "
                                "its requests go to the owner", name, version)
                    continue
                self.by_generation[generation] = replica
        self.models.prepared.clear()  # what the owner does not serve (or serves otherwise) is dropped

    def _retire(self, generation: int) -> None:
        replica = self.by_generation.pop(generation, None)
        if replica is not None:  # what it counted since the last pull still reaches the owner
            self._retired.append(replica)
            delta = self._delta(generation, replica)
            if delta is not None:
                self._unsent.append([generation, delta])
            self._sent.pop(generation, None)

    def _delta(self, generation: int, replica: ModelVersion) -> dict[str, Any] | None:
        from pyserve.metrics.stats import counters_delta

        now = replica.stats.counters()
        delta = counters_delta(now, self._sent.get(generation))
        self._sent[generation] = now
        if not any(delta[k] for k in ("success_count", "fail_count", "enqueued", "dequeued", "execution_count")):
            return None
        delta["batches"] = {str(size): entry for size, entry in delta["batches"].items() if entry[0]}
        delta["responses"] = {str(index): entry for index, entry in delta["responses"].items() if any(entry)}
        return delta

    def stats_deltas(self) -> list[list[Any]]:
        """``[generation, counters delta]`` for every replica that counted something since the
        last call."""
        deltas, self._unsent = self._unsent, []
        for generation, replica in list(self.by_generation.items()):
            delta = self._delta(generation, replica)
            if delta is not None:
                deltas.append([generation, delta])
        return deltas

    async def close(self, timeout: float) -> None:
        """Unload every replica (finishing what they have queued)."""
        await self.loop.run_in_executor(None, self.models.unload_all, timeout)
