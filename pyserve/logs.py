"""Log set-up in Triton's default line format, and the model status table.

Triton's format: ``<L><MMDD> <hh:mm:ss.uuuuuu> <pid> <file>:<line>] <message>`` where ``L`` is
``I``, ``W``, ``E`` or ``V``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence

_LEVEL_LETTER = {logging.DEBUG: "V", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E", logging.CRITICAL: "E"}


class TritonFormatter(logging.Formatter):
    """Formats records the way Triton's default log format does."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.localtime(record.created)
        micros = int((record.created % 1) * 1_000_000)
        letter = _LEVEL_LETTER.get(record.levelno, "I")
        head = (
            f"{letter}{stamp.tm_mon:02d}{stamp.tm_mday:02d} {time.strftime('%H:%M:%S', stamp)}.{micros:06d} "
            f"{os.getpid()} {record.filename}:{record.lineno}]"
        )
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        return f"{head} {message}"


def configure(verbose: int = 0) -> None:
    """Send pyserve's (and uvicorn's error) logs to stderr; ``verbose >= 1`` shows debug lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TritonFormatter())
    root = logging.getLogger("pyserve")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose > 0 else logging.INFO)
    root.propagate = False
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.handlers[:] = [handler]
    uvicorn_log.setLevel(logging.DEBUG if verbose > 1 else logging.WARNING)
    uvicorn_log.propagate = False


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """An ASCII table like the ones Triton prints at startup."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(cells: Sequence[str]) -> str:
        return "|" + "|".join(f" {c:<{w}} " for c, w in zip(cells, widths)) + "|"

    out = [rule, line(headers), rule]
    out += [line(row) for row in rows]
    out.append(rule)
    return "\n".join(out)
