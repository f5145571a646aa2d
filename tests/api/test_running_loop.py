"""``pyserve.api.inference.RunningLoop``: the running loop of the calling thread, remembered safely."""

from __future__ import annotations

import asyncio
import threading

from pyserve.api.inference import RunningLoop


def test_running_loop_follows_the_thread_and_the_loop() -> None:
    remembered = RunningLoop()
    assert remembered.get() is None  # no loop runs here

    async def inside() -> asyncio.AbstractEventLoop | None:
        return remembered.get()

    first = asyncio.new_event_loop()
    try:
        assert first.run_until_complete(inside()) is first
        assert first.run_until_complete(inside()) is first  # remembered
    finally:
        first.close()
    assert remembered.get() is None  # that loop stopped: not handed out any more

    second = asyncio.new_event_loop()
    try:
        assert second.run_until_complete(inside()) is second  # a new loop on the same thread
    finally:
        second.close()

    seen: list[asyncio.AbstractEventLoop | None] = []
    other = threading.Thread(target=lambda: seen.append(remembered.get()))
    other.start()
    other.join()
    assert seen == [None]  # another thread without a loop
