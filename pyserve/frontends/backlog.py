"""Responses on their way from model threads to one event-loop writer, with backpressure.

A decoupled model may send responses faster than its client reads them (a gRPC stream, an SSE
``generate_stream``). :class:`ResponseBacklog` holds them for the writer; a sender on another
thread that finds ``limit`` responses already waiting blocks until the writer has taken them down
to half of that, or the backlog is closed (the client went away): the model is paused instead of
the server's memory growing. A sender on the loop's own thread (a model executed on the loop)
never blocks: it could not be woken.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any

RESPONSE_BACKLOG = 64
"""Responses one stream may hold for its writer before senders wait."""


class ResponseBacklog:
    """A FIFO from any thread to the coroutine that writes one stream's responses.

    :param loop: the writer's event loop (built on it).
    :param limit: responses held before a sender on another thread waits.
    """

    __slots__ = ("loop", "limit", "_items", "_waiter", "_room", "_loop_thread", "closed")

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int = RESPONSE_BACKLOG) -> None:
        self.loop = loop
        self.limit = limit
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._room = threading.Event()
        self._room.set()
        self._loop_thread = threading.get_ident()
        self.closed = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Any) -> None:
        """Queue ``item`` (any thread); blocks a thread other than the loop's while the backlog is
        full, until the writer catches up or ``close`` is called."""
        items = self._items
        items.append(item)  # deque appends and pops are atomic
        if self._waiter is not None:
            if threading.get_ident() == self._loop_thread:
                self._wake()
            else:
                self.loop.call_soon_threadsafe(self._wake)
        if len(items) > self.limit and threading.get_ident() != self._loop_thread:
            self._room.clear()
            while len(items) > self.limit // 2 and not self.closed:
                self._room.wait(0.05)  # also re-checks, should the writer's set() come first

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Any:
        """The next item (on the loop), waiting for one."""
        items = self._items
        while not items:
            self._waiter = self.loop.create_future()
            try:
                if not items:  # a put may have come before the waiter was set
                    await self._waiter
            finally:
                self._waiter = None
        item = items.popleft()
        if not self._room.is_set() and len(items) <= self.limit // 2:
            self._room.set()
        return item

    def close(self) -> None:
        """The writer is gone: drop what waits and release blocked senders."""
        self.closed = True
        self._items.clear()
        self._room.set()
