"""A lean asyncio gRPC client for ``pyserve bench``: unary calls over one HTTP/2 connection.

grpc.aio spends more CPU per call than a 2-core machine can give a load generator next to the
server it measures. This client does only what a unary call needs: HTTP/2 framing (frames from
:mod:`pyserve.frontends.grpc.http2`), HPACK through ``hpack``, flow control in both directions, the
5-byte gRPC message prefix and the ``grpc-status`` trailer. Reply bodies are counted, not parsed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import hpack

from pyserve.frontends.grpc import http2 as h2

RECEIVE_WINDOW = 1 << 30
MAX_STREAM_ID = 2**31 - 1


class CallFailed(Exception):
    """A call ended without OK: ``code`` is the gRPC status name (``UNAVAILABLE``, ...)."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


_STATUS_NAMES = {str(code.value[0]): code.name for code in grpc.StatusCode}
"""``grpc-status`` value → status name (``"5"`` → ``NOT_FOUND``)."""


class _Call:
    __slots__ = ("future", "pending", "send_window", "status", "details")

    def __init__(self, future: asyncio.Future[None], send_window: int) -> None:
        self.future = future
        self.pending: memoryview | None = None  # request bytes waiting for flow-control window
        self.send_window = send_window
        self.status = ""
        self.details = ""


