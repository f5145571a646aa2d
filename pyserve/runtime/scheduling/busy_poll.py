"""Busy polling after an execute on the event loop (``--busy-poll-us``).

At one connection a request waits mostly for wake-ups: the server's loop sleeps in the kernel
between requests, and waking a sleeping thread costs tens of microseconds (on a virtual machine
the idle CPU halts and the hypervisor resumes it). A loop that has just executed a model on
itself (``pyserve_inline_execute``) can instead keep polling its sockets for a short window:
the next request of a client that answers quickly is then read without any wake-up. An idle
server stops polling after one window.

Only a lone client that sends its requests back to back makes the loop poll: after an answer,
a window starts only if the request just answered started within one window of the previous
answer (a client that thinks between requests would only make the loop spin for nothing).
Only one client's requests make the loop poll. While requests come over several connections
(``pyserve.runtime.scheduling.client_activity.several_clients``: within its 10 ms window) an execute does not start
a window: the loop is seldom idle then, and each gap it did spin through was CPU taken from the
clients and the other processes. With two processes and a load generator on two cores, polling
at 8–32 connections cost 6–19% of the throughput. A client that opens a new connection for each
request counts as several clients, and so do the requests a frontend process hands over.

The price is CPU while polling (up to the window after each answer) and, for other threads of
the process, the GIL: the polling loop takes it back between polls, so an instance thread of a
threaded model in the same process may wait for it until the window closes, as it would beside
a busy loop. ``pyserve run`` turns it on (300 µs) where there are two or more CPUs
(``pyserve.handoff.layout``); embedded servers leave it off unless asked.

The setting is process-wide (``configure``), like ``pyserve.repository.tensor_checks.LIMITS``; each inline
scheduler keeps its own ``BusyPoll`` for the loop it executes on.
"""

from __future__ import annotations

import asyncio
import time

from pyserve.runtime.scheduling import client_activity

MAX_WINDOW_US = 1_000_000
"""The longest window accepted (one second)."""

_window_s = 0.0


class PollCounts:
    """What polling did in this process (read by tests and diagnostics; written on the loops)."""

    __slots__ = ("windows", "turns", "active")

    def __init__(self) -> None:
        self.windows = 0  # polling windows started
        self.turns = 0  # loop turns spent polling
        self.active = 0  # windows not over yet


COUNTS = PollCounts()


def configure(microseconds: int) -> int:
    """Set how long a loop keeps polling after an inline execute (0: not at all).

    :returns: the previous setting, in microseconds (to restore it).
    :raises ValueError: ``microseconds`` is negative or above one second.
    """
    global _window_s
    if not 0 <= microseconds <= MAX_WINDOW_US:
        raise ValueError(f"--busy-poll-us must be between 0 and {MAX_WINDOW_US}, got {microseconds}")
    previous = round(_window_s * 1e6)
    _window_s = microseconds / 1e6
    return previous


def window_us() -> int:
    """The current setting, in microseconds."""
    return round(_window_s * 1e6)


class BusyPoll:
    """Keeps one event loop polling for the configured window after each ``touch``.

    Polling is a callback that re-schedules itself with ``call_soon`` until the window has
    passed, so every loop turn polls the sockets without blocking. Not thread-safe: ``touch``
    and ``stop`` are called on the loop's thread.
    """

    __slots__ = ("_until", "_polling", "_answered_ns")

    def __init__(self) -> None:
        self._until = 0.0  # perf_counter time when polling stops
        self._polling = False  # a ``_poll`` callback is scheduled
        self._answered_ns = 0  # ``client_activity.now_ns`` at the previous answer (``touch``)

    def touch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Poll ``loop`` (the running loop) until one window from now; no-op while disabled,
        while several clients send requests, or when the request just answered came later than
        one window after the previous answer (the client does not send back to back)."""
        window = _window_s
        if not window:
            return
        answered, self._answered_ns = self._answered_ns, client_activity.now_ns()
        if client_activity.several_clients():
            return
        if client_activity.last_request_ns() - answered > window * 1e9:
            return  # the client paused longer than a window before this request
        self._until = time.perf_counter() + window
        if not self._polling:
            self._polling = True
            COUNTS.windows += 1
            COUNTS.active += 1
            loop.call_soon(self._poll, loop)

    def stop(self) -> None:
        """End the current window (the scheduled callback finishes at its next turn)."""
        self._until = 0.0

    def _poll(self, loop: asyncio.AbstractEventLoop) -> None:
        COUNTS.turns += 1
        if time.perf_counter() < self._until:
            loop.call_soon(self._poll, loop)
        else:
            self._polling = False
            COUNTS.active -= 1
