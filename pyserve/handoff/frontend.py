"""A frontend process: serves the HTTP and gRPC ports beside the model owner.

``pyserve run --frontend-processes N`` starts N of these (``python -m pyserve.handoff.frontend``).
Each serves the same HTTP and gRPC ports as the owner: the owner accepts the connections and
passes each to the process holding the fewest (``pyserve.frontends.balancer``), or, with
``--frontend-balance kernel``, each process binds the ports itself (``SO_REUSEPORT``: the kernel
spreads new connections over the processes). It parses and decodes requests with the same codecs as the
owner, and hands the decoded request to the owner over one Unix-socket connection
(``pyserve.handoff.wire``). The owner schedules and executes it and sends the outputs back;
the frontend encodes the answer. Protocol work, the larger share of a small model's cost,
thus runs on another core, while models, schedulers, sequences, statistics and metrics stay
in the one owner process.

What a frontend does not decode itself goes to the owner unchanged: infer requests naming
shared-memory regions or a model missing from its snapshot (RAW frames), every other HTTP
route (relayed to the owner's HTTP server on a Unix socket) and every other gRPC method
(relayed to the owner's gRPC server on a Unix socket), so answers are the owner's own.

A frontend exits when its connection to the owner closes, and shuts down gracefully on
SIGTERM (stop accepting, finish what is in flight). SIGINT is ignored: the owner decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import sys
from typing import Any

import grpc

from pyserve import logs
from pyserve import protocol as pb
from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.dataplane.header_forwarding import HeaderForwarding, compile_forwarding
from pyserve.frontends import balancer as balancing
from pyserve.frontends.grpc.codec import SplitInferRequest
from pyserve.frontends.grpc.codec import decode_infer as grpc_decode
from pyserve.frontends.grpc.server import GrpcOptions
from pyserve.frontends.grpc.servicer import (
    InferenceServicer,
    _abort,
    _trace_parent,
    infer_model,
)
from pyserve.frontends.http.codec import DecodedRequest
from pyserve.frontends.http.fast_infer import (
    Headers,
    check_declared_length,
    error_reply,
    submit_request,
)
from pyserve.frontends.http.native_infer import InferHttpProtocol, InferHttpServer
from pyserve.frontends.http.parsed_request import ParsedRequest as _Request
from pyserve.frontends.restricted import Restriction
from pyserve.frontends.tcp import bind_tcp
from pyserve.handoff import wire
from pyserve.handoff.http_proxy import OwnerHttpProxy
from pyserve.handoff.replicas import ReplicaSet
from pyserve.handoff.wire import Kind
from pyserve.repository import tensor_checks
from pyserve.runtime.scheduling import busy_poll, execution_board
from pyserve.runtime.versions import ModelState, ModelVersion

log = logging.getLogger("pyserve.frontend")

OWNER_GONE = "the model owner process is not reachable from this frontend process"


class NeedsOwner(Exception):
    """The frontend cannot decode this request itself; the owner must (not an error)."""


class _OwnerOnlySharedMemory:
    """Shared-memory regions are registered with the owner: any use sends the request there."""

    def input_bytes(self, *args: Any) -> Any:
        raise NeedsOwner

    def output_target(self, *args: Any) -> Any:
        raise NeedsOwner

    def region(self, *args: Any) -> Any:
        raise NeedsOwner


class _PassTraceParent:
    """Tracing is decided by the owner; the frontend always passes ``traceparent`` on."""

    active = True


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

    def announce_replicas(self, generations: list[int]) -> None:
        """Tell the owner which of its versions this frontend now answers itself."""
        with contextlib.suppress(InferError):
            self._send(wire.frame(Kind.REPLICAS, 0, {"g": generations}))

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


class FrontendDataPlane:
    """What the HTTP server and the gRPC servicer need of a data plane: models from the
    owner's snapshot, answered by a local replica when there is one, else over the link."""

    def __init__(self, link: OwnerLink) -> None:
        self.link = link
        self.live = True
        self.exiting = False
        self.accepting = True
        self.shared_memory = _OwnerOnlySharedMemory()
        self.tracing = _PassTraceParent()
        self.http_forwarding: HeaderForwarding | None = None
        self.grpc_forwarding: HeaderForwarding | None = None

    def model(self, name: str, version: str | None = None) -> ModelVersion:
        """The local replica, else the snapshot's version (a ``RemoteModel``).

        :raises NeedsOwner: not in the snapshot (the owner answers, error texts included).
        """
        model = self.link.models.get((name, version or None))
        if model is None:
            raise NeedsOwner
        replicas = self.link.replicas
        if replicas is not None:
            local = replicas.local_for(model.generation)
            if local is not None:
                return local
        return model

    def submit(self, model: ModelVersion, request: InferRequest) -> InferError | None:
        """Schedule a request on a local replica (``DataPlane.submit``)."""
        assert self.link.replicas is not None
        return self.link.replicas.dataplane.submit(model, request)

    def finished(self, request: InferRequest) -> None:
        if self.link.replicas is not None:
            self.link.replicas.dataplane.finished(request)

    async def infer(self, model: ModelVersion, request: InferRequest) -> InferResponse | InferError:
        if not isinstance(model, RemoteModel):
            assert self.link.replicas is not None
            return await self.link.replicas.dataplane.infer(model, request)
        request_id, future = self.link.submit(model, request)
        try:
            return await future
        except asyncio.CancelledError:
            self.link.cancel(request_id)
            raise


