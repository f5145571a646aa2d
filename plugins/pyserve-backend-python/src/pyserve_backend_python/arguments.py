"""Argument checks of ``pb_utils`` constructors, raising what Triton's pybind11 bindings raise.

Triton's ``pb_utils`` classes are C++ bindings: an argument of the wrong type (``None`` for a
name, a list or an integer) raises ``TypeError`` before any of the class's own checks, which
raise ``TritonModelException``. Text arguments accept ``bytes`` as pybind11 converts them to
``std::string`` (Triton's BLS example passes ``model_name=b"add_sub"``); pyserve decodes them as
UTF-8.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def text(value: Any, what: str) -> str:
    """``value`` as a ``str`` (``bytes`` decoded as UTF-8).

    :raises TypeError: neither ``str`` nor UTF-8 ``bytes``.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise TypeError(f"{what} must be a str, got bytes that are not UTF-8") from None
    raise TypeError(f"{what} must be a str, got {type(value).__name__}")


def integer(value: Any, what: str) -> int:
    """``value`` as an ``int``.

    :raises TypeError: not an integer (``None``, a float, a str).
    """
    if isinstance(value, int):
        return int(value)
    index = getattr(type(value), "__index__", None)  # numpy integers
    if index is not None:
        return int(index(value))
    raise TypeError(f"{what} must be an int, got {type(value).__name__}")


def sequence(value: Any, what: str) -> list[Any]:
    """An iterable argument (a list of tensors, of names) as a list.

    :raises TypeError: ``None``, a ``str`` or anything that is not iterable.
    """
    if type(value) is list or type(value) is tuple:  # the usual case, without the ABC check
        return list(value)
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"{what} must be a list, got {type(value).__name__}")
    if not isinstance(value, Iterable):
        raise TypeError(f"{what} must be a list, got {type(value).__name__}")
    return list(value)


def texts(value: Any, what: str) -> tuple[str, ...]:
    """A list of names (``requested_output_names``) as a tuple of ``str``.

    :raises TypeError: not a list, or an element that is not text.
    """
    return tuple(text(item, f"each of {what}") for item in sequence(value, what))
