"""HTTP routes of the shared-memory, trace and logging extensions.

``/v2/systemsharedmemory[/region/{r}]/status|register|unregister``,
``/v2/cudasharedmemory[/region/{r}]/status|register|unregister``, ``/v2/trace/setting``,
``/v2/models/{m}/trace/setting`` and ``/v2/logging``, with Triton's bodies and errors.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve import logs
from pyserve.api.errors import InferError
from pyserve.dataplane.interface import ServingPlane
from pyserve.frontends.http.body import read_body
from pyserve.frontends.http.errors import error_response


def _json(data: Any) -> Response:
    return Response(orjson.dumps(data), 200, media_type="application/json")


def _ok() -> Response:
    return Response(b"", 200, media_type="application/json")


async def _json_body(request: Request, limit: int, *, required: bool = True) -> Any:
    body = await read_body(request, limit)
    if not body.strip():
        if required:
            raise InferError.invalid("the request body must be a JSON object")
        return {}
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InferError.invalid(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(payload, dict):
        raise InferError.invalid("the request body must be a JSON object")
    return payload


def extension_routes(dataplane: ServingPlane, max_input_size: int) -> list[Route]:
    """The extension routes for ``dataplane``'s server."""
    shm = dataplane.shared_memory

    def shm_routes(prefix: str, kind: str) -> list[Route]:
        async def status(request: Request) -> Response:
            try:
                return _json(shm.status(request.path_params.get("region", ""), kind))
            except InferError as exc:
                return error_response(exc)

        async def register(request: Request) -> Response:
            try:
                body = await _json_body(request, max_input_size)
                name = request.path_params["region"]
                if kind == "system":
                    shm.register_system(name, body.get("key"), body.get("offset", 0), body.get("byte_size"))
                else:
                    shm.register_cuda_json(name, body)
            except InferError as exc:
                return error_response(exc)
            return _ok()

        async def unregister(request: Request) -> Response:
            try:
                shm.unregister(request.path_params.get("region", ""), kind)
            except InferError as exc:  # a region a request is using
                return error_response(exc)
            return _ok()

        return [
            Route(f"{prefix}/status", status, methods=["GET"]),
            Route(f"{prefix}/region/{{region}}/status", status, methods=["GET"]),
            Route(f"{prefix}/region/{{region}}/register", register, methods=["POST"]),
            Route(f"{prefix}/unregister", unregister, methods=["POST"]),
            Route(f"{prefix}/region/{{region}}/unregister", unregister, methods=["POST"]),
        ]

    async def trace_setting(request: Request) -> Response:
        model = request.path_params.get("model_name")
        try:
            if model is not None:
                dataplane.check_trace_model(model)
            if request.method == "GET":
                return _json(dataplane.tracing.settings(model))
            body = await _json_body(request, max_input_size, required=False)
            return _json(dataplane.tracing.update(body, model))
        except InferError as exc:
            return error_response(exc)

    async def logging_settings(request: Request) -> Response:
        try:
            if request.method == "GET":
                return _json(logs.get_settings())
            body = await _json_body(request, max_input_size, required=False)
            return _json(logs.update_settings(body))
        except InferError as exc:
            return error_response(exc)

    return [
        *shm_routes("/v2/systemsharedmemory", "system"),
        *shm_routes("/v2/cudasharedmemory", "cuda"),
        Route("/v2/trace/setting", trace_setting, methods=["GET", "POST"]),
        Route("/v2/models/{model_name}/trace/setting", trace_setting, methods=["GET", "POST"]),
        Route("/v2/logging", logging_settings, methods=["GET", "POST"]),
    ]