# -- HTTP ------------------------------------------------------------------------------------


class _Raw:
    """Marks a request whose model is not in the snapshot: the owner decodes it."""


_RAW: Any = _Raw()


class FrontendHttpProtocol(InferHttpProtocol):
    """An HTTP connection of a frontend: infer requests are decoded here and handed off."""

    def __init__(self, server: InferHttpServer) -> None:
        super().__init__(server)
        self.handoff_ids: dict[int, int] = {}  # id(_Request) → hand-off request id

    def _check_infer(self, request: _Request) -> None:
        try:
            super()._check_infer(request)
        except NeedsOwner:
            request.model = _RAW
            declared = None
            for name, value in request.headers:
                if name == b"content-length":
                    declared = value
            try:
                check_declared_length(declared, self.server.max_input_size)
            except InferError as exc:
                request.early = error_reply(exc)
                request.discard_body = True
                request.close_after = True
                request.complete = True
                self.ignore_input = True

    def _start_infer(self, request: _Request) -> None:
        if request.model is _RAW:
            body = request.chunks[0] if len(request.chunks) == 1 else b"".join(request.chunks)
            request.chunks = []
            self._start_raw(request, body)
            return
        super()._start_infer(request)  # decoded here (a large body on a decode thread), then _decoded

    def _decode_failed(self, request: _Request, body: bytes | bytearray, exc: BaseException) -> None:
        if isinstance(exc, NeedsOwner):  # e.g. a shared-memory input: the owner decodes it
            self._start_raw(request, body)
            return
        super()._decode_failed(request, body, exc)

    def _decoded(self, request: _Request, headers: Headers, decoded: DecodedRequest, decode_ns: int) -> None:
        """Submit to a local replica, or hand the decoded request to the owner."""
        server = self.server
        model = request.model
        try:
            if isinstance(model, RemoteModel):
                link: OwnerLink = server.dataplane.link  # type: ignore[attr-defined]
                request_id, future = link.submit(model, decoded.request)
            else:
                future = submit_request(server.dataplane, model, decoded.request, self.loop)  # type: ignore[arg-type]
                request_id = 0
                request.infer_request = decoded.request
        except Exception as exc:  # noqa: BLE001 - InferError, or a bug: answered, the server goes on
            self._answer_failure(request, exc)
            return
        request.future = future
        if request_id:
            self.handoff_ids[id(request)] = request_id
        elif future.done():  # a local replica answered during submit (inline): no extra loop turn
            self._handed_back(request, model, decoded, decode_ns, headers, future)
            return
        future.add_done_callback(
            lambda done: self._handed_back(request, model, decoded, decode_ns, headers, done)
        )

    def _handed_back(self, request: _Request, model: Any, decoded: Any, decode_ns: int, headers: Any, future: Any) -> None:
        self.handoff_ids.pop(id(request), None)
        self._infer_done(request, model, decoded, decode_ns, headers, future)

    def _start_raw(self, request: _Request, body: bytes | bytearray) -> None:
        assert request.target is not None
        link: OwnerLink = self.server.dataplane.link  # type: ignore[attr-defined]
        try:
            request_id, future = link.raw_http(request.target, request.headers, body)
        except InferError as exc:
            self._write_reply(request, *error_reply(exc))
            return
        request.future = future
        self.handoff_ids[id(request)] = request_id
        future.add_done_callback(lambda done: self._raw_done(request, done))

    def _raw_done(self, request: _Request, future: asyncio.Future[Any]) -> None:
        self.handoff_ids.pop(id(request), None)
        if self.closed or future.cancelled():
            return
        result = future.result()
        if result is None:  # cancelled by a disconnect
            return
        if isinstance(result, InferError):
            self._write_reply(request, *error_reply(result))
            return
        self._write_reply(request, *result)

    def _abandon(self, request: _Request) -> None:
        future = request.future
        if future is not None and not future.done():
            request_id = self.handoff_ids.pop(id(request), None)
            if request_id is not None:
                self.server.dataplane.link.cancel(request_id)  # type: ignore[attr-defined]
            elif request.infer_request is not None:  # a local replica's request
                request.infer_request.cancel()
            future.set_result(None)
        request.wake()
        if request.asgi is not None:
            request.asgi.disconnected()


