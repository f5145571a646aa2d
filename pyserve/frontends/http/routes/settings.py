"""Trace and log settings routes: ``GET|POST /v2/trace/setting``, ``/v2/models/{m}/trace/setting``
and ``/v2/logging``."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve import logs
from pyserve.api.errors import InferError
from pyserve.dataplane.interface import ServingPlane
from pyserve.frontends.http.errors import error_response
from pyserve.frontends.http.routes.common import json_object_body, json_response


class SettingsRoutes:
    """Reading (GET) and updating (POST) the trace settings, global or per model, and the log
    settings.

    :param dataplane: the server's data plane (its ``tracing``).
    :param max_input_size: the largest request body accepted.
    """

    def __init__(self, dataplane: ServingPlane, max_input_size: int) -> None:
        self.dataplane = dataplane
        self.max_input_size = max_input_size

    def routes(self) -> list[Route]:
        """The trace, then the logging, routes."""
        return [
            Route("/v2/trace/setting", self.trace_setting, methods=["GET", "POST"]),
            Route("/v2/models/{model_name}/trace/setting", self.trace_setting, methods=["GET", "POST"]),
            Route("/v2/logging", self.logging_settings, methods=["GET", "POST"]),
        ]

    async def trace_setting(self, request: Request) -> Response:
        """The trace settings (a model's, on a model path) after applying a POST's body."""
        model = request.path_params.get("model_name")
        try:
            if model is not None:
                self.dataplane.check_trace_model(model)
            if request.method == "GET":
                return json_response(self.dataplane.tracing.settings(model))
            body = await json_object_body(request, self.max_input_size, required=False)
            return json_response(self.dataplane.tracing.update(body, model))
        except InferError as exc:
            return error_response(exc)

    async def logging_settings(self, request: Request) -> Response:
        """The log settings after applying a POST's body."""
        try:
            if request.method == "GET":
                return json_response(logs.get_settings())
            body = await json_object_body(request, self.max_input_size, required=False)
            return json_response(logs.update_settings(body))
        except InferError as exc:
            return error_response(exc)
