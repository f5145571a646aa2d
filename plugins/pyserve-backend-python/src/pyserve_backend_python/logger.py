"""``pb_utils.Logger``: Triton's model logging API, written to Python's ``logging``.

Records go to the logger ``pyserve.python_model`` (so the server's log settings apply), with
the calling model.py file and line as the record's location. ``VERBOSE`` maps to ``DEBUG``.
As Triton writes a model's messages, each is quoted and escaped like a JSON string, so a
message cannot break a log line or pass for a server line (``"a \"b\"\\nc"``).
"""

from __future__ import annotations

import enum
import json
import logging

_log = logging.getLogger("pyserve.python_model")


class _Quoted:
    """A model's message, quoted and escaped when (and only if) the record is written."""

    __slots__ = ("message",)

    def __init__(self, message: object) -> None:
        self.message = message

    def __str__(self) -> str:
        return json.dumps(str(self.message), ensure_ascii=False)


class LogLevel(enum.IntEnum):
    """Triton's log levels for ``Logger.log``."""

    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


_TO_LOGGING = {
    LogLevel.INFO: logging.INFO,
    LogLevel.WARNING: logging.WARNING,
    LogLevel.ERROR: logging.ERROR,
    LogLevel.VERBOSE: logging.DEBUG,
}


class Logger:
    """Static logging methods (``pb_utils.Logger.log_info("...")``); also usable on an instance."""

    LogLevel = LogLevel
    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: int = LogLevel.INFO) -> None:
        """Log ``message`` at ``level``."""
        _log.log(_TO_LOGGING.get(LogLevel(level), logging.INFO), "%s", _Quoted(message), stacklevel=2)

    @staticmethod
    def log_info(message: str) -> None:
        """Log at INFO."""
        _log.info("%s", _Quoted(message), stacklevel=2)

    @staticmethod
    def log_warn(message: str) -> None:
        """Log at WARNING."""
        _log.warning("%s", _Quoted(message), stacklevel=2)

    @staticmethod
    def log_error(message: str) -> None:
        """Log at ERROR."""
        _log.error("%s", _Quoted(message), stacklevel=2)

    @staticmethod
    def log_verbose(message: str) -> None:
        """Log at VERBOSE (``logging.DEBUG``)."""
        _log.debug("%s", _Quoted(message), stacklevel=2)