class FrontendHttpServer(InferHttpServer):
    """pyserve's HTTP/1.1 server with hand-off infer and every other route relayed to the owner."""

    protocol_class = FrontendHttpProtocol


# -- gRPC ------------------------------------------------------------------------------------


class FrontendServicer(InferenceServicer):
    """``ModelInfer`` decoded here and handed off; the other RPCs are relayed (see ``relay_handlers``)."""

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        dataplane: FrontendDataPlane = self.dataplane  # type: ignore[assignment]
        try:
            forwarding = dataplane.grpc_forwarding
            forwarded = forwarding.select(context.invocation_metadata() or ()) if forwarding is not None else []
            try:
                model = infer_model(dataplane, request)
                decoded = grpc_decode(request, model, shm=dataplane.shared_memory)  # type: ignore[arg-type]
            except NeedsOwner:
                response = await self._raw(dataplane.link, request, context, forwarded)
            else:
                decoded.request.parameters.update(forwarded)
                response = await self.infer_decoded(model, decoded, 0, context)
        except InferError as exc:
            await _abort(context, exc)
        if self.compress_infer:
            context.set_compression(grpc.Compression.Gzip)
        return response

    @staticmethod
    async def _raw(link: OwnerLink, request: Any, context: grpc.aio.ServicerContext,
                   forwarded: list[tuple[str, str]]) -> bytes:
        message = request.wire if isinstance(request, SplitInferRequest) else request.SerializeToString()
        request_id, future = link.raw_grpc(message, _trace_parent(context), forwarded)
        try:
            result = await future
        except asyncio.CancelledError:
            link.cancel(request_id)
            raise
        if isinstance(result, InferError):
            raise result
        return result


def _forwarded_metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, Any], ...]:
    return tuple((k, v) for k, v in (context.invocation_metadata() or ()) if not k.startswith("grpc-"))


def _relay_unary(channel: grpc.aio.Channel, path: str) -> grpc.RpcMethodHandler:
    call = channel.unary_unary(path)

    async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return await call(request, metadata=_forwarded_metadata(context), timeout=context.time_remaining())
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "", tuple(exc.trailing_metadata() or ()))
            raise  # not reached

    return grpc.unary_unary_rpc_method_handler(relay)


