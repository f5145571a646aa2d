"""``POST /v2/models/{m}[/versions/{v}]/infer`` of a decoupled model: its responses as a stream.

The request body is an ordinary infer request (JSON, or JSON plus binary inputs). The answer
streams one JSON object per model response, in the order the model sends them:

* ``Accept: text/event-stream``: Server-Sent Events, each ``data: <object>\\n\\n``;
* any other ``Accept`` (none, ``*/*``, ``application/x-ndjson`` ...): JSON lines
  (``application/x-ndjson``), each ``<object>\\n``, with chunked transfer encoding.

Each object is the KServe infer response (``model_name``, ``model_version``, ``id`` when given,
``outputs`` with their ``data``) with parameter ``triton_final_response``, false but on the last
object, as Triton marks the responses of a gRPC stream. A final flag the model sends without a
response becomes a last object with empty ``outputs``. A model's error is an object with
``error`` instead of ``outputs``. The status waits for the first response: a request the model
fails at once is answered with the error's status and ``{"error": ...}``, not a stream.

Outputs are JSON in a stream: a request asking for binary outputs (``binary_data``,
``binary_data_output``, or a body of binary data only) is refused with 400. A client that
disconnects cancels the request (the model sees ``is_cancelled()``). Non-decoupled models are
answered as before (one response, ``pyserve.frontends.http.fast_infer``); this module serves them too
when a request reaches the application after the model was reloaded as non-decoupled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from pyserve.api.errors import InferError
from pyserve.api.inference import InferResponse
from pyserve.dataplane.interface import InferencePlane
from pyserve.frontends.http.body import infer_body_limit, read_body
from pyserve.frontends.http.codec import DecodedRequest, encode_infer
from pyserve.frontends.http.errors import error_response
from pyserve.frontends.http.fast_infer import (
    Headers,
    decode_soon,
    encode_reply,
    submit_request,
)
from pyserve.frontends.http.generate import GenerateSender
from pyserve.frontends.http.streaming import (
    DISCONNECTED,
    NDJSON_TYPE,
    SSE_TYPE,
    EventStream,
    until_disconnected,
)
from pyserve.runtime.versions import ModelVersion

FINAL = "triton_final_response"
"""The response parameter marking the last response of a request."""


def stream_format(accept: str | None) -> tuple[str, Callable[[bytes], bytes]]:
    """``(content type, framing of one JSON object)`` for the request's ``Accept`` header."""
    if accept and "text/event-stream" in accept.lower():
        return SSE_TYPE, lambda data: b"data: " + data + b"\n\n"
    return NDJSON_TYPE, lambda data: data + b"\n"


async def _decode(request: Request, dataplane: InferencePlane, model: ModelVersion, limit: int) -> tuple[DecodedRequest, int]:
    headers: Headers = dict(request.scope["headers"])
    cap = infer_body_limit(headers.get(b"inference-header-content-length"), headers.get(b"content-encoding"), limit)
    body = await read_body(request, limit, cap)  # decompressed here: decode_soon must not again
    headers.pop(b"content-encoding", None)
    return await decode_soon(dataplane, model, body, headers, limit)


async def infer_stream(request: Request, dataplane: InferencePlane, model: ModelVersion, limit: int) -> Response:
    """Answer an infer request of the decoupled ``model`` as a stream (see the module doc)."""
    try:
        decoded, _ = await _decode(request, dataplane, model, limit)
        if any(options.binary for options in decoded.outputs.values()):
            raise InferError.invalid(
                f"model '{model.name}' is decoupled: its responses stream as JSON, binary outputs cannot be "
                "requested (leave out 'binary_data' and 'binary_data_output')"
            )
        sender = GenerateSender()
        decoded.request.attach_sender(sender)
        dataplane.submit(model, decoded.request)
    except InferError as exc:
        return error_response(exc)
    infer = decoded.request
    items = sender.items()
    media_type, frame = stream_format(request.headers.get("accept"))

    def close() -> None:
        sender.close()
        infer.cancel()
        infer.release()

    try:
        first = await until_disconnected(request.receive, anext(items))
    except BaseException:
        close()
        raise
    if first is DISCONNECTED:
        close()
        return Response(b"", 400)
    if isinstance(first[0], InferError):
        close()
        return error_response(first[0])

    encode = _Encoder(model, decoded, frame)

    async def body() -> AsyncIterator[bytes]:
        yield encode(*first)
        if first[1]:
            return
        async for response, final in items:
            yield encode(response, final)

    return EventStream(body(), media_type, on_close=close)


class _Encoder:
    """One model response (or error, or bare final flag) as one framed JSON object of the stream."""

    def __init__(self, model: ModelVersion, decoded: DecodedRequest, frame: Callable[[bytes], bytes]) -> None:
        self.model = model
        self.decoded = decoded
        self.frame = frame
        request_id = decoded.request.id
        self.head: dict[str, Any] = {"id": request_id} if request_id else {}
        self.head.update(model_name=model.name, model_version=str(model.version))

    def __call__(self, response: InferResponse | InferError | None, final: bool) -> bytes:
        marker = {"parameters": {FINAL: final}}
        if isinstance(response, InferError):
            return self.frame(orjson.dumps({**self.head, "error": response.message, **marker}))
        if response is None:
            return self.frame(orjson.dumps({**self.head, "outputs": [], **marker}))
        marked = InferResponse(response.outputs, {**response.parameters, FINAL: final})
        try:
            data, _ = encode_infer(marked, self.decoded, self.model)
        except InferError as exc:
            return self.frame(orjson.dumps({**self.head, "error": exc.message, **marker}))
        return self.frame(data)


async def infer_once(request: Request, dataplane: InferencePlane, model: ModelVersion, limit: int) -> Response:
    """Answer an infer request of a non-decoupled ``model`` with its one response."""
    try:
        decoded, decode_ns = await _decode(request, dataplane, model, limit)
        future = submit_request(dataplane, model, decoded.request, asyncio.get_running_loop())
    except InferError as exc:
        return error_response(exc)
    with decoded.request:
        result = await until_disconnected(request.receive, future)
    if result is DISCONNECTED:
        decoded.request.cancel()
        return Response(b"", 400)
    try:
        status, content, headers = encode_reply(result, decoded, model, decode_ns, request.headers.get("accept-encoding",
                                                                                                      "").encode())
    except InferError as exc:
        return error_response(exc)
    response = Response(content, status)
    response.raw_headers = [*headers, (b"content-length", str(len(content)).encode())]
    return response
