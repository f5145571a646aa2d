"""How a gRPC connection ends: GOAWAY on errors, idleness and shutdown; keepalive pings.

A protocol error ends the connection with GOAWAY and its code (at once, if the peer does not
read); :meth:`ConnectionLifetime.goaway` refuses new streams and closes once the open ones are
done; an unanswered keepalive ping aborts the connection.
"""

from __future__ import annotations

import logging

from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.grpc.outgoing import OutgoingFrames

log = logging.getLogger("pyserve.frontends.grpc")


class ConnectionLifetime(OutgoingFrames):
    """Closing the connection (gracefully or not) and keeping it alive while it is used."""

    def _connection_error(self, code: int, message: str) -> None:
        log.debug("gRPC connection from %s closed: %s", self.peer, message)
        self._write(h2.goaway(self._last_stream_id, code, message.encode("utf-8", "replace")[:256]))
        self._flush()
        if self._paused:  # a peer that does not read would keep the socket open for ever
            self._closed = True
            self.abort()
        else:
            self._close()

    def _idle(self) -> None:
        """No call for ``--grpc-idle-timeout-secs``: GOAWAY NO_ERROR, then close."""
        log.debug("gRPC connection from %s closed: idle", self.peer)
        self.goaway()

    def goaway(self) -> None:
        """Refuse new streams (GOAWAY, NO_ERROR) and close once the open ones are done."""
        if self._closed or self.closing:
            return
        self.closing = True
        self._write(h2.goaway(self._last_stream_id, h2.NO_ERROR))
        self._flush()
        if not self._streams:
            self._close()

    def abort(self) -> None:
        """Close now, cancelling the calls still open."""
        if self.transport is not None:
            self.transport.abort()

    def _close(self) -> None:
        if self.transport is not None and not self._closed:
            self._flush()
            self._closed = True
            self.transport.close()

    def _arm_keepalive(self) -> None:
        interval = self.server.options.keepalive_time_ms / 1000.0
        if interval > 0 and interval < 10**8:
            self._keepalive_handle = self.loop.call_later(interval, self._keepalive)

    def _keepalive(self) -> None:
        self._keepalive_handle = None
        if self._closed:
            return
        options = self.server.options
        if self._preface and (self._streams or options.keepalive_permit_without_calls):
            self._write(h2.frame(h2.PING, 0, 0, b"pyserve\x00"))
            self._flush()
            if self._keepalive_timeout is None:
                self._keepalive_timeout = self.loop.call_later(
                    options.keepalive_timeout_ms / 1000.0, self._keepalive_expired)
        self._arm_keepalive()

    def _keepalive_expired(self) -> None:
        self._keepalive_timeout = None
        log.debug("gRPC connection from %s: keepalive ping not answered", self.peer)
        self.abort()