def _relay_stream(channel: grpc.aio.Channel, path: str) -> grpc.RpcMethodHandler:
    make_call = channel.stream_stream(path)

    async def relay(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        call = make_call(requests, metadata=_forwarded_metadata(context), timeout=context.time_remaining())
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "", tuple(exc.trailing_metadata() or ()))
        finally:
            call.cancel()

    return grpc.stream_stream_rpc_method_handler(relay)


def relay_handlers(service: Any, channel: grpc.aio.Channel, skip: frozenset[str]) -> grpc.GenericRpcHandler:
    """Handlers relaying every method of ``service`` but ``skip`` to the owner, bytes unparsed."""
    methods: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        if method.name in skip:
            continue
        path = f"/{service.full_name}/{method.name}"
        if method.client_streaming or method.server_streaming:
            methods[method.name] = _relay_stream(channel, path)
        else:
            methods[method.name] = _relay_unary(channel, path)
    return grpc.method_handlers_generic_handler(service.full_name, methods)


def create_grpc(dataplane: FrontendDataPlane, options: GrpcOptions, owner_address: str,
                listen: bool = True) -> tuple[Any, grpc.aio.Channel]:
    """The frontend's gRPC server (not started) and its channel to the owner.

    :param listen: bind the gRPC port (``SO_REUSEPORT``); False: the server only takes the
        connections the owner's balancer passes (``GrpcServer.adopt``), with the port's TLS.
    """
    from pyserve.frontends.grpc.server import (
        _handlers,
        bind,
        new_server,
        ssl_context,
        tls_files,
    )

    server = new_server(options, reuse_port=True)
    channel = grpc.aio.insecure_channel(owner_address, options=[
        ("grpc.max_send_message_length", options.max_message_bytes),
        ("grpc.max_receive_message_length", options.max_message_bytes),
    ])
    servicer = FrontendServicer(dataplane, compress_infer=options.infer_compression != "none")  # type: ignore[arg-type]
    server.add_generic_rpc_handlers((
        _handlers(pb.SERVICE_DESCRIPTOR, servicer, only=frozenset({"ModelInfer"})),
        relay_handlers(pb.SERVICE_DESCRIPTOR, channel, skip=frozenset({"ModelInfer"})),
        relay_handlers(pb.HEALTH_SERVICE_DESCRIPTOR, channel, skip=frozenset()),
    ))
    if listen:
        bind(server, options)
    else:
        tls = tls_files(options)
        server.adopted_tls = ssl_context(tls) if tls is not None else None
    return server, channel


# -- the process ----------------------------------------------------------------------------


