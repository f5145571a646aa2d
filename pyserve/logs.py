"""Logging: Triton's line formats, the runtime logging settings, and the model status table.

Triton's default format: ``<L><MMDD> <hh:mm:ss.uuuuuu> <pid> <file>:<line>] <message>`` where
``L`` is ``I``, ``W``, ``E`` or ``V``; ``ISO8601``: ``<YYYY-MM-DDThh:mm:ssZ> <L> <pid>
<file>:<line>] <message>``; ``json`` (pyserve's own): one JSON object per line.

The settings (``--log-info``, ``--log-warning``, ``--log-error``, ``--log-verbose``,
``--log-format``, ``--log-file``) live in the process-wide :data:`SETTINGS`, read by the
handler's filter and formatter on every record, so ``update_settings`` (the logging
extension, ``POST /v2/logging`` and gRPC ``LogSettings``) takes effect at once. Whoever must
repeat an update elsewhere (the owner, to its frontend processes) registers with
``add_update_listener``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import orjson

_LEVEL_LETTER = {logging.DEBUG: "V", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E", logging.CRITICAL: "E"}

LOG_FORMATS = ("default", "ISO8601", "json")
"""Accepted ``log_format`` values."""


@dataclass
class LogSettings:
    """The logging extension's settings (field names are its JSON keys)."""

    log_file: str = ""
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "default"


SETTINGS = LogSettings()
"""The process-wide settings every pyserve log handler consults."""

_lock = threading.Lock()
_listeners: list[Callable[[dict[str, Any]], None]] = []
_configured = False
"""Whether ``configure`` installed pyserve's handlers (only then are logger levels managed)."""


class TritonFormatter(logging.Formatter):
    """Formats records in the current ``SETTINGS.log_format`` (Triton's default when unset).

    :param fmt_name: a fixed format; None follows ``SETTINGS.log_format``.
    """

    def __init__(self, fmt_name: str | None = None) -> None:
        super().__init__()
        self.fmt_name = fmt_name

    def format(self, record: logging.LogRecord) -> str:
        fmt = self.fmt_name or SETTINGS.log_format
        letter = _LEVEL_LETTER.get(record.levelno, "I")
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        if fmt == "ISO8601":
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created))
            return f"{stamp} {letter} {os.getpid()} {record.filename}:{record.lineno}] {message}"
        if fmt == "json":
            micros = int((record.created % 1) * 1_000_000)
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{micros:06d}Z"
            return orjson.dumps({
                "timestamp": stamp, "level": record.levelname, "pid": os.getpid(), "logger": record.name,
                "file": record.filename, "line": record.lineno, "message": message,
            }).decode()
        stamp_local = time.localtime(record.created)
        micros = int((record.created % 1) * 1_000_000)
        head = (
            f"{letter}{stamp_local.tm_mon:02d}{stamp_local.tm_mday:02d} "
            f"{time.strftime('%H:%M:%S', stamp_local)}.{micros:06d} "
            f"{os.getpid()} {record.filename}:{record.lineno}]"
        )
        return f"{head} {message}"


class SettingsFilter(logging.Filter):
    """Drops records whose severity the current settings turn off."""

    def filter(self, record: logging.LogRecord) -> bool:
        level = record.levelno
        if level >= logging.ERROR:
            return SETTINGS.log_error
        if level >= logging.WARNING:
            return SETTINGS.log_warning
        if level >= logging.INFO:
            return SETTINGS.log_info
        return SETTINGS.log_verbose_level > 0


def _apply_levels() -> None:
    """Set the logger thresholds from ``SETTINGS`` (cheap early-outs for disabled levels)."""
    if not _configured:
        return
    root = logging.getLogger("pyserve")
    if SETTINGS.log_verbose_level > 0:
        root.setLevel(logging.DEBUG)
    elif SETTINGS.log_info:
        root.setLevel(logging.INFO)
    elif SETTINGS.log_warning:
        root.setLevel(logging.WARNING)
    else:
        root.setLevel(logging.ERROR)
    logging.getLogger("uvicorn.error").setLevel(logging.DEBUG if SETTINGS.log_verbose_level > 1 else logging.WARNING)


