"""HTTP/2 framing for pyserve's gRPC server (RFC 9113), kept to what a gRPC server needs.

Frames are built and parsed here; connection state lives in :mod:`pyserve.frontends.grpc.connection`
(and the layers it is made of).
Header blocks are decoded with the ``hpack`` package (HPACK, RFC 7541); a block that leaves the
decoding table as it was decodes to the same headers while the table stays unchanged, so such
blocks are remembered by their bytes (the common case: a client repeating one call) until a
block changes the table.
Headers the server sends are literals that never enter the peer's table, so encoding needs
no state at all.
"""

from __future__ import annotations

import re
from typing import Final

from hpack import Decoder, HPACKError

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types
DATA: Final = 0x0
HEADERS: Final = 0x1
PRIORITY: Final = 0x2
RST_STREAM: Final = 0x3
SETTINGS: Final = 0x4
PUSH_PROMISE: Final = 0x5
PING: Final = 0x6
GOAWAY: Final = 0x7
WINDOW_UPDATE: Final = 0x8
CONTINUATION: Final = 0x9

# flags
END_STREAM: Final = 0x1
ACK: Final = 0x1
END_HEADERS: Final = 0x4
PADDED: Final = 0x8
PRIORITY_FLAG: Final = 0x20

# settings identifiers
HEADER_TABLE_SIZE: Final = 0x1
ENABLE_PUSH: Final = 0x2
MAX_CONCURRENT_STREAMS: Final = 0x3
INITIAL_WINDOW_SIZE: Final = 0x4
MAX_FRAME_SIZE: Final = 0x5
MAX_HEADER_LIST_SIZE: Final = 0x6

# error codes
NO_ERROR: Final = 0x0
PROTOCOL_ERROR: Final = 0x1
INTERNAL_ERROR: Final = 0x2
FLOW_CONTROL_ERROR: Final = 0x3
STREAM_CLOSED: Final = 0x5
FRAME_SIZE_ERROR: Final = 0x6
REFUSED_STREAM: Final = 0x7
CANCEL: Final = 0x8
COMPRESSION_ERROR: Final = 0x9
ENHANCE_YOUR_CALM: Final = 0xB

DEFAULT_WINDOW: Final = 65_535
DEFAULT_MAX_FRAME: Final = 16_384
MAX_WINDOW: Final = 2**31 - 1


class ConnectionError_(Exception):  # noqa: N801 - the builtin name is taken
    """A connection error (RFC 9113 §5.4.1): the connection ends with GOAWAY ``code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame_header(kind: int, flags: int, stream_id: int, length: int) -> bytes:
    """The 9-byte header of a frame whose payload is written separately (large DATA)."""
    return bytes((length >> 16, (length >> 8) & 0xFF, length & 0xFF, kind, flags)) + stream_id.to_bytes(4, "big")


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame: the 9-byte header and ``payload``."""
    return frame_header(kind, flags, stream_id, len(payload)) + payload


def unpad(payload: memoryview) -> memoryview:
    """The data of a PADDED frame's payload: without its pad length byte and its padding.

    :raises ConnectionError_: PROTOCOL_ERROR when the pad length does not fit the payload.
    """
    if not payload:
        raise ConnectionError_(PROTOCOL_ERROR, "padded frame without a pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise ConnectionError_(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1:len(payload) - pad]


def split_frames(buffer: bytes) -> tuple[list[tuple[int, int, int, bytes]], bytes]:
    """The whole frames at the start of ``buffer`` as ``(type, flags, stream id, payload)``, and
    the bytes left over (a frame not complete yet). For clients and test peers; the server's
    connection parses in place instead (pyserve.frontends.grpc.frame_reader)."""
    frames = []
    position, end = 0, len(buffer)
    while end - position >= 9:
        length = int.from_bytes(buffer[position:position + 3], "big")
        if end - position - 9 < length:
            break
        stream_id = int.from_bytes(buffer[position + 5:position + 9], "big") & 0x7FFFFFFF
        frames.append((buffer[position + 3], buffer[position + 4], stream_id, buffer[position + 9:position + 9 + length]))
        position += 9 + length
    return frames, buffer[position:]


def settings(values: dict[int, int]) -> bytes:
    """A SETTINGS frame carrying ``values``."""
    return frame(SETTINGS, 0, 0, b"".join(key.to_bytes(2, "big") + value.to_bytes(4, "big") for key, value in values.items()))


def window_update(stream_id: int, increment: int) -> bytes:
    """A WINDOW_UPDATE frame."""
    return frame(WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))


