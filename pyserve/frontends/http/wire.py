"""Ready-made bytes of HTTP/1.1 answers: status lines, ``100 Continue``, and the limits on
joining an answer into one write."""

from __future__ import annotations

from http import HTTPStatus

SINGLE_WRITE_LIMIT = 1 << 16
"""Bodies up to this size are joined to the head; larger ones go out with ``writelines``."""
WRITE_PIECE = 1 << 20
"""Larger parts of an answer are handed to the transport this many bytes at a time, each once
the transport has room (so a large tensor is sent from where it lies, not copied first)."""


class BodyParts:
    """A body that goes out as several buffers (an infer answer's JSON header, then each binary
    tensor) and is never joined into one: ``len()`` is its size in bytes, ``bytes()`` joins it
    (for a caller that needs one piece, e.g. to compress it).

    :param buffers: the parts, in order (``bytes`` or views of the tensors' memory).
    """

    __slots__ = ("buffers", "size")

    def __init__(self, buffers: list[bytes | memoryview]) -> None:
        self.buffers = buffers
        self.size = sum(map(len, buffers))  # views are of bytes (format 'B'): len is their size

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return b"".join(self.buffers)

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
