"""The server's own settings: its name, readiness, start-up failures and shutdown."""

from __future__ import annotations

from dataclasses import dataclass

from pyserve.server.options import values
from pyserve.server.options.declare import flag, setting


@dataclass(kw_only=True)
class LifecycleOptions:
    """How the server presents itself, when it is ready, and how it starts and stops."""

    server_id: str = setting(flag("--id", dest="server_id", help="server name in server metadata"), default="pyserve")
    exit_timeout_secs: float = setting(
        flag("--exit-timeout-secs", type=float, metavar="SECS", headline=True,
             help="on SIGINT/SIGTERM, wait this long for in-flight requests (default 30)"),
        default=30.0, convert=values.exit_timeout,
    )
    exit_on_error: bool = setting(
        flag("--exit-on-error", type=values.boolean, nargs="?", const=True, metavar="BOOL",
             help="exit if any model fails to load at startup (default true, as Triton; false: serve the others)"),
        default=True,
    )
    strict_readiness: bool = setting(  # ready only while every model version is READY
        flag("--strict-readiness", type=values.boolean, metavar="BOOL",
             help="ready only while every model is ready (default true, as Triton); false: while serving"),
        default=True,
    )
