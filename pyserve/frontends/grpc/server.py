"""Building the gRPC server: generic handlers from our own service descriptors.

The handlers are made from ``pyserve.protocol.SERVICE_DESCRIPTOR`` (our .proto files in a
private descriptor pool), so no generated ``_pb2_grpc`` module is needed and Triton's own
generated modules can be imported in the same process without a conflict. They are served by
pyserve's own HTTP/2 server (:mod:`pyserve.frontends.grpc.listener`, the default) or by ``grpc.aio``
(``--grpc-server grpcio``); both run the same servicer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from pyserve import protocol as pb
from pyserve.dataplane.interface import ServingPlane
from pyserve.frontends.grpc.codec import WireParts, parse_infer_request
from pyserve.frontends.grpc.servicer import HealthServicer, InferenceServicer
from pyserve.frontends.restricted import Restriction, grpc_interceptor

MAX_MESSAGE_BYTES = 2**31 - 1
"""Default cap on gRPC message size: what protobuf itself can hold (as Triton allows)."""


@dataclass
class GrpcOptions:
    """gRPC settings, named after Triton's ``--grpc-*`` flags."""

    host: str = ""  # empty: the server's --host
    port: int = 8001
    max_message_bytes: int = MAX_MESSAGE_BYTES
    infer_compression: str = "none"  # none | low | medium | high
    keepalive_time_ms: int = 7_200_000
    keepalive_timeout_ms: int = 20_000
    keepalive_permit_without_calls: bool = False
    http2_max_pings_without_data: int = 2
    http2_min_recv_ping_interval_without_data_ms: int = 300_000
    http2_max_ping_strikes: int = 2
    restrictions: Mapping[str, Restriction] = field(default_factory=dict)  # --grpc-restricted-protocol
    implementation: str = "pyserve"  # --grpc-server: pyserve (own HTTP/2) | grpcio (grpc.aio)
    reuse_port: bool = False  # --reuse-grpc-port: SO_REUSEPORT, other servers may share the port
    use_ssl: bool = False  # --grpc-use-ssl: TLS with server_cert / server_key
    use_ssl_mutual: bool = False  # --grpc-use-ssl-mutual: TLS, and clients must present a cert signed by root_cert
    server_cert: str = ""  # --grpc-server-cert (PEM)
    server_key: str = ""  # --grpc-server-key (PEM)
    root_cert: str = ""  # --grpc-root-cert (PEM): the CA client certificates must chain to
    header_forward_pattern: str = ""  # --grpc-header-forward-pattern (pyserve.dataplane.header_forwarding)
    # limits of pyserve's own server (pyserve.frontends.grpc.guard); grpcio applies max_connections and
    # idle_timeout_secs through its channel arguments, not the others
    max_connections: int = 0  # --grpc-max-connections; 0: from the descriptor limit (pyserve.frontends.limits)
    idle_timeout_secs: float = 300.0  # --grpc-idle-timeout-secs: a connection without calls is closed; 0: never
    message_timeout_secs: float = 300.0  # --grpc-message-timeout-secs: a request message must arrive in time; 0: no limit
    max_connection_buffer: int = 0  # --grpc-max-connection-buffer: incomplete messages per connection; 0: max_message_bytes
    max_server_buffer: int = 0  # --grpc-max-server-buffer: all connections; 0: a quarter of memory (at least the above)


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of a TLS gRPC port, checked readable."""

    cert: str
    key: str
    root: str | None  # set for mutual TLS


def tls_files(options: GrpcOptions) -> TlsFiles | None:
    """The TLS settings of ``options`` (None: plaintext), as Triton's ``--grpc-use-ssl*`` flags.

    :raises RuntimeError: a required file is not given or cannot be read (the message names
        the flag and the path).
    """
    if not (options.use_ssl or options.use_ssl_mutual):
        return None
    needed = [("--grpc-server-cert", options.server_cert), ("--grpc-server-key", options.server_key)]
    if options.use_ssl_mutual:
        needed.append(("--grpc-root-cert", options.root_cert))
    for flag, path in needed:
        if not path:
            raise RuntimeError(f"{flag} is required with --grpc-use-ssl{'-mutual' if options.use_ssl_mutual else ''}")
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise RuntimeError(f"{flag} '{path}': {exc.strerror or exc}") from None
    return TlsFiles(options.server_cert, options.server_key, options.root_cert if options.use_ssl_mutual else None)


def ssl_context(files: TlsFiles) -> Any:
    """A server ``ssl.SSLContext`` offering HTTP/2 (ALPN ``h2``) for pyserve's own server.

    :raises RuntimeError: the certificate, key or CA file is not valid PEM or does not match.
    """
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    try:
        context.load_cert_chain(files.cert, files.key)
        if files.root is not None:
            context.load_verify_locations(files.root)
            context.verify_mode = ssl.CERT_REQUIRED
    except (ssl.SSLError, OSError) as exc:
        raise RuntimeError(f"TLS files for the gRPC port cannot be used ({files.cert}, {files.key}): {exc}") from None
    return context


GRPC_SERVERS = ("pyserve", "grpcio")
"""The gRPC server implementations ``--grpc-server`` chooses from."""


PRESERIALIZED = frozenset({"ModelInfer"})
"""RPCs whose behaviour may return the serialized response (``bytes``) instead of a message."""


def _pass_bytes(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """A response serializer that sends ``bytes`` as they are, joins ``WireParts`` and
    serializes messages (pyserve's own server sends ``WireParts`` without joining them)."""

    def serializer(response: Any) -> bytes:
        kind = type(response)
        if kind is bytes:
            return response
        if kind is WireParts:
            return response.join()
        return serialize(response)

    return serializer


REQUEST_PARSERS: dict[str, Callable[[Any], Any]] = {"ModelInfer": parse_infer_request}
"""RPCs whose requests are parsed by pyserve rather than by protobuf alone (large tensors stay views)."""


def _handlers(service: Any, servicer: object, only: frozenset[str] | None = None) -> grpc.GenericRpcHandler:
    methods = {}
    for method in service.methods:
        if only is not None and method.name not in only:
            continue
        request_class = pb.message_class(method.input_type.full_name)
        response_class = pb.message_class(method.output_type.full_name)
        behaviour = getattr(servicer, method.name)
        if method.client_streaming and method.server_streaming:
            make = grpc.stream_stream_rpc_method_handler
        elif method.server_streaming:
            make = grpc.unary_stream_rpc_method_handler
        elif method.client_streaming:
            make = grpc.stream_unary_rpc_method_handler
        else:
            make = grpc.unary_unary_rpc_method_handler
        methods[method.name] = make(
            behaviour,
            request_deserializer=REQUEST_PARSERS.get(method.name, request_class.FromString),
            response_serializer=(
                _pass_bytes(response_class.SerializeToString) if method.name in PRESERIALIZED
                else response_class.SerializeToString
            ),
        )
    return grpc.method_handlers_generic_handler(service.full_name, methods)


def channel_options(options: GrpcOptions) -> list[tuple[str, Any]]:
    """The grpc core options for ``options`` (message caps, keepalive, HTTP/2 pings)."""
    return [
        ("grpc.max_send_message_length", options.max_message_bytes),
        ("grpc.max_receive_message_length", options.max_message_bytes),
        ("grpc.keepalive_time_ms", options.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", options.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", int(options.keepalive_permit_without_calls)),
        ("grpc.http2.max_pings_without_data", options.http2_max_pings_without_data),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", options.http2_min_recv_ping_interval_without_data_ms),
        ("grpc.http2.max_ping_strikes", options.http2_max_ping_strikes),
    ]


def bind(server: Any, options: GrpcOptions) -> int:
    """Bind ``server`` to ``options.host:options.port``; the port actually bound (for port 0).

    :raises RuntimeError: the port could not be bound.
    """
    address = f"[{options.host}]:{options.port}" if ":" in options.host else f"{options.host}:{options.port}"
    tls = tls_files(options)
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        elif isinstance(server, grpc.aio.Server):
            with open(tls.cert, "rb") as cert, open(tls.key, "rb") as key:
                pair = (key.read(), cert.read())
            root = None
            if tls.root is not None:
                with open(tls.root, "rb") as ca:
                    root = ca.read()
            credentials = grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=root is not None)
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_secure_port(address, ssl_context(tls))
    except RuntimeError as exc:
        raise RuntimeError(f"gRPC service could not bind {address}: {exc}") from None
    if port == 0:
        raise RuntimeError(f"gRPC service could not bind {address}")
    return port


