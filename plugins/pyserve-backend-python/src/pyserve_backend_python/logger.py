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

from pyserve_backend_python import arguments

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


_Level = LogLevel  # for annotations inside Logger, whose ``LogLevel`` attribute shadows the class


class Logger:
    """Static logging methods (``pb_utils.Logger.log_info("...")``); also usable on an instance."""

    LogLevel = LogLevel
    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: _Level = LogLevel.INFO) -> None:
        """Log ``message`` at ``level`` (a ``Logger.LogLevel``).

        :raises TypeError: ``message`` is not a str, or ``level`` not a ``LogLevel`` (as
            Triton's binding: a plain int is refused).
        """
        if not isinstance(level, LogLevel):
            raise TypeError(f"level must be a pb_utils.LogLevel, got {type(level).__name__}")
        _log.log(_TO_LOGGING[level], "%s", _Quoted(_message(message)), stacklevel=2)

    @staticmethod
    def log_info(message: str) -> None:
        """Log at INFO. :raises TypeError: ``message`` is not a str."""
        _log.info("%s", _Quoted(_message(message)), stacklevel=2)

    @staticmethod
    def log_warn(message: str) -> None:
        """Log at WARNING. :raises TypeError: ``message`` is not a str."""
        _log.warning("%s", _Quoted(_message(message)), stacklevel=2)

    @staticmethod
    def log_error(message: str) -> None:
        """Log at ERROR. :raises TypeError: ``message`` is not a str."""
        _log.error("%s", _Quoted(_message(message)), stacklevel=2)

    @staticmethod
    def log_verbose(message: str) -> None:
        """Log at VERBOSE (``logging.DEBUG``). :raises TypeError: ``message`` is not a str."""
        _log.debug("%s", _Quoted(_message(message)), stacklevel=2)


def _message(message: object) -> str:
    return arguments.text(message, "the log message")
