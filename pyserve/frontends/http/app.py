"""The KServe v2 REST routes, as Triton serves them, on Starlette.

Each route decodes, calls the ``DataPlane`` and encodes; nothing here knows about backends.
Every error body is ``{"error": "..."}``; unknown routes get 404 ``Not Found`` and wrong
methods 405 ``Method Not Allowed``, as Triton answers them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from pyserve.api.errors import InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.dataplane.interface import ServingPlane
from pyserve.frontends.http.body import read_body
from pyserve.frontends.http.errors import error_response, status_error
from pyserve.frontends.http.extensions import extension_routes
from pyserve.frontends.http.fast_infer import InferFastPath
from pyserve.frontends.http.generate import (
    SSE_TYPE,
    GenerateSender,
    decode_generate,
    encode_generate,
    sse_event,
)
from pyserve.frontends.http.infer_stream import infer_once, infer_stream
from pyserve.frontends.http.openai import OpenAIMetrics, openai_routes
from pyserve.frontends.http.openai.errors import OpenAIError
from pyserve.frontends.restricted import RestrictedHttp, Restrictions

T = TypeVar("T")

log = logging.getLogger("pyserve.frontends.http")

_MODEL = "/v2/models/{model_name}"
_VERSIONED = "/v2/models/{model_name}/versions/{model_version:int}"


def _json(data: Any) -> Response:
    return Response(orjson.dumps(data), 200, media_type="application/json")


def _version(request: Request) -> str | None:
    version = request.path_params.get("model_version")
    return None if version is None else str(version)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``, or cancel it and return None if the client disconnects first.

    Cancelling marks the inference request cancelled, so a queued request never executes.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnected(receive: Callable[[], Awaitable[Any]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _collect(sender: GenerateSender) -> list[InferResponse | InferError]:
    return [item async for item in sender.responses()]


def create_app(
    dataplane: ServingPlane, *, max_input_size: int, restrictions: Restrictions | None = None,
    status_page: bool = False,
    openai: bool = True, openai_metrics: OpenAIMetrics | None = None,
) -> InferFastPath | RestrictedHttp:
    """Build the ASGI application serving ``dataplane``: the infer fast path in front of
    the Starlette routes for everything else (``/infer`` of a non-decoupled model is answered by
    the fast path, or natively by ``pyserve.frontends.http.server.HttpServer``; a decoupled model's
    streams from here, ``pyserve.frontends.http.infer_stream``).

    :param max_input_size: the largest request body accepted, compressed or not.
    :param restrictions: ``--http-restricted-api`` rules; when given, a 403 check sits in
        front of everything.
    :param status_page: serve the status page (``/status``, and ``/`` for browsers;
        ``pyserve.frontends.status``).
    :param openai: serve the OpenAI-compatible ``/v1`` routes (``pyserve.frontends.http.openai``).
    :param openai_metrics: where those routes count tokens and their timings (None: nowhere).
    """

    async def live(request: Request) -> Response:
        if dataplane.exiting:
            return status_error(503, "Server exiting")
        if dataplane.live:
            return Response(b"", 200)
        return status_error(400, "Server is not live")

    async def ready(request: Request) -> Response:
        if await dataplane.check_server_ready():
            return Response(b"", 200)
        return status_error(400, "Server is not ready")

    async def server_metadata(request: Request) -> Response:
        return _json(dataplane.server_metadata())

    async def model_metadata(request: Request) -> Response:
        try:
            return _json(dataplane.model_metadata(request.path_params["model_name"], _version(request)))
        except InferError as exc:
            return error_response(exc)

    async def model_ready(request: Request) -> Response:
        if await dataplane.check_model_ready(request.path_params["model_name"], _version(request)):
            return Response(b"", 200)
        return status_error(400, "Model version not ready")

    async def model_config(request: Request) -> Response:
        try:
            return _json(dataplane.model_config(request.path_params["model_name"], _version(request)))
        except InferError as exc:
            return error_response(exc)

    async def model_stats(request: Request) -> Response:
        try:
            name = request.path_params.get("model_name", "")
            await dataplane.collect_statistics()
            return _json(dataplane.model_statistics(name, _version(request)))
        except InferError as exc:
            return error_response(exc)

    async def repository_index(request: Request) -> Response:
        ready_only = False
        try:
            body = await read_body(request, max_input_size)
            if body.strip():
                payload = orjson.loads(body)
                if not isinstance(payload, dict):
                    raise InferError.invalid("the repository index body must be a JSON object")
                ready_only = payload.get("ready", False)
                if not isinstance(ready_only, bool):
                    raise InferError.invalid("'ready' must be a boolean")
        except orjson.JSONDecodeError as exc:
            return status_error(400, f"failed to parse the request JSON buffer: {exc}")
        except InferError as exc:
            return error_response(exc)
        return _json(dataplane.repository_index(ready_only))

    async def infer(request: Request) -> Response:
        # POST .../infer of a non-decoupled model is answered by the fast path (or HttpServer)
        # before it gets here, unless the model was reloaded meanwhile; a decoupled one streams.
        try:
            model = dataplane.model(request.path_params["model_name"], _version(request))
        except InferError as exc:
            return error_response(exc)
        if model.decoupled:
            return await infer_stream(request, dataplane, model, max_input_size)
        return await infer_once(request, dataplane, model, max_input_size)

    async def start_generate(request: Request) -> tuple[Any, InferRequest, GenerateSender]:
        """Decode a generate body and schedule it; the caller must release the request.

        :raises InferError: unknown model, bad body, or the request was refused.
        """
        model = dataplane.model(request.path_params["model_name"], _version(request))
        body = await read_body(request, max_input_size)
        infer_request = decode_generate(body, model)
        sender = GenerateSender()
        infer_request.attach_sender(sender)
        dataplane.submit(model, infer_request)
        return model, infer_request, sender

    async def generate(request: Request) -> Response:
        try:
            model, infer_request, sender = await start_generate(request)
            with infer_request:
                responses = await _unless_disconnected(request, _collect(sender))
            if responses is None:
                infer_request.cancel()
                return status_error(400, "client disconnected")
            errors = [r for r in responses if isinstance(r, InferError)]
            if errors:  # Triton 2.51 answers a failed generate with 400, whatever the error
                return status_error(400, errors[0].message)
            if len(responses) != 1:
                raise InferError.invalid(
                    "generate expects model to produce exactly 1 response, use generate stream for model "
                    f"that generates various number of responses (model '{model.name}' produced {len(responses)})"
                )
            response = responses[0]
            assert isinstance(response, InferResponse)
            return _json(encode_generate(response, infer_request, model))
        except InferError as exc:
            return error_response(exc)

    async def generate_stream(request: Request) -> Response:
        """As Triton 2.51: the status waits for the first response, so a request whose first
        response is an error answers 400 with that error as its only event."""
        try:
            model, infer_request, sender = await start_generate(request)
        except InferError as exc:
            return error_response(exc)
        responses = sender.responses()

        def event(item: InferResponse | InferError) -> bytes:
            if isinstance(item, InferError):
                return sse_event({"error": item.message})
            try:
                return sse_event(encode_generate(item, infer_request, model))
            except InferError as exc:
                return sse_event({"error": exc.message})

        def close() -> None:
            sender.close()
            infer_request.cancel()
            infer_request.release()

        try:
            first = await _unless_disconnected(request, anext(responses, None))
        except BaseException:
            close()
            raise
        if first is None or isinstance(first, InferError):
            close()
            if first is None:  # no response (a final flag alone), or the client went away
                return Response(b"", 200, media_type=SSE_TYPE)
            return Response(event(first), 400, media_type=SSE_TYPE)

        async def events() -> AsyncIterator[bytes]:
            try:
                yield event(first)
                async for item in responses:
                    yield event(item)
            finally:
                close()

        return StreamingResponse(events(), media_type=SSE_TYPE)

    async def control_parameters(request: Request) -> dict[str, Any]:
        """The ``parameters`` object of a load/unload body (empty body = no parameters).

        :raises InferError: the body is not a JSON object or ``parameters`` is not one.
        """
        body = await read_body(request, max_input_size)
        if not body.strip():
            return {}
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise InferError.invalid(f"failed to parse the request JSON buffer: {exc}") from None
        if not isinstance(payload, dict):
            raise InferError.invalid("the request body must be a JSON object")
        parameters = payload.get("parameters", {})
        if not isinstance(parameters, dict):
            raise InferError.invalid("'parameters' must be a JSON object")
        return parameters

    async def repository_load(request: Request) -> Response:
        try:
            parameters = await control_parameters(request)
            await dataplane.load_model(request.path_params["model_name"], parameters)
        except InferError as exc:
            return error_response(exc)
        return Response(b"", 200, media_type="application/json")

    async def repository_unload(request: Request) -> Response:
        try:
            parameters = await control_parameters(request)
            dependents = parameters.get("unload_dependents", False)
            if not isinstance(dependents, bool):
                raise InferError.invalid("'unload_dependents' must be a boolean")
            await dataplane.unload_model(request.path_params["model_name"], dependents)
        except InferError as exc:
            return error_response(exc)
        return Response(b"", 200, media_type="application/json")

    async def repository_named(request: Request) -> Response:
        return status_error(501, "'repository_name' specification is not supported")

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = {404: "Not Found", 405: "Method Not Allowed"}.get(exc.status_code, str(exc.detail))
        if openai and request.url.path.startswith("/v1/"):  # OpenAI clients read their own error shape
            return OpenAIError(exc.status_code, message).response()
        return status_error(exc.status_code, message)

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return status_error(500, f"internal server error: {type(exc).__name__}: {exc}")

    routes = [
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2", server_metadata, methods=["GET"]),
        Route("/v2/models/stats", model_stats, methods=["GET"]),  # before /v2/models/{model_name}
        Route("/v2/repository/index", repository_index, methods=["POST"]),
        # Triton 2.51 answers the index with a repository name too (as its gRPC RepositoryIndex does)
        Route("/v2/repository/{repository_name}/index", repository_index, methods=["POST"]),
        Route("/v2/repository/models/{model_name}/load", repository_load, methods=["POST"]),
        Route("/v2/repository/models/{model_name}/unload", repository_unload, methods=["POST"]),
        Route("/v2/repository/{repository_name}/models/{model_name}/load", repository_named, methods=["POST"]),
        Route("/v2/repository/{repository_name}/models/{model_name}/unload", repository_named, methods=["POST"]),
    ]
    for prefix in (_MODEL, _VERSIONED):
        routes += [
            Route(prefix, model_metadata, methods=["GET"]),
            Route(prefix + "/ready", model_ready, methods=["GET"]),
            Route(prefix + "/config", model_config, methods=["GET"]),
            Route(prefix + "/stats", model_stats, methods=["GET"]),
            Route(prefix + "/infer", infer, methods=["POST"]),
            Route(prefix + "/generate", generate, methods=["POST"]),
            Route(prefix + "/generate_stream", generate_stream, methods=["POST"]),
        ]
    routes += extension_routes(dataplane, max_input_size)  # shared memory, trace, logging
    if status_page:
        from pyserve.frontends.status import status_routes

        routes += status_routes(dataplane, restrictions)
    if openai:
        routes += openai_routes(dataplane, max_input_size, openai_metrics)
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: http_error, Exception: internal_error},
    )
    app.router.redirect_slashes = False  # as Triton: '/infer/' is an unknown route (404 JSON), not a 307
    fast = InferFastPath(app, dataplane, max_input_size)
    return RestrictedHttp(fast, restrictions) if restrictions else fast
