"""A frontend process's one connection to the model owner (``pyserve.handoff.frontend``).

Requests decoded in the frontend go out as frames (``pyserve.handoff.wire``); results, model
snapshots and statistics pulls come back. The snapshot lists the owner's READY versions as
``RemoteModel`` objects, which is how the frontend knows the models it may decode for.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from typing import Any

from pyserve import logs
from pyserve import protocol as pb
from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.handoff import wire
from pyserve.handoff.replicas import ReplicaSet
from pyserve.handoff.wire import Kind
from pyserve.runtime.versions import ModelState, ModelVersion

log = logging.getLogger("pyserve.frontend")

OWNER_GONE = "the model owner process is not reachable from this frontend process"


class RemoteModel(ModelVersion):
    """A READY model version as a frontend knows it: its config, and the owner's number for it."""

    generation: int = 0
    target: tuple[str, str | None] = ("", None)


class OwnerLink(asyncio.Protocol):
    """The frontend's one connection to the owner: requests out, results and snapshots in.

    Event loop only. ``models`` maps ``(name, version or None)`` to the READY versions of the
    latest snapshot.
    """

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.models: dict[tuple[str, str | None], RemoteModel] = {}
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.ids = itertools.count(1)
        self.reader = wire.FrameReader(self._on_frame)
        self.writer: wire.FrameWriter | None = None
        self.snapshot_received = asyncio.Event()
        self.lost = asyncio.Event()
        self.replicas: ReplicaSet | None = None
        """The frontend's own replicas, which follow each snapshot (None: no replicas)."""
        self.trace_all = False  # the owner's TRACING state: its global scope traces
        self.traced: frozenset[str] = frozenset()  # models with settings of their own that trace
        self.untraced: frozenset[str] = frozenset()  # ... that do not
        self._tasks: set[asyncio.Task[None]] = set()  # readiness answers under way

    # -- connection ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.writer = wire.FrameWriter(self.loop, transport)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        error = InferError(OWNER_GONE, ErrorCode.UNAVAILABLE)
        for future in self.pending.values():
            if not future.done():
                future.set_result(error)
        self.pending.clear()
        self.lost.set()
        self.snapshot_received.set()

    def data_received(self, data: bytes) -> None:
        try:
            self.reader.feed(data)
        except Exception:  # noqa: BLE001 - a broken stream cannot be resynchronised
            log.exception("hand-off stream from the owner is broken")
            if self.writer is not None:
                self.writer.transport.close()

    def hello(self) -> None:
        """Tell the owner this frontend listens and takes requests."""
        self._send(wire.frame(Kind.HELLO, 0, {"pid": os.getpid()}))

    def may_trace(self, model: str) -> bool:
        """Whether the owner may trace requests of ``model`` now (they must go to the owner)."""
        if model in self.traced:
            return True
        return self.trace_all and model not in self.untraced

    def _send(self, parts: list[Any]) -> None:
        if self.writer is None or self.lost.is_set():
            raise InferError(OWNER_GONE, ErrorCode.UNAVAILABLE)
        self.writer.send(parts)

    # -- frames ------------------------------------------------------------------------------
    def _on_frame(self, kind: int, request_id: int, payload: bytes | bytearray) -> None:
        if kind == Kind.SNAPSHOT:
            self._take_snapshot(payload)
            if request_id:
                with contextlib.suppress(InferError):
                    self._send(wire.frame(Kind.SNAPSHOT_APPLIED, request_id))
            return
        if kind == Kind.STATS_PULL:
            self.send_stats(request_id)
            return
        if kind == Kind.TRACING:
            header, _ = wire.split_payload(payload)
            self.trace_all = bool(header["g"])
            self.traced, self.untraced = frozenset(header["on"]), frozenset(header["off"])
            return
        if kind == Kind.LOG_SETTINGS:
            header, _ = wire.split_payload(payload)
            try:
                logs.update_settings(header)
            except Exception:  # noqa: BLE001 - the owner checked them; keep the link whatever happens
                log.exception("frontend: the owner's logging settings could not be applied")
            return
        if kind == Kind.READY_PULL:
            header, _ = wire.split_payload(payload)
            task = asyncio.ensure_future(self._answer_readiness(request_id, [int(g) for g in header["g"]]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        future = self.pending.pop(request_id, None)
        if future is None or future.done():
            return  # cancelled meanwhile
        header, data = wire.split_payload(payload)
        if "e" in header:
            future.set_result(InferError(header["e"], ErrorCode(header["c"])))
        elif kind == Kind.RESULT:
            future.set_result(InferResponse(wire.read_tensors(header["o"], data), header["p"]))
        elif kind == Kind.RAW_HTTP_REPLY:
            headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in header["h"]]
            future.set_result((header["s"], bytes(data), headers))
        else:  # RAW_GRPC_REPLY
            future.set_result(bytes(data))

    def _take_snapshot(self, payload: bytes | bytearray) -> None:
        header, data = wire.split_payload(payload)
        configs: list[Any] = []
        offset = 0
        for size in header["s"]:
            configs.append(pb.ModelConfig.FromString(bytes(data[offset : offset + size])))
            offset += size
        by_generation: dict[int, RemoteModel] = {}
        models: dict[tuple[str, str | None], RemoteModel] = {}
        replicate: list[tuple[str, int, int, bytes, Any]] = []
        offsets = [0]
        for size in header["s"]:
            offsets.append(offsets[-1] + size)
        for name, key, generation, version, index, replicable in header["m"]:
            model = by_generation.get(generation)
            if model is None:
                config = configs[index]
                model = RemoteModel(name=name, version=version, state=ModelState.READY, config=config,
                                    io=wire.io_from_json(header["io"][index]))
                model.generation = generation
                model.target = (name, key)
                by_generation[generation] = model
                if replicable:
                    replicate.append((name, version, generation, bytes(data[offsets[index] : offsets[index + 1]]), model.io))
            models[(name, key)] = model
        self.models = models
        if self.replicas is not None:
            self.replicas.follow(replicate)
        self.snapshot_received.set()

    def send_stats(self, request_id: int) -> None:
        """Send the replicas' counters since the last time (to a pull, or unasked with id 0)."""
        deltas = self.replicas.stats_deltas() if self.replicas is not None else []
        with contextlib.suppress(InferError):
            self._send(wire.frame(Kind.STATS, request_id, {"d": deltas}))

    async def _answer_readiness(self, request_id: int, generations: list[int]) -> None:
        """Run the readiness checks of the replicas standing for ``generations`` and tell the
        owner which are not ready (a generation with no READY replica here is not counted)."""
        not_ready: list[int] = []
        replicas = self.replicas
        if replicas is not None:
            checks = replicas.dataplane.readiness
            for generation in generations:
                replica = replicas.local_for(generation)
                if replica is not None and not await checks.version_ready(replica):
                    not_ready.append(generation)
        with contextlib.suppress(InferError):
            self._send(wire.frame(Kind.READY, request_id, {"n": not_ready}))

    def announce_replicas(self, generations: list[int], unloading: list[list[Any]], syncing: bool) -> None:
        """Tell the owner which of its versions this frontend now answers itself, which
        ``[name, version]`` replicas still unload, and whether loads or unloads are under way."""
        with contextlib.suppress(InferError):
            self._send(wire.frame(Kind.REPLICAS, 0, {"g": generations, "u": unloading, "s": syncing}))

    # -- requests --------------------------------------------------------------------------
    def submit(self, model: RemoteModel, request: InferRequest) -> tuple[int, asyncio.Future[Any]]:
        """Send a decoded request; the future resolves to its ``InferResponse`` or ``InferError``.

        :raises InferError: the owner is gone, or the request does not fit in a frame.
        """
        request_id = next(self.ids)
        try:
            parts = wire.request_frame(request_id, request, model.generation, model.target)
        except (TypeError, ValueError) as exc:
            raise InferError.invalid(f"the request cannot be handed to the model owner: {exc}") from None
        return request_id, self._await(request_id, parts)

    def raw_http(self, target: tuple[str, str | None], headers: list[tuple[bytes, bytes]], body: bytes | bytearray) -> tuple[int, asyncio.Future[Any]]:
        """Hand an HTTP infer request to the owner undecoded; resolves to ``(status, body, headers)``."""
        request_id = next(self.ids)
        names = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers]
        parts = wire.frame(Kind.RAW_HTTP, request_id, {"n": target[0], "v": target[1], "h": names}, [memoryview(body)])
        return request_id, self._await(request_id, parts)

    def raw_grpc(self, message: bytes | memoryview, trace_parent: str | None,
                 forwarded: list[tuple[str, str]] | None = None) -> tuple[int, asyncio.Future[Any]]:
        """Hand a serialized ModelInferRequest to the owner; resolves to the response's bytes.

        :param forwarded: metadata to add as request parameters (``--grpc-header-forward-pattern``).
        """
        request_id = next(self.ids)
        header: dict[str, Any] = {"tp": trace_parent}
        if forwarded:  # only with --grpc-header-forward-pattern
            header["fh"] = [list(pair) for pair in forwarded]
        return request_id, self._await(request_id, wire.frame(Kind.RAW_GRPC, request_id, header, [message]))

    def _await(self, request_id: int, parts: list[Any]) -> asyncio.Future[Any]:
        self._send(parts)
        future: asyncio.Future[Any] = self.loop.create_future()
        self.pending[request_id] = future
        return future

    def cancel(self, request_id: int) -> None:
        """The client went away: the owner drops the request if it has not run yet."""
        if self.pending.pop(request_id, None) is not None and not self.lost.is_set():
            with contextlib.suppress(InferError):
                self._send(wire.frame(Kind.CANCEL, request_id))
