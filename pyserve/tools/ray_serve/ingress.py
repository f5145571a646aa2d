"""The ingress deployment: KServe v2 over Serve's HTTP proxy and Serve's gRPC proxy.

HTTP requests reach ``__call__`` (Serve hands over a Starlette ``Request``); gRPC calls of
``inference.GRPCInferenceService`` reach the method of the RPC's name (Serve's gRPC proxy,
with ``add_inference_servicer`` registered). Both decode with pyserve's own codecs against the
models' configs (fetched from the model deployments at start), send the decoded tensors to
the model's deployment, and encode the answer, so tritonclient works unchanged. Ensembles run
here, their steps sent to the steps' deployments (``pyserve.tools.ray_serve.ensembles``).

Requests of a sequence-batched model carry ``<model>/<correlation id>`` as the multiplexed
model id: Serve routes every request of the sequence to the replica that holds its state.
Errors are Triton's texts with Triton's HTTP statuses and gRPC codes.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from pyserve import __version__
from pyserve import protocol as pb
from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.frontends.grpc.codec import decode_infer as grpc_decode
from pyserve.frontends.grpc.codec import encode_infer, model_version
from pyserve.frontends.grpc.servicer import DECOUPLED_MESSAGE, GRPC_STATUS
from pyserve.frontends.http.body import DEFAULT_MAX_INPUT_SIZE, decode_content, too_large
from pyserve.frontends.http.codec import decode_infer as http_decode
from pyserve.frontends.http.codec import encode_infer as http_encode
from pyserve.frontends.http.codec import parse_header_length
from pyserve.frontends.http.errors import HTTP_STATUS, error_body
from pyserve.frontends.http.fast_infer import DECOUPLED_MESSAGE as HTTP_DECOUPLED_MESSAGE
from pyserve.handoff import wire
from pyserve.handoff.frontend import RemoteModel
from pyserve.protocol.config_json import model_config_to_dict
from pyserve.runtime.versions import ModelState
from pyserve.tools.ray_serve import EnsembleSpec
from pyserve.tools.ray_serve.ensembles import RemoteEnsemble, build_ensembles

EXTENSIONS = ["classification", "binary_tensor_data", "parameters", "model_configuration"]
"""What this ingress serves of the protocol extensions."""


def _json(value: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY), status, media_type="application/json")


def _error(error: InferError) -> Response:
    return Response(error_body(error.message), HTTP_STATUS[error.code], media_type="application/json")


class PyserveIngress:
    """The application's ingress: routes to one handle per model deployment, and runs the
    ensembles of the repository itself (``pyserve.tools.ray_serve.ensembles``).

    :param handles: model name → the handle of the deployment serving it.
    :param ensembles: the ensembles the ingress runs (none with ``per_repository``: the
        repository's deployment serves them).
    """

    def __init__(self, handles: dict[str, Any], ensembles: list[EnsembleSpec] | None = None) -> None:
        self.handles = handles
        self.ensembles = list(ensembles or [])
        self.models: dict[tuple[str, str | None], RemoteModel] = {}
        self.unavailable: dict[str, str] = {}  # ensemble → why the ingress does not serve it
        self._described = False

    async def _describe(self) -> None:
        if self._described:
            return
        seen: set[int] = set()
        for handle in self.handles.values():
            if id(handle) in seen:
                continue
            seen.add(id(handle))
            for name, key, version, config, io in await handle.describe.remote():
                model = RemoteModel(name=name, version=version, state=ModelState.READY,
                                    config=pb.ModelConfig.FromString(config), io=wire.io_from_json(io))
                self.models[(name, key)] = model
        self.unavailable = build_ensembles(self.ensembles, self.models, self._run)
        self._described = True

    async def _model(self, name: str, version: str | None) -> RemoteModel:
        await self._describe()
        model = self.models.get((name, version or None))
        if model is None:
            if name in self.unavailable:
                raise InferError.unavailable(f"Request for unknown model: '{name}' has no available versions "
                                             f"({self.unavailable[name]})")
            if not any(n == name for n, _ in self.models):
                raise InferError.not_found(f"Request for unknown model: '{name}' is not found")
            raise InferError.not_found(f"Request for unknown model: '{name}' version {version} is not found")
        return model

    async def _run(self, model: RemoteModel, request: InferRequest) -> InferResponse | InferError:
        if isinstance(model, RemoteEnsemble):
            return await model.run(request)
        handle = self.handles[model.name]
        sequence = model.config.HasField("sequence_batching") and request.correlation_id not in (0, "")
        if sequence:
            handle = handle.options(multiplexed_model_id=f"{model.name}/{request.correlation_id}")
        fields = {
            "outputs": list(request.requested_outputs), "id": request.id, "parameters": request.parameters,
            "flags": request.flags, "correlation_id": request.correlation_id, "priority": request.priority,
            "timeout_us": request.timeout_us, "batch_size": request.batch_size,
        }
        key = str(model.version) if (model.name, str(model.version)) in self.models else None
        result = await handle.infer.remote(model.name, key, fields, request.inputs)
        if result[0] == "error":
            return InferError(result[2], ErrorCode(result[1]))
        return InferResponse(result[1], result[2])

    def _metadata(self, model: RemoteModel, versioned: bool) -> dict[str, Any]:
        io = model.io
        assert io is not None
        batch = [-1] if io.batching else []
        versions = [str(model.version)] if versioned else sorted(
            {str(m.version) for (n, k), m in self.models.items() if n == model.name and k is not None}, key=int)

        def tensors(specs: Any) -> list[dict[str, Any]]:
            return [{"name": s.name, "datatype": s.datatype.name, "shape": batch + list(s.dims)} for s in specs.values()]

        return {"name": model.name, "versions": versions, "platform": model.config.platform or model.config.backend,
                "inputs": tensors(io.inputs), "outputs": tensors(io.outputs)}

    # -- HTTP --------------------------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        parts = [p for p in request.url.path.split("/") if p]
        method = request.method
        try:
            if parts == ["v2"] and method == "GET":
                return _json({"name": "pyserve", "version": __version__, "extensions": EXTENSIONS})
            if parts[:2] == ["v2", "health"] and len(parts) == 3 and method == "GET":
                if parts[2] == "live":
                    return Response(b"", 200)
                await self._describe()
                return Response(b"", 200) if parts[2] == "ready" and self.models else Response(b"", 400)
            if len(parts) >= 3 and parts[:2] == ["v2", "models"]:
                return await self._model_route(request, parts[2:], method)
        except InferError as exc:
            return _error(exc)
        return _json({"error": "Not Found"}, 404)

    async def _model_route(self, request: Request, rest: list[str], method: str) -> Response:
        name, rest = rest[0], rest[1:]
        version = None
        if len(rest) >= 2 and rest[0] == "versions":
            version, rest = rest[1], rest[2:]
        action = rest[0] if rest else ""
        if action == "infer" and method == "POST" and len(rest) == 1:
            return await self._http_infer(request, name, version)
        if method != "GET" or len(rest) > 1:
            return _json({"error": "Not Found"}, 404)
        if action == "ready":
            try:
                await self._model(name, version)
            except InferError:
                return Response(b"", 400)
            return Response(b"", 200)
        model = await self._model(name, version)
        if action == "config":
            return _json(model_config_to_dict(model.config))
        if action == "":
            return _json(self._metadata(model, version is not None))
        return _json({"error": "Not Found"}, 404)

    async def _http_infer(self, request: Request, name: str, version: str | None) -> Response:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > DEFAULT_MAX_INPUT_SIZE:
            raise too_large(DEFAULT_MAX_INPUT_SIZE)
        model = await self._model(name, version)
        if model.decoupled:
            raise InferError.unsupported(HTTP_DECOUPLED_MESSAGE)
        body: bytes | bytearray = await request.body()
        if len(body) > DEFAULT_MAX_INPUT_SIZE:
            raise too_large(DEFAULT_MAX_INPUT_SIZE)
        encoding = request.headers.get("content-encoding")
        if encoding:
            body = decode_content(body, encoding, DEFAULT_MAX_INPUT_SIZE)
        length = parse_header_length(request.headers.get("inference-header-content-length"), len(body))
        decoded = http_decode(body, length, model)
        result = await self._run(model, decoded.request)
        if isinstance(result, InferError):
            raise result
        content, headers = http_encode(result, decoded, model)
        return Response(content, 200, headers=headers)

    # -- gRPC (Serve's gRPC proxy calls the method named as the RPC) --------------------------------
    @staticmethod
    def _fail(context: Any, error: InferError, empty: Any) -> Any:
        if context is not None:
            context.set_code(GRPC_STATUS[error.code])
            context.set_details(error.message)
        return empty

    async def ServerLive(self, request: Any, grpc_context: Any = None) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, grpc_context: Any = None) -> Any:
        await self._describe()
        return pb.ServerReadyResponse(ready=bool(self.models))

    async def ServerMetadata(self, request: Any, grpc_context: Any = None) -> Any:
        return pb.ServerMetadataResponse(name="pyserve", version=__version__, extensions=EXTENSIONS)

    async def ModelReady(self, request: Any, grpc_context: Any = None) -> Any:
        try:
            await self._model(request.name, model_version(request.version))
        except InferError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def ModelMetadata(self, request: Any, grpc_context: Any = None) -> Any:
        try:
            model = await self._model(request.name, model_version(request.version))
        except InferError as exc:
            return self._fail(grpc_context, exc, pb.ModelMetadataResponse())
        meta = self._metadata(model, bool(request.version))
        response = pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"])
        for field in ("inputs", "outputs"):
            for tensor in meta[field]:
                getattr(response, field).add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        return response

    async def ModelConfig(self, request: Any, grpc_context: Any = None) -> Any:
        try:
            model = await self._model(request.name, model_version(request.version))
        except InferError as exc:
            return self._fail(grpc_context, exc, pb.ModelConfigResponse())
        response = pb.ModelConfigResponse()
        response.config.CopyFrom(model.config)
        return response

    async def ModelInfer(self, request: Any, grpc_context: Any = None) -> Any:
        try:
            model = await self._model(request.model_name, model_version(request.model_version))
            if model.decoupled:
                raise InferError.unsupported(DECOUPLED_MESSAGE)
            decoded = grpc_decode(request, model)
            result = await self._run(model, decoded.request)
            if isinstance(result, InferError):
                raise result
            return encode_infer(result, decoded, model)
        except InferError as exc:
            return self._fail(grpc_context, exc, pb.ModelInferResponse())
