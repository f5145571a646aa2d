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

Its parts: the connection to the owner (``pyserve.handoff.link``), its data plane
(``pyserve.handoff.frontend_plane``), its gRPC server (``pyserve.handoff.frontend_grpc``); the
HTTP server and the process itself are here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from typing import Any

from pyserve import logs
from pyserve.api.errors import InferError
from pyserve.dataplane.header_forwarding import compile_forwarding
from pyserve.frontends import balancer as balancing
from pyserve.frontends.grpc.server import GrpcOptions
from pyserve.frontends.http.codec import DecodedRequest
from pyserve.frontends.http.fast_infer import (
    Headers,
    declared_infer_body,
    error_reply,
    submit_request,
)
from pyserve.frontends.http.native_infer import InferHttpProtocol, InferHttpServer
from pyserve.frontends.http.parsed_request import ParsedRequest as _Request
from pyserve.frontends.http.server import ASGIApp
from pyserve.frontends.restricted import Restriction
from pyserve.frontends.tcp import bind_tcp
from pyserve.handoff.frontend_grpc import OwnerChannel, create_grpc
from pyserve.handoff.frontend_plane import FrontendDataPlane, NeedsOwner
from pyserve.handoff.http_proxy import OwnerHttpProxy
from pyserve.handoff.link import OwnerLink, RemoteModel
from pyserve.handoff.replicas import ReplicaSet
from pyserve.repository import tensor_checks
from pyserve.runtime import execution_board
from pyserve.runtime.scheduling import busy_poll

log = logging.getLogger("pyserve.frontend")

# -- HTTP ------------------------------------------------------------------------------------


class _Raw:
    """Marks a request whose model is not in the snapshot: the owner decodes it."""


_RAW: Any = _Raw()


class FrontendHttpProtocol(InferHttpProtocol):
    """An HTTP connection of a frontend: infer requests are decoded here and handed off."""

    def __init__(self, server: FrontendHttpServer) -> None:
        super().__init__(server)
        self.link = server.link
        self.handoff_ids: dict[int, int] = {}  # id(_Request) → hand-off request id

    def _check_infer(self, request: _Request) -> None:
        try:
            super()._check_infer(request)
        except NeedsOwner:
            request.model = _RAW
            try:
                request.body_limit = declared_infer_body(request.headers, self.server.max_input_size)
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
        assert model is not None
        try:
            if isinstance(model, RemoteModel):
                request_id, future = self.link.submit(model, decoded.request)
            else:
                future = submit_request(server.dataplane, model, decoded.request, self.loop)
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
        try:
            request_id, future = self.link.raw_http(request.target, request.headers, body)
        except InferError as exc:
            self._write_reply(request, *error_reply(exc))
            return
        except ValueError as exc:  # a body over the hand-off frame limit (4 GiB)
            self._write_reply(request, *error_reply(InferError.invalid(str(exc))))
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
                self.link.cancel(request_id)
            elif request.infer_request is not None:  # a local replica's request
                request.infer_request.cancel()
            future.set_result(None)
        request.wake()
        if request.asgi is not None:
            request.asgi.disconnected()


class FrontendHttpServer(InferHttpServer):
    """pyserve's HTTP/1.1 server with hand-off infer and every other route relayed to the owner."""

    protocol_class = FrontendHttpProtocol

    def __init__(self, app: ASGIApp, dataplane: FrontendDataPlane, **options: Any) -> None:
        super().__init__(app, dataplane, **options)
        self.link = dataplane.link


# -- the process ----------------------------------------------------------------------------


async def serve(settings: dict[str, Any], prepared: Any = None) -> int:
    """Run one frontend until SIGTERM or until the owner goes away; the exit status.

    :param prepared: a forked frontend's ``ModelManager`` holding the models prepared before
        the fork (``pyserve.handoff.prefork``), which its replicas start instead of loading.
    """
    link = await _connect(settings, prepared)
    if link is None:
        return 1
    if settings.get("max_tensor_elements"):
        tensor_checks.LIMITS.max_tensor_elements = settings["max_tensor_elements"]
    if settings.get("busy_poll_us"):  # replicas executed on this loop poll as the owner's do
        busy_poll.configure(settings["busy_poll_us"])
    dataplane = FrontendDataPlane(link)
    dataplane.http_forwarding = compile_forwarding(settings.get("http_header_forward_pattern", ""))
    dataplane.grpc_forwarding = compile_forwarding(settings["grpc"].get("header_forward_pattern", ""))
    servers = _Servers(settings, dataplane)
    if not await servers.start():
        return 1
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    link.hello()
    lost = asyncio.ensure_future(link.lost.wait())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([lost, stopping], return_when=asyncio.FIRST_COMPLETED)
    graceful = stop.is_set() and not link.lost.is_set()
    timeout = float(settings.get("exit_timeout_secs", 30.0)) if graceful else 0.0
    dataplane.exiting = True
    await servers.stop(timeout)
    if link.replicas is not None:
        if graceful:
            link.send_stats(0)  # the last counts of the replicas reach the owner's statistics
            if link.writer is not None:
                link.writer.flush()
        await link.replicas.close(timeout)
    for task in (lost, stopping):
        task.cancel()
    return 0 if graceful else 1