class H2Connection(asyncio.Protocol):
    """One client HTTP/2 connection; :meth:`call` runs a unary call on a new stream."""

    def __init__(self, authority: str) -> None:
        self.authority = authority
        self.transport: asyncio.Transport | None = None
        self.encoder = hpack.Encoder()
        self.decoder = h2.HeaderDecoder(1 << 20)
        self.buffer = b""
        self.next_id = 1
        self.calls: dict[int, _Call] = {}
        self.blocks: dict[str, tuple[int, bytes]] = {}  # path -> (times encoded, block)
        self.send_window = h2.DEFAULT_WINDOW
        self.peer_initial_window = h2.DEFAULT_WINDOW
        self.peer_max_frame = h2.DEFAULT_MAX_FRAME
        self.unacked = 0
        self.closed = False
        self.error = ""

    @property
    def usable(self) -> bool:
        return not self.closed and self.next_id < MAX_STREAM_ID

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(h2.PREFACE + h2.settings({h2.ENABLE_PUSH: 0, h2.INITIAL_WINDOW_SIZE: RECEIVE_WINDOW})  # type: ignore[attr-defined]
                        + h2.window_update(0, RECEIVE_WINDOW - h2.DEFAULT_WINDOW))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail_all("UNAVAILABLE", self.error or f"connection lost{f': {exc}' if exc else ''}")

    def data_received(self, data: bytes) -> None:
        frames, self.buffer = h2.split_frames(self.buffer + data if self.buffer else data)
        out: list[bytes] = []
        for kind, flags, stream_id, payload in frames:
            self._frame(kind, flags, stream_id, payload, out)
        if self.unacked >= RECEIVE_WINDOW // 2:
            out.append(h2.window_update(0, self.unacked))
            self.unacked = 0
        if out and self.transport is not None and not self.closed:
            self.transport.write(b"".join(out))

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes, out: list[bytes]) -> None:
        """Act on one frame from the server; frames to send back are appended to ``out``."""
        if kind == h2.DATA:
            self.unacked += len(payload)
            call = self.calls.get(stream_id)
            if call is not None and flags & h2.END_STREAM:
                self._finish(stream_id, call)
        elif kind == h2.HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == h2.SETTINGS:
            if not flags & h2.ACK:
                self._on_settings(payload)
                out.append(h2.frame(h2.SETTINGS, h2.ACK, 0))
                self._send_pending(out)
        elif kind == h2.WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
            self._send_pending(out)
        elif kind == h2.PING:
            if not flags & h2.ACK:
                out.append(h2.frame(h2.PING, h2.ACK, 0, payload))
        elif kind == h2.RST_STREAM:
            self._on_reset(stream_id, payload)
        elif kind == h2.GOAWAY:
            self._on_goaway(payload)

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if flags & h2.PADDED:
            payload = payload[1:len(payload) - payload[0]]
        if flags & h2.PRIORITY_FLAG:
            payload = payload[5:]
        headers, _ = self.decoder.decode(payload)  # every block: the HPACK table must follow
        call = self.calls.get(stream_id)
        if call is None:
            return
        for name, value in headers:
            if name == "grpc-status":
                call.status = value
            elif name == "grpc-message":
                call.details = value
            elif name == ":status" and value != "200":
                call.status, call.details = "14", f"HTTP status {value}"
        if flags & h2.END_STREAM:
            self._finish(stream_id, call)

    def _on_settings(self, payload: bytes) -> None:
        for offset in range(0, len(payload) - 5, 6):
            setting = int.from_bytes(payload[offset:offset + 2], "big")
            amount = int.from_bytes(payload[offset + 2:offset + 6], "big")
            if setting == h2.INITIAL_WINDOW_SIZE:
                delta, self.peer_initial_window = amount - self.peer_initial_window, amount
                for open_call in self.calls.values():
                    open_call.send_window += delta
            elif setting == h2.MAX_FRAME_SIZE:
                self.peer_max_frame = amount

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            self.send_window += increment
        elif (call := self.calls.get(stream_id)) is not None:
            call.send_window += increment

    def _on_reset(self, stream_id: int, payload: bytes) -> None:
        call = self.calls.pop(stream_id, None)
        if call is not None and not call.future.done():
            code = int.from_bytes(payload, "big")
            call.future.set_exception(CallFailed("CANCELLED" if code == h2.CANCEL else "INTERNAL",
                                                 f"stream reset by the server (HTTP/2 error {code})"))

    def _on_goaway(self, payload: bytes) -> None:
        last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
        self.closed = True  # no new calls here; the ones above ``last`` were not processed
        self.error = f"the server sent GOAWAY ({payload[8:].decode('utf-8', 'replace')})"
        for stream, call in list(self.calls.items()):
            if stream > last:
                self.calls.pop(stream)
                if not call.future.done():
                    call.future.set_exception(CallFailed("UNAVAILABLE", self.error))

    def _finish(self, stream_id: int, call: _Call) -> None:
        self.calls.pop(stream_id, None)
        if call.future.done():
            return
        if call.status == "0":
            call.future.set_result(None)
        else:
            code = _STATUS_NAMES.get(call.status, "UNKNOWN") if call.status else "INTERNAL"
            call.future.set_exception(CallFailed(code, call.details or "the call ended without a grpc-status"))

    def _fail_all(self, code: str, details: str) -> None:
        calls, self.calls = self.calls, {}
        for call in calls.values():
            if not call.future.done():
                call.future.set_exception(CallFailed(code, details))

    # -- calls -----------------------------------------------------------------------------------
    def _block(self, path: str) -> bytes:
        """The request header block: encoded until it is made of table references only."""
        count, block = self.blocks.get(path, (0, b""))
        if count >= 2:
            return block
        block = self.encoder.encode([
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", self.authority),
            ("content-type", "application/grpc"), ("te", "trailers"), ("user-agent", "pyserve-bench"),
        ])
        self.blocks[path] = (count + 1, block)
        return block

    async def call(self, path: str, message: bytes) -> None:
        """One unary call; returns when the server answered OK.

        :raises CallFailed: any other status, a reset stream, or a lost connection.
        """
        if not self.usable or self.transport is None:
            raise CallFailed("UNAVAILABLE", self.error or "the connection is closed")
        stream_id, self.next_id = self.next_id, self.next_id + 2
        future = asyncio.get_running_loop().create_future()
        call = _Call(future, self.peer_initial_window)
        self.calls[stream_id] = call
        out = [h2.frame(h2.HEADERS, h2.END_HEADERS, stream_id, self._block(path))]
        body = b"\x00" + len(message).to_bytes(4, "big") + message
        if len(body) > min(self.send_window, call.send_window, self.peer_max_frame):
            call.pending = memoryview(body)
            self._send_pending(out)
        else:
            self.send_window -= len(body)
            call.send_window -= len(body)
            out.append(h2.frame(h2.DATA, h2.END_STREAM, stream_id, body))
        self.transport.write(b"".join(out))
        await future

    def _send_pending(self, out: list[Any]) -> None:
        for stream_id, call in self.calls.items():
            data = call.pending
            while data is not None:
                allowed = min(self.send_window, call.send_window, self.peer_max_frame)
                if allowed <= 0:
                    break
                chunk = data[:allowed]
                last = len(chunk) == len(data)
                out.append(h2.frame(h2.DATA, h2.END_STREAM if last else 0, stream_id, bytes(chunk)))
                self.send_window -= len(chunk)
                call.send_window -= len(chunk)
                data = None if last else data[len(chunk):]
                call.pending = data

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()


class LeanChannel:
    """Unary calls to ``host:port`` over one HTTP/2 connection, reconnecting when it is gone."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.connection: H2Connection | None = None
        self._connecting: asyncio.Future[H2Connection] | None = None

    async def _connected(self) -> H2Connection:
        connection = self.connection
        if connection is not None and connection.usable:
            return connection
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _connect(self) -> H2Connection:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await loop.create_connection(lambda: H2Connection(f"{self.host}:{self.port}"),
                                                         self.host, self.port)
        except OSError as exc:
            raise CallFailed("UNAVAILABLE", f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}") from None
        self.connection = connection
        return connection

    async def unary(self, path: str, message: bytes) -> None:
        connection = await self._connected()
        await connection.call(path, message)

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
