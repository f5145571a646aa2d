"""Inference routes: ``POST .../infer``, ``.../generate`` and ``.../generate_stream`` per model.

``/infer`` of a non-decoupled model is answered before the router (``pyserve.frontends.http.
fast_infer``, or natively by ``pyserve.frontends.http.native_infer``); it reaches the route here
when the model was reloaded meanwhile, and a decoupled model's answer streams from here
(``pyserve.frontends.http.infer_stream``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from pyserve.api.errors import InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.dataplane.interface import InferencePlane
from pyserve.frontends.http.body import read_body
from pyserve.frontends.http.errors import error_response, status_error
from pyserve.frontends.http.generate import (
    SSE_TYPE,
    GenerateSender,
    decode_generate,
    encode_generate,
    sse_event,
)
from pyserve.frontends.http.infer_stream import infer_once, infer_stream
from pyserve.frontends.http.routes.common import json_response, model_version

T = TypeVar("T")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
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


class _GenerateStream:
    """One ``generate_stream`` request after its first response: turns responses into server-sent
    events and, once closed, releases the request."""

    def __init__(self, dataplane: InferencePlane, model: Any, infer_request: InferRequest, sender: GenerateSender) -> None:
        self.dataplane = dataplane
        self.model = model
        self.infer_request = infer_request
        self.sender = sender
        self.responses = sender.responses()

    def event(self, item: InferResponse | InferError) -> bytes:
        if isinstance(item, InferError):
            return sse_event({"error": item.message})
        try:
            return sse_event(encode_generate(item, self.infer_request, self.model))
        except InferError as exc:
            return sse_event({"error": exc.message})

    def close(self) -> None:
        self.sender.close()
        self.infer_request.cancel()
        self.infer_request.release()

    async def events(self, first: InferResponse) -> AsyncIterator[bytes]:
        try:
            yield self.event(first)
            async for item in self.responses:
                yield self.event(item)
        finally:
            self.close()


class InferenceRoutes:
    """Inference by the router: streamed (decoupled) infer and generate.

    :param dataplane: the server's data plane.
    :param max_input_size: the largest request body accepted, compressed or not.
    """

    def __init__(self, dataplane: InferencePlane, max_input_size: int) -> None:
        self.dataplane = dataplane
        self.max_input_size = max_input_size

    def model_routes(self, prefix: str) -> list[Route]:
        """The per-model routes under ``prefix`` (``common.MODEL`` or ``common.VERSIONED``)."""
        return [
            Route(prefix + "/infer", self.infer, methods=["POST"]),
            Route(prefix + "/generate", self.generate, methods=["POST"]),
            Route(prefix + "/generate_stream", self.generate_stream, methods=["POST"]),
        ]

    async def infer(self, request: Request) -> Response:
        """A decoupled model's streamed answer, or (after a reload raced the fast path) one answer."""
        try:
            model = self.dataplane.model(request.path_params["model_name"], model_version(request))
        except InferError as exc:
            return error_response(exc)
        if model.decoupled:
            return await infer_stream(request, self.dataplane, model, self.max_input_size)
        return await infer_once(request, self.dataplane, model, self.max_input_size)

    async def start_generate(self, request: Request) -> tuple[Any, InferRequest, GenerateSender]:
        """Decode a generate body and schedule it; the caller must release the request.

        :raises InferError: unknown model, bad body, or the request was refused.
        """
        model = self.dataplane.model(request.path_params["model_name"], model_version(request))
        body = await read_body(request, self.max_input_size)
        infer_request = decode_generate(body, model)
        sender = GenerateSender()
        infer_request.attach_sender(sender)
        self.dataplane.submit(model, infer_request)
        return model, infer_request, sender

    async def generate(self, request: Request) -> Response:
        """The model's one response as a generate answer (400 for any failure, as Triton 2.51)."""
        try:
            model, infer_request, sender = await self.start_generate(request)
            with infer_request:
                responses = await unless_disconnected(request, _collect(sender))
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
            return json_response(encode_generate(response, infer_request, model))
        except InferError as exc:
            return error_response(exc)

    async def generate_stream(self, request: Request) -> Response:
        """As Triton 2.51: the status waits for the first response, so a request whose first
        response is an error answers 400 with that error as its only event."""
        try:
            model, infer_request, sender = await self.start_generate(request)
        except InferError as exc:
            return error_response(exc)
        stream = _GenerateStream(self.dataplane, model, infer_request, sender)
        try:
            first = await unless_disconnected(request, anext(stream.responses, None))
        except BaseException:
            stream.close()
            raise
        if first is None or isinstance(first, InferError):
            stream.close()
            if first is None:  # no response (a final flag alone), or the client went away
                return Response(b"", 200, media_type=SSE_TYPE)
            return Response(stream.event(first), 400, media_type=SSE_TYPE)
        return StreamingResponse(stream.events(first), media_type=SSE_TYPE)
