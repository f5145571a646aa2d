"""The hot path: ``POST /v2/models/{m}[/versions/{v}]/infer`` as a plain ASGI handler.

Inference requests skip Starlette's router, middleware and ``Request``/``Response`` objects:
the path is matched by hand, the body is read straight from ``receive`` (with the size cap),
and the answer goes out in two ``send`` calls. Every other route falls through to the
Starlette application. Behaviour (status codes, error texts, compression) is the same as on
any route; only the per-request overhead differs.
"""

from __future__ import annotations

import asyncio
from time import monotonic_ns
from typing import Any

from pyserve.dataplane import DataPlane
from pyserve.errors import InferError
from pyserve.http.body import compress, decode_content, too_large
from pyserve.http.codec import decode_infer, encode_infer, parse_header_length
from pyserve.http.errors import HTTP_STATUS, error_body
from pyserve.inference import FutureSender, InferResponse

Scope = dict[str, Any]
ASGIApp = Any

_PREFIX = "/v2/models/"
_SUFFIX = "/infer"
_JSON_HEADERS = [(b"content-type", b"application/json")]


def _route(path: str) -> tuple[str, str | None] | None:
    """``(model, version)`` for an infer path, or None for anything else."""
    if not (path.startswith(_PREFIX) and path.endswith(_SUFFIX)):
        return None
    parts = path[len(_PREFIX) : -len(_SUFFIX)].split("/")
    if len(parts) == 1 and parts[0]:
        return parts[0], None
    if len(parts) == 3 and parts[0] and parts[1] == "versions" and parts[2].isdigit():
        return parts[0], parts[2]
    return None


class InferFastPath:
    """ASGI middleware answering infer requests itself and passing the rest to ``app``.

    :param app: the Starlette application for every other route.
    :param dataplane: the server's data plane.
    :param max_input_size: the request body cap (``--http-max-input-size``).
    """

    def __init__(self, app: ASGIApp, dataplane: DataPlane, max_input_size: int) -> None:
        self.app = app
        self.dataplane = dataplane
        self.max_input_size = max_input_size

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            target = _route(scope["path"])
            if target is not None:
                await self._infer(scope, receive, send, *target)
                return
        await self.app(scope, receive, send)

    async def _infer(self, scope: Scope, receive: Any, send: Any, name: str, version: str | None) -> None:
        headers: dict[bytes, bytes] = {}
        for key, value in scope["headers"]:
            headers[key] = value
        try:
            model = self.dataplane.model(name, version)
            if model.decoupled:
                await _send(send, 501, error_body(
                    "HTTP end point doesn't support models with decoupled transaction policy"
                ), _JSON_HEADERS)
                return
            body = await self._read(receive, headers)
            if body is None:
                return  # the client went away
            encoding = headers.get(b"content-encoding")
            if encoding:
                body = decode_content(body, encoding.decode("latin-1"), self.max_input_size)
            raw_length = headers.get(b"inference-header-content-length")
            header_length = parse_header_length(
                raw_length.decode("latin-1") if raw_length is not None else None, len(body)
            )
            decode_start = monotonic_ns()
            decoded = decode_infer(body, header_length, model, self.dataplane.shared_memory)
            decode_ns = monotonic_ns() - decode_start
            if self.dataplane.tracing.active:
                parent = headers.get(b"traceparent")
                decoded.request.trace_parent = parent.decode("latin-1") if parent is not None else None
            result = await self._run(model, decoded.request, receive)
            if result is None:
                return
            if isinstance(result, InferError):
                raise result
            encode_start = monotonic_ns()
            content, out_headers = encode_infer(result, decoded, model)
            request = decoded.request
            if request.stats is not None and request.exec_start_ns >= 0:  # not for cache hits
                request.stats.codec(decode_ns, monotonic_ns() - encode_start)
        except InferError as exc:
            await _send(send, HTTP_STATUS[exc.code], error_body(exc.message), _JSON_HEADERS)
            return
        raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in out_headers.items()]
        accept = headers.get(b"accept-encoding")
        if accept:
            content, applied = compress(content, accept.decode("latin-1"))
            if applied:
                raw_headers.append((b"content-encoding", applied.encode("latin-1")))
        await _send(send, 200, content, raw_headers)

    async def _read(self, receive: Any, headers: dict[bytes, bytes]) -> bytes | None:
        limit = self.max_input_size
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                if int(declared) > limit:
                    raise too_large(limit)
            except ValueError:
                raise InferError.invalid("Content-Length must be an integer") from None
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False):
            if len(body) > limit:
                raise too_large(limit)
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
                raise too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _run(self, model: Any, request: Any, receive: Any) -> InferResponse | InferError | None:
        """Schedule the request and wait for it; None if the client disconnected first.

        One watcher task listens for ``http.disconnect`` meanwhile: a disconnect cancels the
        request, so one still queued never reaches execute.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        request.attach_sender(FutureSender(loop, future))
        error = self.dataplane.submit(model, request)
        if error is not None:
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
            self.dataplane.finished(request)


async def _send(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode("latin-1"))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
