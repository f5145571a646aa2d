"""The HTTP settings: the address and port, the server, its limits and what it serves."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyserve.server.options import values
from pyserve.server.options.declare import OPERATIONS, TUNING, flag, setting

if TYPE_CHECKING:
    from pyserve.frontends.restricted import Restriction

MAX_INPUT_SIZE = 64 * 1024 * 1024
"""``--http-max-input-size``'s default (``pyserve.frontends.http.body.DEFAULT_MAX_INPUT_SIZE``)."""
HEADER_TIMEOUT_SECS = 30.0
"""``--http-header-timeout-secs``'s default (``pyserve.frontends.http.server.HEADER_TIMEOUT``)."""
BODY_TIMEOUT_SECS = 300.0
"""``--http-body-timeout-secs``'s default (``pyserve.frontends.http.server.BODY_TIMEOUT``)."""


@dataclass(kw_only=True)
class HttpOptions:
    """The HTTP port (``--http-*``); ``host`` is also the other services' default address."""

    host: str = setting(
        flag("--host", "--http-address", headline=True, help="address to listen on (default 0.0.0.0, as Triton)"),
        default="0.0.0.0",
    )
    http_port: int = setting(
        flag("--http-port", type=values.port, headline=True, help="HTTP port (default 8000; 0 = any free port)"),
        default=8000,
    )
    allow_http: bool = setting(flag("--allow-http", type=values.boolean, metavar="BOOL"), default=True)
    allow_openai: bool = setting(  # the OpenAI-compatible /v1 routes on the HTTP port
        flag("--allow-openai", type=values.boolean, metavar="BOOL",
             help="serve the OpenAI-compatible /v1 routes on the HTTP port (default true)"),
        default=True,
    )
    http_max_input_size: int = setting(
        flag("--http-max-input-size", type=values.http_max_input_size, metavar="BYTES",
             help="largest request body accepted (default 64 MiB); of an infer request with binary "
                  "tensor data, the largest JSON header (the data may be up to the machine's memory)"),
        default=MAX_INPUT_SIZE,
    )
    http_max_connections: int = setting(  # 0: from the descriptor limit (pyserve.frontends.limits)
        flag("--http-max-connections", type=values.non_negative_int, metavar="N",
             help="open connections past which the longest idle one is closed, or, with none idle, "
                  "new ones are answered 503 (default 0: half the descriptor limit less a reserve, "
                  "at most 16384)"),
        default=0,
    )
    http_header_timeout_secs: float = setting(  # 0: no total limit
        flag("--http-header-timeout-secs", type=values.non_negative_float, metavar="SECS",
             help="a request's line and headers must arrive within this (default 30; 0 = no limit)"),
        default=HEADER_TIMEOUT_SECS,
    )
    http_body_timeout_secs: float = setting(  # 0: no total limit
        flag("--http-body-timeout-secs", type=values.non_negative_float, metavar="SECS",
             help="a request's body must arrive within this of its headers (default 300; 0 = no limit)"),
        default=BODY_TIMEOUT_SECS,
    )
    http_header_forward_pattern: str = setting(  # pyserve.dataplane.header_forwarding
        flag("--http-header-forward-pattern", metavar="REGEX",
             help="forward HTTP headers whose name matches REGEX as request parameters "
                  "(case-insensitive unless REGEX starts with (?-i))"),
        default="",
    )
    reuse_http_port: bool = setting(  # SO_REUSEPORT: other servers may share the port
        flag("--reuse-http-port", type=values.boolean, metavar="BOOL",
             help="let other servers listen on the same HTTP port (SO_REUSEPORT)"),
        default=False,
    )
    http_restricted_api: Mapping[str, Restriction] = setting(  # category → header
        flag("--http-restricted-api", action="append", metavar="APIS:KEY=VALUE", group=OPERATIONS,
             help="require header KEY: VALUE for the listed HTTP API categories (repeatable)"),
        default_factory=dict, convert=values.http_restrictions,
    )
    status_page: bool = setting(  # GET /status (and / for browsers): pyserve.frontends.status
        flag("--status-page", type=values.boolean, metavar="BOOL", group=OPERATIONS,
             help="serve the status page on the HTTP port at /status (and / for browsers; default true)"),
        default=True,
    )
    http_server: str = setting(  # "pyserve" (native HTTP/1.1) or "uvicorn"
        flag("--http-server", choices=["pyserve", "uvicorn"], group=TUNING,
             help="the HTTP/1.1 server on --http-port: pyserve's own (default) or uvicorn"),
        default="pyserve",
    )
