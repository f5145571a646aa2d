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
