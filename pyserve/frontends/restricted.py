"""Endpoint restriction (``--http-restricted-api``, ``--grpc-restricted-protocol``).

Each flag value is ``<api>[,<api>...]:<key>=<value>``: requests to an API of those categories
must carry header ``<key>: <value>`` (HTTP) or metadata ``triton-grpc-protocol-<key>:
<value>`` (gRPC). Otherwise HTTP answers 403 ``This API is restricted, expecting header
'<key>'`` and gRPC ``UNAVAILABLE`` ``This protocol is restricted, expecting header
'triton-grpc-protocol-<key>'`` (Triton 2.51's code and text). Only installed when a flag is
given, so unrestricted servers pay nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

CATEGORIES = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
)
"""Triton's API categories."""

GRPC_HEADER_PREFIX = "triton-grpc-protocol-"


class RestrictionError(ValueError):
    """A malformed restriction flag value."""


@dataclass(frozen=True, slots=True)
class Restriction:
    """The header a category requires."""

    key: str
    value: str

    @property
    def message(self) -> str:
        """The HTTP 403 error text."""
        return f"This API is restricted, expecting header '{self.key}'"

    @property
    def grpc_message(self) -> str:
        """The gRPC UNAVAILABLE status text (the key has its ``triton-grpc-protocol-`` prefix)."""
        return f"This protocol is restricted, expecting header '{self.key}'"


Restrictions = Mapping[str, Restriction]
"""Category → required header."""


def parse_restrictions(items: Iterable[str], *, grpc: bool = False) -> dict[str, Restriction]:
    """Flag values → category → ``Restriction`` (gRPC keys get the ``triton-grpc-protocol-`` prefix).

    :raises RestrictionError: unknown category, a category restricted twice, or a bad form.
    """
    result: dict[str, Restriction] = {}
    feature = "protocol" if grpc else "api"  # Triton's word for each flag's categories
    for item in items:
        apis, sep, header = item.partition(":")
        key, eq, value = header.partition("=")
        if not sep or not eq or not apis.strip() or not key.strip():
            raise RestrictionError(f"restricted API '{item}' must be <api>[,<api>...]:<key>=<value>")
        key = key.strip().lower()
        if grpc:
            key = GRPC_HEADER_PREFIX + key
        for api in apis.split(","):
            api = api.strip()
            if api not in CATEGORIES:
                raise RestrictionError(  # Triton's words first (its scripts grep them), then the choices
                    f"unknown restricted {feature} '{api}' (expected one of {', '.join(CATEGORIES)})")
            if api in result:
                raise RestrictionError(f"restricted {feature} '{api}' can not be specified in multiple config groups")
            result[api] = Restriction(key, value)
    return result


_MODEL_PATH = re.compile(r"^/v2/models/[^/]+(?:/versions/[0-9]+)?(?P<rest>/.*)?$")

_EXACT_CATEGORIES = {
    "/v2": "metadata",
    "/v2/": "metadata",
    "/v2/models/stats": "statistics",
    "/v1/completions": "inference",  # the OpenAI-compatible routes
    "/v1/chat/completions": "inference",
    "/v1/models": "metadata",
}
"""Paths whose category is theirs alone (none of them starts with a prefix below)."""

_PREFIX_CATEGORIES = (
    ("/v2/health/", "health"),
    ("/v2/repository", "model-repository"),
    ("/v2/systemsharedmemory", "shared-memory"),
    ("/v2/cudasharedmemory", "shared-memory"),
    ("/v2/trace", "trace"),
    ("/v2/logging", "logging"),
    ("/v1/models/", "metadata"),
)
"""Path prefixes and the category of every path under them (no two overlap)."""

_MODEL_CATEGORIES = {
    "": "metadata",
    "/ready": "health",
    "/infer": "inference",
    "/generate": "inference",
    "/generate_stream": "inference",
    "/config": "model-config",
    "/stats": "statistics",
    "/trace/setting": "trace",
}
"""What follows ``/v2/models/{m}[/versions/{v}]`` → category."""


def http_category(method: str, path: str) -> str | None:
    """The category of an HTTP request, or None for paths outside the restricted APIs."""
    category = _EXACT_CATEGORIES.get(path)
    if category is not None:
        return category
    for prefix, category in _PREFIX_CATEGORIES:
        if path.startswith(prefix):
            return category
    match = _MODEL_PATH.match(path)
    if match is None:
        return None
    return _MODEL_CATEGORIES.get(match.group("rest") or "")


GRPC_CATEGORIES = {
    "ServerLive": "health",
    "ServerReady": "health",
    "ModelReady": "health",
    "Check": "health",
    "ServerMetadata": "metadata",
    "ModelMetadata": "metadata",
    "ModelInfer": "inference",
    "ModelStreamInfer": "inference",
    "ModelConfig": "model-config",
    "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory",
    "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory",
    "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory",
    "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}
"""gRPC method name → category."""


class RestrictedHttp:
    """ASGI middleware answering 403 to requests of a restricted category without its header.

    :param app: the application behind it.
    :param restrictions: category → required header.
    """

    def __init__(self, app: Any, restrictions: Restrictions) -> None:
        self.app = app
        self.restrictions = dict(restrictions)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            category = http_category(scope["method"], scope["path"])
            rule = self.restrictions.get(category) if category else None
            if rule is not None and not _has_header(scope["headers"], rule):
                body = orjson.dumps({"error": rule.message})
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def denied(restrictions: Restrictions, category: str, headers: Iterable[tuple[bytes, bytes]]) -> Restriction | None:
    """The rule a request with ``headers`` (lowercase names, as ASGI gives them) breaks by
    reading ``category``, or None when it may (unrestricted, or the header is there)."""
    rule = restrictions.get(category)
    if rule is None or _has_header(headers, rule):
        return None
    return rule


def _has_header(headers: Iterable[tuple[bytes, bytes]], rule: Restriction) -> bool:
    key = rule.key.encode("latin-1")
    value = rule.value.encode("latin-1")
    return any(k.lower() == key and v == value for k, v in headers)


def grpc_interceptor(restrictions: Restrictions) -> Any:
    """A ``grpc.aio.ServerInterceptor`` enforcing ``restrictions`` (UNAVAILABLE, as Triton 2.51)."""
    import grpc

    rules = dict(restrictions)

    def denier(message: str, streaming_request: bool, streaming_response: bool) -> Any:
        async def abort_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)

        async def abort_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)
            yield  # pragma: no cover - makes this an async generator

        if streaming_request and streaming_response:
            return grpc.stream_stream_rpc_method_handler(abort_stream)
        if streaming_request:
            return grpc.stream_unary_rpc_method_handler(abort_unary)
        if streaming_response:
            return grpc.unary_stream_rpc_method_handler(abort_stream)
        return grpc.unary_unary_rpc_method_handler(abort_unary)

    class _Interceptor(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            method = details.method.rsplit("/", 1)[-1]
            rule = rules.get(GRPC_CATEGORIES.get(method, ""))
            if rule is not None:
                metadata = details.invocation_metadata or ()
                if not any(k.lower() == rule.key and v == rule.value for k, v in metadata):
                    handler = await continuation(details)
                    if handler is None:
                        return None
                    return denier(rule.grpc_message, handler.request_streaming, handler.response_streaming)
            return await continuation(details)

    return _Interceptor()
