"""``ErrorCode`` → HTTP status, and the ``{"error": ...}`` body every failure carries."""

from __future__ import annotations

import orjson
from starlette.responses import Response

from pyserve.api.errors import ErrorCode, InferError

HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.UNKNOWN: 400,
    ErrorCode.INTERNAL: 500,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.INVALID_ARG: 400,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNSUPPORTED: 501,
    ErrorCode.ALREADY_EXISTS: 400,
    ErrorCode.CANCELLED: 400,
}
"""Triton's mapping (``HttpCodeFromError``)."""

JSON_HEADERS: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]
"""The headers of every error answer and of the usual infer answer (plus its content-length);
shared, never mutated: the HTTP/1.1 server recognises them by identity."""

Reply = tuple[int, bytes, list[tuple[bytes, bytes]]]
"""``(status, body, headers)`` of an answer, content-length not included."""


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


def error_reply(error: InferError) -> Reply:
    """The ``{"error": ...}`` answer for ``error``."""
    return HTTP_STATUS[error.code], error_body(error.message), JSON_HEADERS


def error_response(error: InferError) -> Response:
    return Response(error_body(error.message), HTTP_STATUS[error.code], media_type="application/json")


def status_error(status: int, message: str) -> Response:
    return Response(error_body(message), status, media_type="application/json")
