"""The control plane of ``pyserve bench``: model metadata and config, the statistics extension
and system shared memory registration, over HTTP (``http.client``) or gRPC (a blocking channel).

Nothing here is on the hot path; the workers send the inference requests themselves.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from typing import Any, Protocol

from pyserve.tools.bench.inputs import ModelInfo, TensorSpec
from pyserve.tools.bench.options import BenchError

TIMEOUT_S = 10.0

_STAT_KINDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


class Unsupported(Exception):
    """The server does not offer an extension (HTTP 404/501, gRPC UNIMPLEMENTED/UNAVAILABLE)."""


class ControlClient(Protocol):
    """What the runner asks of the server outside the measured requests."""

    def model_info(self, model: str, version: str) -> ModelInfo:
        """The model's inputs, outputs, batching and decoupled flag.

        :raises BenchError: the server is unreachable or does not serve the model.
        """

    def statistics(self, model: str, version: str) -> dict[str, int]:
        """Cumulative counters ``{"inference_count", "execution_count", "<kind>_count", "<kind>_ns"}``.

        :raises Unsupported: the server has no statistics extension.
        """

    def register_system_shm(self, name: str, key: str, byte_size: int) -> None:
        """Register a system shared memory region.

        :raises Unsupported: the server has no shared memory extension.
        """

    def unregister_system_shm(self, name: str) -> None:
        """Unregister a region (errors ignored)."""

    def close(self) -> None:
        """Release the connection."""


def _info_from(model: str, version: str, metadata: dict[str, Any], config: dict[str, Any]) -> ModelInfo:
    def specs(key: str) -> list[TensorSpec]:
        return [TensorSpec(t["name"], t["datatype"], [int(d) for d in t.get("shape", [])])
                for t in metadata.get(key, [])]

    policy = config.get("model_transaction_policy") or {}
    optional = {i["name"] for i in config.get("input", []) if i.get("optional")}
    return ModelInfo(
        name=model,
        version=version,
        inputs=specs("inputs"),
        outputs=specs("outputs"),
        max_batch_size=int(config.get("max_batch_size", 0) or 0),
        decoupled=bool(policy.get("decoupled", False)),
        optional_inputs=optional,
    )


def _flatten_stats(model_stats: list[dict[str, Any]]) -> dict[str, int]:
    """Sum Triton's ``model_stats`` entries (one per version) into flat counters."""
    totals: dict[str, int] = {"inference_count": 0, "execution_count": 0}
    for kind in _STAT_KINDS:
        totals[f"{kind}_count"] = 0
        totals[f"{kind}_ns"] = 0
    for entry in model_stats:
        totals["inference_count"] += int(entry.get("inference_count", 0))
        totals["execution_count"] += int(entry.get("execution_count", 0))
        stats = entry.get("inference_stats", {})
        for kind in _STAT_KINDS:
            duration = stats.get(kind, {})
            totals[f"{kind}_count"] += int(duration.get("count", 0))
            totals[f"{kind}_ns"] += int(duration.get("ns", 0))
    return totals


