"""The log settings of ``pyserve run`` (``--log-*``): they configure this process's logging
(``pyserve.logs``), so they are not part of ``ServerOptions``."""

from __future__ import annotations

from dataclasses import dataclass

from pyserve import logs
from pyserve.server.options import values
from pyserve.server.options.declare import OPERATIONS, flag, setting


@dataclass(kw_only=True)
class LogOptions:
    """What is logged, in which format, and where."""

    verbose: int = setting(
        flag("--log-verbose", type=int, metavar="N", headline=True, help="verbose logging level (0 = off)"),
        default=0, convert=values.at_least_zero("--log-verbose"),
    )
    info: bool = setting(flag("--log-info", type=values.boolean, metavar="BOOL", group=OPERATIONS,
                              help="log info lines (default true)"), default=True)
    warning: bool = setting(flag("--log-warning", type=values.boolean, metavar="BOOL", group=OPERATIONS,
                                 help="log warnings (default true)"), default=True)
    error: bool = setting(flag("--log-error", type=values.boolean, metavar="BOOL", group=OPERATIONS,
                               help="log errors (default true)"), default=True)
    format: str = setting(flag("--log-format", choices=["default", "ISO8601", "json"], group=OPERATIONS,
                               help="log line format (default: Triton's default)"), default="default")
    file: str | None = setting(flag("--log-file", metavar="PATH", group=OPERATIONS,
                                    help="write the log here instead of stderr"), default=None)

    def configure(self) -> None:
        """Configure this process's logging with these settings (``pyserve.logs.configure``).

        :raises ValueError: the log file cannot be opened (the message names ``--log-file``).
        """
        try:
            logs.configure(self.verbose, info=self.info, warning=self.warning, error=self.error,
                           log_format=self.format, log_file=self.file)
        except OSError as exc:
            raise ValueError(f"--log-file '{self.file}': {exc.strerror or exc}") from None
