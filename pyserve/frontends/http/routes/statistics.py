"""Statistics routes: ``GET /v2/models/stats`` (every model) and ``.../stats`` per model."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.api.errors import InferError
from pyserve.dataplane.interface import ServingPlane
from pyserve.frontends.http.errors import error_response
from pyserve.frontends.http.routes.common import json_response, model_version


class StatisticsRoutes:
    """Inference statistics, collected fresh for each request.

    :param dataplane: the server's data plane.
    """

    def __init__(self, dataplane: ServingPlane) -> None:
        self.dataplane = dataplane

    def server_routes(self) -> list[Route]:
        """``/v2/models/stats``: it must come before the ``/v2/models/{model_name}`` routes."""
        return [Route("/v2/models/stats", self.model_stats, methods=["GET"])]

    def model_routes(self, prefix: str) -> list[Route]:
        """The per-model route under ``prefix`` (``common.MODEL`` or ``common.VERSIONED``)."""
        return [Route(prefix + "/stats", self.model_stats, methods=["GET"])]

    async def model_stats(self, request: Request) -> Response:
        """The statistics of one model (version), or of all of them without a model name."""
        try:
            name = request.path_params.get("model_name", "")
            await self.dataplane.collect_statistics()
            return json_response(self.dataplane.model_statistics(name, model_version(request)))
        except InferError as exc:
            return error_response(exc)
