"""Where model changes become visible: the server's event loop, reached from load threads."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable


class LoopRunner:
    """Runs an action on the server's event loop and waits for it.

    Requests are enqueued on that loop, so a swap of versions done there is seen by every
    request either before or after it, never half-way. Without a loop (tests, before the server
    started), on the loop itself, or once the loop stopped, the action runs inline.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Run actions on ``loop`` from now on (None: inline)."""
        self._loop = loop

    def call(self, action: Callable[[], None]) -> None:
        """Run ``action`` on the loop and wait for it; an exception it raises is re-raised here."""
        loop = self._loop
        if loop is None or loop.is_closed() or _running_on(loop):
            action()
            return
        done = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                action()
            except BaseException as exc:  # re-raised on the calling thread
                failure.append(exc)
            finally:
                done.set()

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:  # closed meanwhile
            action()
            return
        while not done.wait(0.05):
            if not loop.is_running():
                if not done.is_set():
                    run()
                break
        if failure:
            raise failure[0]


def _running_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
