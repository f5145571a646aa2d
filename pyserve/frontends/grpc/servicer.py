"""``inference.GRPCInferenceService``: decode → data plane → encode (on either gRPC server).

Every RPC of Triton's service is served. Errors carry the same texts as HTTP, mapped to the
gRPC status codes Triton uses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from time import monotonic_ns
from typing import Any

import grpc
from google.protobuf import json_format

from pyserve import protocol as pb
from pyserve.api.errors import ErrorCode, InferError
from pyserve.dataplane.interface import InferencePlane, ServingPlane
from pyserve.frontends.grpc import extensions
from pyserve.frontends.grpc.codec import decode_infer, encode_infer_wire, model_version
from pyserve.frontends.grpc.stream import StreamSession

log = logging.getLogger("pyserve.frontends.grpc")

GRPC_STATUS: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.UNKNOWN: grpc.StatusCode.UNKNOWN,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
}
"""Triton's error code → gRPC status mapping."""


DECOUPLED_MESSAGE = (
    "ModelInfer RPC doesn't support models with decoupled transaction policy; use ModelStreamInfer"
)


def infer_model(dataplane: Any, request: Any) -> Any:
    """The model a ``ModelInferRequest`` targets (``dataplane.model``), refusing decoupled ones.

    :raises InferError: unknown model or version, a bad version string, or a decoupled model.
    """
    model = dataplane.model(request.model_name, model_version(request.model_version))
    if model.decoupled:
        raise InferError.unsupported(DECOUPLED_MESSAGE)
    return model


async def _abort(context: grpc.aio.ServicerContext, error: InferError) -> None:
    await context.abort(GRPC_STATUS[error.code], error.message)


def _trace_parent(context: grpc.aio.ServicerContext) -> str | None:
    """The W3C ``traceparent`` metadata of a call, if the client sent one."""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


def _repository_parameters(parameters: Any) -> dict[str, Any]:
    """A ``map<string, ModelRepositoryParameter>`` as plain values (``bytes_param`` → bytes)."""
    values: dict[str, Any] = {}
    for key, parameter in parameters.items():
        which = parameter.WhichOneof("parameter_choice")
        if which is not None:
            values[key] = getattr(parameter, which)
    return values


async def infer_decoded(
    dataplane: InferencePlane, model: Any, decoded: Any, decode_ns: int, context: grpc.aio.ServicerContext
) -> Any:
    """Run a decoded ``ModelInfer`` request and encode its answer (``ModelInferResponse`` bytes,
    or ``WireParts`` for a large one). The request's statistics count it as sent once it is
    encoded (``decode_ns`` is inside its duration already: it starts at ``arrival_ns``).

    :raises InferError: the model answered an error.
    """
    infer_request = decoded.request
    if dataplane.tracing.active:
        infer_request.trace_parent = _trace_parent(context)
    infer_request.reply_ns = -1  # response_sent below ends the request's duration
    result = await dataplane.infer(model, infer_request)
    if isinstance(result, InferError):
        raise result
    response = encode_infer_wire(result, decoded, model, join=False)
    if infer_request.stats is not None:
        infer_request.stats.response_sent(infer_request)
    return response