def configure(
    verbose: int = 0,
    *,
    info: bool = True,
    warning: bool = True,
    error: bool = True,
    log_format: str = "default",
    log_file: str | None = None,
) -> None:
    """Send pyserve's (and uvicorn's error) logs to stderr or ``log_file``.

    ``verbose >= 1`` shows debug lines. Replaces the current settings.

    :raises ValueError: an unknown ``log_format`` or a negative ``verbose``.
    :raises OSError: ``log_file`` cannot be opened.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"unknown log format '{log_format}' (expected one of {', '.join(LOG_FORMATS)})")
    if verbose < 0:
        raise ValueError("the verbose level must be >= 0")
    handler: logging.Handler
    handler = logging.FileHandler(log_file, encoding="utf-8") if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(TritonFormatter())
    handler.addFilter(SettingsFilter())
    global _configured
    with _lock:
        _configured = True
        SETTINGS.log_file = log_file or ""
        SETTINGS.log_info, SETTINGS.log_warning, SETTINGS.log_error = info, warning, error
        SETTINGS.log_verbose_level = verbose
        SETTINGS.log_format = log_format
        root = logging.getLogger("pyserve")
        for old in root.handlers:
            if isinstance(old, logging.FileHandler):
                old.close()
        root.handlers[:] = [handler]
        root.propagate = False
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.handlers[:] = [handler]
        uvicorn_log.propagate = False
        _apply_levels()


def configuration() -> dict[str, Any]:
    """The keyword arguments of ``configure`` that give another process these settings (the
    keeper of ``pyserve run`` logs as the server does)."""
    return {"verbose": SETTINGS.log_verbose_level, "info": SETTINGS.log_info, "warning": SETTINGS.log_warning,
            "error": SETTINGS.log_error, "log_format": SETTINGS.log_format, "log_file": SETTINGS.log_file or None}


def get_settings() -> dict[str, Any]:
    """The logging extension's JSON object."""
    return asdict(SETTINGS)


def update_settings(changes: Mapping[str, Any]) -> dict[str, Any]:
    """Apply a logging-extension update (all keys checked before any is applied).

    Unknown keys are ignored (logged), as Triton 2.51 ignores them (its own documentation's
    ``log_warnings`` / ``log_errors`` among them).

    :returns: the settings after the update.
    :raises InferError: INVALID_ARG for a read-only key or a bad value.
    """
    from pyserve.api.errors import InferError  # here: the keeper logs through this module without the API

    if not isinstance(changes, Mapping):
        raise InferError.invalid("the logging settings must be a JSON object")
    staged: dict[str, Any] = {}
    for key, value in changes.items():
        if key == "log_file":
            if value != SETTINGS.log_file:
                raise InferError.invalid("'log_file' can not be updated through the logging API")
        elif key in ("log_info", "log_warning", "log_error"):
            if not isinstance(value, bool):
                raise InferError.invalid(f"expect boolean for '{key}'")
            staged[key] = value
        elif key == "log_verbose_level":
            if not isinstance(value, int) or isinstance(value, bool):
                raise InferError.invalid("expect integer for 'log_verbose_level'")
            if value < 0:
                raise InferError.invalid("'log_verbose_level' must be a non-negative integer")
            staged[key] = value
        elif key == "log_format":
            if value not in LOG_FORMATS:
                raise InferError.invalid(
                    f"unknown 'log_format' '{value}'; expected one of {', '.join(LOG_FORMATS)}"
                )
            staged[key] = value
        else:
            logging.getLogger("pyserve.logs").warning("ignoring unknown logging setting '%s'", key)
    with _lock:
        for key, value in staged.items():
            setattr(SETTINGS, key, value)
        _apply_levels()
        listeners = list(_listeners)
    settings = get_settings()
    passed_on = changeable_settings()
    for listener in listeners:
        try:
            listener(dict(passed_on))
        except Exception:  # a listener's failure is not the update's
            logging.getLogger("pyserve.logs").exception("passing on the logging settings failed")
    return settings


def changeable_settings() -> dict[str, Any]:
    """The settings ``update_settings`` may change (all but ``log_file``), as its argument."""
    settings = get_settings()
    del settings["log_file"]
    return settings


def add_update_listener(listener: Callable[[dict[str, Any]], None]) -> None:
    """Call ``listener(changeable_settings())`` after every ``update_settings``, on the thread
    that updated (the event loop's, for the logging extension). It should not block."""
    with _lock:
        _listeners.append(listener)


def remove_update_listener(listener: Callable[[dict[str, Any]], None]) -> None:
    """Stop calling ``listener`` (nothing happens if it is not registered)."""
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)


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
