"""What one gRPC connection may cost the server: memory, resets, control frames, idle time.

:class:`BufferBudget` is the server-wide count of bytes held in request messages that have not
arrived whole; :class:`ConnectionGuard` keeps one connection's share of it and the counters and
timers that end an abusive or stalled connection. Everything here runs on the event loop of the
connection it belongs to; nothing here is on the path of a message that arrives whole in one
DATA frame (the usual small call).

What a peer may rely on (the limits are ``GrpcOptions`` fields, ``--grpc-*`` flags):

* a request message is buffered as its bytes arrive, never set aside from its declared length;
  a message that would take the bytes its connection holds for incomplete messages past
  ``max_connection_buffer``, or the server's past ``max_server_buffer``, ends its call with
  RESOURCE_EXHAUSTED (its bytes are dropped; the connection and other calls go on); a
  compressed message inflates to at most what both budgets have left;
* a message (or a header block) that is not received whole within ``message_timeout_secs`` of its
  first byte ends its call with DEADLINE_EXCEEDED (a header block: the connection, with GOAWAY);
* a connection without a call for ``idle_timeout_secs`` (checked every that many seconds, so
  between one and two periods) is closed with GOAWAY NO_ERROR;
* a peer that resets calls faster than ``RESET_RATE`` a second after a burst of ``RESET_BURST``,
  or that makes the server owe it more than ``MAX_CONTROL_BACKLOG`` control frames (SETTINGS and
  PING acknowledgements, resets) while it does not read, is sent GOAWAY ENHANCE_YOUR_CALM and
  dropped.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyserve.frontends.grpc.http2_stream import Stream

RESET_BURST = 1000
"""Calls a peer may reset at once before the rate limit applies (as nghttp2's default)."""
RESET_RATE = 100.0
"""Calls a second a peer may go on resetting after the burst."""
MAX_CONTROL_BACKLOG = 1000
"""Control frames the server may owe a peer whose connection does not take what is written."""
DEFAULT_IDLE_TIMEOUT_S = 300.0
"""``--grpc-idle-timeout-secs`` default."""
DEFAULT_MESSAGE_TIMEOUT_S = 300.0
"""``--grpc-message-timeout-secs`` default."""


def physical_memory() -> int:
    """Bytes of memory of this machine (0 when the platform does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return 0


def server_buffer_default(connection_limit: int) -> int:
    """The server-wide budget when none is given: a quarter of the machine's memory, and never
    less than one connection's budget (one message of the largest size must be able to arrive)."""
    return max(physical_memory() // 4, connection_limit)


class BufferBudget:
    """Bytes held in incomplete request messages by every connection of one server.

    :param limit: the most that may be held at once.
    """

    __slots__ = ("limit", "held")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0


class ConnectionGuard:
    """The limits of one connection (see the module docstring).

    :param loop: the connection's event loop.
    :param budget: the server-wide budget this connection takes its bytes from.
    :param connection_limit: bytes this connection may hold in incomplete messages.
    :param idle_timeout: seconds without a call after which ``on_idle`` runs (0: never).
    :param message_timeout: seconds a message may take to arrive (0: no limit).
    :param on_idle: closes the connection (called on the loop).
    :param on_slow: ends the calls (streams) whose message is late, and the connection when a
        header block is (``None`` in the argument).
    :param calls: ``(calls opened so far, calls open now)`` of the connection.
    """

    __slots__ = (
        "loop", "budget", "limit", "held", "idle_timeout", "message_timeout", "_on_idle", "_on_slow", "_calls",
        "_idle_handle", "_calls_seen", "_partial", "_partial_handle", "header_started",
        "_reset_tokens", "_reset_time", "control_owed",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, budget: BufferBudget, connection_limit: int, idle_timeout: float,
        message_timeout: float, on_idle: Callable[[], None], on_slow: Callable[[Stream | None], None],
        calls: Callable[[], tuple[int, int]],
    ) -> None:
        self.loop = loop
        self.budget = budget
        self.limit = connection_limit
        self.held = 0
        self.idle_timeout = idle_timeout
        self.message_timeout = message_timeout
        self._on_idle = on_idle
        self._on_slow = on_slow
        self._calls = calls
        self._idle_handle: asyncio.TimerHandle | None = None
        self._calls_seen = -1
        self._partial: dict[Stream, float] = {}  # stream → when its incomplete message began
        self._partial_handle: asyncio.TimerHandle | None = None
        self.header_started: float | None = None  # when an unfinished header block began
        self._reset_tokens = float(RESET_BURST)
        self._reset_time = loop.time()
        self.control_owed = 0  # control frames written while the transport did not take them

    # -- memory ------------------------------------------------------------------------------------
    def available(self) -> int:
        """Bytes this connection may still take (its own budget and the server's)."""
        return max(min(self.limit - self.held, self.budget.limit - self.budget.held), 0)

    def hold(self, stream: Stream, size: int) -> str:
        """Count ``size`` more bytes of ``stream``'s incomplete message; "" if they fit, else why
        not (nothing is counted then)."""
        if self.held + size > self.limit:
            return (f"the incomplete request messages of this connection would take more than {self.limit} "
                    "bytes (--grpc-max-connection-buffer)")
        budget = self.budget
        if budget.held + size > budget.limit:
            return (f"the incomplete request messages of all connections would take more than {budget.limit} "
                    "bytes (--grpc-max-server-buffer)")
        if not stream.held and self.message_timeout > 0:
            self._partial[stream] = self.loop.time()
            if self._partial_handle is None:
                self._partial_handle = self.loop.call_later(self.message_timeout, self._check_partial)
        stream.held += size
        self.held += size
        budget.held += size
        return ""

    def release(self, stream: Stream) -> None:
        """``stream`` holds nothing any more (its message is complete, or dropped)."""
        held = stream.held
        if held:
            stream.held = 0
            self.held -= held
            self.budget.held -= held
        self._partial.pop(stream, None)

    # -- time ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Arm the idle timer (the connection was just made)."""
        if self.idle_timeout > 0:
            self._idle_handle = self.loop.call_later(self.idle_timeout, self._check_idle)

    def stop(self) -> None:
        """Cancel the timers (the connection is gone)."""
        for handle in (self._idle_handle, self._partial_handle):
            if handle is not None:
                handle.cancel()
        self._idle_handle = self._partial_handle = None
        self._partial.clear()

    def _check_idle(self) -> None:
        """Every ``idle_timeout``: close if no call was open at any time since the last check."""
        self._idle_handle = None
        opened, open_now = self._calls()
        if open_now == 0 and opened == self._calls_seen:
            self._on_idle()
            return
        self._calls_seen = opened if open_now == 0 else -1
        self._idle_handle = self.loop.call_later(self.idle_timeout, self._check_idle)

    def header_block_begins(self) -> None:
        """A header block continues in CONTINUATION frames: it must end in time too."""
        if self.message_timeout > 0:
            self.header_started = self.loop.time()
            if self._partial_handle is None:
                self._partial_handle = self.loop.call_later(self.message_timeout, self._check_partial)

    def _check_partial(self) -> None:
        self._partial_handle = None
        now = self.loop.time()
        oldest = now
        if self.header_started is not None:
            if now - self.header_started >= self.message_timeout:
                self._on_slow(None)
                return
            oldest = self.header_started
        for stream, began in list(self._partial.items()):
            if now - began >= self.message_timeout:
                self._on_slow(stream)
            else:
                oldest = min(oldest, began)
        if self._partial or self.header_started is not None:
            self._partial_handle = self.loop.call_later(max(oldest + self.message_timeout - now, 0.01),
                                                        self._check_partial)

    # -- abuse ---------------------------------------------------------------------------------------
    def reset_allowed(self) -> bool:
        """One call reset by the peer; False once it resets faster than the rate allows."""
        now = self.loop.time()
        tokens = min(float(RESET_BURST), self._reset_tokens + (now - self._reset_time) * RESET_RATE)
        self._reset_time = now
        if tokens < 1.0:
            self._reset_tokens = tokens
            return False
        self._reset_tokens = tokens - 1.0
        return True

    def control_frame(self, writing_paused: bool) -> bool:
        """A control frame is owed to the peer; False once too many wait on a peer not reading."""
        if not writing_paused:
            self.control_owed = 0
            return True
        self.control_owed += 1
        return self.control_owed <= MAX_CONTROL_BACKLOG
