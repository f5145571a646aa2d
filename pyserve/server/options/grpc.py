"""The gRPC settings: the port, and the flags of ``GrpcOptions``.

``GrpcOptions`` stays with the gRPC server (``pyserve.frontends.grpc.server``); the flags that set
its fields are declared here, keyed by field name (:data:`GRPC_SETTINGS`). Their defaults are
written here too, so that ``--help`` need not import grpc; ``tests/test_options.py`` checks they
are ``GrpcOptions``'s own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyserve.server.options import values
from pyserve.server.options.declare import GRPC, OPERATIONS, TUNING, Setting, flag, nested, setting, spec

if TYPE_CHECKING:
    from pyserve.frontends.grpc.server import GrpcOptions

_BOOL = {"type": values.boolean, "metavar": "BOOL"}

GRPC_SETTINGS: Mapping[str, Setting] = {
    "host": spec(flag("--grpc-address", metavar="HOST", group=GRPC,
                      help="address the gRPC service listens on (default: --host)"), default=""),
    "infer_compression": spec(flag("--grpc-infer-response-compression-level", choices=["none", "low", "medium", "high"],
                                   group=GRPC, help="compress infer responses (gzip) unless 'none'"), default="none"),
    "max_message_bytes": spec(flag("--grpc-max-message-size", type=int, metavar="BYTES", group=GRPC,
                                   help="largest gRPC message sent or received (default 2 GiB - 1)"),
                              default=2**31 - 1),
    "keepalive_time_ms": spec(flag("--grpc-keepalive-time", type=int, metavar="MS", group=GRPC), default=7_200_000),
    "keepalive_timeout_ms": spec(flag("--grpc-keepalive-timeout", type=int, metavar="MS", group=GRPC), default=20_000),
    "keepalive_permit_without_calls": spec(flag("--grpc-keepalive-permit-without-calls", group=GRPC, **_BOOL),
                                           default=False),
    "http2_max_pings_without_data": spec(flag("--grpc-http2-max-pings-without-data", type=int, metavar="N",
                                              group=GRPC), default=2),
    "http2_min_recv_ping_interval_without_data_ms": spec(
        flag("--grpc-http2-min-recv-ping-interval-without-data", type=int, metavar="MS", group=GRPC), default=300_000),
    "http2_max_ping_strikes": spec(flag("--grpc-http2-max-ping-strikes", type=int, metavar="N", group=GRPC), default=2),
    "use_ssl": spec(flag("--grpc-use-ssl", group=GRPC, **_BOOL,
                         help="TLS on the gRPC port (needs --grpc-server-cert and --grpc-server-key)"), default=False),
    "use_ssl_mutual": spec(flag("--grpc-use-ssl-mutual", group=GRPC, **_BOOL,
                                help="TLS, and clients must present a certificate signed by --grpc-root-cert"),
                           default=False),
    "server_cert": spec(flag("--grpc-server-cert", metavar="PEM", group=GRPC), default=""),
    "server_key": spec(flag("--grpc-server-key", metavar="PEM", group=GRPC), default=""),
    "root_cert": spec(flag("--grpc-root-cert", metavar="PEM", group=GRPC), default=""),
    "header_forward_pattern": spec(flag("--grpc-header-forward-pattern", metavar="REGEX", group=GRPC,
                                        help="forward gRPC metadata whose key matches REGEX as request parameters "
                                             "(case-insensitive unless REGEX starts with (?-i))"), default=""),
    "reuse_port": spec(flag("--reuse-grpc-port", group=GRPC, **_BOOL,
                            help="let other servers listen on the same gRPC port (SO_REUSEPORT)"), default=False),
    "max_connections": spec(flag("--grpc-max-connections", type=values.non_negative_int, metavar="N", group=GRPC,
                                 help="open connections past which new ones get GOAWAY (default 0: half the "
                                      "descriptor limit less a reserve, at most 16384)"), default=0),
    "idle_timeout_secs": spec(flag("--grpc-idle-timeout-secs", type=values.non_negative_float, metavar="SECS",
                                   group=GRPC, help="close a connection without calls after this long "
                                                    "(default 300; 0 = never)"), default=300.0),
    "message_timeout_secs": spec(flag("--grpc-message-timeout-secs", type=values.non_negative_float, metavar="SECS",
                                      group=GRPC, help="a request message must arrive whole within this of its "
                                                       "first byte (default 300; 0 = no limit)"), default=300.0),
    "max_connection_buffer": spec(flag("--grpc-max-connection-buffer", type=values.non_negative_int, metavar="BYTES",
                                       group=GRPC, help="bytes of incomplete request messages one connection may "
                                                        "hold (default 0: --grpc-max-message-size)"), default=0),
    "max_server_buffer": spec(flag("--grpc-max-server-buffer", type=values.non_negative_int, metavar="BYTES",
                                   group=GRPC, help="bytes of incomplete request messages all connections may hold "
                                                    "(default 0: a quarter of the machine's memory)"), default=0),
    "restrictions": spec(flag("--grpc-restricted-protocol", action="append", metavar="APIS:KEY=VALUE", group=OPERATIONS,
                              help="require metadata triton-grpc-protocol-KEY: VALUE for the listed gRPC categories"),
                         default_factory=dict, convert=values.grpc_restrictions),
    "implementation": spec(flag("--grpc-server", choices=["pyserve", "grpcio"], group=TUNING,
                                help="gRPC server: pyserve's own HTTP/2 server (default) or grpc.aio"),
                           default="pyserve"),
}
"""The flags of ``GrpcOptions``'s fields, by field name (its ``port`` is ``--grpc-port``)."""


def default_grpc_options() -> GrpcOptions:
    """``GrpcOptions()``, imported only when made (the import brings grpc in)."""
    from pyserve.frontends.grpc.server import GrpcOptions

    return GrpcOptions()


def make_grpc_options(fields: dict[str, Any]) -> GrpcOptions:
    """``GrpcOptions`` from the values of :data:`GRPC_SETTINGS`."""
    from pyserve.frontends.grpc.server import GrpcOptions

    return GrpcOptions(**fields)


@dataclass(kw_only=True)
class GrpcServiceOptions:
    """The gRPC port, and the rest of the gRPC settings (``grpc``, ``GrpcOptions``)."""

    grpc_port: int = setting(flag("--grpc-port", type=values.port, headline=True, help="gRPC port (default 8001)"),
                             default=8001)
    allow_grpc: bool = setting(flag("--allow-grpc", type=values.boolean, metavar="BOOL"), default=True)
    grpc: GrpcOptions = nested(GRPC_SETTINGS, make_grpc_options, default_factory=default_grpc_options)