async def _connect(settings: dict[str, Any], prepared: Any) -> OwnerLink | None:
    """The link to the owner, connected and holding its first snapshot; None: not reachable."""
    link = OwnerLink()
    if settings.get("replicate", "none") != "none":
        link.replicas = ReplicaSet(settings, prepared)
        link.replicas.on_change = link.announce_replicas
    try:
        await asyncio.get_running_loop().create_unix_connection(lambda: link, settings["handoff"])
    except OSError as exc:
        log.error("frontend cannot reach the model owner: %s", exc)
        return None
    await link.snapshot_received.wait()
    return None if link.lost.is_set() else link


class _Servers:
    """A frontend's HTTP and gRPC servers, listening on the ports themselves or taking the
    connections the owner's balancer passes (``settings["balance"]``)."""

    def __init__(self, settings: dict[str, Any], dataplane: FrontendDataPlane) -> None:
        self.settings = settings
        self.dataplane = dataplane
        self.http: FrontendHttpServer | None = None
        self.grpc: Any = None
        self.channel: OwnerChannel | None = None
        self.receiver: balancing.BalancedReceiver | None = None
        self.adopters: dict[bytes, balancing.Adopt] = {}

    async def start(self) -> bool:
        """Start the configured servers; False: the owner's balancer is not reachable."""
        if self.settings.get("http_port") is not None:
            await self._start_http()
        if self.settings.get("grpc_port") is not None:
            await self._start_grpc()
        if self.adopters:
            return await self._join_balancer()
        return True

    async def _start_http(self) -> None:
        settings = self.settings
        restrictions = {k: Restriction(*v) for k, v in settings["http_restricted_api"].items()}
        http = self.http = FrontendHttpServer(
            OwnerHttpProxy(settings["owner_http"], settings["http_max_input_size"]), self.dataplane,
            max_input_size=settings["http_max_input_size"], restrictions=restrictions,
            **settings.get("http_limits", {}),
        )
        if settings.get("balance"):
            self.adopters[balancing.HTTP] = http.adopt
            return
        listener = bind_tcp(settings["host"], settings["http_port"], reuse_port=True)
        try:
            listener.listen(2048)
        except OSError:
            listener.close()
            raise
        await http.start(listener)

    async def _start_grpc(self) -> None:
        settings = self.settings
        options = GrpcOptions(**settings["grpc"])
        options.restrictions = {k: Restriction(*v) for k, v in settings["grpc"]["restrictions"].items()}
        options.host = options.host or settings["host"]
        options.port = settings["grpc_port"]
        balanced = bool(settings.get("balance") and settings.get("balance_grpc"))
        self.grpc, self.channel = create_grpc(
            self.dataplane, options, "unix:" + settings["owner_grpc"], listen=not balanced)
        await self.grpc.start()
        if balanced:
            self.adopters[balancing.GRPC] = self.grpc.adopt

    async def _join_balancer(self) -> bool:
        receiver = self.receiver = balancing.BalancedReceiver(self.adopters, self.open_connections)
        for server in (self.http, self.grpc):
            if server is not None and hasattr(server, "on_connection_closed"):
                server.on_connection_closed = receiver.changed
        try:
            await receiver.connect(self.settings["balance"])
        except OSError as exc:
            log.error("frontend cannot reach the owner's connection balancer: %s", exc)
            return False
        return True

    def open_connections(self) -> int:
        """The TCP connections this frontend serves (what the owner's balancer counts)."""
        count = len(self.http.connections) if self.http is not None else 0
        if self.grpc is not None and hasattr(self.grpc, "tcp_connection_count"):
            count += self.grpc.tcp_connection_count()
        return count

    async def stop(self, timeout: float) -> None:
        """Stop taking connections and finish what is in flight within ``timeout`` seconds."""
        if self.receiver is not None:  # the owner keeps the next connections
            self.receiver.close()
        if self.http is not None:
            await self.http.shutdown(timeout)
        if self.grpc is not None:
            await self.grpc.stop(grace=timeout)
        if self.channel is not None:
            await self.channel.close()


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