def rst_stream(stream_id: int, code: int) -> bytes:
    """An RST_STREAM frame."""
    return frame(RST_STREAM, 0, stream_id, code.to_bytes(4, "big"))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    """A GOAWAY frame."""
    return frame(GOAWAY, 0, 0, last_stream_id.to_bytes(4, "big") + code.to_bytes(4, "big") + debug)


# -- HPACK ------------------------------------------------------------------------------------


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """HPACK integer encoding (RFC 7541 §5.1) with the high bits of the first byte ``first``."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing and a literal name (RFC 7541 §6.2.2)."""
    return b"\x00" + _integer(len(name), 7, 0) + name + _integer(len(value), 7, 0) + value


STATUS_200: Final = b"\x88"
"""``:status: 200``: index 8 of the static table."""


class HeaderDecoder:
    """Decodes one connection's request header blocks (the connection's HPACK state).

    A block is remembered by its bytes only while the dynamic table stays the one it was
    decoded against: any block that changes the table (an insertion, an eviction, a size
    update) forgets every remembered block, so an index always means what RFC 7541 says it
    means at that point of the connection.

    :param max_header_list_size: the decoded size (RFC 7541 §4.1) above which a block is refused.
    """

    def __init__(self, max_header_list_size: int) -> None:
        self._decoder = Decoder(max_header_list_size=max_header_list_size)
        self._table = self._decoder.header_table
        self._remembered: dict[bytes, tuple[list[tuple[str, str]], str]] = {}

    def decode(self, block: bytes) -> tuple[list[tuple[str, str]], str]:
        """The ``(name, value)`` pairs of ``block``, in order, and why they do not form a valid
        HTTP/2 field section ("" when they do: RFC 9113 §8.2 and §8.3, see ``field_problem``).

        :raises ConnectionError_: COMPRESSION_ERROR for a block that is not valid HPACK.
        """
        remembered = self._remembered.get(block)
        if remembered is not None:
            return remembered
        entries = self._table.dynamic_entries
        size, first, limit = len(entries), entries[0] if entries else None, self._table.maxsize
        try:
            headers: list[tuple[str, str]] = self._decoder.decode(block, raw=False)  # type: ignore[assignment]
        except (HPACKError, ValueError, UnicodeDecodeError) as exc:  # hpack raises all three for bad input
            # the type only: hpack's messages show object addresses of this process
            raise ConnectionError_(COMPRESSION_ERROR, f"invalid header block ({type(exc).__name__})") from None
        result = (headers, field_problem(headers))
        entries = self._table.dynamic_entries
        if len(entries) == size and (entries[0] if entries else None) is first and self._table.maxsize == limit:
            if len(self._remembered) >= 256:  # headers that vary per call (e.g. ids): keep the set small
                self._remembered.clear()
            self._remembered[bytes(block)] = result
        else:  # the table changed: blocks remembered so far may now mean other headers
            self._remembered.clear()
        return result


_PSEUDO = frozenset({":method", ":scheme", ":path", ":authority", ":protocol"})
_CONNECTION_SPECIFIC = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"})


def field_problem(headers: list[tuple[str, str]]) -> str:
    """Why decoded request headers are malformed (RFC 9113 §8.2, §8.3), or "".

    Field names must be lower case; pseudo-header fields must be request ones and come before
    every regular field; connection-specific fields are not allowed, nor ``te`` other than
    ``trailers``.
    """
    regular = False
    for name, value in headers:
        if name.startswith(":"):
            if regular:
                return f"pseudo-header field '{name}' after a regular field"
            if name not in _PSEUDO:
                return f"unknown pseudo-header field '{name}'"
        else:
            regular = True
            if name in _CONNECTION_SPECIFIC or (name == "te" and value != "trailers"):
                return f"connection-specific header field '{name}'"
        if not name.islower() and name != name.lower():
            return f"header field name '{name}' is not lower case"
    return ""


# -- gRPC header values -----------------------------------------------------------------------

_TIMEOUT = re.compile(r"^(\d{1,8})([HMSmun])$")
_TIMEOUT_UNIT = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def parse_timeout(value: str) -> float | None:
    """Seconds of a ``grpc-timeout`` value (``"100m"``), or None if it is malformed."""
    match = _TIMEOUT.match(value)
    if match is None:
        return None
    return int(match.group(1)) * _TIMEOUT_UNIT[match.group(2)]


_UNRESERVED = frozenset(range(0x20, 0x7F)) - {ord("%")}


def percent_encode(message: str) -> bytes:
    """A ``grpc-message`` value: UTF-8, with bytes outside printable ASCII and ``%`` as ``%XX``."""
    raw = message.encode("utf-8", "replace")
    if all(byte in _UNRESERVED for byte in raw):
        return raw
    return b"".join(bytes((byte,)) if byte in _UNRESERVED else b"%%%02X" % byte for byte in raw)
