"""The model owner's end of the hand-off: takes decoded requests from frontend processes.

The owner is the ``pyserve run`` process that loaded the models. ``HandoffServer`` listens on
a Unix socket; each frontend process keeps one connection to it and multiplexes its requests
over it by request id. An INFER frame becomes an ``InferRequest`` (inputs are views of the
frame's bytes) that goes through ``DataPlane.submit`` exactly like one decoded in this
process, so schedulers, sequences, statistics, the response cache and metrics see no
difference. The answer goes back as a RESULT frame once the request's future resolves.

Frontends decode against a snapshot of the READY models (name, version, config) that the
owner sends when they connect and again whenever a model becomes READY or is unloaded. A
frame names the snapshot entry (``generation``) it was decoded for; the owner maps it back to
that ``ModelVersion`` (a version replaced by a reload hands the request to its successor, as
in-process requests are). Requests a frontend cannot decode itself (shared-memory tensors, a
model not in its snapshot) come as RAW frames and are decoded and encoded here, so every
answer, error text included, is the one a single-process server gives.

Threading: everything here runs on the owner's event loop; backends answer from instance
threads through ``FutureSender``, which hands results to the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

from pyserve import logs
from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import FutureSender, InferRequest
from pyserve.dataplane.plane import DataPlane
from pyserve.frontends.grpc.codec import WireParts, encode_infer_wire, parse_infer_request
from pyserve.frontends.grpc.codec import decode_infer as grpc_decode
from pyserve.frontends.grpc.servicer import infer_model as grpc_infer_model
from pyserve.frontends.http.fast_infer import (
    declared_infer_body,
    decode_soon,
    encode_reply,
    error_reply,
    infer_model,
    submit_request,
)
from pyserve.handoff import wire
from pyserve.handoff.replicas import ReplicationMode, describe, replicable
from pyserve.handoff.wire import Kind
from pyserve.runtime.scheduling import client_activity
from pyserve.runtime.versions import ModelVersion

log = logging.getLogger("pyserve.handoff")

_REQUEST_KINDS = frozenset((Kind.INFER, Kind.RAW_HTTP, Kind.RAW_GRPC))
"""Frames that start a request (``client_activity``: each may come from another client)."""


def _running(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the calling thread runs ``loop``."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class HandoffServer:
    """Serves frontend processes on a Unix socket (event loop only).

    :param dataplane: the owner's data plane.
    :param max_input_size: ``--http-max-input-size``, for raw HTTP requests.
    :ivar requests: requests answered for frontends so far (fast and raw).
    :ivar absorbed: requests the frontends' replicas answered, as their statistics reported.
    """

    def __init__(self, dataplane: DataPlane, max_input_size: int, replication: ReplicationMode | None = None,
                 unload_wait_secs: float = 30.0) -> None:
        self.dataplane = dataplane
        self.max_input_size = max_input_size
        self.replication = replication or ReplicationMode("none")
        self.unload_wait_secs = unload_wait_secs
        """How long a load or unload waits for the frontends' replicas it retired to drain (as
        the owner waits for its own versions: ``--exit-timeout-secs``)."""
        self.replicas: dict[int, list[int]] = {}
        """Frontend pid → the owner versions (generations) it answers with its own replicas."""
        self.unloading: dict[int, set[tuple[str, int]]] = {}
        """Frontend pid → (model, version) of its replicas that still unload after the owner
        unloaded or replaced that version (listed UNLOADING by the repository index)."""
        self._unloading_changed = asyncio.Event()  # set (and replaced) whenever ``unloading`` changes
        self._replicable: weakref.WeakKeyDictionary[ModelVersion, bool] = weakref.WeakKeyDictionary()
        self.connections: set[_FrontendConnection] = set()
        self.requests = 0
        self.absorbed = 0
        """Requests frontend replicas answered themselves, as counted by statistics pulls."""
        self.hello = asyncio.Condition()
        self.ready_pids: set[int] = set()
        self._server: asyncio.base_events.Server | None = None
        self._generations: weakref.WeakValueDictionary[int, ModelVersion] = weakref.WeakValueDictionary()
        self._generation_of: weakref.WeakKeyDictionary[ModelVersion, int] = weakref.WeakKeyDictionary()
        self._next_generation = 1
        self._snapshot: list[Any] | None = None
        self._push_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, path: str) -> None:
        """Listen on the Unix socket ``path`` (created here, owner-only)."""
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_unix_server(lambda: _FrontendConnection(self), path)
        os.chmod(path, 0o600)
        logs.add_update_listener(self._log_settings_changed)
        self.dataplane.tracing.change_listeners.append(self._tracing_changed)

    async def close(self) -> None:
        """Stop listening and close every frontend connection."""
        logs.remove_update_listener(self._log_settings_changed)
        with contextlib.suppress(ValueError):
            self.dataplane.tracing.change_listeners.remove(self._tracing_changed)
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close()

    def _on_loop(self, callback: Callable[..., None], *args: Any) -> None:
        """Run ``callback(*args)`` now when called on the owner's loop (so that what it sends
        precedes the answer being written), else soon on the loop; not once the loop closed."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            if _running(loop):
                callback(*args)
            else:
                loop.call_soon_threadsafe(callback, *args)

    def _log_settings_changed(self, settings: dict[str, Any]) -> None:
        """The logging extension changed this process's settings (any thread): frontends apply
        them too (each connection is sent them as it opens, so a restarted frontend has them)."""
        self._on_loop(self._send_log_settings, settings)

    def _send_log_settings(self, settings: dict[str, Any]) -> None:
        for connection in list(self.connections):
            connection.send_log_settings(settings)

    def tracing_frame(self) -> list[Any]:
        """The TRACING frame of the owner's trace settings now."""
        traced, on, off = self.dataplane.tracing.traced_models()
        return wire.frame(Kind.TRACING, 0, {"g": traced, "on": on, "off": off})

    def _tracing_changed(self) -> None:
        """Which models are traced changed (any thread): frontends send those models' requests
        to the owner, whose sampling and trace file every traced request must pass through."""
        self._on_loop(self._send_tracing)

    def _send_tracing(self) -> None:
        frame = self.tracing_frame()
        for connection in list(self.connections):
            if connection.writer is not None:
                connection.writer.send(frame)

    # -- model snapshots -------------------------------------------------------------------
    def models_changed(self) -> None:
        """A model became READY or was unloaded: send frontends a new snapshot (any thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._schedule_push)

    def _schedule_push(self) -> None:
        self._snapshot = None
        if not self._push_scheduled and self._loop is not None:
            self._push_scheduled = True
            self._loop.call_later(0.01, self._push)  # several models changing at once: one push

    def _push(self) -> None:
        self._push_scheduled = False
        for connection in list(self.connections):
            connection.send_snapshot()

    async def sync_frontends(self, timeout: float = 10.0) -> None:
        """Send every frontend the current snapshot now and wait until each applied it, then
        for the replicas it retired to finish unloading (``unload_wait_secs`` at most).

        Model control awaits this before answering, so that once an unload returns no
        frontend answers from a replica of the unloaded version any more, and, as in one
        process, the version is UNAVAILABLE unless an execute outlasted the wait (then the
        index lists it UNLOADING until the replica's executes end).
        """
        before = self.unloading_versions()
        self._snapshot = None
        waits = [w for c in list(self.connections)
                 if c.hello_received and (w := c.send_snapshot(wait=True)) is not None]
        if waits:
            await asyncio.wait(waits, timeout=timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.unload_wait_secs
        while self.unloading_versions() - before:  # frontends report before they acknowledge
            left = deadline - loop.time()
            if left <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._unloading_changed.wait(), left)

    def unloading_versions(self) -> set[tuple[str, int]]:
        """(model, version) of every replica a frontend still unloads."""
        versions: set[tuple[str, int]] = set()
        for held in self.unloading.values():
            versions |= held
        return versions

    def _set_unloading(self, pid: int, versions: set[tuple[str, int]] | None) -> None:
        if versions:
            self.unloading[pid] = versions
        else:
            self.unloading.pop(pid, None)
        changed, self._unloading_changed = self._unloading_changed, asyncio.Event()
        changed.set()

    def snapshot(self) -> list[Any]:
        """The SNAPSHOT frame: ``[name, version key, generation, config index]`` entries
        for every READY version and for each model's default (unversioned) choice, plus the
        serialized configs."""
        if self._snapshot is None:
            entries: list[list[Any]] = []
            configs: list[bytes] = []
            ios: list[Any] = []
            index_of: dict[int, int] = {}
            for name, record in list(self.dataplane.models.records.items()):
                ready = record.ready_versions()
                for version in ready:
                    generation = self.generation(version)
                    if generation not in index_of:
                        index_of[generation] = len(configs)
                        configs.append(version.config.SerializeToString())
                        ios.append(wire.io_to_json(version.io))
                    entries.append([name, str(version.version), generation, version.version, index_of[generation],
                                    self._replicate(version)])
                if ready:
                    latest = ready[-1]
                    entries.append([name, None, self.generation(latest), latest.version, index_of[self.generation(latest)],
                                    self._replicate(latest)])
            sizes = [len(c) for c in configs]
            self._snapshot = wire.frame(Kind.SNAPSHOT, 0, {"m": entries, "s": sizes, "io": ios}, configs)
        return self._snapshot

    def _replicate(self, version: ModelVersion) -> bool:
        chosen = self._replicable.get(version)
        if chosen is None:
            chosen, reason = replicable(version, self.replication, self.dataplane.models.repositories)
            if not self.replication.none:
                describe([(version, chosen, reason)])
            self._replicable[version] = chosen
        return chosen

    def replicas_placed(self, pid: int) -> bool:
        """Whether frontend ``pid`` said HELLO and its replicas hold what its last snapshot
        asked for (loaded, or failed and left to the owner); True for a frontend without
        replicas once it said HELLO."""
        return any(c.pid == pid and c.hello_received and not c.replicas_syncing for c in list(self.connections))

    async def collect_stats(self, timeout: float = 2.0) -> None:
        """Pull the counters of every frontend's replicas into the owner's statistics.

        Called before a statistics answer or a metrics scrape; a frontend that does not answer
        within ``timeout`` seconds is left out this time (its counts arrive with a later pull).
        """
        waits = [c.pull_stats() for c in list(self.connections) if c.hello_received]
        if waits:
            await asyncio.wait(waits, timeout=timeout)

    async def replicas_not_ready(self, versions: list[ModelVersion]) -> set[ModelVersion]:
        """Of ``versions``, those a frontend's replica fails its readiness check for (Triton's
        model is ready only when every instance is, and a replica's instances are the model's
        too). Frontends holding no replica of a version are not asked; one that does not
        answer within the check timeout counts as not ready for what it was asked."""
        asks: list[tuple[asyncio.Future[list[int] | None], dict[int, ModelVersion]]] = []
        for connection in list(self.connections):
            held = set(self.replicas.get(connection.pid, ()))
            asked = {g: v for v in versions if (g := self._generation_of.get(v)) is not None and g in held}
            if asked and connection.hello_received:
                asks.append((connection.pull_readiness(sorted(asked)), asked))
        if not asks:
            return set()
        await asyncio.wait([future for future, _ in asks], timeout=self.dataplane.readiness.timeout_s + 1.0)
        failed: set[ModelVersion] = set()
        for future, asked in asks:
            if not future.done():
                future.cancel()
                failed.update(asked.values())
            elif (not_ready := future.result()) is not None:
                failed.update(asked[g] for g in not_ready if g in asked)
        return failed

    def absorb(self, deltas: list[list[Any]]) -> None:
        """Add replica counters to the versions they stand for (versions gone are skipped)."""
        for generation, delta in deltas:
            version = self._generations.get(generation)
            if version is not None:
                version.stats.absorb(delta)
                self.absorbed += delta.get("success_count", 0) + delta.get("fail_count", 0)

    def generation(self, version: ModelVersion) -> int:
        """The number frontends know ``version`` by (stable for the version's lifetime)."""
        generation = self._generation_of.get(version)
        if generation is None:
            generation = self._next_generation
            self._next_generation += 1
            self._generation_of[version] = generation
            self._generations[generation] = version
        return generation

    def resolve(self, generation: int, name: str, version: str | None) -> ModelVersion:
        """The ``ModelVersion`` a frontend decoded for; looked up afresh when it is gone.

        :raises InferError: as ``DataPlane.model`` when the version is gone.
        """
        model = self._generations.get(generation)
        if model is not None and model.serving().ready:
            return model
        self._schedule_push()  # the frontend's snapshot is out of date: answer as a lookup would
        return self.dataplane.model(name, version)


class _FrontendConnection(asyncio.Protocol):
    """One frontend process's connection."""

    def __init__(self, server: HandoffServer) -> None:
        self.server = server
        self.dataplane = server.dataplane
        self.loop = asyncio.get_running_loop()
        self.reader = wire.FrameReader(self._on_frame)
        self.writer: wire.FrameWriter | None = None
        self.pending: dict[int, InferRequest] = {}
        self.tasks: dict[int, asyncio.Task[Any]] = {}
        self.waiters: dict[int, asyncio.Future[Any]] = {}  # pull or sync id → its answer (None: none)
        self.next_pull = 1
        self.hello_received = False
        self.pid = 0
        self.replicas_syncing = False
        """Whether the frontend's replicas are still loading or unloading what the last
        snapshot asked for (its REPLICAS reports say)."""
        self._early_report: dict[str, Any] | None = None  # a REPLICAS report sent before HELLO

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.writer = wire.FrameWriter(self.loop, transport)  # type: ignore[arg-type]
        self.server.connections.add(self)
        self.send_log_settings(logs.changeable_settings())  # changed since the frontend's start, maybe
        self.writer.send(self.server.tracing_frame())  # before the snapshot: no replica answers untraced
        self.send_snapshot()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.server.ready_pids.discard(self.pid)
        for request in self.pending.values():
            request.cancel()
        for task in self.tasks.values():
            task.cancel()
        for waiter in self.waiters.values():
            if not waiter.done():
                waiter.set_result(None)
        self.server.replicas.pop(self.pid, None)
        self.server._set_unloading(self.pid, None)
        self._spawn(0, self._announce())  # a supervisor waiting for this frontend looks again

    def _waiter(self) -> tuple[int, asyncio.Future[Any]]:
        """A new pull or sync id and the future its answer resolves (``_answered``)."""
        pull_id = self.next_pull
        self.next_pull += 1
        waiter: asyncio.Future[Any] = self.loop.create_future()
        self.waiters[pull_id] = waiter
        return pull_id, waiter

    def pull_stats(self) -> asyncio.Future[None]:
        """Ask the frontend for its replicas' counters; resolves once they are absorbed."""
        pull_id, waiter = self._waiter()
        assert self.writer is not None
        self.writer.send(wire.frame(Kind.STATS_PULL, pull_id))
        return waiter

    def pull_readiness(self, generations: list[int]) -> asyncio.Future[list[int] | None]:
        """Ask the frontend to run its replicas' readiness checks for ``generations``; resolves
        to the generations whose replica is not ready (None: the frontend went away)."""
        pull_id, waiter = self._waiter()
        assert self.writer is not None
        self.writer.send(wire.frame(Kind.READY_PULL, pull_id, {"g": generations}))
        return waiter

    def close(self) -> None:
        if self.writer is not None:
            self.writer.transport.close()

    def send_log_settings(self, settings: dict[str, Any]) -> None:
        """Send the logging settings for the frontend to apply (``update_settings``)."""
        if self.writer is not None:
            self.writer.send(wire.frame(Kind.LOG_SETTINGS, 0, settings))

    def send_snapshot(self, wait: bool = False) -> asyncio.Future[None] | None:
        """Send the current snapshot; with ``wait``, a future resolved once it is applied."""
        if self.writer is None:
            return None
        parts = list(self.server.snapshot())
        if not wait:
            self.writer.send(parts)
            return None
        sync_id, waiter = self._waiter()
        parts[0] = wire.retarget(parts[0], sync_id)
        self.writer.send(parts)
        return waiter

    def data_received(self, data: bytes) -> None:
        try:
            self.reader.feed(data)
        except Exception:  # noqa: BLE001 - a broken stream: drop this frontend, keep serving
            log.exception("hand-off stream from frontend %d is broken; closing it", self.pid)
            self.close()

    # -- frames ------------------------------------------------------------------------------
    def _on_frame(self, kind: int, request_id: int, payload: bytes | bytearray) -> None:
        if kind in _REQUEST_KINDS:  # a link carries many clients' requests
            client_activity.request_mixed()
        if kind == Kind.INFER:
            try:
                self._infer(request_id, payload)
            except Exception as exc:  # noqa: BLE001 - a bug: answer INTERNAL, keep the link
                log.exception("hand-off of a request failed")
                error = InferError(f"internal server error: {type(exc).__name__}: {exc}")
                assert self.writer is not None
                self.writer.send(wire.error_frame(Kind.RESULT, request_id, error))
        elif kind == Kind.CANCEL:
            request = self.pending.get(request_id)
            if request is not None:
                request.cancel()
            task = self.tasks.get(request_id)
            if task is not None:
                task.cancel()
        elif kind == Kind.RAW_HTTP:
            self._spawn(request_id, self._raw_http(request_id, payload))
        elif kind == Kind.RAW_GRPC:
            self._spawn(request_id, self._raw_grpc(request_id, payload))
        else:
            self._on_control(kind, request_id, payload)

    def _on_control(self, kind: int, request_id: int, payload: bytes | bytearray) -> None:
        """Frames about the link itself: answers to the owner's pulls, replica reports, HELLO."""
        if kind == Kind.STATS:
            header, _ = wire.split_payload(payload)
            self.server.absorb(header["d"])
            self._answered(request_id, None)
        elif kind == Kind.SNAPSHOT_APPLIED:
            self._answered(request_id, None)
        elif kind == Kind.READY:
            header, _ = wire.split_payload(payload)
            self._answered(request_id, [int(g) for g in header["n"]])
        elif kind == Kind.REPLICAS:
            header, _ = wire.split_payload(payload)
            if self.hello_received:
                self._take_report(header)
            else:  # its first snapshot came before HELLO: filed under its pid once that is known
                self._early_report = header
        elif kind == Kind.HELLO:
            header, _ = wire.split_payload(payload)
            self.pid = int(header.get("pid", 0))
            self.hello_received = True
            self.server.ready_pids.add(self.pid)
            if self._early_report is not None:
                self._take_report(self._early_report)
                self._early_report = None
            self._spawn(0, self._announce())
        else:
            raise ValueError(f"unexpected frame kind {kind} from a frontend")

    def _take_report(self, header: dict[str, Any]) -> None:
        self.server.replicas[self.pid] = list(header["g"])
        self.server._set_unloading(self.pid, {(str(n), int(v)) for n, v in header.get("u", ())})
        syncing = bool(header.get("s", False))
        if self.replicas_syncing and not syncing:
            self._spawn(0, self._announce())  # the supervisor may be waiting for these replicas
        self.replicas_syncing = syncing
        log.debug("frontend %d answers %d model version(s) with its own replicas%s", self.pid, len(header["g"]),
                  " (loading more)" if syncing else "")

    def _answered(self, request_id: int, answer: Any) -> None:
        waiter = self.waiters.pop(request_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    async def _announce(self) -> None:
        async with self.server.hello:
            self.server.hello.notify_all()

    def _spawn(self, request_id: int, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        if request_id:
            self.tasks[request_id] = task
            task.add_done_callback(lambda _: self.tasks.pop(request_id, None))

    def _infer(self, request_id: int, payload: bytes | bytearray) -> None:
        assert self.writer is not None
        try:
            header, data = wire.split_payload(payload)
            name, version_key = header["m"]
            model = self.server.resolve(header["g"], name, version_key)
            request = InferRequest(
                name,
                model.version,
                wire.read_tensors(header["i"], data),
                tuple(header["o"]),
                id=header["id"],
                parameters=header["p"],
                flags=header["f"],
                correlation_id=header["c"],
                priority=header["pr"],
                timeout_us=header["t"],
                batch_size=header["b"],
            )
        except InferError as exc:
            self.writer.send(wire.error_frame(Kind.RESULT, request_id, exc))
            return
        except (KeyError, ValueError, TypeError) as exc:
            error = InferError(f"malformed hand-off request: {exc}", ErrorCode.INTERNAL)
            self.writer.send(wire.error_frame(Kind.RESULT, request_id, error))
            return
        request.arrival_ns = header["a"]
        request.trace_parent = header["tp"]
        future: asyncio.Future[Any] = self.loop.create_future()
        request.attach_sender(FutureSender(self.loop, future))
        try:
            self.dataplane.submit(model, request)
        except InferError as refused:
            self.writer.send(wire.error_frame(Kind.RESULT, request_id, refused))
            return
        self.pending[request_id] = request
        future.add_done_callback(lambda done: self._answer(request_id, request, done))

    def _answer(self, request_id: int, request: InferRequest, future: asyncio.Future[Any]) -> None:
        request.release()
        self.pending.pop(request_id, None)
        self.server.requests += 1
        writer = self.writer
        if writer is None or writer.transport.is_closing() or future.cancelled():
            return
        try:
            parts = wire.result_frame(request_id, future.result())
        except (TypeError, ValueError) as exc:  # e.g. a response parameter JSON cannot hold
            error = InferError(f"the response of model '{request.model_name}' cannot be sent: {exc}")
            parts = wire.error_frame(Kind.RESULT, request_id, error)
        writer.send(parts)

    # -- requests the frontend could not decode ----------------------------------------------
    async def _raw_http(self, request_id: int, payload: bytes | bytearray) -> None:
        """Run an HTTP infer body through the owner's own HTTP steps; answer status/headers/body."""
        header, body = wire.split_payload(payload)
        headers = {k.encode("latin-1"): v.encode("latin-1") for k, v in header["h"]}
        dataplane = self.dataplane
        request: InferRequest | None = None
        try:
            model = infer_model(dataplane, header["n"], header["v"])
            declared_infer_body(headers.items(), self.server.max_input_size)
            decoded, decode_ns = await decode_soon(dataplane, model, bytes(body), headers, self.server.max_input_size)
            request = decoded.request
            future = submit_request(dataplane, model, request, self.loop)
            try:
                result = await future
            except asyncio.CancelledError:
                request.cancel()
                raise
            reply = encode_reply(result, decoded, model, decode_ns, headers.get(b"accept-encoding"))
        except InferError as exc:
            reply = error_reply(exc)
        except Exception as exc:  # noqa: BLE001 - a bug: answer 500, keep serving
            log.exception("hand-off of an HTTP infer request failed")
            reply = error_reply(InferError(f"internal server error: {type(exc).__name__}: {exc}"))
        finally:
            if request is not None:
                request.release()
        status, content, out_headers = reply
        self.server.requests += 1
        if self.writer is not None:
            names = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in out_headers]
            self.writer.send(wire.frame(Kind.RAW_HTTP_REPLY, request_id, {"s": status, "h": names}, [content]))

    async def _raw_grpc(self, request_id: int, payload: bytes | bytearray) -> None:
        """Run a serialized ModelInferRequest through the owner's gRPC steps."""
        header, data = wire.split_payload(payload)
        dataplane = self.dataplane
        try:
            message = parse_infer_request(data)  # large tensors stay views of the payload
            model = grpc_infer_model(dataplane, message)
            decoded = grpc_decode(message, model, shm=dataplane.shared_memory)
            decoded.request.trace_parent = header.get("tp")
            for name, value in header.get("fh", ()):  # forwarded metadata, already checked by the frontend
                decoded.request.parameters[name] = value
            result = await dataplane.infer(model, decoded.request)
            if isinstance(result, InferError):
                raise result
            encoded = encode_infer_wire(result, decoded, model, join=False)  # large outputs: views, not joined
            parts = encoded if type(encoded) is WireParts else [encoded]
            reply = wire.frame(Kind.RAW_GRPC_REPLY, request_id, {}, parts)  # type: ignore[arg-type]
        except InferError as exc:
            reply = wire.error_frame(Kind.RAW_GRPC_REPLY, request_id, exc)
        except Exception as exc:  # noqa: BLE001 - a bug: answer INTERNAL, keep serving
            log.exception("hand-off of a gRPC infer request failed")
            error = InferError(f"internal server error: {type(exc).__name__}: {exc}")
            reply = wire.error_frame(Kind.RAW_GRPC_REPLY, request_id, error)
        self.server.requests += 1
        if self.writer is not None:
            self.writer.send(reply)
