"""The gRPC side of a frontend process (``pyserve.handoff.frontend``): ``ModelInfer`` decoded
here and handed off, every other method relayed to the owner's gRPC server unparsed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from pyserve import protocol as pb
from pyserve.api.errors import InferError
from pyserve.frontends.grpc.codec import SplitInferRequest
from pyserve.frontends.grpc.codec import decode_infer as grpc_decode
from pyserve.frontends.grpc.server import GrpcOptions
from pyserve.frontends.grpc.servicer import _abort, _trace_parent, infer_decoded, infer_model
from pyserve.handoff.frontend_plane import FrontendDataPlane, NeedsOwner
from pyserve.handoff.link import OwnerLink


class FrontendServicer:
    """``ModelInfer`` decoded here and handed off; the other RPCs are relayed (see ``relay_handlers``).

    :param dataplane: the frontend's data plane.
    :param compress_infer: gzip infer responses (``--grpc-infer-response-compression-level``).
    """

    def __init__(self, dataplane: FrontendDataPlane, compress_infer: bool = False) -> None:
        self.dataplane = dataplane
        self.compress_infer = compress_infer

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """As ``InferenceServicer.ModelInfer``; a request the frontend cannot decode goes to the owner."""
        dataplane = self.dataplane
        try:
            forwarding = dataplane.grpc_forwarding
            forwarded = forwarding.select(context.invocation_metadata() or ()) if forwarding is not None else []
            try:
                model = infer_model(dataplane, request)
                decoded = grpc_decode(request, model, shm=dataplane.shared_memory)
            except NeedsOwner:
                response = await self._raw(dataplane.link, request, context, forwarded)
            else:
                decoded.request.parameters.update(forwarded)
                response = await infer_decoded(dataplane, model, decoded, 0, context)
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


class OwnerChannel:
    """The frontend's gRPC channel to the owner's server, opened on the first call relayed
    through it: a frontend that relays nothing holds no gRPC client (no C-core channel, its
    threads and buffers). Event-loop thread only.

    :param address: the owner's gRPC address (``unix:...``).
    :param max_message_bytes: the largest message sent or received.
    """

    def __init__(self, address: str, max_message_bytes: int) -> None:
        self.address = address
        self.max_message_bytes = max_message_bytes
        self._channel: grpc.aio.Channel | None = None

    def get(self) -> grpc.aio.Channel:
        """The channel, opened now if this is its first use."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=[
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes),
            ])
        return self._channel

    async def close(self) -> None:
        """Close the channel if it was opened (calls on it end)."""
        if self._channel is not None:
            await self._channel.close()


def _relay_unary(channel: OwnerChannel, path: str) -> grpc.RpcMethodHandler:
    calls: list[Any] = []  # the multi-callable, made on the first call

    async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if not calls:
            calls.append(channel.get().unary_unary(path))
        try:
            return await calls[0](request, metadata=_forwarded_metadata(context), timeout=context.time_remaining())
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "", tuple(exc.trailing_metadata() or ()))
            raise  # not reached

    return grpc.unary_unary_rpc_method_handler(relay)


def _relay_stream(channel: OwnerChannel, path: str) -> grpc.RpcMethodHandler:
    calls: list[Any] = []

    async def relay(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        if not calls:
            calls.append(channel.get().stream_stream(path))
        call = calls[0](requests, metadata=_forwarded_metadata(context), timeout=context.time_remaining())
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "", tuple(exc.trailing_metadata() or ()))
        finally:
            call.cancel()

    return grpc.stream_stream_rpc_method_handler(relay)


def relay_handlers(service: Any, channel: OwnerChannel, skip: frozenset[str]) -> grpc.GenericRpcHandler:
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
                listen: bool = True) -> tuple[Any, OwnerChannel]:
    """The frontend's gRPC server (not started) and its channel to the owner (opened on first use).

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
    channel = OwnerChannel(owner_address, options.max_message_bytes)
    servicer = FrontendServicer(dataplane, compress_infer=options.infer_compression != "none")
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
