"""What the route groups share: JSON answers, the version path parameter, JSON object bodies."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from pyserve.api.errors import InferError
from pyserve.frontends.http.body import read_body

MODEL = "/v2/models/{model_name}"
"""The path of a model, any version."""
VERSIONED = "/v2/models/{model_name}/versions/{model_version:int}"
"""The path of one version of a model."""
MODEL_PREFIXES = (MODEL, VERSIONED)
"""Every per-model route exists under both prefixes, in this order."""


def json_response(data: Any) -> Response:
    """200 with ``data`` as JSON."""
    return Response(orjson.dumps(data), 200, media_type="application/json")


def empty_json() -> Response:
    """200 with an empty body (a JSON content type, as Triton answers control requests)."""
    return Response(b"", 200, media_type="application/json")


def model_version(request: Request) -> str | None:
    """The ``{model_version}`` path parameter as text, or None on an unversioned path."""
    version = request.path_params.get("model_version")
    return None if version is None else str(version)


async def json_object_body(request: Request, limit: int, *, required: bool = True) -> Any:
    """The request body parsed as a JSON object (at most ``limit`` bytes); an empty body is
    ``{}`` unless ``required``.

    :raises InferError: the body is too large, empty when required, not JSON, or not an object.
    """
    body = await read_body(request, limit)
    if not body.strip():
        if required:
            raise InferError.invalid("the request body must be a JSON object")
        return {}
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InferError.invalid(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(payload, dict):
        raise InferError.invalid("the request body must be a JSON object")
    return payload
