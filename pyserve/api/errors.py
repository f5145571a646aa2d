"""Transport-neutral errors.

Every error the core raises or a backend returns is an ``InferError`` carrying an
``ErrorCode``. The codes are Triton's ``TRITONSERVER_Error_Code`` values; the HTTP and gRPC
frontends map them to status codes (``pyserve.frontends.http.errors``, and the gRPC frontend), so this
module imports nothing from either transport.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Triton's error codes, with the same numbering as ``TRITONSERVER_Error_Code``."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7


class InferError(Exception):
    """An error for one request (or one call of the server API).

    Backends may return it (or raise it) from ``pyserve_execute``; the frontends turn it into
    an HTTP ``{"error": message}`` body or a gRPC status with the message.

    :param message: what went wrong, written for the client.
    :param code: the error class; decides the HTTP / gRPC status.
    """

    __slots__ = ("code", "message")

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    def __repr__(self) -> str:
        return f"InferError({self.message!r}, {self.code.name})"

    @classmethod
    def invalid(cls, message: str) -> InferError:
        """An ``INVALID_ARG`` error: the client sent something the model cannot take."""
        return cls(message, ErrorCode.INVALID_ARG)

    @classmethod
    def not_found(cls, message: str) -> InferError:
        """A ``NOT_FOUND`` error: unknown model, version or region."""
        return cls(message, ErrorCode.NOT_FOUND)

    @classmethod
    def unavailable(cls, message: str) -> InferError:
        """An ``UNAVAILABLE`` error: the server or model cannot take requests now."""
        return cls(message, ErrorCode.UNAVAILABLE)

    @classmethod
    def unsupported(cls, message: str) -> InferError:
        """An ``UNSUPPORTED`` error: a feature this server or model does not offer."""
        return cls(message, ErrorCode.UNSUPPORTED)


class ModelConfigError(ValueError):
    """A model's configuration is invalid; the message names the file, line or field."""


class ModelFileError(ValueError):
    """A model's own file is the problem: it is missing, cannot be parsed, or fails to import.
    The message names the file and says what is wrong.

    Backends raise it (or a subclass) from their hooks: the model's unavailable reason is then
    the message itself, not labelled as a failure of the load step that ran into it
    (auto-complete of the config, model creation).
    """


class ModelFileNotFound(ModelFileError, FileNotFoundError):  # noqa: N818 - named as what it reports
    """A file a model needs (its weights, its model.py) is not there; the message names the file."""
