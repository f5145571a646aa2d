"""One request on a pyserve HTTP/1.1 connection, from its headers until its answer is written."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from pyserve.frontends.http.errors import Reply

if TYPE_CHECKING:
    from pyserve.frontends.http.asgi_bridge import AsgiCycle
    from pyserve.runtime.versions import ModelVersion


class ParsedRequest:
    """One parsed request on a connection, from its headers until its answer is written.

    A plain record (slots, no behaviour but ``wake``): the connection (``pyserve.frontends.http.
    connection``) fills it as the parser reports, and whoever answers it reads it. ``target``
    set means the connection answers it natively (``pyserve.frontends.http.native_infer``);
    otherwise ``asgi`` holds the application's cycle once it starts.
    """

    __slots__ = (
        "method", "url", "headers", "http_version", "keep_alive", "expect_continue", "target",
        "chunks", "buffered", "complete", "early", "close_after", "model", "discard_body",
        "started", "waiter", "asgi", "infer_request", "future", "bad", "url_parts", "body_limit",
    )

    def __init__(self) -> None:
        self.method = ""
        self.url = b""
        self.url_parts: list[bytes] | None = None  # a URL arriving in pieces: joined once
        self.headers: list[tuple[bytes, bytes]] = []
        self.http_version = "1.1"
        self.keep_alive = True
        self.expect_continue = False
        self.target: tuple[str, str | None] | None = None  # (model, version) for native infer
        # the body: pieces for ASGI routes; for native infer one piece, a bytearray once a
        # second piece arrived (grown in place, so the body is never held twice)
        self.chunks: list[bytes | bytearray] = []
        self.buffered = 0  # body bytes received (native infer) or buffered unconsumed (ASGI)
        self.complete = False  # the whole message has been parsed
        self.early: Reply | None = None  # an answer decided before the body (error, 403)
        self.close_after = False  # the body is not read to its end: close after answering
        self.model: ModelVersion | None = None
        self.discard_body = False
        self.started = False
        self.waiter: asyncio.Future[None] | None = None  # an ASGI receive() waiting for body
        self.asgi: AsgiCycle | None = None
        self.infer_request: Any = None
        self.future: asyncio.Future[Any] | None = None
        self.bad = False  # a malformed request: answer 400 (or ``early``) and close
        self.body_limit = 0  # a native infer body's cap (``body.infer_body_limit``); 0: the server's

    def wake(self) -> None:
        """Resume the ASGI ``receive()`` waiting for this request's body, if one waits."""
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)
