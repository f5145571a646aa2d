"""``--http-header-forward-pattern`` / ``--grpc-header-forward-pattern``: request headers (gRPC
metadata) whose names match a regular expression become string parameters of the request, as
in Triton.

The pattern is searched for anywhere in the header name and matches case-insensitively unless it
starts with ``(?-i)``. HTTP header names arrive lower-cased, as gRPC metadata keys always are. A
matching header whose name is a reserved parameter (``priority``, ``triton_*``, ...) makes the
request fail with a 400 / INVALID_ARGUMENT; a forwarded header replaces a body parameter of the
same name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from pyserve.api.errors import InferError
from pyserve.api.inference import InferRequest
from pyserve.repository.tensor_checks import RESERVED_PARAMETERS

_CASE_SENSITIVE = "(?-i)"


class HeaderForwarding:
    """A compiled forward pattern; safe to share between threads (it holds no state).

    :param pattern: the regular expression (Python ``re`` syntax).
    :raises ValueError: the pattern does not compile (the message names it).
    """

    __slots__ = ("pattern", "_regex")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        try:
            if pattern.startswith(_CASE_SENSITIVE):
                self._regex = re.compile(pattern[len(_CASE_SENSITIVE):])
            else:
                self._regex = re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise ValueError(f"header forward pattern '{pattern}' is not a valid regular expression: {exc}") from None

    def select(self, headers: Iterable[tuple[str, str | bytes]]) -> list[tuple[str, str]]:
        """The ``(name, value)`` pairs to forward, values as strings (bytes read as Latin-1).

        :raises InferError: a matching header is named like a reserved parameter.
        """
        search = self._regex.search
        chosen: list[tuple[str, str]] = []
        for name, value in headers:
            if not search(name):
                continue
            if name in RESERVED_PARAMETERS or name.startswith("triton_"):
                raise InferError.invalid(
                    f"header '{name}' matches the header forward pattern, but '{name}' is a parameter "
                    "reserved for Triton usage"
                )
            chosen.append((name, value.decode("latin-1") if isinstance(value, bytes) else value))
        return chosen

    def apply(self, headers: Iterable[tuple[str, str | bytes]], request: InferRequest) -> None:
        """Add the matching headers to ``request.parameters``.

        :raises InferError: as :meth:`select`.
        """
        for name, value in self.select(headers):
            request.parameters[name] = value


def compile_forwarding(pattern: str) -> HeaderForwarding | None:
    """``HeaderForwarding`` for a non-empty pattern, else None (forwarding off).

    :raises ValueError: the pattern does not compile.
    """
    return HeaderForwarding(pattern) if pattern else None
