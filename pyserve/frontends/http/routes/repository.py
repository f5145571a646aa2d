"""Model repository routes: the index, and loading and unloading a model.

``POST /v2/repository/index`` (and ``/v2/repository/{r}/index``), ``POST
/v2/repository/models/{m}/load|unload``; a named repository's load and unload answer 501.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.api.errors import InferError
from pyserve.dataplane.interface import ServingPlane
from pyserve.frontends.http.body import read_body
from pyserve.frontends.http.errors import error_response, status_error
from pyserve.frontends.http.routes.common import empty_json, json_object_body, json_response


class RepositoryRoutes:
    """The repository index and model control.

    :param dataplane: the server's data plane.
    :param max_input_size: the largest request body accepted.
    """

    def __init__(self, dataplane: ServingPlane, max_input_size: int) -> None:
        self.dataplane = dataplane
        self.max_input_size = max_input_size

    def routes(self) -> list[Route]:
        """The repository routes (the literal ``index`` path before ``{repository_name}``)."""
        return [
            Route("/v2/repository/index", self.repository_index, methods=["POST"]),
            # Triton 2.51 answers the index with a repository name too (as its gRPC RepositoryIndex does)
            Route("/v2/repository/{repository_name}/index", self.repository_index, methods=["POST"]),
            Route("/v2/repository/models/{model_name}/load", self.repository_load, methods=["POST"]),
            Route("/v2/repository/models/{model_name}/unload", self.repository_unload, methods=["POST"]),
            Route("/v2/repository/{repository_name}/models/{model_name}/load", self.repository_named, methods=["POST"]),
            Route("/v2/repository/{repository_name}/models/{model_name}/unload", self.repository_named, methods=["POST"]),
        ]

    async def repository_index(self, request: Request) -> Response:
        """Every model of the repository (``{"ready": true}``: the ready ones only)."""
        ready_only = False
        try:
            body = await read_body(request, self.max_input_size)
            if body.strip():
                payload = orjson.loads(body)
                if not isinstance(payload, dict):
                    raise InferError.invalid("the repository index body must be a JSON object")
                ready_only = payload.get("ready", False)
                if not isinstance(ready_only, bool):
                    raise InferError.invalid("'ready' must be a boolean")
        except orjson.JSONDecodeError as exc:
            return status_error(400, f"failed to parse the request JSON buffer: {exc}")
        except InferError as exc:
            return error_response(exc)
        return json_response(self.dataplane.repository_index(ready_only))

    async def control_parameters(self, request: Request) -> dict[str, Any]:
        """The ``parameters`` object of a load/unload body (empty body = no parameters).

        :raises InferError: the body is not a JSON object or ``parameters`` is not one.
        """
        payload = await json_object_body(request, self.max_input_size, required=False)
        parameters = payload.get("parameters", {})
        if not isinstance(parameters, dict):
            raise InferError.invalid("'parameters' must be a JSON object")
        return parameters

    async def repository_load(self, request: Request) -> Response:
        """Load (or reload) a model, with the body's ``parameters``."""
        try:
            parameters = await self.control_parameters(request)
            await self.dataplane.load_model(request.path_params["model_name"], parameters)
        except InferError as exc:
            return error_response(exc)
        return empty_json()

    async def repository_unload(self, request: Request) -> Response:
        """Unload a model (``unload_dependents``: the models depending on it too)."""
        try:
            parameters = await self.control_parameters(request)
            dependents = parameters.get("unload_dependents", False)
            if not isinstance(dependents, bool):
                raise InferError.invalid("'unload_dependents' must be a boolean")
            await self.dataplane.unload_model(request.path_params["model_name"], dependents)
        except InferError as exc:
            return error_response(exc)
        return empty_json()

    async def repository_named(self, request: Request) -> Response:
        """501: a named repository is not supported."""
        return status_error(501, "'repository_name' specification is not supported")
