"""A lean HTTP/1.1 server for pyserve's HTTP port: ``asyncio.Protocol`` + ``httptools``.

``POST /v2/models/{m}[/versions/{v}]/infer`` of a non-decoupled model is answered natively (a
decoupled model's stream goes to the application like any other route): the body is collected by
the protocol (the ``--http-max-input-size`` cap is enforced from ``Content-Length`` before
anything is buffered, and while a chunked body streams in), then the same steps as the ASGI
fast path (``pyserve.frontends.http.fast_infer``) run without a task: decode → ``dataplane.submit`` →
a done-callback on the response future → encode, and the whole answer (status line, headers
and body) goes out in one ``transport.write``. A body with over a megabyte of JSON is decoded on
a decode thread (``pyserve.frontends.http.offload``) and goes on from a done-callback; while it decodes,
the loop serves the other connections. While more than one connection is open, answers
of small size are queued and written together one loop turn later (``HttpServer.flush_replies``):
replies then leave in bursts, so the clients (and, in turn, their next requests) wake up once
per burst instead of once per reply; on this machine that cut the server's CPU per request by
about a sixth and the load generator's by half at 8–32 connections. A lone connection is
answered at once: nothing would join its burst.

Every other request goes to the Starlette application through a small ASGI bridge
(``http`` scope, ``receive`` delivering body chunks then ``http.disconnect``, ``send``
streaming with chunked transfer encoding when no ``Content-Length`` is given).

Connections support keep-alive, pipelining (requests answered in order), HTTP/1.0,
``Connection: close``, ``Expect: 100-continue`` and chunked request bodies. A malformed
request gets 400 and the connection is closed. The request line plus headers of one request
may take at most ``MAX_HEAD_SIZE`` bytes: past that the request is answered 431 (414 when the
URL alone is most of it) and the connection closed, so an endless header can neither grow the
server's memory nor keep the event loop busy re-joining it. A transfer coding other than
``chunked`` gets 501 and the connection is closed. A request's line and headers must arrive
within ``header_timeout`` seconds of its first byte and its body within ``body_timeout`` seconds
of its headers (``--http-header-timeout-secs``, ``--http-body-timeout-secs``), and no byte may be
more than ``READ_TIMEOUT`` seconds after the one before; otherwise it is answered 408 and the
connection closed. Bytes that begin no request (leading CRLFs) do not keep an idle connection
open. Past ``max_connections`` open TCP connections (``--http-max-connections``) a new one is
answered 503 and closed, and a warning is logged. A client that disconnects while its infer
request waits has the request cancelled, so a queued request never executes. Reading pauses
while the transport's write buffer is full, while too many requests are pipelined, or while
an ASGI handler has not consumed the body already buffered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote

import httptools

from pyserve.api.errors import InferError
from pyserve.dataplane.interface import InferencePlane
from pyserve.frontends import balancer as balancing
from pyserve.frontends import limits
from pyserve.frontends.balancer import ConnectionBalancer
from pyserve.frontends.http import offload
from pyserve.frontends.http.body import too_large
from pyserve.frontends.http.codec import DecodedRequest
from pyserve.frontends.http.errors import error_body
from pyserve.frontends.http.fast_infer import (
    JSON_HEADERS,
    Headers,
    Reply,
    check_declared_length,
    decode_request,
    encode_reply,
    error_reply,
    route,
    submit_request,
)
from pyserve.frontends.restricted import Restriction, Restrictions
from pyserve.runtime.scheduling import client_activity
from pyserve.runtime.versions import ModelVersion

log = logging.getLogger("pyserve.frontends.http")

ASGIApp = Callable[..., Any]

KEEP_ALIVE_TIMEOUT = 5.0
"""Seconds an idle keep-alive connection stays open (uvicorn's default)."""
READ_TIMEOUT = 60.0
"""Seconds a partly received request may go without a byte before it is answered 408 and the
connection closed (a client that stalls mid-request must not hold the connection for ever)."""
HEADER_TIMEOUT = 30.0
"""``--http-header-timeout-secs`` default: a request line and headers must arrive within this."""
BODY_TIMEOUT = 300.0
"""``--http-body-timeout-secs`` default: a request body must arrive within this of its headers."""
MAX_PIPELINED = 16
"""Reading pauses while more requests than this wait on one connection."""
BODY_HIGH_WATER = 1 << 20
"""Reading pauses while an ASGI handler leaves more than this many body bytes unconsumed."""
MAX_HEAD_SIZE = 64 * 1024
"""Bytes the request line plus headers of one request may take (as Triton's HTTP server, and
most servers, allow between 8 and 64 KiB). Counted as bytes arrive; because the count restarts
when a message ends, a request pipelined behind another in the same packet may take up to about
twice this before it is refused."""
_SINGLE_WRITE_LIMIT = 1 << 16
"""Bodies up to this size are joined to the head; larger ones go out with ``writelines``."""

_STATUS_LINES: dict[int, bytes] = {
    int(s): f"HTTP/1.1 {int(s)} {s.phrase}\r\n".encode("latin-1") for s in HTTPStatus
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_JSON_HEADS: dict[int, bytes] = {}
"""Status line + JSON content-type header, by status (``HttpProtocol._write_reply``)."""
_TARGET_CACHE = 1024
"""How many distinct POST URLs ``HttpServer.infer_target`` remembers."""
_NO_BODY_STATUS = frozenset({204, 304})


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else f"HTTP/1.1 {status} \r\n".encode("latin-1")


class _Request:
    """One parsed request on a connection, from its headers until its answer is written."""

    __slots__ = (
        "method", "url", "headers", "http_version", "keep_alive", "expect_continue", "target",
        "chunks", "buffered", "complete", "early", "close_after", "model", "discard_body",
        "started", "waiter", "asgi", "infer_request", "future", "bad", "url_parts",
    )

    def __init__(self) -> None:
        self.method = ""
        self.url = b""
        self.url_parts: list[bytes] | None = None  # a URL arriving in pieces: joined once
        self.headers: list[tuple[bytes, bytes]] = []
        self.http_version = "1.1"
        self.keep_alive = True
        self.expect_continue = False
        self.target: tuple[str, str | None] | None = None  # (model, version) for native infer
        self.chunks: list[bytes] = []
        self.buffered = 0  # body bytes received (native infer) or buffered unconsumed (ASGI)
        self.complete = False  # the whole message has been parsed
        self.early: Reply | None = None  # an answer decided before the body (error, 403)
        self.close_after = False  # the body is not read to its end: close after answering
        self.model: ModelVersion | None = None
        self.discard_body = False
        self.started = False
        self.waiter: asyncio.Future[None] | None = None  # an ASGI receive() waiting for body
        self.asgi: _AsgiCycle | None = None
        self.infer_request: Any = None
        self.future: asyncio.Future[Any] | None = None
        self.bad = False  # a malformed request: answer 400 (or ``early``) and close

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)


class HttpProtocol(asyncio.Protocol):
    """One HTTP/1.1 connection.

    :param server: the server this connection belongs to.
    """

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.activity_key = client_activity.connection_key()
        parser = httptools.HttpRequestParser(self)
        # RFC 9112 §6.3: a request with both Transfer-Encoding and Content-Length is read by its
        # Transfer-Encoding alone (as Triton reads it), and the connection closes after the answer
        # (on_headers_complete), which leaves no room for request smuggling on this connection.
        parser.set_dangerous_leniencies(lenient_chunked_length=True)
        self.parser: httptools.HttpRequestParser | None = parser
        self.in_head = True  # the next bytes belong to a request line or headers
        self.head_room = MAX_HEAD_SIZE  # bytes the current request's head may still take
        self.pipeline: deque[_Request] = deque()
        self.current: _Request | None = None  # the request being parsed
        self.closed = False
        self.ignore_input = False  # after a parse error or a refused body: read no more
        self.reading_paused = False
        self.write_paused = False
        self.drain_waiters: list[asyncio.Future[None]] = []
        # One lazy timer per connection: answering a request only moves ``deadline`` (no timer
        # handle is made or cancelled per request); the timer re-arms itself when it fires early.
        self.deadline: float | None = None  # loop time when ``deadline_action`` runs
        self.deadline_action: Callable[[], None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0  # when ``timer`` fires
        self.phase_started: float | None = None  # when the current request's head (or body) began
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.queued = False  # an answer of this connection waits in ``server.replies``

    # -- connection events --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if self.server.shutting_down:  # accepted while the server stops: nobody would close it later
            self.closed = True
            self.transport.abort()
            return
        refusal = self.server.refusal(transport)
        if refusal is not None:  # over --http-max-connections: a readable answer, then close
            self.closed = True
            self.transport.write(refusal)
            self.transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client = _address(transport.get_extra_info("peername"))
        self.local = _address(transport.get_extra_info("sockname"))
        self.server.connections.add(self)
        self._arm_idle_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.deadline = None
        self.deadline_action = None  # a bound method of this protocol: a reference cycle
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.server.connection_closed(self)
        for request in self.pipeline:
            self._abandon(request)
        self.pipeline.clear()
        # the parser refers back to this protocol: drop it (and a half-parsed request with its
        # headers) now, rather than at the next full garbage collection
        self.parser = None
        self.current = None
        for waiter in self.drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self.drain_waiters.clear()

    def eof_received(self) -> bool | None:
        return None  # close the transport: a half-closed client cannot read pipelined answers

    def pause_writing(self) -> None:
        self.write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        for waiter in self.drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self.drain_waiters.clear()
        self._update_reading()

    def data_received(self, data: bytes) -> None:
        if self.ignore_input or self.closed:
            return
        if self.in_head and len(data) > self.head_room:
            self._receive_past_head_room(data)
        else:
            if self.in_head:
                self.head_room -= len(data)  # reset by on_message_complete when the message ends
            self._feed(data)
        if self.current is not None and not self.closed:
            self._arm_read_timer()
        self._update_reading()

    def _receive_past_head_room(self, data: bytes) -> None:
        """Feed ``data``, which may take the current head past ``MAX_HEAD_SIZE``: only the
        allowed bytes go to the parser; if the head is still not complete, refuse it."""
        while not (self.ignore_input or self.closed):
            if not self.in_head or len(data) <= self.head_room:
                if self.in_head:
                    self.head_room -= len(data)
                self._feed(data)
                return
            room = self.head_room
            self.head_room = 0
            self._feed(data[:room])
            if self.ignore_input or self.closed:
                return
            if self.in_head and self.head_room == 0:  # no message ended: the same head goes on
                self._refuse_head()
                return
            data = data[room:]

    def _refuse_head(self) -> None:
        """The request line plus headers passed ``MAX_HEAD_SIZE``: answer 431 (414 when the
        URL is most of it) after the requests before it, read nothing more, then close."""
        current = self.current
        self.current = None
        url_size = 0
        if current is not None:
            url_size = len(current.url) + sum(map(len, current.url_parts or ()))
        if url_size > MAX_HEAD_SIZE // 2:
            self._refuse(_Request(), 414, f"the request URL exceeds the limit of {MAX_HEAD_SIZE} bytes")
        else:
            self._refuse(_Request(), 431, f"the request line and headers exceed the limit of {MAX_HEAD_SIZE} bytes")

    def _feed(self, data: bytes) -> None:
        """Hand ``data`` to the parser; a malformed or upgrade request ends the reading."""
        parser = self.parser
        if parser is None:
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # no protocol upgrades: the request is answered as a plain one, then the connection closes
            self.ignore_input = True
            for request in self.pipeline:
                request.keep_alive = False
                if not request.complete:
                    request.complete = True
                    request.wake()
            self.current = None
            self._next()
        except httptools.HttpParserError:
            self.ignore_input = True
            current = self.current
            self.current = None
            if current is not None and current in self.pipeline:
                if current.started:  # its handler already runs: a broken body ends the connection
                    self.close()
                    return
                self.pipeline.remove(current)
            bad = _Request()
            bad.bad = True
            bad.complete = True
            self.pipeline.append(bad)
            self._next()

    # -- parser callbacks (httptools) ------------------------------------------------------

    def on_message_begin(self) -> None:
        self.current = None if self.ignore_input else _Request()
        self.phase_started = None

    def on_url(self, url: bytes) -> None:
        request = self.current
        if request is None:
            return
        if request.url_parts is None:
            if not request.url:  # the usual case: the whole URL in one piece
                request.url = url
                return
            request.url_parts = [request.url]
        request.url_parts.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.current is not None:
            self.current.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.phase_started = None
        request = self.current
        parser = self.parser
        if request is None or parser is None:  # after a refused request: what follows is not read
            return
        if request.url_parts is not None:
            request.url = b"".join(request.url_parts)
            request.url_parts = None
        request.method = parser.get_method().decode("ascii")
        request.http_version = parser.get_http_version()
        request.keep_alive = parser.should_keep_alive() and not self.server.shutting_down
        coded = sized = False
        for name, value in request.headers:
            if name == b"expect" and value.lower() == b"100-continue":
                request.expect_continue = True
            elif name == b"transfer-encoding":
                if _unsupported_coding(value):
                    self._refuse_transfer_coding(request, value)
                    return
                coded = True
            elif name == b"content-length":
                sized = True
        if coded and sized:  # read as chunked (the parser ignores the length); then close (RFC 9112)
            request.keep_alive = False
            request.headers = [(n, v) for n, v in request.headers if n != b"content-length"]
        if request.method == "POST":
            request.target = self.server.infer_target(request.url)
        client_activity.request_from(self.activity_key, together=bool(self.pipeline))  # pipelined: not one at a time
        if request.target is not None:
            self._check_infer(request)
        self.pipeline.append(request)
        self._next()

    def _refuse_transfer_coding(self, request: _Request, value: bytes) -> None:
        """Answer 501 (RFC 9112: a transfer coding the server does not implement) after the
        requests before it, read nothing more, then close."""
        coding = value.decode("latin-1").strip()
        request.discard_body = True
        self._refuse(request, 501, f"unsupported transfer coding '{coding}': only 'chunked' is implemented")

    def _refuse(self, request: _Request, status: int, message: str) -> None:
        """Queue ``request`` to be answered ``status`` with ``message`` after the requests
        before it; nothing more is read, and the connection closes after the answer."""
        request.bad = True
        request.complete = True
        request.early = (status, error_body(message), JSON_HEADERS)
        self.ignore_input = True
        self.pipeline.append(request)
        self._next()

    def on_body(self, body: bytes) -> None:
        request = self.current
        if request is None or request.discard_body:
            return
        request.buffered += len(body)
        if request.target is not None:
            limit = self.server.max_input_size
            if request.buffered > limit:  # a chunked body over the cap: refuse, stop reading
                request.early = error_reply(too_large(limit))
                request.discard_body = True
                request.close_after = True
                request.chunks.clear()
                self.ignore_input = True
                request.complete = True
                self._next()
                return
            request.chunks.append(body)
            return
        request.chunks.append(body)
        request.wake()
        if request.buffered > BODY_HIGH_WATER:
            self._update_reading()

    def on_message_complete(self) -> None:
        self.in_head = True
        self.head_room = MAX_HEAD_SIZE
        request = self.current
        self.current = None
        if request is None or request.complete:
            return
        request.complete = True
        request.wake()
        if request.target is not None and self.pipeline and self.pipeline[0] is request:
            self._next()
        if len(self.pipeline) > MAX_PIPELINED:
            self._update_reading()

    # -- request handling ------------------------------------------------------------------

    def _check_infer(self, request: _Request) -> None:
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
        declared = None
        for name, value in request.headers:
            if name == b"content-length":
                declared = value
        try:
            check_declared_length(declared, server.max_input_size)
        except InferError as exc:  # refused before reading: the body stays unread
            request.early = error_reply(exc)
            request.discard_body = True
            request.close_after = True
            request.complete = True
            self.ignore_input = True

    def _next(self) -> None:
        """Start the request at the head of the pipeline if it can start."""
        if not self.pipeline or self.closed:
            return
        request = self.pipeline[0]
        if request.started:
            return
        if request.bad:
            request.started = True
            reply = request.early or (400, error_body("Invalid HTTP request received."), JSON_HEADERS)
            self._write_reply(request, *reply)
            return
        if request.target is None:
            request.started = True
            request.asgi = _AsgiCycle(self, request)
            return
        if request.early is not None and (request.complete or request.close_after or request.expect_continue):
            request.started = True
            if not request.complete:  # the client waits for 100 Continue: answer now, then close
                request.close_after = True
                if request is self.current:
                    self.ignore_input = True
            self._write_reply(request, *request.early)
            return
        if not request.complete:
            if request.expect_continue and request.early is None and self.transport is not None:
                request.expect_continue = False
                self.write(_CONTINUE)
            return
        request.started = True
        self._start_infer(request)

    def _start_infer(self, request: _Request) -> None:
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
        self, request: _Request, body: bytes | bytearray, headers: Headers,
        done: asyncio.Future[tuple[DecodedRequest, int]],
    ) -> None:
        if self.closed or done.cancelled():  # the client left while its body was decoded
            return
        error = done.exception()
        if error is not None:
            self._decode_failed(request, body, error)
            return
        self._decoded(request, headers, *done.result())

    def _decode_failed(self, request: _Request, body: bytes | bytearray, exc: BaseException) -> None:
        """The body of ``request`` could not be decoded: answer why."""
        self._answer_failure(request, exc)

    def _decoded(self, request: _Request, headers: Headers, decoded: DecodedRequest, decode_ns: int) -> None:
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

    def _answer_failure(self, request: _Request, exc: BaseException) -> None:
        """Answer a request that failed before reaching a model: its error, or 500 for a bug."""
        if isinstance(exc, InferError):
            self._write_reply(request, *error_reply(exc))
        else:
            self._write_reply(request, *_internal_error(request, exc))

    def _infer_done(
        self, request: _Request, model: ModelVersion, decoded: DecodedRequest, decode_ns: int,
        headers: Headers, future: asyncio.Future[Any],
    ) -> None:
        decoded.request.release()
        if self.closed or future.cancelled():
            return
        result = future.result()
        if result is None:  # cancelled by a disconnect
            return
        try:
            reply = encode_reply(result, decoded, model, decode_ns, headers.get(b"accept-encoding"))
        except InferError as exc:
            reply = error_reply(exc)
        except Exception as exc:  # noqa: BLE001 - a bug: answer 500, keep serving
            reply = _internal_error(request, exc)
        self._write_reply(request, *reply)

    def _abandon(self, request: _Request) -> None:
        """The connection is gone: cancel what ``request`` is waiting on."""
        future = request.future
        if future is not None and not future.done():
            request.infer_request.cancel()  # a queued request never reaches execute
            future.set_result(None)
        request.wake()
        if request.asgi is not None:
            request.asgi.disconnected()

    def _write_reply(
        self, request: _Request, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """Write a whole answer in one go, then move on to the next request."""
        transport = self.transport
        if transport is None or self.closed:
            return
        keep_alive = request.keep_alive and not request.close_after and not request.bad
        if headers is JSON_HEADERS:  # the usual answer (and every error): a ready-made head
            head = _JSON_HEADS.get(status)
            if head is None:
                head = _JSON_HEADS[status] = _status_line(status) + b"".join(
                    name + b": " + value + b"\r\n" for name, value in JSON_HEADERS)
            parts = [head]
        else:
            parts = [_status_line(status)]
            for name, value in headers:
                parts += (name, b": ", value, b"\r\n")
        parts.append(b"content-length: %d\r\n" % len(body))
        if not keep_alive:
            parts.append(b"connection: close\r\n")
        elif request.http_version == "1.0":
            parts.append(b"connection: keep-alive\r\n")
        parts.append(b"\r\n")
        if len(body) <= _SINGLE_WRITE_LIMIT:
            parts.append(body)
            whole = b"".join(parts)
            if len(self.server.connections) > 1:
                self.server.queue_reply(self, whole)
            else:
                self.write(whole)
        else:
            self.writelines([b"".join(parts), body])
        request.keep_alive = keep_alive
        self.finish(request)

    def write(self, data: bytes) -> None:
        """Write ``data`` now, after any answer of this connection still queued."""
        if self.queued:
            self.server.flush_replies()
        if self.transport is not None:
            self.transport.write(data)

    def writelines(self, parts: list[bytes]) -> None:
        """Write ``parts`` now (large bodies: not joined), after any answer still queued."""
        if self.queued:
            self.server.flush_replies()
        if self.transport is not None:
            self.transport.writelines(parts)

    def finish(self, request: _Request) -> None:
        """``request`` is answered: close, or go on with the next one."""
        if self.pipeline and self.pipeline[0] is request:
            self.pipeline.popleft()
        if self.closed or self.transport is None:
            return
        if not request.keep_alive or self.server.shutting_down and not self.pipeline:
            self.close()
            return
        if self.pipeline:
            self._next()
        elif self.current is None:
            self._arm_idle_timer()
        self._update_reading()

    def close(self) -> None:
        """Close the connection once what was written (or queued) is flushed."""
        if self.queued:
            self.server.flush_replies()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def shutdown(self) -> None:
        """The server stops: close now if idle, else after the answer in progress."""
        for request in self.pipeline:
            request.keep_alive = False
        if not self.pipeline and self.current is None:
            self.close()

    # -- flow control ----------------------------------------------------------------------

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None or self.closed:
            return
        backlog = False
        for request in self.pipeline:
            if request.asgi is not None and request.buffered > BODY_HIGH_WATER:
                backlog = True
        current = self.current
        if current is not None and current.target is None and current.buffered > BODY_HIGH_WATER:
            backlog = True
        pause = self.write_paused or backlog or len(self.pipeline) > MAX_PIPELINED
        if pause and not self.reading_paused:
            self.reading_paused = True
            transport.pause_reading()
        elif not pause and self.reading_paused:
            self.reading_paused = False
            transport.resume_reading()

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark."""
        if self.write_paused and not self.closed:
            waiter: asyncio.Future[None] = self.loop.create_future()
            self.drain_waiters.append(waiter)
            await waiter

    def body_consumed(self) -> None:
        """An ASGI handler took buffered body bytes: reading may resume."""
        if self.reading_paused:
            self._update_reading()

    # -- keep-alive timeout ----------------------------------------------------------------

    def _set_deadline(self, delay: float, action: Callable[[], None]) -> None:
        """Run ``action`` after ``delay`` seconds unless input arrives first."""
        loop = self.loop
        deadline = loop.time() + delay
        self.deadline = deadline
        self.deadline_action = action
        timer = self.timer
        if timer is None or self.timer_at > deadline:
            if timer is not None:
                timer.cancel()
            self.timer_at = deadline
            self.timer = loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        deadline = self.deadline
        if deadline is None or self.closed:
            return
        if self.loop.time() < deadline:  # the deadline moved on since the timer was set
            self.timer_at = deadline
            self.timer = self.loop.call_at(deadline, self._on_timer)
            return
        action = self.deadline_action
        self.deadline = None
        if action is not None:
            action()

    def _arm_idle_timer(self) -> None:
        self._set_deadline(KEEP_ALIVE_TIMEOUT, self._idle_timeout)

    def _idle_timeout(self) -> None:
        if not self.pipeline and self.current is None:
            self.close()

    def _arm_read_timer(self) -> None:
        """A request is partly received: it must go on within ``READ_TIMEOUT`` and its head (or
        body) end within the server's total limit for it, counted from when it began."""
        now = self.loop.time()
        if self.phase_started is None:  # set here, not per request: most arrive in one read
            self.phase_started = now
        limit = self.server.header_timeout if self.in_head else self.server.body_timeout
        self._set_deadline(max(min(READ_TIMEOUT, self.phase_started + limit - now), 0.0), self._read_timeout)

    def _read_timeout(self) -> None:
        """A request stopped arriving half-way, or took too long in all: answer 408 (when
        nothing else is being answered on the connection) and close."""
        if self.closed or self.current is None:
            return
        if self.reading_paused:  # we stopped reading, not the client: wait on
            self.phase_started = None
            self._arm_read_timer()
            return
        self.ignore_input = True
        transport = self.transport
        if transport is not None and not any(r.started for r in self.pipeline):
            part, limit = ("headers", self.server.header_timeout) if self.in_head else ("body", self.server.body_timeout)
            body = error_body(f"the request {part} did not arrive in time ({limit:g} s in all, "
                              f"at most {READ_TIMEOUT:g} s between bytes)")
            self.write(
                _status_line(408) + b"content-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % len(body) + body
            )
        self.close()


class _AsgiCycle:
    """One request handed to the ASGI application.

    :param protocol: the connection.
    :param request: the parsed request (its body may still be arriving).
    """

    __slots__ = (
        "protocol", "request", "status", "response_headers", "response_started", "head_written",
        "chunked", "response_complete", "body_done", "disconnect_waiter", "is_disconnected", "task",
        "no_body",
    )

    def __init__(self, protocol: HttpProtocol, request: _Request) -> None:
        self.protocol = protocol
        self.request = request
        self.status = 200
        self.response_headers: list[tuple[bytes, bytes]] = []
        self.response_started = False
        self.head_written = False
        self.chunked = False
        self.response_complete = False
        self.body_done = False  # the last body chunk was handed to the application
        self.disconnect_waiter: asyncio.Future[None] | None = None
        self.is_disconnected = False
        self.no_body = request.method == "HEAD"
        self.task = protocol.loop.create_task(self.run())

    def scope(self) -> dict[str, Any]:
        request = self.request
        raw_path, _, query = request.url.partition(b"?")
        path = raw_path.decode("ascii", "surrogateescape")
        if "%" in path:
            path = unquote(path)
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version,
            "server": self.protocol.local,
            "client": self.protocol.client,
            "scheme": "http",
            "method": request.method,
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "headers": request.headers,
            "state": {},
        }

    async def run(self) -> None:
        protocol = self.protocol
        try:
            await protocol.server.app(self.scope(), self.receive, self.send)
        except asyncio.CancelledError:
            protocol.close()
            raise
        except Exception:  # noqa: BLE001 - an application bug: 500 if still possible
            log.exception("exception in the ASGI application on %s %s", self.request.method, self.request.url)
            self.fail()
        else:
            if not self.response_complete and not self.is_disconnected:  # a gone client gets nothing
                if self.response_started:
                    log.error("ASGI application returned before completing its response")
                else:
                    log.error("ASGI application returned without starting a response")
                self.fail()
        finally:
            self.request.asgi = None
            if self.response_complete and not protocol.closed:
                if not self.request.complete:  # the body was not read to its end
                    self.request.keep_alive = False
                    protocol.ignore_input = True
                protocol.finish(self.request)

    def fail(self) -> None:
        if self.head_written or self.protocol.closed:
            self.protocol.close()
            return
        self.response_headers = [(b"content-type", b"text/plain; charset=utf-8")]
        self.status = 500
        self.response_started = True
        self.request.keep_alive = False
        self._write(b"Internal Server Error", more=False)

    def disconnected(self) -> None:
        self.is_disconnected = True
        self._wake_disconnect()

    def _wake_disconnect(self) -> None:
        waiter = self.disconnect_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def receive(self) -> dict[str, Any]:
        """The next body chunk, then ``http.disconnect`` once the response is done or the
        client has gone."""
        request = self.request
        protocol = self.protocol
        if self.is_disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        if not self.body_done:
            if not request.chunks and not request.complete:
                if request.expect_continue and protocol.transport is not None and not self.head_written:
                    request.expect_continue = False
                    protocol.write(_CONTINUE)
                waiter: asyncio.Future[None] = protocol.loop.create_future()
                request.waiter = waiter
                await waiter
                if self.is_disconnected:
                    return {"type": "http.disconnect"}
            body = request.chunks[0] if len(request.chunks) == 1 else b"".join(request.chunks)
            request.chunks = []
            request.buffered = 0
            protocol.body_consumed()
            more = not request.complete
            if not more:
                self.body_done = True
            return {"type": "http.request", "body": body, "more_body": more}
        if self.disconnect_waiter is None:  # shared by every receive() waiting for the end
            self.disconnect_waiter = protocol.loop.create_future()
        await asyncio.shield(self.disconnect_waiter)
        return {"type": "http.disconnect"}

    async def send(self, message: Mapping[str, Any]) -> None:
        """``http.response.start`` / ``http.response.body`` (streamed while ``more_body``)."""
        kind = message["type"]
        if self.is_disconnected:
            return
        if kind == "http.response.start":
            if self.response_started:
                raise RuntimeError("http.response.start sent twice")
            self.status = int(message["status"])
            self.response_headers = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", ())]
            self.response_started = True
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message type '{kind}'")
        if not self.response_started:
            raise RuntimeError("http.response.body sent before http.response.start")
        if self.response_complete:
            raise RuntimeError("http.response.body sent after the response was complete")
        self._write(bytes(message.get("body", b"")), more=bool(message.get("more_body", False)))
        if self.response_complete:
            self._wake_disconnect()
        else:
            await self.protocol.drain()

    def _write(self, body: bytes, more: bool) -> None:
        protocol = self.protocol
        transport = protocol.transport
        if transport is None or protocol.closed:
            return
        request = self.request
        no_body = self.no_body or self.status in _NO_BODY_STATUS or 100 <= self.status < 200
        out: list[bytes] = []
        if not self.head_written:
            self.head_written = True
            out.append(_status_line(self.status))
            has_length = False
            for name, value in self.response_headers:
                if name == b"content-length":
                    has_length = True
                elif name == b"transfer-encoding":
                    has_length = True  # the application frames the body itself
                elif name == b"connection" and value.lower() == b"close":
                    request.keep_alive = False
                out += (name, b": ", value, b"\r\n")
            if not has_length and not no_body:
                if not more:
                    out.append(b"content-length: %d\r\n" % len(body))
                elif request.http_version == "1.1":
                    out.append(b"transfer-encoding: chunked\r\n")
                    self.chunked = True
                else:
                    request.keep_alive = False  # HTTP/1.0: the body ends with the connection
            if not request.complete and not more:
                request.keep_alive = False  # the body was not read: the connection cannot be reused
            if request.keep_alive and protocol.server.shutting_down:
                request.keep_alive = False
            if not request.keep_alive:
                out.append(b"connection: close\r\n")
            elif request.http_version == "1.0":
                out.append(b"connection: keep-alive\r\n")
            out.append(b"\r\n")
        if not no_body:
            if self.chunked:
                if body:
                    out += (b"%x\r\n" % len(body), body, b"\r\n")
                if not more:
                    out.append(b"0\r\n\r\n")
            elif body:
                out.append(body)
        if out:
            if sum(len(part) for part in out) <= _SINGLE_WRITE_LIMIT:
                protocol.write(b"".join(out))
            else:
                protocol.writelines(out)
        if not more:
            self.response_complete = True


class HttpServer:
    """pyserve's HTTP/1.1 server.

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
        self.app = app
        self.max_connections = limits.connection_limit(max_connections)
        self.header_timeout = header_timeout if header_timeout > 0 else float("inf")
        self.body_timeout = body_timeout if body_timeout > 0 else float("inf")
        self._refusals = limits.RefusalLog(log, "HTTP service (--http-max-connections)")
        self.dataplane = dataplane
        self.max_input_size = max_input_size
        self.inference_rule: Restriction | None = (restrictions or {}).get("inference")
        self.connections: set[HttpProtocol] = set()
        self.shutting_down = False
        self.infer_targets: dict[bytes, tuple[str, str | None] | None] = {}
        """POST URL → ``(model, version)`` for native infer, or None; see ``infer_target``."""
        self._server: Any = None  # asyncio.Server, or the balancer's BalancedListener
        self._all_closed: asyncio.Event | None = None
        self.on_connection_closed: Callable[[], None] | None = None
        """Called after a connection closes (a frontend reports its count to the owner's balancer)."""
        self.replies: list[tuple[HttpProtocol, bytes]] = []
        """Answers waiting for ``flush_replies`` (in the order they were made)."""

    protocol_class: type[HttpProtocol] = HttpProtocol
    """The connection class (a frontend process answers infer requests its own way)."""

    def queue_reply(self, connection: HttpProtocol, data: bytes) -> None:
        """Queue a whole answer; the first one queued in a loop turn schedules the flush."""
        if not self.replies:
            connection.loop.call_soon(self.flush_replies)
        self.replies.append((connection, data))
        connection.queued = True

    def flush_replies(self) -> None:
        """Write every queued answer (connections closed since are skipped). Also called
        early by a connection about to write something else, so its bytes stay in order."""
        replies, self.replies = self.replies, []
        for connection, data in replies:
            connection.queued = False
            transport = connection.transport
            if transport is not None and not connection.closed and not transport.is_closing():
                transport.write(data)

    def refusal(self, transport: asyncio.BaseTransport) -> bytes | None:
        """The 503 answer for a new TCP connection past ``max_connections``, or None to serve it
        (a frontend's relay connections on the Unix socket are never refused)."""
        if len(self.connections) < self.max_connections:
            return None
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:
            return None
        self._refusals.refused(self.max_connections)
        body = error_body(f"the server has reached its limit of {self.max_connections} connections "
                          "(--http-max-connections); try again later")
        return (_status_line(503) + b"content-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % len(body) + body)

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

    async def start(self, sock: socket.socket, balancer: ConnectionBalancer | None = None) -> None:
        """Listen on an already bound socket (TCP, or a Unix socket for frontend processes).

        :param balancer: the owner's connection balancer (``--frontend-balance connections``):
            it accepts on ``sock`` and serves here only the connections it keeps.
        """
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        factory = self.protocol_class
        if balancer is not None:
            self._server = balancer.listen(sock, balancing.HTTP, self.adopt, lambda: len(self.connections))
        elif sock.family == socket.AF_UNIX:
            self._server = await loop.create_unix_server(lambda: factory(self), sock=sock, backlog=2048)
        else:
            self._server = await loop.create_server(lambda: factory(self), sock=sock, backlog=2048)

    async def adopt(self, sock: socket.socket) -> None:
        """Serve a connection accepted elsewhere (non-blocking; handed over by the balancer)."""
        factory = self.protocol_class
        await asyncio.get_running_loop().connect_accepted_socket(lambda: factory(self), sock)

    @property
    def port(self) -> int:
        """The port listened on (TCP only)."""
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    def connection_closed(self, connection: HttpProtocol) -> None:
        self.connections.discard(connection)
        if not self.connections and self._all_closed is not None:
            self._all_closed.set()
        if self.on_connection_closed is not None:
            self.on_connection_closed()

    async def shutdown(self, timeout: float) -> None:
        """Stop listening, close idle keep-alive connections, let the answers in progress
        finish for up to ``timeout`` seconds, then close whatever is left."""
        self.shutting_down = True
        if self._server is not None:
            self._server.close()
        self._all_closed = asyncio.Event()
        for connection in list(self.connections):
            connection.shutdown()
        if self.connections:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._all_closed.wait(), max(timeout, 0.0))
        for connection in list(self.connections):
            for request in connection.pipeline:
                if request.asgi is not None:
                    request.asgi.task.cancel()
            if connection.transport is not None:
                connection.transport.abort()
        await asyncio.sleep(0)  # let connection_lost run


class AppServer(HttpServer):
    """pyserve's HTTP/1.1 server for an ASGI application alone: no native infer route, no data
    plane (the metrics port). Same threading and shutdown as ``HttpServer``."""

    def __init__(self, app: ASGIApp, *, max_input_size: int) -> None:
        super().__init__(app, cast(InferencePlane, None), max_input_size=max_input_size)

    def infer_target(self, url: bytes) -> tuple[str, str | None] | None:
        """Never native infer: every request goes to the application."""
        return None


def _unsupported_coding(value: bytes) -> bool:
    """Whether a ``Transfer-Encoding`` value names a coding other than ``chunked``."""
    return any(coding.strip().lower() != b"chunked" for coding in value.split(b","))


def _address(value: Any) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return str(value[0]), int(value[1])
    return None


def _has_header(headers: list[tuple[bytes, bytes]], rule: Restriction) -> bool:
    key = rule.key.encode("latin-1")
    value = rule.value.encode("latin-1")
    return any(k == key and v == value for k, v in headers)


def _internal_error(request: _Request, exc: BaseException) -> Reply:
    log.exception("unhandled error on %s %s", request.method, request.url.decode("latin-1"), exc_info=exc)
    return 500, error_body(f"internal server error: {type(exc).__name__}: {exc}"), JSON_HEADERS
