"""One connection of pyserve's HTTP/1.1 server: an ``asyncio.Protocol`` driving ``httptools``.

The engine alone: parsing, pipelining, writing, keep-alive, timeouts and limits; it knows
nothing of models. Each request is answered by the ASGI application (``pyserve.frontends.http.
asgi_bridge``) unless the server names it a native target (``HttpServer.infer_target``): then a
subclass answers it through the ``_check_infer`` / ``_start_infer`` hooks
(``pyserve.frontends.http.native_infer``), writing its whole answer with ``_write_reply``.

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
open. A native request's body is capped at the server's ``max_input_size`` while it streams in.
Reading pauses while the transport's write buffer is full, while too many requests are
pipelined, or while an ASGI handler has not consumed the body already buffered.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import httptools

from pyserve.frontends.http.asgi_bridge import AsgiCycle
from pyserve.frontends.http.body import too_large
from pyserve.frontends.http.errors import JSON_HEADERS, error_body, error_reply
from pyserve.frontends.http.parsed_request import ParsedRequest
from pyserve.frontends.http.wire import (
    CONTINUE,
    JSON_HEADS,
    SINGLE_WRITE_LIMIT,
    WRITE_PIECE,
    BodyParts,
    status_line,
)
from pyserve.runtime.scheduling import client_activity

if TYPE_CHECKING:
    from pyserve.frontends.http.server import HttpServer

KEEP_ALIVE_TIMEOUT: float | None = None
"""Seconds an idle keep-alive connection stays open; None: until the client closes it, as
Triton's HTTP server keeps it. A client reusing a pooled connection the server closed while it
was idle has its request fail mid-send when the body is large (a multi-GB request from
tritonclient after a pause), so idle connections are closed only when the server needs their
room: past ``--http-max-connections`` the longest idle one gives way (``HttpServer.refusal``)."""
READ_TIMEOUT = 60.0
"""Seconds a partly received request may go without a byte before it is answered 408 and the
connection closed (a client that stalls mid-request must not hold the connection for ever)."""
MAX_PIPELINED = 16
"""Reading pauses while more requests than this wait on one connection."""
BODY_HIGH_WATER = 1 << 20
"""Reading pauses while an ASGI handler leaves more than this many body bytes unconsumed."""
MAX_HEAD_SIZE = 64 * 1024
"""Bytes the request line plus headers of one request may take (as Triton's HTTP server, and
most servers, allow between 8 and 64 KiB). Counted as bytes arrive; because the count restarts
when a message ends, a request pipelined behind another in the same packet may take up to about
twice this before it is refused."""


class HttpProtocol(asyncio.Protocol):
    """One HTTP/1.1 connection; every request goes to the server's ASGI application unless a
    subclass answers it natively (the ``_check_infer`` / ``_start_infer`` hooks).

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
        self.pipeline: deque[ParsedRequest] = deque()
        self.current: ParsedRequest | None = None  # the request being parsed
        self.closed = False
        self.ignore_input = False  # after a parse error or a refused body: read no more
        self.reading_paused = False
        self.write_paused = False
        self.drain_waiters: list[asyncio.Future[None]] = []
        # a large body still to write, in order, piece by piece as the transport takes it
        # (None: nothing waits); what is written meanwhile goes behind it
        self.outgoing: deque[memoryview] | None = None
        self.close_when_written = False  # close() came while ``outgoing`` was still writing
        # One lazy timer per connection: answering a request only moves ``deadline`` (no timer
        # handle is made or cancelled per request); the timer re-arms itself when it fires early.
        self.deadline: float | None = None  # loop time when ``deadline_action`` runs
        self.idle_since: float | None = None  # loop time when it last fell idle; None: busy
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
        self.outgoing = None
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
        if self.outgoing is not None:
            self._write_outgoing()
            if self.outgoing is not None:  # paused again: drain waiters go on waiting
                return
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
            self._refuse(ParsedRequest(), 414, f"the request URL exceeds the limit of {MAX_HEAD_SIZE} bytes")
        else:
            self._refuse(ParsedRequest(), 431, f"the request line and headers exceed the limit of {MAX_HEAD_SIZE} bytes")

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
            bad = ParsedRequest()
            bad.bad = True
            bad.complete = True
            self.pipeline.append(bad)
            self._next()

    # -- parser callbacks (httptools) ------------------------------------------------------

    def on_message_begin(self) -> None:
        self.current = None if self.ignore_input else ParsedRequest()
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

    def _refuse_transfer_coding(self, request: ParsedRequest, value: bytes) -> None:
        """Answer 501 (RFC 9112: a transfer coding the server does not implement) after the
        requests before it, read nothing more, then close."""
        coding = value.decode("latin-1").strip()
        request.discard_body = True
        self._refuse(request, 501, f"unsupported transfer coding '{coding}': only 'chunked' is implemented")

    def _refuse(self, request: ParsedRequest, status: int, message: str) -> None:
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
            limit = request.body_limit or self.server.max_input_size
            if request.buffered > limit:  # a chunked body over the cap: refuse, stop reading
                request.early = error_reply(too_large(limit, self.server.max_input_size))
                request.discard_body = True
                request.close_after = True
                request.chunks.clear()
                self.ignore_input = True
                request.complete = True
                self._next()
                return
            chunks = request.chunks
            if not chunks:
                chunks.append(body)  # the usual case: the whole body in one piece, used as it is
            elif type(chunks[0]) is bytes:  # a second piece: from here on one growing buffer, not
                joined = bytearray(chunks[0])  # a list joined at the end (which held the body twice)
                joined += body
                chunks[0] = joined
            else:
                chunks[0] += body  # grows in place (realloc), each byte copied once
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

    def _check_infer(self, request: ParsedRequest) -> None:
        """Decide at header time how a native request (``request.target`` set) is answered: set
        ``request.early`` to answer before the body, or clear ``request.target`` to hand it to
        the application. Only called when the server names native targets."""
        raise NotImplementedError

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
            request.asgi = AsgiCycle(self, request)
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
                self.write(CONTINUE)
            return
        request.started = True
        self._start_infer(request)

    def _start_infer(self, request: ParsedRequest) -> None:
        """Answer a native request whose body is complete (``_write_reply`` when done). Only
        called when the server names native targets."""
        raise NotImplementedError

    def _abandon(self, request: ParsedRequest) -> None:
        """The connection is gone: stop what ``request`` is waiting on."""
        request.wake()
        if request.asgi is not None:
            request.asgi.disconnected()

    def _write_reply(
        self, request: ParsedRequest, status: int, body: bytes | BodyParts, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """Write a whole answer in one go, then move on to the next request."""
        transport = self.transport
        if transport is None or self.closed:
            return
        keep_alive = request.keep_alive and not request.close_after and not request.bad
        if headers is JSON_HEADERS:  # the usual answer (and every error): a ready-made head
            head = JSON_HEADS.get(status)
            if head is None:
                head = JSON_HEADS[status] = status_line(status) + b"".join(
                    name + b": " + value + b"\r\n" for name, value in JSON_HEADERS)
            parts = [head]
        else:
            parts = [status_line(status)]
            for name, value in headers:
                parts += (name, b": ", value, b"\r\n")
        parts.append(b"content-length: %d\r\n" % len(body))
        if not keep_alive:
            parts.append(b"connection: close\r\n")
        elif request.http_version == "1.0":
            parts.append(b"connection: keep-alive\r\n")
        parts.append(b"\r\n")
        if isinstance(body, BodyParts):  # a JSON header and large binary tensors: never joined
            self.writelines([b"".join(parts), *body.buffers])
        elif len(body) <= SINGLE_WRITE_LIMIT:
            parts.append(body)
            whole = b"".join(parts)
            if len(self.server.connections) > 1 and self.outgoing is None:
                self.server.queue_reply(self, whole)
            else:
                self.write(whole)
        else:
            self.writelines([b"".join(parts), body])
        request.keep_alive = keep_alive
        self.finish(request)

    def write(self, data: bytes) -> None:
        """Write ``data`` now, after any answer of this connection still queued or writing."""
        if self.queued:
            self.server.flush_replies()
        if self.outgoing is not None:
            self.outgoing.append(memoryview(data))
        elif self.transport is not None:
            self.transport.write(data)

    def writelines(self, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        """Write ``parts`` in order, after any answer still queued or writing. Large parts are
        neither joined nor copied into the transport's buffer: they go out in pieces of
        ``WRITE_PIECE`` bytes while the transport takes them (``pause_writing`` stops, and
        ``resume_writing`` goes on), so a 1 GiB tensor is never held twice."""
        if self.queued:
            self.server.flush_replies()
        transport = self.transport
        if transport is None or self.closed:
            return
        outgoing = self.outgoing
        for part in parts:
            if outgoing is None and (part.nbytes if isinstance(part, memoryview) else len(part)) <= WRITE_PIECE:
                transport.write(part)
                continue
            if outgoing is None:
                outgoing = self.outgoing = deque()
            view = memoryview(part)
            outgoing.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
        if outgoing is not None and not self.write_paused:
            self._write_outgoing()

    def _write_outgoing(self) -> None:
        """Hand ``outgoing`` to the transport a piece at a time until it pauses or all is out."""
        outgoing = self.outgoing
        transport = self.transport
        if outgoing is None:
            return
        if transport is None or self.closed or transport.is_closing():
            self.outgoing = None
            return
        while outgoing and not self.write_paused:
            view = outgoing[0]
            if len(view) <= WRITE_PIECE:
                outgoing.popleft()
                transport.write(view)
            else:
                outgoing[0] = view[WRITE_PIECE:]
                transport.write(view[:WRITE_PIECE])
        if not outgoing:
            self.outgoing = None
            if self.close_when_written:
                transport.close()

    def finish(self, request: ParsedRequest) -> None:
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
        if self.outgoing is not None:  # a large body is still going out: close after it
            self.close_when_written = True
            return
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
        self.idle_since = self.loop.time()
        if KEEP_ALIVE_TIMEOUT is None:
            self.deadline = None  # no deadline while idle (a timer still set finds none)
        else:
            self._set_deadline(KEEP_ALIVE_TIMEOUT, self._idle_timeout)

    @property
    def idle(self) -> bool:
        """Open, between requests (nothing received of the next one)."""
        return not self.closed and not self.pipeline and self.current is None and self.idle_since is not None

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
                status_line(408) + b"content-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % len(body) + body
            )
        self.close()


def _unsupported_coding(value: bytes) -> bool:
    """Whether a ``Transfer-Encoding`` value names a coding other than ``chunked``."""
    return any(coding.strip().lower() != b"chunked" for coding in value.split(b","))


def _address(value: Any) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return str(value[0]), int(value[1])
    return None