def new_server(options: GrpcOptions, reuse_port: bool = False) -> Any:
    """An empty gRPC server of ``options.implementation`` (handlers and ports not added yet).

    Both kinds take ``add_generic_rpc_handlers``, ``add_insecure_port``, ``start`` and ``stop``.
    ``reuse_port`` lets several processes listen on one port (grpc core would set
    SO_REUSEPORT by default: it is set explicitly either way).
    """
    if options.implementation == "grpcio":
        interceptors = [grpc_interceptor(options.restrictions)] if options.restrictions else None
        extra = [("grpc.so_reuseport", int(reuse_port))]
        if options.idle_timeout_secs > 0:
            extra.append(("grpc.max_connection_idle_ms", int(options.idle_timeout_secs * 1000)))
        return grpc.aio.server(options=channel_options(options) + extra, interceptors=interceptors)
    if options.implementation != "pyserve":
        raise RuntimeError(f"unknown gRPC server '{options.implementation}' (choose from {', '.join(GRPC_SERVERS)})")
    from pyserve.frontends.grpc.listener import GrpcServer

    # pyserve's own server checks options.restrictions from a call's headers, before its body
    return GrpcServer(options, reuse_port=reuse_port)


def create_server(dataplane: ServingPlane, options: GrpcOptions, reuse_port: bool = False) -> tuple[Any, int]:
    """A gRPC server bound to ``host:port`` (not started).

    :returns: the server and the port actually bound (for port 0).
    :raises RuntimeError: the port could not be bound.
    """
    server = new_server(options, reuse_port)
    if hasattr(server, "inherit_as"):  # pyserve's own server can take a socket bound before it
        server.inherit_as = "grpc"
    servicer = InferenceServicer(dataplane, compress_infer=options.infer_compression != "none")
    server.add_generic_rpc_handlers((
        _handlers(pb.SERVICE_DESCRIPTOR, servicer),
        _handlers(pb.HEALTH_SERVICE_DESCRIPTOR, HealthServicer(dataplane)),
    ))
    return server, bind(server, options)
