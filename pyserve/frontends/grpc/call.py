"""One gRPC call on pyserve's HTTP/2 server: its servicer context and its request messages.

:class:`CallContext` offers the ``grpc.aio.ServicerContext`` methods, so the same servicer
functions (and ``grpc.aio`` interceptors) run on either server. Everything here runs on the
event loop of the connection that carries the call.
"""

from __future__ import annotations

import asyncio
import base64
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

if TYPE_CHECKING:
    from pyserve.frontends.grpc.http2_stream import Stream

Metadata = tuple[tuple[str, "str | bytes"], ...]

RESERVED_HEADERS = frozenset({"content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding"})
"""Request headers that are transport details, not call metadata (as grpc leaves them out)."""


class AbortError(Exception):
    """Raised by :meth:`CallContext.abort`; ends the call with the status already recorded."""


class CallCancelled(Exception):
    """The call ended while reading from or writing to it (reset by the peer, deadline, closed)."""


def metadata_from_headers(headers: Sequence[tuple[str, str]]) -> Metadata:
    """Call metadata of a request's headers: no pseudo-headers or transport headers, ``-bin``
    values base64-decoded to bytes."""
    items: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        if not name or name[0] == ":" or name in RESERVED_HEADERS:
            continue
        if name.endswith("-bin"):
            try:
                items.append((name, base64.b64decode(value + "=" * (-len(value) % 4))))
            except ValueError:
                continue
        else:
            items.append((name, value))
    return tuple(items)


def encode_metadata(metadata: Sequence[tuple[str, str | bytes]]) -> list[tuple[bytes, bytes]]:
    """Metadata as header fields (``-bin`` values base64 without padding, names lower-cased)."""
    fields = []
    for key, value in metadata:
        name = key.lower()
        if name.endswith("-bin"):
            raw = value if isinstance(value, bytes) else value.encode("utf-8")
            fields.append((name.encode("ascii"), base64.b64encode(raw).rstrip(b"=")))
        else:
            fields.append((name.encode("ascii"), value.encode("latin-1") if isinstance(value, str) else value))
    return fields


def raw_message(message: bytes | bytearray) -> bytes:
    """A request message for a handler without a deserializer: ``bytes``, as grpc's server
    gives it. A message that arrived over several reads is joined in a ``bytearray``, which
    such a handler may pass on to grpc's client (the frontend's relay), and grpc takes only
    ``bytes``; handlers with a deserializer get the ``bytearray`` (the codec keeps views of it)."""
    return message if type(message) is bytes else bytes(message)


class RequestMessages:
    """The request messages of a client-streaming call, as an async iterator.

    Messages are appended by the connection as they arrive; iteration ends when the client
    ends its stream and raises :class:`CallCancelled` if the call is reset first. Without a
    deserializer each message is ``bytes``, as grpc's server gives them (``raw_message``).
    """

    __slots__ = ("_items", "_waiter", "_ended", "_failed", "_deserialize")

    def __init__(self, deserialize: Callable[[bytes], Any] | None) -> None:
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._failed: BaseException | None = None
        self._deserialize = deserialize

    def push(self, message: bytes | bytearray) -> None:
        self._items.append(message)
        self._wake()

    def end(self) -> None:
        self._ended = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        self._failed = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> RequestMessages:
        return self

    async def __anext__(self) -> Any:
        while True:
            if self._items:
                message = self._items.popleft()
                return raw_message(message) if self._deserialize is None else self._deserialize(message)
            if self._failed is not None:
                raise self._failed
            if self._ended:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class CallContext:
    """The servicer context of one call (the ``grpc.aio.ServicerContext`` methods).

    Safe to use from the call's own task only (the event loop thread).
    """

    __slots__ = (
        "_stream", "_headers", "_metadata", "_code", "_details", "_trailing", "compression",
        "_done_callbacks", "_deadline", "_peer", "_messages", "next_uncompressed",
    )

    def __init__(self, stream: Stream, headers: Sequence[tuple[str, str]], deadline: float | None, peer: str) -> None:
        self._stream = stream
        self._headers = headers  # the request's header fields; metadata is made from them when asked for
        self._metadata: Metadata | None = None
        self._code: grpc.StatusCode = grpc.StatusCode.OK
        self._details = ""
        self._trailing: Metadata = ()
        self.compression: grpc.Compression | None = None
        self._done_callbacks: list[Callable[[CallContext], None]] | None = None
        self._deadline = deadline
        self._peer = peer
        self._messages: RequestMessages | None = None
        self.next_uncompressed = False

    # -- metadata and status ---------------------------------------------------------------------
    def invocation_metadata(self) -> Metadata:
        if self._metadata is None:  # most calls never read it: not built on the hot path
            self._metadata = metadata_from_headers(self._headers)
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def peer_identities(self) -> None:
        return None

    def peer_identity_key(self) -> None:
        return None

    def auth_context(self) -> dict[str, Any]:
        return {}

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def set_details(self, details: str) -> None:
        self._details = details

    def details(self) -> str:
        return self._details

    def set_trailing_metadata(self, trailing_metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self._trailing = tuple(trailing_metadata)

    def trailing_metadata(self) -> Metadata:
        return self._trailing

    def set_compression(self, compression: grpc.Compression) -> None:
        self.compression = compression

    def disable_next_message_compression(self) -> None:
        self.next_uncompressed = True

    async def send_initial_metadata(self, initial_metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self._stream.connection.send_initial_metadata(self._stream, initial_metadata)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Sequence[tuple[str, str | bytes]] = ()
    ) -> NoReturn:
        """End the call with ``code``/``details``; raises (never returns), as grpc.aio does."""
        if code == grpc.StatusCode.OK:
            code = grpc.StatusCode.UNKNOWN  # grpc refuses to abort with OK
        self._code = code
        self._details = details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise AbortError(details)

    async def abort_with_status(self, status: Any) -> NoReturn:
        await self.abort(status.code, status.details, status.trailing_metadata)

    # -- lifetime --------------------------------------------------------------------------------
    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(self._deadline - asyncio.get_running_loop().time(), 0.0)

    def cancelled(self) -> bool:
        return self._stream.cancelled

    def done(self) -> bool:
        return self._stream.finished

    def add_done_callback(self, callback: Callable[[CallContext], None]) -> None:
        if self._stream.finished:
            callback(self)
            return
        if self._done_callbacks is None:
            self._done_callbacks = []
        self._done_callbacks.append(callback)

    def run_done_callbacks(self) -> None:
        callbacks, self._done_callbacks = self._done_callbacks, None
        for callback in callbacks or ():
            try:
                callback(self)
            except Exception:  # a callback's failure must not disturb the connection
                import logging

                logging.getLogger("pyserve.frontends.grpc").exception("a gRPC done callback failed")

    # -- explicit reads and writes (streaming handlers may use them instead of iterators) -------
    async def read(self) -> Any:
        if self._messages is None:
            raise RuntimeError("read() is only for client-streaming calls")
        try:
            return await self._messages.__anext__()
        except StopAsyncIteration:
            return grpc.aio.EOF

    async def write(self, message: Any) -> None:
        await self._stream.connection.write_message(self._stream, message)

    def attach_messages(self, messages: RequestMessages) -> None:
        self._messages = messages
