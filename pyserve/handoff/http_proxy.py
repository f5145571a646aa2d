"""Relays an HTTP request to the owner's HTTP server on a Unix socket (frontend processes).

Every route but infer (health, metadata, config, repository, statistics, shared memory,
trace, logging, generate) is answered by the owner, so a frontend never holds state of its
own. The request body streams to the owner with chunked transfer encoding; the answer streams
back as it arrives (server-sent events included, the OpenAI ``/v1`` routes and decoupled models'
infer streams among them). A client that goes away before its answer is complete drops the
connection to the owner, so the owner cancels the request as if its own client had left. Idle
connections to the owner are reused.

A body over ``--http-max-input-size`` (for an infer request, over the cap its
``Inference-Header-Content-Length`` gives: binary tensor data is not counted) is refused here, in
the owner's words, before anything is relayed. Should the owner still stop reading a body and close (it answers errors early), its
answer is relayed when it arrived, and otherwise the client gets a JSON 502, never a bare 500.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httptools

from pyserve.api.errors import InferError
from pyserve.frontends.http.body import too_large
from pyserve.frontends.http.errors import HTTP_STATUS, JSON_HEADERS, error_body
from pyserve.frontends.http.fast_infer import declared_infer_body

_HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
    b"proxy-connection", b"content-length", b"expect",
})
_MAX_IDLE = 16


class _Answer:
    """httptools callbacks collecting one response."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.events: list[tuple[str, Any]] = []
        self.parser = httptools.HttpResponseParser(self)
        self.complete = False
        self.abandoned = False  # the client went away: the owner's connection was dropped

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.events.append(("start", (self.parser.get_status_code(), self.headers)))

    def on_body(self, body: bytes) -> None:
        self.events.append(("body", body))

    def on_message_complete(self) -> None:
        self.complete = True


class OwnerHttpProxy:
    """An ASGI application relaying each request to ``path`` (the owner's HTTP Unix socket).

    :param max_input_size: ``--http-max-input-size``: a longer body is refused here, as the
        owner would refuse it.
    """

    def __init__(self, path: str, max_input_size: int) -> None:
        self.path = path
        self.max_input_size = max_input_size
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self._idle:
            reader, writer = self._idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer
            writer.close()
        return await asyncio.open_unix_connection(self.path, limit=1 << 20)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        try:
            cap = declared_infer_body(scope["headers"], self.max_input_size)
        except InferError as exc:  # over the cap from its headers: refused unread, as the owner would
            await _send_error(send, HTTP_STATUS[exc.code], exc.message)
            return
        started = False

        async def send_once_started(message: dict[str, Any]) -> None:
            nonlocal started
            started = True
            await send(message)

        reader, writer = await self._connect()
        reusable = False
        try:
            reusable = await self._relay(scope, receive, send_once_started, reader, writer, cap)
        except ConnectionError:
            if started:
                raise
            await _send_error(send, 502, "the model owner closed the connection before it answered")
        finally:
            if reusable and len(self._idle) < _MAX_IDLE:
                self._idle.append((reader, writer))
            else:
                writer.close()

    async def _relay(self, scope: dict[str, Any], receive: Any, send: Any,
                     reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cap: int) -> bool:
        target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
        head = [scope["method"].encode("ascii"), b" ", target, b" HTTP/1.1\r\n"]
        for name, value in scope["headers"]:
            if name not in _HOP_BY_HOP:
                head += (name, b": ", value, b"\r\n")
        message = await receive()
        if message["type"] == "http.disconnect":
            return False
        body = message.get("body", b"")
        if len(body) > cap:
            return await self._refuse_streamed(send, cap)
        if not message.get("more_body", False):  # the whole body is here: one write, with its length
            head.append(b"content-length: %d\r\n\r\n" % len(body))
            writer.write(b"".join(head) + body)
        else:  # stream it: the owner may answer before reading all of it only on errors
            head.append(b"transfer-encoding: chunked\r\n\r\n")
            writer.write(b"".join(head) + (b"%x\r\n%s\r\n" % (len(body), body) if body else b""))
            received = len(body)
            while True:
                try:
                    await writer.drain()
                except ConnectionError:  # the owner stopped reading: it may have answered
                    break
                message = await receive()
                if message["type"] == "http.disconnect":
                    return False
                body = message.get("body", b"")
                received += len(body)
                if received > cap:
                    writer.transport.abort()
                    return await self._refuse_streamed(send, cap)
                if body:
                    writer.write(b"%x\r\n%s\r\n" % (len(body), body))
                if not message.get("more_body", False):
                    writer.write(b"0\r\n\r\n")
                    break
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        answer = _Answer()
        head_only = scope["method"] == "HEAD"
        watcher = asyncio.ensure_future(self._watch(receive, writer, answer))
        try:
            return await self._answer(answer, reader, send, head_only)
        finally:
            watcher.cancel()

    async def _refuse_streamed(self, send: Any, cap: int) -> bool:
        """Answer a body that streamed past ``cap`` as the owner would; returns False (the
        owner's connection is not reused)."""
        error = too_large(cap, self.max_input_size)
        await _send_error(send, HTTP_STATUS[error.code], error.message)
        return False

    @staticmethod
    async def _watch(receive: Any, writer: asyncio.StreamWriter, answer: _Answer) -> None:
        """The client went away before the answer was complete: drop the owner's connection,
        so the owner stops what it does for the request (a streamed answer's model request)."""
        while (await receive())["type"] != "http.disconnect":
            pass
        if not answer.complete:
            answer.abandoned = True
            writer.transport.abort()

    @staticmethod
    async def _answer(answer: _Answer, reader: asyncio.StreamReader, send: Any, head_only: bool) -> bool:
        while not answer.complete:
            try:
                data = await reader.read(1 << 16)
            except ConnectionError:
                if answer.abandoned:
                    return False
                raise
            if not data:
                if answer.abandoned:  # the client is gone: nobody reads the rest
                    return False
                answer.parser.feed_data(b"")  # may complete a body that ends with the connection
                if not answer.complete:
                    raise ConnectionError("the model owner closed the connection mid-answer")
                break
            answer.parser.feed_data(data)
            events, answer.events = answer.events, []
            for kind, value in events:
                if kind == "start":
                    status, headers = value
                    await send({
                        "type": "http.response.start", "status": status,
                        "headers": [(k, v) for k, v in headers if k not in _HOP_BY_HOP or k == b"content-length"],
                    })
                    if head_only:
                        answer.complete = True
                else:
                    await send({"type": "http.response.body", "body": value, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        with contextlib.suppress(Exception):
            return answer.parser.should_keep_alive() and not head_only
        return False


async def _send_error(send: Any, status: int, message: str) -> None:
    """A whole ``{"error": message}`` answer."""
    body = error_body(message)
    await send({"type": "http.response.start", "status": status,
                "headers": [*JSON_HEADERS, (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