class InferenceServicer:
    """The RPC implementations, one method per RPC name.

    :param dataplane: the server's data plane.
    :param compress_infer: gzip infer responses (``--grpc-infer-response-compression-level``).
    """

    def __init__(self, dataplane: ServingPlane, compress_infer: bool = False) -> None:
        self.dataplane = dataplane
        self.compress_infer = compress_infer

    # -- health and metadata -----------------------------------------------------------------
    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if self.dataplane.exiting:
            await _abort(context, InferError.unavailable("Server exiting"))
        return pb.ServerLiveResponse(live=self.dataplane.live)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=await self.dataplane.check_server_ready())

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            version = model_version(request.version)
        except InferError as exc:
            await _abort(context, exc)
        return pb.ModelReadyResponse(ready=await self.dataplane.check_model_ready(request.name, version))

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        meta = self.dataplane.server_metadata()
        return pb.ServerMetadataResponse(name=meta["name"], version=meta["version"], extensions=meta["extensions"])

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            meta = self.dataplane.model_metadata(request.name, model_version(request.version))
        except InferError as exc:
            await _abort(context, exc)
        response = pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"])
        for field in ("inputs", "outputs"):
            for tensor in meta[field]:
                getattr(response, field).add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        return response

    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            model = self.dataplane.model(request.name, model_version(request.version))
        except InferError as exc:
            await _abort(context, exc)
        response = pb.ModelConfigResponse()
        response.config.CopyFrom(model.config)
        return response

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.repository_name:
            await _abort(context, InferError.unsupported("'repository_name' specification is not supported"))
        response = pb.RepositoryIndexResponse()
        for entry in self.dataplane.repository_index(request.ready):
            response.models.add(
                name=entry["name"], version=entry.get("version", ""), state=entry.get("state", ""),
                reason=entry.get("reason", ""),
            )
        return response

    # -- inference -------------------------------------------------------------------------------
    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Unary infer. Returns the serialized ``ModelInferResponse`` (``bytes``): the handler's
        serializer passes bytes through (see ``pyserve.frontends.grpc.server``), which spares the
        protobuf copies of large outputs (``encode_infer_wire``)."""
        dataplane = self.dataplane
        try:
            model = infer_model(dataplane, request)
            decode_start = monotonic_ns()
            decoded = decode_infer(request, model, shm=dataplane.shared_memory)
            if dataplane.grpc_forwarding is not None:
                dataplane.grpc_forwarding.apply(context.invocation_metadata() or (), decoded.request)
            decode_ns = monotonic_ns() - decode_start
            decoded.request.arrival_ns = decode_start  # the request's statistics start with its decoding
            response = await self.infer_decoded(model, decoded, decode_ns, context)
        except InferError as exc:
            await _abort(context, exc)
        if self.compress_infer:
            context.set_compression(grpc.Compression.Gzip)
        return response

    async def infer_decoded(self, model: Any, decoded: Any, decode_ns: int, context: grpc.aio.ServicerContext) -> Any:
        """``infer_decoded`` on this servicer's data plane."""
        return await infer_decoded(self.dataplane, model, decoded, decode_ns, context)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        error_closes = any(
            key == "triton_grpc_error" and str(value).lower() == "true"
            for key, value in (context.invocation_metadata() or ())
        )
        try:
            forwarded = (self.dataplane.grpc_forwarding.select(context.invocation_metadata() or ())
                         if self.dataplane.grpc_forwarding is not None else [])
        except InferError as exc:
            await _abort(context, exc)
        session = StreamSession(
            self.dataplane, error_closes=error_closes,
            trace_parent=_trace_parent(context) if self.dataplane.tracing.active else None,
            forwarded=forwarded,
        )
        reader = asyncio.ensure_future(session.read(request_iterator))
        try:
            async for item in session.responses():
                if isinstance(item, InferError):
                    await _abort(context, item)
                yield item
            await reader
        finally:
            session.cancel_open()
            if not reader.done():
                reader.cancel()
            elif not reader.cancelled():
                reader.exception()  # retrieved: reading ends with an error when the call is aborted

    # -- features owned by later work ------------------------------------------------------------
    async def ModelStatistics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            await self.dataplane.collect_statistics()
            stats = self.dataplane.model_statistics(request.name, request.version or None)
        except InferError as exc:
            await _abort(context, exc)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

    async def RepositoryModelLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if request.repository_name:
                raise InferError.unsupported("'repository_name' specification is not supported")
            await self.dataplane.load_model(request.model_name, _repository_parameters(request.parameters))
        except InferError as exc:
            await _abort(context, exc)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if request.repository_name:
                raise InferError.unsupported("'repository_name' specification is not supported")
            parameters = _repository_parameters(request.parameters)
            dependents = parameters.get("unload_dependents", False)
            if not isinstance(dependents, bool):
                raise InferError.invalid("'unload_dependents' must be a bool_param")
            await self.dataplane.unload_model(request.model_name, dependents)
        except InferError as exc:
            await _abort(context, exc)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory, trace and log settings (pyserve.frontends.grpc.extensions) -------------------------
    async def _extension(self, call: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return call(self.dataplane, request)
        except InferError as exc:
            await _abort(context, exc)

    async def SystemSharedMemoryStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._extension(extensions.system_shm_status, request, context)

    async def SystemSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._extension(extensions.system_shm_register, request, context)

    async def SystemSharedMemoryUnregister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._extension(extensions.system_shm_unregister, request, context)

    async def CudaSharedMemoryStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._extension(extensions.cuda_shm_status, request, context)

    async def CudaSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._extension(extensions.cuda_shm_register, request, context)

    async def CudaSharedMemoryUnregister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._extension(extensions.cuda_shm_unregister, request, context)

    async def TraceSetting(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._extension(extensions.trace_setting, request, context)

    async def LogSettings(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._extension(lambda _, message: extensions.log_settings(message), request, context)


class HealthServicer:
    """``grpc.health.v1.Health/Check``: SERVING while the server is live."""

    def __init__(self, dataplane: InferencePlane) -> None:
        self.dataplane = dataplane

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        status = "SERVING" if self.dataplane.live else "NOT_SERVING"
        response = pb.message_class("grpc.health.v1.HealthCheckResponse")()
        response.status = response.DESCRIPTOR.fields_by_name["status"].enum_type.values_by_name[status].number
        return response

