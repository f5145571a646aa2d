"""Reading request bodies with a size cap, including compressed ones.

The cap (``--http-max-input-size``) is enforced from ``Content-Length`` before anything is
read, while streaming for chunked bodies, and on the decompressed size for gzip/deflate, so
an oversized or zip-bomb body is refused without the memory being allocated.
"""

from __future__ import annotations

import zlib

from starlette.requests import ClientDisconnect, Request

from pyserve.api.errors import InferError

DEFAULT_MAX_INPUT_SIZE = 64 * 1024 * 1024
"""Triton's default ``--http-max-input-size`` (64 MiB)."""


def too_large(limit: int) -> InferError:
    return InferError.invalid(
        f"request body is larger than the server's limit of {limit} bytes (--http-max-input-size)"
    )


async def read_body(request: Request, limit: int) -> bytes | bytearray:
    """The request body, decompressed if ``Content-Encoding`` says so.

    :raises InferError: over the limit, bad Content-Length, unknown encoding or corrupt data,
        or the client went away before the body ended (nobody reads that answer; it is not a
        server error and is not logged as one).
    """
    length_header = request.headers.get("content-length")
    if length_header is not None:
        try:
            declared = int(length_header)
        except ValueError:
            raise InferError.invalid("Content-Length must be an integer") from None
        if declared > limit:
            raise too_large(limit)
    chunks: list[bytes] = []
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise InferError.invalid("the client disconnected before the request body ended") from None
    body = chunks[0] if len(chunks) == 1 else bytearray().join(chunks)  # writeable tensor views
    return decode_content(body, request.headers.get("content-encoding", ""), limit)


def decode_content(body: bytes | bytearray, content_encoding: str, limit: int) -> bytes | bytearray:
    """Undo ``Content-Encoding`` (gzip, deflate or identity) within the size limit.

    :raises InferError: unknown encoding, corrupt or truncated data, or over the limit.
    """
    encoding = content_encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in _WBITS:
        raise InferError.unsupported(f"unsupported Content-Encoding '{encoding}'; use gzip, deflate or identity")
    try:
        return inflate(body, encoding, limit)
    except TooLarge:
        raise too_large(limit) from None
    except ValueError as exc:
        raise InferError.invalid(f"request body is {exc}") from None


class TooLarge(ValueError):
    """Inflated data would exceed the limit (``inflate``)."""


_WBITS = {"gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}


def inflate(data: bytes | bytearray | memoryview, encoding: str, limit: int) -> bytes:
    """gzip or deflate ``data`` inflated, never to more than ``limit`` bytes (HTTP bodies and
    gRPC messages).

    :raises TooLarge: the inflated data would exceed ``limit``.
    :raises ValueError: an encoding other than gzip/deflate, or data that is not valid or is
        truncated (the message says which).
    """
    wbits = _WBITS.get(encoding)
    if wbits is None:
        raise ValueError(f"not gzip or deflate data (encoding '{encoding}')")
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as exc:
        raise ValueError(f"not valid {encoding} data: {exc}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise TooLarge(f"more than {limit} bytes once decompressed")
    if not inflater.eof:
        raise ValueError(f"truncated {encoding} data")
    return out


def compress(body: bytes, accept_encoding: str) -> tuple[bytes, str | None]:
    """Compress a response body if the client accepts gzip or deflate."""
    accepted = set()
    for part in accept_encoding.split(","):
        name, _, params = part.partition(";")
        quality = params.strip().lower()
        if quality.startswith("q=") and quality[2:].strip() in ("0", "0.0", "0.00", "0.000"):
            continue
        accepted.add(name.strip().lower())
    if "gzip" in accepted:
        c = zlib.compressobj(6, zlib.DEFLATED, zlib.MAX_WBITS | 16)
        return c.compress(body) + c.flush(), "gzip"
    if "deflate" in accepted:
        return zlib.compress(body), "deflate"
    return body, None
