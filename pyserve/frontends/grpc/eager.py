"""Run a call's coroutine eagerly: its first step at once, a task only if it has to wait.

A unary call whose model executes on the event loop (``pyserve_inline_execute``) finishes
without ever waiting. Run as a task, it would start one loop turn after its request was parsed
and its answer would leave another turn later. :func:`start_eagerly` runs the coroutine's
first step in the caller (the connection's ``data_received``), so such a call is answered in
the same turn, with the other answers of that read. A coroutine that does wait goes on as a task
from where it stopped (what Python 3.12's eager task factory does for every task).
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


def start_eagerly(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T] | None:
    """Run ``coro`` up to its first wait; None if it finished, else the task that goes on with it.

    The coroutine runs in a copy of the caller's context, as a task's would, and the task (if
    any) keeps that copy. Its first step runs in the caller: ``asyncio.current_task()`` is the
    caller's task, None in a protocol callback such as ``data_received``, so the coroutine must
    not need a task of its own before it first waits (``asyncio.timeout`` does). Its result,
    if it finishes at once, is dropped.

    On Python 3.10 the coroutine simply becomes a task: a task there cannot be given the context
    the first step ran in (``create_task(context=...)`` is 3.11's).

    :raises BaseException: what the first step raised (``coro`` is then closed); a coroutine
        that handles its own errors raises nothing here.
    """
    if sys.version_info < (3, 11):
        return loop.create_task(coro)
    context = contextvars.copy_context()
    try:
        first = context.run(coro.send, None)
    except StopIteration:
        return None
    return loop.create_task(_Resumed(coro, first), context=context)


class _Resumed(Coroutine[Any, Any, T]):
    """A started coroutine seen from a task as if the task had started it.

    The task's first ``send`` gets the future the coroutine is already waiting on; every later
    ``send``/``throw`` goes to the coroutine, as ``await`` would pass them on. A ``throw`` before
    that first ``send`` (the task was cancelled before its first step) goes straight to the
    coroutine, where its wait raises it.
    """

    __slots__ = ("_coro", "_first", "_pending_first")

    def __init__(self, coro: Coroutine[Any, Any, T], first: Any) -> None:
        self._coro = coro
        self._first: Any = first
        self._pending_first = True

    def send(self, value: Any) -> Any:
        if self._pending_first:
            self._pending_first = False
            first, self._first = self._first, None
            return first
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self._pending_first = False
        self._first = None
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, T]:
        raise TypeError("a resumed coroutine is run by its task, not awaited")

    @property
    def __name__(self) -> str:  # what a task's repr shows
        return getattr(self._coro, "__qualname__", "coroutine")

    def __repr__(self) -> str:
        return f"<resumed {self._coro!r}>"
