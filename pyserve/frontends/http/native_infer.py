"""Native infer on pyserve's HTTP/1.1 server: the part of the HTTP port wired to the data plane.

``POST /v2/models/{m}[/versions/{v}]/infer`` of a non-decoupled model is answered by the
connection itself (a decoupled model's stream goes to the application like any other route):
the body is collected by the protocol (the ``--http-max-input-size`` cap is enforced from
``Content-Length`` before anything is buffered, and while a chunked body streams in), then the
same steps as the ASGI fast path (``pyserve.frontends.http.fast_infer``) run without a task:
decode → ``dataplane.submit`` → a done-callback on the response future → encode, and the whole
answer (status line, headers and body) goes out in one ``transport.write``. A body with over a
megabyte of JSON is decoded on a decode thread (``pyserve.frontends.http.offload``) and goes on
from a done-callback; while it decodes, the loop serves the other connections. A client that
disconnects while its infer request waits has the request cancelled, so a queued request never
executes. The ``inference`` rule of ``--http-restricted-api`` is checked here for native infer.

``InferHttpServer`` is the engine's ``HttpServer`` (``pyserve.frontends.http.server``) naming
these URLs as native targets; ``InferHttpProtocol`` is its connection, answering them through
the engine's hooks.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pyserve.api.errors import InferError
from pyserve.dataplane.interface import InferencePlane
from pyserve.frontends.http import offload
from pyserve.frontends.http.codec import DecodedRequest
from pyserve.frontends.http.connection import HttpProtocol
from pyserve.frontends.http.errors import JSON_HEADERS, Reply, error_body, error_reply
from pyserve.frontends.http.fast_infer import (
    Headers,
    declared_infer_body,
    decode_request,
    encode_reply_parts,
    route,
    submit_request,
)
from pyserve.frontends.http.parsed_request import ParsedRequest
from pyserve.frontends.http.server import BODY_TIMEOUT, HEADER_TIMEOUT, ASGIApp, HttpServer
from pyserve.frontends.restricted import Restriction, Restrictions
from pyserve.runtime.versions import ModelVersion

log = logging.getLogger("pyserve.frontends.http")

_TARGET_CACHE = 1024
"""How many distinct POST URLs ``InferHttpServer.infer_target`` remembers."""


class InferHttpProtocol(HttpProtocol):
    """An HTTP/1.1 connection answering native infer requests itself.

    :param server: the server this connection belongs to.
    """

    server: InferHttpServer

    def _check_infer(self, request: ParsedRequest) -> None:
        """Decide at header time what the ASGI path would answer before reading the body."""
        server = self.server
        rule = server.inference_rule
        if rule is not None and not _has_header(request.headers, rule):
            request.early = (403, error_body(rule.message), JSON_HEADERS)
            request.discard_body = True
            return
        try:
            model = server.dataplane.model(*request.target)  # type: ignore[misc]
        except InferError as exc:
            request.early = error_reply(exc)
            request.discard_body = True
            return
        if model.decoupled:  # its answer streams: the application serves it (pyserve.frontends.http.infer_stream)
            request.target = None
            return
        request.model = model
        try:
            request.body_limit = declared_infer_body(request.headers, server.max_input_size)
        except InferError as exc:  # refused before reading: the body stays unread
            request.early = error_reply(exc)
            request.discard_body = True
            request.close_after = True
            request.complete = True
            self.ignore_input = True

    def _start_infer(self, request: ParsedRequest) -> None:
        """Decode the body of ``request`` (on a decode thread when it is large,
        ``pyserve.frontends.http.offload``), then go on with ``_decoded`` (or ``_decode_failed``)."""
        # a body of several chunks is joined into a bytearray (the same one copy): the tensors
        # decoded from it are writeable views, which a model may change in place without a copy
        body = request.chunks[0] if len(request.chunks) == 1 else bytearray().join(request.chunks)
        request.chunks = []
        headers: Headers = dict(request.headers)
        server = self.server
        model = request.model
        assert model is not None
        if len(body) > offload.OFFLOAD_COMPRESSED_BYTES and offload.off_loop(len(body), headers):
            offload.run(self.loop, lambda: decode_request(
                server.dataplane, model, body, headers, server.max_input_size,
            )).add_done_callback(lambda done: self._decoded_off_loop(request, body, headers, done))
            return
        try:
            decoded, decode_ns = decode_request(server.dataplane, model, body, headers, server.max_input_size)
        except Exception as exc:  # noqa: BLE001 - InferError, or a bug: answered, the server goes on
            self._decode_failed(request, body, exc)
            return
        self._decoded(request, headers, decoded, decode_ns)

    def _decoded_off_loop(
        self, request: ParsedRequest, body: bytes | bytearray, headers: Headers,
        done: asyncio.Future[tuple[DecodedRequest, int]],
    ) -> None:
        if self.closed or done.cancelled():  # the client left while its body was decoded
            return
        error = done.exception()
        if error is not None:
            self._decode_failed(request, body, error)
            return
        self._decoded(request, headers, *done.result())

    def _decode_failed(self, request: ParsedRequest, body: bytes | bytearray, exc: BaseException) -> None:
        """The body of ``request`` could not be decoded: answer why."""
        self._answer_failure(request, exc)

    def _decoded(self, request: ParsedRequest, headers: Headers, decoded: DecodedRequest, decode_ns: int) -> None:
        """Submit a decoded request to its model; its answer is written when it is done."""
        server = self.server
        model = request.model
        assert model is not None
        try:
            future = submit_request(server.dataplane, model, decoded.request, self.loop)
        except Exception as exc:  # noqa: BLE001 - InferError, or a bug: answered, the server goes on
            self._answer_failure(request, exc)
            return
        request.infer_request = decoded.request
        request.future = future
        if future.done():  # answered during submit (an inline model, a cache hit): no extra loop turn
            self._infer_done(request, model, decoded, decode_ns, headers, future)
            return
        future.add_done_callback(
            lambda done: self._infer_done(request, model, decoded, decode_ns, headers, done)
        )

    def _answer_failure(self, request: ParsedRequest, exc: BaseException) -> None:
        """Answer a request that failed before reaching a model: its error, or 500 for a bug."""
        if isinstance(exc, InferError):
            self._write_reply(request, *error_reply(exc))
        else:
            self._write_reply(request, *_internal_error(request, exc))

    def _infer_done(
        self, request: ParsedRequest, model: ModelVersion, decoded: DecodedRequest, decode_ns: int,
        headers: Headers, future: asyncio.Future[Any],
    ) -> None:
        decoded.request.release()
        if self.closed or future.cancelled():
            return
        result = future.result()
        if result is None:  # cancelled by a disconnect
            return
        try:
            reply = encode_reply_parts(result, decoded, model, decode_ns, headers.get(b"accept-encoding"))
        except InferError as exc:
            reply = error_reply(exc)
        except Exception as exc:  # noqa: BLE001 - a bug: answer 500, keep serving
            reply = _internal_error(request, exc)
        self._write_reply(request, *reply)

    def _abandon(self, request: ParsedRequest) -> None:
        """The connection is gone: cancel what ``request`` is waiting on."""
        future = request.future
        if future is not None and not future.done():
            request.infer_request.cancel()  # a queued request never reaches execute
            future.set_result(None)
        super()._abandon(request)


class InferHttpServer(HttpServer):
    """pyserve's HTTP/1.1 server for the HTTP port: native infer, every other request to ``app``.

    :param app: the ASGI application for every request but native infer.
    :param dataplane: the server's data plane.
    :param max_input_size: the request body cap (``--http-max-input-size``).
    :param restrictions: ``--http-restricted-api`` rules (the ``inference`` one is checked here
        for native infer; ``app`` enforces the others).
    :param max_connections: open TCP connections past which new ones are refused with 503
        (``--http-max-connections``; 0: the default of ``pyserve.frontends.limits.connection_limit``).
    :param header_timeout: seconds a request's line and headers may take in all.
    :param body_timeout: seconds a request's body may take in all, from the end of its headers.
    """

    protocol_class: type[HttpProtocol] = InferHttpProtocol

    def __init__(
        self,
        app: ASGIApp,
        dataplane: InferencePlane,
        *,
        max_input_size: int,
        restrictions: Restrictions | None = None,
        max_connections: int = 0,
        header_timeout: float = HEADER_TIMEOUT,
        body_timeout: float = BODY_TIMEOUT,
    ) -> None:
        super().__init__(
            app, max_input_size=max_input_size, max_connections=max_connections,
            header_timeout=header_timeout, body_timeout=body_timeout,
        )
        self.dataplane = dataplane
        self.inference_rule: Restriction | None = (restrictions or {}).get("inference")
        self.infer_targets: dict[bytes, tuple[str, str | None] | None] = {}
        """POST URL → ``(model, version)`` for native infer, or None; see ``infer_target``."""

    def infer_target(self, url: bytes) -> tuple[str, str | None] | None:
        """``(model, version)`` when a POST to ``url`` is a native infer request, else None.

        Remembered per URL (clients repeat a handful of URLs): up to ``_TARGET_CACHE`` URLs of
        at most 256 bytes.
        """
        targets = self.infer_targets
        if url in targets:
            return targets[url]
        path = url.partition(b"?")[0]
        # percent-encoded infer paths take the ASGI route
        target = None if b"%" in path else route(path.decode("latin-1"))
        if len(targets) < _TARGET_CACHE and len(url) <= 256:
            targets[url] = target
        return target


def _has_header(headers: list[tuple[bytes, bytes]], rule: Restriction) -> bool:
    key = rule.key.encode("latin-1")
    value = rule.value.encode("latin-1")
    return any(k == key and v == value for k, v in headers)


def _internal_error(request: ParsedRequest, exc: BaseException) -> Reply:
    log.exception("unhandled error on %s %s", request.method, request.url.decode("latin-1"), exc_info=exc)
    return 500, error_body(f"internal server error: {type(exc).__name__}: {exc}"), JSON_HEADERS
