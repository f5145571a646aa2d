"""Health, metadata and model configuration routes.

``GET /v2/health/live``, ``/v2/health/ready``, ``/v2`` and, per model (any version or one),
``GET /v2/models/{m}``, ``.../ready`` and ``.../config``.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.api.errors import InferError
from pyserve.dataplane.interface import ServingPlane
from pyserve.frontends.http.errors import error_response, status_error
from pyserve.frontends.http.routes.common import json_response, model_version


class MetadataRoutes:
    """The server's liveness, readiness and metadata, and each model's readiness, metadata
    and configuration.

    :param dataplane: the server's data plane.
    """

    def __init__(self, dataplane: ServingPlane) -> None:
        self.dataplane = dataplane

    def server_routes(self) -> list[Route]:
        """The server-wide routes."""
        return [
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/v2", self.server_metadata, methods=["GET"]),
        ]

    def model_routes(self, prefix: str) -> list[Route]:
        """The per-model routes under ``prefix`` (``common.MODEL`` or ``common.VERSIONED``)."""
        return [
            Route(prefix, self.model_metadata, methods=["GET"]),
            Route(prefix + "/ready", self.model_ready, methods=["GET"]),
            Route(prefix + "/config", self.model_config, methods=["GET"]),
        ]

    async def live(self, request: Request) -> Response:
        """200 while live; 503 once exiting; 400 before the server is live."""
        if self.dataplane.exiting:
            return status_error(503, "Server exiting")
        if self.dataplane.live:
            return Response(b"", 200)
        return status_error(400, "Server is not live")

    async def ready(self, request: Request) -> Response:
        """200 when the server is ready, else 400."""
        if await self.dataplane.check_server_ready():
            return Response(b"", 200)
        return status_error(400, "Server is not ready")

    async def server_metadata(self, request: Request) -> Response:
        """The server's name, version and extensions."""
        return json_response(self.dataplane.server_metadata())

    async def model_metadata(self, request: Request) -> Response:
        """A model's inputs, outputs and versions."""
        try:
            return json_response(self.dataplane.model_metadata(request.path_params["model_name"], model_version(request)))
        except InferError as exc:
            return error_response(exc)

    async def model_ready(self, request: Request) -> Response:
        """200 when the model version is ready, else 400."""
        if await self.dataplane.check_model_ready(request.path_params["model_name"], model_version(request)):
            return Response(b"", 200)
        return status_error(400, "Model version not ready")

    async def model_config(self, request: Request) -> Response:
        """A model's configuration, as JSON."""
        try:
            return json_response(self.dataplane.model_config(request.path_params["model_name"], model_version(request)))
        except InferError as exc:
            return error_response(exc)
