"""Streamed answers that end when the client goes away: ``EventStream`` and ``until_disconnected``.

Both watch the ASGI ``receive`` channel for ``http.disconnect`` while they wait, on any ASGI
server (pyserve's and uvicorn, whatever ASGI spec version it reports), so that a client that
closes its connection stops the work done for it at once rather than at the next write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from starlette.responses import Response

log = logging.getLogger("pyserve.frontends.http")
T = TypeVar("T")

SSE_TYPE = "text/event-stream; charset=utf-8"
NDJSON_TYPE = "application/x-ndjson"

Receive = Callable[[], Awaitable[Any]]


async def wait_disconnect(receive: Receive) -> None:
    """Return once ``receive`` says the client disconnected (body chunks are skipped)."""
    while (await receive())["type"] != "http.disconnect":
        pass


_GONE: Any = object()


async def until_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``, or cancel it if the client disconnects first.

    :returns: what ``work`` returns, or ``DISCONNECTED`` when the client went away.
    :raises Exception: whatever ``work`` raised.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled from outside: stop both
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return _GONE


DISCONNECTED: Any = _GONE
"""What ``until_disconnected`` returns when the client went away first."""


class EventStream(Response):
    """A response whose body is the chunks of an async iterator, each written as it comes.

    The iterator is closed (``aclose``) and ``on_close`` called exactly once however the stream
    ends: done, failed, or the client disconnected (watched on ``receive`` meanwhile).

    :param chunks: the body, chunk by chunk.
    :param media_type: the ``Content-Type`` (``SSE_TYPE``, ``NDJSON_TYPE`` ...).
    :param on_close: called on the event loop when the stream is over.
    """

    def __init__(self, chunks: AsyncIterator[bytes], media_type: str, *, status_code: int = 200,
                 on_close: Callable[[], None] | None = None, headers: Mapping[str, str] | None = None) -> None:
        self.chunks = chunks
        self.on_close = on_close
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: Any, receive: Receive, send: Callable[[Any], Awaitable[None]]) -> None:
        producer = asyncio.ensure_future(self._produce(send))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait((producer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (producer, watcher):
                task.cancel()
            await asyncio.gather(producer, watcher, return_exceptions=True)
            close = getattr(self.chunks, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
            if self.on_close is not None:
                self.on_close()
        if producer.done() and not producer.cancelled() and producer.exception() is not None:
            # the head may be written already: no error answer is possible, the connection ends
            log.error("streamed answer failed", exc_info=producer.exception())

    async def _produce(self, send: Callable[[Any], Awaitable[None]]) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
