"""Ready-made bytes of HTTP/1.1 answers: status lines, ``100 Continue``, and the limits on
joining an answer into one write."""

from __future__ import annotations

from http import HTTPStatus

SINGLE_WRITE_LIMIT = 1 << 16
"""Bodies up to this size are joined to the head; larger ones go out with ``writelines``."""

_STATUS_LINES: dict[int, bytes] = {
    int(s): f"HTTP/1.1 {int(s)} {s.phrase}\r\n".encode("latin-1") for s in HTTPStatus
}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
"""The interim answer to ``Expect: 100-continue``."""
JSON_HEADS: dict[int, bytes] = {}
"""Status line + JSON content-type header, by status (filled by ``HttpProtocol._write_reply``)."""
NO_BODY_STATUS = frozenset({204, 304})
"""Statuses whose answer never has a body."""


def status_line(status: int) -> bytes:
    """``HTTP/1.1 <status> <phrase>\\r\\n`` (no phrase for a status ``http.HTTPStatus`` does not name)."""
    line = _STATUS_LINES.get(status)
    return line if line is not None else f"HTTP/1.1 {status} \r\n".encode("latin-1")
