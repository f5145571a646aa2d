"""The hot path: ``POST /v2/models/{m}[/versions/{v}]/infer`` as a plain ASGI handler.

Inference requests (of non-decoupled models: a decoupled model's answer streams from the
application, ``pyserve.frontends.http.infer_stream``) skip Starlette's router, middleware and ``Request``/``Response`` objects:
the path is matched by hand, the body is read straight from ``receive`` (with the size cap),
and the answer goes out in two ``send`` calls. Every other route falls through to the
Starlette application. Behaviour (status codes, error texts, compression) is the same as on
any route; only the per-request overhead differs.

The steps (``infer_model``, ``check_declared_length``, ``decode_request`` or its coroutine form
``decode_soon``, ``submit_request``, ``encode_reply``, ``error_reply``) are module functions
shared with the native HTTP/1.1 server (``pyserve.frontends.http.native_infer``), which runs the same sequence
without ASGI. A large body is decoded on a decode thread (``pyserve.frontends.http.offload``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from time import monotonic_ns
from typing import Any, cast

from pyserve.api.errors import InferError
from pyserve.api.inference import FutureSender, InferRequest, InferResponse
from pyserve.dataplane.interface import InferencePlane
from pyserve.frontends.http import offload
from pyserve.frontends.http.body import compress, decode_content, infer_body_limit, too_large
from pyserve.frontends.http.codec import (
    JSON_TYPE,
    DecodedRequest,
    decode_infer,
    encode_infer,
    parse_header_length,
)
from pyserve.frontends.http.errors import JSON_HEADERS, Reply, error_reply
from pyserve.frontends.http.wire import BodyParts
from pyserve.repository.scan import is_version_number
from pyserve.runtime.versions import ModelVersion

Scope = dict[str, Any]
ASGIApp = Any

_PREFIX = "/v2/models/"
_SUFFIX = "/infer"
DECOUPLED_MESSAGE = "HTTP end point doesn't support models with decoupled transaction policy"

Headers = dict[bytes, bytes]
"""Request headers by lower-case name (the last value of a repeated header wins)."""


def route(path: str) -> tuple[str, str | None] | None:
    """``(model, version)`` for an infer path, or None for anything else.

    A version is ASCII digits only (``str.isdigit`` alone would take '²' or '١'), as the
    ``{model_version:int}`` routes of the application match; any other version segment is
    left to the application, which answers it as an unknown route.
    """
    if not (path.startswith(_PREFIX) and path.endswith(_SUFFIX)):
        return None
    parts = path[len(_PREFIX) : -len(_SUFFIX)].split("/")
    if len(parts) == 1 and parts[0]:
        return parts[0], None
    if len(parts) == 3 and parts[0] and parts[1] == "versions" and is_version_number(parts[2]):
        return parts[0], parts[2]
    return None


_route = route  # the former private name


def infer_model(dataplane: InferencePlane, name: str, version: str | None) -> ModelVersion:
    """The model an infer request targets.

    :raises InferError: unknown model or version, or a decoupled model (501).
    """
    model = dataplane.model(name, version)
    if model.decoupled:
        raise InferError.unsupported(DECOUPLED_MESSAGE)
    return model


def check_declared_length(declared: bytes | None, limit: int, json_limit: int | None = None,
                          raw: bool = False) -> None:
    """Refuse a body whose ``Content-Length`` is over ``limit`` before reading any of it.

    :param json_limit: ``--http-max-input-size`` when ``limit`` is an infer body's
        (``body.infer_body_limit``), for the error's words.
    :param raw: the body is one raw binary input, for the error's words.
    :raises InferError: over the limit, or not an integer.
    """
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise InferError.invalid("Content-Length must be an integer") from None
        if length > limit:
            raise too_large(limit, json_limit, length=length, raw=raw)


def declared_infer_body(headers: Iterable[tuple[bytes, bytes]], limit: int) -> int:
    """Check an infer request's declared body length against its cap before reading any of
    it; returns the cap for the body as it streams in (``body.infer_body_limit``).

    :param headers: the request's (lower-case name, value) pairs, read in one pass.
    :raises InferError: over the cap, or a bad Content-Length.
    """
    declared = header_length = encoding = None
    for name, value in headers:
        if name == b"content-length":
            declared = value
        elif name == b"inference-header-content-length":
            header_length = value
        elif name == b"content-encoding":
            encoding = value
    cap = infer_body_limit(header_length, encoding, limit)
    raw = header_length is not None and header_length.strip() == b"0"
    check_declared_length(declared, cap, limit, raw=raw)
    return cap


def decode_request(
    dataplane: InferencePlane, model: ModelVersion, body: bytes | bytearray, headers: Headers, limit: int
) -> tuple[DecodedRequest, int]:
    """Decompress and decode an infer body; ``(decoded, decode nanoseconds)``.

    The request's statistics start here: its ``arrival_ns`` is the moment decoding began, and
    it is marked to end when ``encode_reply`` has its response ready to send.

    :raises InferError: a bad encoding, header length or request.
    """
    decode_start = monotonic_ns()
    encoding = headers.get(b"content-encoding")
    if encoding:
        body = decode_content(body, encoding.decode("latin-1"), limit)
    raw_length = headers.get(b"inference-header-content-length")
    header_length = parse_header_length(
        raw_length.decode("latin-1") if raw_length is not None else None, len(body)
    )
    decoded = decode_infer(body, header_length, model, dataplane.shared_memory)
    forwarding = dataplane.http_forwarding
    if forwarding is not None:
        forwarding.apply(((k.decode("latin-1"), v) for k, v in headers.items()), decoded.request)
    decode_ns = monotonic_ns() - decode_start
    request = decoded.request
    request.arrival_ns = decode_start
    request.reply_ns = -1  # encode_reply reports when the response is ready to go out
    if dataplane.tracing.active:
        parent = headers.get(b"traceparent")
        decoded.request.trace_parent = parent.decode("latin-1") if parent is not None else None
    return decoded, decode_ns


async def decode_soon(
    dataplane: InferencePlane, model: ModelVersion, body: bytes | bytearray, headers: Headers, limit: int
) -> tuple[DecodedRequest, int]:
    """``decode_request`` for a coroutine: inline for the usual body, on a decode thread for a
    large one (``pyserve.frontends.http.offload``) so that the event loop goes on serving meanwhile."""
    if len(body) > offload.OFFLOAD_COMPRESSED_BYTES and offload.off_loop(len(body), headers):
        return await offload.run(
            asyncio.get_running_loop(), lambda: decode_request(dataplane, model, body, headers, limit))
    return decode_request(dataplane, model, body, headers, limit)


def submit_request(
    dataplane: InferencePlane, model: ModelVersion, request: InferRequest, loop: asyncio.AbstractEventLoop
) -> asyncio.Future[Any]:
    """Schedule ``request``; the future resolves to its ``InferResponse`` or ``InferError``.

    ``request.release()`` must follow once the future is done (or abandoned).

    :raises InferError: the data plane refused the request (nothing to release then).
    """
    future: asyncio.Future[Any] = loop.create_future()
    request.attach_sender(FutureSender(loop, future))
    dataplane.submit(model, request)
    return future


def encode_reply(
    result: InferResponse | InferError, decoded: DecodedRequest, model: ModelVersion, decode_ns: int,
    accept_encoding: bytes | None,
) -> Reply:
    """The 200 answer for a model's response, compressed if the client accepts it; the
    request's statistics count it as sent once it is encoded (``decode_ns`` is already inside
    the request's duration: it runs from the start of decoding).

    :raises InferError: the model answered an error, or the response cannot be encoded.
    """
    status, content, headers = encode_reply_parts(result, decoded, model, decode_ns, accept_encoding, parts=False)
    return status, cast(bytes, content), headers


def encode_reply_parts(
    result: InferResponse | InferError, decoded: DecodedRequest, model: ModelVersion, decode_ns: int,
    accept_encoding: bytes | None, parts: bool = True,
) -> tuple[int, bytes | BodyParts, list[tuple[bytes, bytes]]]:
    """``encode_reply`` for a caller that writes a ``BodyParts`` body itself (the native HTTP
    server): a large binary answer is its JSON header and views of the outputs, not one copy.

    :raises InferError: as ``encode_reply``.
    """
    if isinstance(result, InferError):
        raise result
    content, out_headers = encode_infer(result, decoded, model, parts=parts)
    if len(out_headers) == 1 and out_headers.get("content-type") == JSON_TYPE:
        raw_headers = JSON_HEADERS  # the usual answer: shared, never mutated
    else:
        raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in out_headers.items()]
    if accept_encoding:
        compressed, applied = compress(bytes(content), accept_encoding.decode("latin-1"))
        if applied:
            content = compressed
            raw_headers = [*raw_headers, (b"content-encoding", applied.encode("latin-1"))]
    request = decoded.request
    if request.stats is not None:
        request.stats.response_sent(request)
    return 200, content, raw_headers


class InferFastPath:
    """ASGI middleware answering infer requests itself and passing the rest to ``app``.

    :param app: the Starlette application for every other route.
    :param dataplane: the server's data plane.
    :param max_input_size: the request body cap (``--http-max-input-size``).
    """

    def __init__(self, app: ASGIApp, dataplane: InferencePlane, max_input_size: int) -> None:
        self.app = app
        self.dataplane = dataplane
        self.max_input_size = max_input_size

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            target = route(scope["path"])
            if target is not None:
                try:
                    model = self.dataplane.model(*target)
                except InferError as exc:
                    await _send(send, *error_reply(exc))
                    return
                if not model.decoupled:  # a decoupled model's answer streams from the application
                    await self._infer(scope, receive, send, model)
                    return
        await self.app(scope, receive, send)

    async def _infer(self, scope: Scope, receive: Any, send: Any, model: ModelVersion) -> None:
        headers: Headers = {}
        for key, value in scope["headers"]:
            headers[key] = value
        try:
            body = await self._read(receive, headers)
            if body is None:
                return  # the client went away
            decoded, decode_ns = await decode_soon(self.dataplane, model, body, headers, self.max_input_size)
            result = await self._run(model, decoded.request, receive)
            if result is None:
                return
            reply = encode_reply(result, decoded, model, decode_ns, headers.get(b"accept-encoding"))
        except InferError as exc:
            reply = error_reply(exc)
        await _send(send, *reply)

    async def _read(self, receive: Any, headers: dict[bytes, bytes]) -> bytes | bytearray | None:
        limit = declared_infer_body(headers.items(), self.max_input_size)
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False):
            if len(body) > limit:
                raise too_large(limit, self.max_input_size)
            return body
        chunks = [body]
        received = len(body)
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > limit:
                raise too_large(limit, self.max_input_size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return bytearray().join(chunks)  # one copy either way; its tensors are writeable views

    async def _run(self, model: Any, request: Any, receive: Any) -> InferResponse | InferError | None:
        """Schedule the request and wait for it; None if the client disconnected first.

        One watcher task listens for ``http.disconnect`` meanwhile: a disconnect cancels the
        request, so one still queued never reaches execute.
        """
        loop = asyncio.get_running_loop()
        try:
            future = submit_request(self.dataplane, model, request, loop)
        except InferError as error:
            return error

        def on_disconnect(task: asyncio.Task[Any]) -> None:
            if not task.cancelled() and task.exception() is None and not future.done():
                request.cancel()
                future.set_result(None)

        watcher = loop.create_task(receive())
        watcher.add_done_callback(on_disconnect)
        try:
            return await future
        except asyncio.CancelledError:
            request.cancel()
            raise
        finally:
            watcher.remove_done_callback(on_disconnect)
            watcher.cancel()
            request.release()


async def _send(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode("latin-1"))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