async def serve(settings: dict[str, Any], prepared: Any = None) -> int:
    """Run one frontend until SIGTERM or until the owner goes away; the exit status.

    :param prepared: a forked frontend's ``ModelManager`` holding the models prepared before
        the fork (``pyserve.handoff.prefork``), which its replicas start instead of loading.
    """
    loop = asyncio.get_running_loop()
    link = OwnerLink()
    if settings.get("replicate", "none") != "none":
        link.replicas = ReplicaSet(settings, prepared)
        link.replicas.on_change = link.announce_replicas
    try:
        await loop.create_unix_connection(lambda: link, settings["handoff"])
    except OSError as exc:
        log.error("frontend cannot reach the model owner: %s", exc)
        return 1
    await link.snapshot_received.wait()
    if link.lost.is_set():
        return 1
    if settings.get("max_tensor_elements"):
        tensor_checks.LIMITS.max_tensor_elements = settings["max_tensor_elements"]
    if settings.get("busy_poll_us"):  # replicas executed on this loop poll as the owner's do
        busy_poll.configure(settings["busy_poll_us"])
    dataplane = FrontendDataPlane(link)
    dataplane.http_forwarding = compile_forwarding(settings.get("http_header_forward_pattern", ""))
    dataplane.grpc_forwarding = compile_forwarding(settings["grpc"].get("header_forward_pattern", ""))
    http: FrontendHttpServer | None = None
    grpc_server: Any = None
    channel: grpc.aio.Channel | None = None
    host = settings["host"]
    balance = settings.get("balance")
    adopters: dict[bytes, balancing.Adopt] = {}
    if settings.get("http_port") is not None:
        restrictions = {k: Restriction(*v) for k, v in settings["http_restricted_api"].items()}
        http = FrontendHttpServer(
            OwnerHttpProxy(settings["owner_http"]), dataplane,  # type: ignore[arg-type]
            max_input_size=settings["http_max_input_size"], restrictions=restrictions,
            **settings.get("http_limits", {}),
        )
        if balance:
            adopters[balancing.HTTP] = http.adopt
        else:
            listener = bind_tcp(host, settings["http_port"], reuse_port=True)
            try:
                listener.listen(2048)
            except OSError:
                listener.close()
                raise
            await http.start(listener)
    if settings.get("grpc_port") is not None:
        options = GrpcOptions(**settings["grpc"])
        options.restrictions = {k: Restriction(*v) for k, v in settings["grpc"]["restrictions"].items()}
        options.host = options.host or host
        options.port = settings["grpc_port"]
        balanced = bool(balance and settings.get("balance_grpc"))
        grpc_server, channel = create_grpc(dataplane, options, "unix:" + settings["owner_grpc"], listen=not balanced)
        await grpc_server.start()
        if balanced:
            adopters[balancing.GRPC] = grpc_server.adopt
    receiver: balancing.BalancedReceiver | None = None
    if adopters and balance:
        receiver = balancing.BalancedReceiver(adopters, lambda: _open_connections(http, grpc_server))
        for server in (http, grpc_server):
            if server is not None and hasattr(server, "on_connection_closed"):
                server.on_connection_closed = receiver.changed
        try:
            await receiver.connect(balance)
        except OSError as exc:
            log.error("frontend cannot reach the owner's connection balancer: %s", exc)
            return 1
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    link.hello()
    lost = asyncio.ensure_future(link.lost.wait())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([lost, stopping], return_when=asyncio.FIRST_COMPLETED)
    graceful = stop.is_set() and not link.lost.is_set()
    timeout = float(settings.get("exit_timeout_secs", 30.0)) if graceful else 0.0
    dataplane.exiting = True
    if receiver is not None:  # the owner keeps the next connections
        receiver.close()
    if http is not None:
        await http.shutdown(timeout)
    if grpc_server is not None:
        await grpc_server.stop(grace=timeout)
    if channel is not None:
        await channel.close()
    if link.replicas is not None:
        if graceful:
            link.send_stats(0)  # the last counts of the replicas reach the owner's statistics
            if link.writer is not None:
                link.writer.flush()
        await link.replicas.close(timeout)
    for task in (lost, stopping):
        task.cancel()
    return 0 if graceful else 1


def _open_connections(http: FrontendHttpServer | None, grpc_server: Any) -> int:
    """The TCP connections this frontend serves (what the owner's balancer counts)."""
    count = len(http.connections) if http is not None else 0
    if grpc_server is not None and hasattr(grpc_server, "tcp_connection_count"):
        count += grpc_server.tcp_connection_count()
    return count


def run_forked(settings: dict[str, Any], prepared: Any) -> int:
    """A frontend forked from the owner (``pyserve.handoff.prefork``): serve with ``settings``,
    starting the replicas ``prepared`` holds; the exit status."""
    logs.configure(**settings.get("log", {}))
    try:
        import uvloop

        return uvloop.run(serve(settings, prepared))
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(serve(settings, prepared))


def main(argv: list[str] | None = None) -> int:
    """``python -m pyserve.handoff.frontend SETTINGS_JSON`` (started by the owner)."""
    args = sys.argv[1:] if argv is None else argv
    settings = json.loads(args[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the owner decides
    if settings.get("board_fd") is not None:  # what it executes, for the owner to read if it dies
        execution_board.attach(execution_board.open_fd(settings["board_fd"]))
    logs.configure(**settings.get("log", {}))
    try:
        import uvloop

        return uvloop.run(serve(settings))
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
