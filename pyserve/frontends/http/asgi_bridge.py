"""The bridge from a pyserve HTTP/1.1 connection to the ASGI application.

A request the connection does not answer natively goes to the application as an ``http``
scope; ``receive`` delivers its body chunks as they arrive, then ``http.disconnect`` once the
answer is complete or the client has gone; ``send`` writes the answer, streaming it with
chunked transfer encoding when the application gives no ``Content-Length`` (HTTP/1.1), or
until the connection closes (HTTP/1.0).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from pyserve.frontends.http.wire import CONTINUE, NO_BODY_STATUS, SINGLE_WRITE_LIMIT, status_line

if TYPE_CHECKING:
    from pyserve.frontends.http.connection import HttpProtocol
    from pyserve.frontends.http.parsed_request import ParsedRequest

log = logging.getLogger("pyserve.frontends.http")


class AsgiCycle:
    """One request handed to the ASGI application.

    :param protocol: the connection.
    :param request: the parsed request (its body may still be arriving).
    """

    __slots__ = (
        "protocol", "request", "status", "response_headers", "response_started", "head_written",
        "chunked", "response_complete", "body_done", "disconnect_waiter", "is_disconnected", "task",
        "no_body",
    )

    def __init__(self, protocol: HttpProtocol, request: ParsedRequest) -> None:
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
                    protocol.write(CONTINUE)
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
        no_body = self.no_body or self.status in NO_BODY_STATUS or 100 <= self.status < 200
        out = self._head(len(body), more, no_body) if not self.head_written else []
        if not no_body:
            if self.chunked:
                if body:
                    out += (b"%x\r\n" % len(body), body, b"\r\n")
                if not more:
                    out.append(b"0\r\n\r\n")
            elif body:
                out.append(body)
        if out:
            if sum(len(part) for part in out) <= SINGLE_WRITE_LIMIT:
                protocol.write(b"".join(out))
            else:
                protocol.writelines(out)
        if not more:
            self.response_complete = True

    def _head(self, length: int, more: bool, no_body: bool) -> list[bytes]:
        """The status line and headers, once per answer: the application's headers, the body's
        framing when it gave none, and whether the connection stays open."""
        self.head_written = True
        request = self.request
        out = [status_line(self.status)]
        has_length = self._copy_headers(out)
        if not has_length and not no_body:
            if not more:
                out.append(b"content-length: %d\r\n" % length)
            elif request.http_version == "1.1":
                out.append(b"transfer-encoding: chunked\r\n")
                self.chunked = True
            else:
                request.keep_alive = False  # HTTP/1.0: the body ends with the connection
        if not request.complete and not more:
            request.keep_alive = False  # the body was not read: the connection cannot be reused
        if request.keep_alive and self.protocol.server.shutting_down:
            request.keep_alive = False
        if not request.keep_alive:
            out.append(b"connection: close\r\n")
        elif request.http_version == "1.0":
            out.append(b"connection: keep-alive\r\n")
        out.append(b"\r\n")
        return out

    def _copy_headers(self, out: list[bytes]) -> bool:
        """Append the application's headers to ``out``; whether they frame the body themselves
        (``Content-Length`` or ``Transfer-Encoding``). ``Connection: close`` ends keep-alive."""
        has_length = False
        for name, value in self.response_headers:
            if name == b"content-length":
                has_length = True
            elif name == b"transfer-encoding":
                has_length = True  # the application frames the body itself
            elif name == b"connection" and value.lower() == b"close":
                self.request.keep_alive = False
            out += (name, b": ", value, b"\r\n")
        return has_length