class HttpControl:
    """Control plane over KServe v2 HTTP/REST."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._conn: http.client.HTTPConnection | None = None

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        payload = json.dumps(body).encode() if body is not None else None
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_S)
            try:
                headers = {"Content-Type": "application/json"} if payload is not None else {}
                self._conn.request(method, path, body=payload, headers=headers)
                response = self._conn.getresponse()
                raw = response.read()
                break
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if attempt or isinstance(exc, ConnectionRefusedError | socket.gaierror):
                    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
                    raise BenchError(f"cannot reach the server at {self.host}:{self.port} over HTTP: {reason}") from None
        try:
            document = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            document = {"error": raw[:200].decode("utf-8", "replace")}
        return response.status, document

    @staticmethod
    def _model_path(model: str, version: str) -> str:
        quoted = urllib.parse.quote(model, safe="")
        return f"/v2/models/{quoted}" + (f"/versions/{urllib.parse.quote(version, safe='')}" if version else "")

    def model_info(self, model: str, version: str) -> ModelInfo:
        path = self._model_path(model, version)
        status, metadata = self._request("GET", path)
        if status != 200:
            error = metadata.get("error", "") if isinstance(metadata, dict) else ""
            raise BenchError(f"model '{model}' is not available on the server (HTTP {status}"
                             f"{': ' + error if error else ''})")
        status, config = self._request("GET", path + "/config")
        return _info_from(model, version, metadata, config if status == 200 and isinstance(config, dict) else {})

    def statistics(self, model: str, version: str) -> dict[str, int]:
        status, document = self._request("GET", self._model_path(model, version) + "/stats")
        if status != 200 or not isinstance(document, dict) or "model_stats" not in document:
            error = document.get("error", "") if isinstance(document, dict) else ""
            raise Unsupported(f"GET /v2/models/{model}/stats answered HTTP {status}" + (f": {error}" if error else ""))
        return _flatten_stats(document["model_stats"])

    def register_system_shm(self, name: str, key: str, byte_size: int) -> None:
        status, document = self._request("GET", "/v2/systemsharedmemory/status")
        if status != 200:
            raise Unsupported(f"GET /v2/systemsharedmemory/status answered HTTP {status}"
                              + (f": {document.get('error')}" if isinstance(document, dict) and document.get("error") else ""))
        status, document = self._request(
            "POST", f"/v2/systemsharedmemory/region/{name}/register", {"key": key, "offset": 0, "byte_size": byte_size}
        )
        if status != 200:
            raise BenchError(f"registering system shared memory region '{name}' failed (HTTP {status}): "
                             f"{document.get('error', '') if isinstance(document, dict) else ''}")

    def unregister_system_shm(self, name: str) -> None:
        try:
            self._request("POST", f"/v2/systemsharedmemory/region/{name}/unregister", {})
        except BenchError:
            pass

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class GrpcControl:
    """Control plane over the ``inference.GRPCInferenceService`` gRPC API."""

    _SERVICE = "/inference.GRPCInferenceService/"

    def __init__(self, host: str, port: int) -> None:
        import grpc

        self._grpc = grpc
        self.target = f"{host}:{port}"
        self._channel = grpc.insecure_channel(self.target)

    def _call(self, method: str, request: Any, response_type: Any) -> Any:
        stub = self._channel.unary_unary(
            self._SERVICE + method,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_type.FromString,
        )
        return stub(request, timeout=TIMEOUT_S)

    def _unreachable(self, exc: Any) -> BenchError:
        return BenchError(f"cannot reach the server at {self.target} over gRPC: {exc.details() or exc.code().name}")

    def model_info(self, model: str, version: str) -> ModelInfo:
        from google.protobuf import json_format

        from pyserve import protocol as pb

        grpc = self._grpc
        try:
            metadata = self._call("ModelMetadata", pb.ModelMetadataRequest(name=model, version=version),
                                  pb.ModelMetadataResponse)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise self._unreachable(exc) from None
            raise BenchError(f"model '{model}' is not available on the server ({exc.code().name}: "
                             f"{exc.details()})") from None
        meta = {
            key: [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in getattr(metadata, key)]
            for key in ("inputs", "outputs")
        }
        try:
            response = self._call("ModelConfig", pb.ModelConfigRequest(name=model, version=version),
                                  pb.ModelConfigResponse)
            config = json_format.MessageToDict(response.config, preserving_proto_field_name=True)
        except grpc.RpcError:
            config = {}
        return _info_from(model, version, meta, config)

    def statistics(self, model: str, version: str) -> dict[str, int]:
        from google.protobuf import json_format

        from pyserve import protocol as pb

        try:
            response = self._call("ModelStatistics", pb.ModelStatisticsRequest(name=model, version=version),
                                  pb.ModelStatisticsResponse)
        except self._grpc.RpcError as exc:
            raise Unsupported(f"ModelStatistics answered {exc.code().name}: {exc.details()}") from None
        document = json_format.MessageToDict(response, preserving_proto_field_name=True)
        return _flatten_stats(document.get("model_stats", []))

    def register_system_shm(self, name: str, key: str, byte_size: int) -> None:
        from pyserve import protocol as pb

        grpc = self._grpc
        try:
            self._call("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest(),
                       pb.SystemSharedMemoryStatusResponse)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise self._unreachable(exc) from None
            raise Unsupported(f"SystemSharedMemoryStatus answered {exc.code().name}: {exc.details()}") from None
        try:
            self._call("SystemSharedMemoryRegister",
                       pb.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=0, byte_size=byte_size),
                       pb.SystemSharedMemoryRegisterResponse)
        except grpc.RpcError as exc:
            raise BenchError(f"registering system shared memory region '{name}' failed "
                             f"({exc.code().name}: {exc.details()})") from None

    def unregister_system_shm(self, name: str) -> None:
        from pyserve import protocol as pb

        try:
            self._call("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest(name=name),
                       pb.SystemSharedMemoryUnregisterResponse)
        except self._grpc.RpcError:
            pass

    def close(self) -> None:
        self._channel.close()


def connect(protocol: str, host: str, port: int) -> ControlClient:
    """The control client for ``-i http|grpc``."""
    if protocol == "grpc":
        return GrpcControl(host, port)
    return HttpControl(host, port)
