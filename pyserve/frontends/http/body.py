"""Reading request bodies with a size cap, including compressed ones.

The cap (``--http-max-input-size``) is enforced from ``Content-Length`` before anything is
read, while streaming for chunked bodies, and on the decompressed size for gzip/deflate, so
an oversized or zip-bomb body is refused without the memory being allocated. As in Triton,
the cap is on the JSON of an infer request and on a raw binary body
(``Inference-Header-Content-Length: 0``): the binary tensor data that follows a JSON header is
bounded by this machine's memory instead (``infer_body_limit``). The refusals use Triton's
words, which its test scripts match.
"""

from __future__ import annotations

import os
import zlib

from starlette.requests import ClientDisconnect, Request

from pyserve.api.errors import InferError

DEFAULT_MAX_INPUT_SIZE = 64 * 1024 * 1024
"""Triton's default ``--http-max-input-size`` (64 MiB)."""


def _machine_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


BINARY_DATA_LIMIT = _machine_memory()
"""The most binary tensor bytes an HTTP infer request may carry: the machine's memory (a
larger one could never be held)."""


def too_large(limit: int, json_limit: int | None = None, *, length: int | None = None,
              raw: bool = False) -> InferError:
    """The error for a body over ``limit``.

    :param json_limit: ``--http-max-input-size`` when ``limit`` is an infer body's that binary
        data raised above it (``infer_body_limit``).
    :param length: the body's length where it is known (its ``Content-Length``); else the body
        was refused as it streamed in, once it passed ``limit``.
    :param raw: the body is one raw binary input (``Inference-Header-Content-Length: 0``).
    """
    if json_limit is not None and limit > json_limit:
        return InferError.invalid(
            f"request body is larger than {limit} bytes: its binary data may not exceed this machine's "
            f"memory ({BINARY_DATA_LIMIT} bytes)"
        )
    size = f"more than {limit}" if length is None else str(length)
    if raw:
        return InferError.invalid(
            f"Raw input has a byte_size ({size} bytes) that exceeds the maximum allowed value of {limit} "
            f"bytes. {_RAISE_IT}"
        )
    return InferError.invalid(
        f"request JSON size of {size} bytes exceeds the maximum allowed input size of {limit} bytes. "
        f"{_RAISE_IT}"
    )


_RAISE_IT = "Use --http-max-input-size to increase the limit."


def infer_body_limit(header_length: bytes | None, content_encoding: bytes | None, limit: int) -> int:
    """The most bytes the body of an infer request may have, from its headers.

    ``limit`` (``--http-max-input-size``) caps its JSON: the whole body, or, with
    ``Inference-Header-Content-Length``, the JSON header, while the binary data after it may
    be up to ``BINARY_DATA_LIMIT``. A raw binary body (header length 0) and a compressed body
    are capped as a whole (the latter's decompressed size too). A header length that is not an
    integer leaves ``limit`` (the codec refuses it).

    :raises InferError: the JSON header alone is over ``limit``.
    """
    if header_length is None or (content_encoding and content_encoding.strip().lower() not in (b"", b"identity")):
        return limit
    try:
        json_length = int(header_length)
    except ValueError:
        return limit
    if json_length > limit:
        raise too_large(limit, length=json_length)
    if json_length == 0:  # one raw binary input: its bytes are the body
        return limit
    return max(limit, json_length + BINARY_DATA_LIMIT)


async def read_body(request: Request, limit: int, body_limit: int | None = None) -> bytes | bytearray:
    """The request body, decompressed if ``Content-Encoding`` says so.

    :param limit: ``--http-max-input-size``: the body's cap, and its decompressed size's.
    :param body_limit: the body's cap when it is not ``limit`` (``infer_body_limit``).
    :raises InferError: over the limit, bad Content-Length, unknown encoding or corrupt data,
        or the client went away before the body ended (nobody reads that answer; it is not a
        server error and is not logged as one).
    """
    cap = limit if body_limit is None else body_limit
    length_header = request.headers.get("content-length")
    if length_header is not None:
        try:
            declared = int(length_header)
        except ValueError:
            raise InferError.invalid("Content-Length must be an integer") from None
        if declared > cap:
            raw = request.headers.get("inference-header-content-length", "").strip() == "0"
            raise too_large(cap, limit, length=declared, raw=raw)
    chunks: list[bytes] = []
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > cap:
                raise too_large(cap, limit)
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
        raise InferError.invalid(
            f"Decompressed data size exceeds the maximum allowed value of {limit} bytes. {_RAISE_IT}"
        ) from None
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
