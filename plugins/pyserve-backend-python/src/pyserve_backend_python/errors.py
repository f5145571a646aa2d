"""``TritonError`` / ``TritonModelException`` and their mapping to pyserve's ``InferError``."""

from __future__ import annotations

from pyserve import ErrorCode, InferError


class TritonError:
    """An error a Python model attaches to a response (Triton's ``pb_utils.TritonError``).

    Callers may rely on ``message()`` and ``code()`` returning what was given, and on the code
    constants having Triton's ``TRITONSERVER_Error_Code`` values (``INTERNAL`` = 1, ...). As in
    Triton, the constants and ``code()`` are enum members (``.name``, ``.value``); they are
    ``IntEnum`` members, so they also compare equal to the plain numbers.
    It is a value, not an exception: raise ``TritonModelException`` to fail an execute.
    """

    UNKNOWN = ErrorCode.UNKNOWN
    INTERNAL = ErrorCode.INTERNAL
    NOT_FOUND = ErrorCode.NOT_FOUND
    INVALID_ARG = ErrorCode.INVALID_ARG
    UNAVAILABLE = ErrorCode.UNAVAILABLE
    UNSUPPORTED = ErrorCode.UNSUPPORTED
    ALREADY_EXISTS = ErrorCode.ALREADY_EXISTS
    CANCELLED = ErrorCode.CANCELLED

    __slots__ = ("_code", "_message")

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = str(message)
        self._code = int(code)

    def message(self) -> str:
        """The error text."""
        return self._message

    def code(self) -> ErrorCode | int:
        """The error code: the class constant (an ``ErrorCode`` member) for a known code, the
        int given otherwise."""
        try:
            return ErrorCode(self._code)
        except ValueError:
            return self._code

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"

    def to_infer_error(self) -> InferError:
        """The server-side error (unknown codes become INTERNAL)."""
        try:
            code = ErrorCode(self._code)
        except ValueError:
            code = ErrorCode.INTERNAL
        return InferError(self._message, code)

    @classmethod
    def from_infer_error(cls, error: InferError) -> TritonError:
        """The model-side view of a server error (BLS responses)."""
        return cls(error.message, int(error.code))


class TritonModelException(Exception):
    """Raised by Python models (and by pb_utils calls that fail) to signal an error.

    Raising it from ``initialize`` makes the model UNAVAILABLE; from ``execute``, every
    request of the batch gets an error response with the message.
    """


def as_triton_error(error: object) -> TritonError:
    """Coerce what a model passed as ``error=`` (TritonError, exception, str) to a TritonError."""
    if isinstance(error, TritonError):
        return error
    if isinstance(error, InferError):
        return TritonError.from_infer_error(error)
    return TritonError(str(error))
