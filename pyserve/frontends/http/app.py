"""The KServe v2 REST routes, as Triton serves them, on Starlette.

Each route decodes, calls the ``DataPlane`` and encodes; nothing here knows about backends.
The routes live in groups (``pyserve.frontends.http.routes``); this module puts them in order
behind the infer fast path. Every error body is ``{"error": "..."}``; unknown routes get 404
``Not Found`` and wrong methods 405 ``Method Not Allowed``, as Triton answers them.
"""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.dataplane.interface import ServingPlane
from pyserve.frontends.http.errors import status_error
from pyserve.frontends.http.fast_infer import InferFastPath
from pyserve.frontends.http.openai import OpenAIMetrics, openai_routes
from pyserve.frontends.http.openai.errors import OpenAIError
from pyserve.frontends.http.routes.common import MODEL_PREFIXES
from pyserve.frontends.http.routes.inference import InferenceRoutes
from pyserve.frontends.http.routes.metadata import MetadataRoutes
from pyserve.frontends.http.routes.repository import RepositoryRoutes
from pyserve.frontends.http.routes.settings import SettingsRoutes
from pyserve.frontends.http.routes.shared_memory import shared_memory_routes
from pyserve.frontends.http.routes.statistics import StatisticsRoutes
from pyserve.frontends.restricted import RestrictedHttp, Restrictions

log = logging.getLogger("pyserve.frontends.http")


def kserve_routes(dataplane: ServingPlane, max_input_size: int) -> list[Route]:
    """The KServe v2 routes and Triton's extensions, in matching order (``/v2/models/stats``
    before ``/v2/models/{model_name}``, ``/v2/repository/index`` before
    ``/v2/repository/{repository_name}/index``)."""
    metadata = MetadataRoutes(dataplane)
    statistics = StatisticsRoutes(dataplane)
    inference = InferenceRoutes(dataplane, max_input_size)
    routes = [
        *metadata.server_routes(),
        *statistics.server_routes(),
        *RepositoryRoutes(dataplane, max_input_size).routes(),
    ]
    for prefix in MODEL_PREFIXES:
        routes += [*metadata.model_routes(prefix), *statistics.model_routes(prefix), *inference.model_routes(prefix)]
    routes += shared_memory_routes(dataplane, max_input_size)
    routes += SettingsRoutes(dataplane, max_input_size).routes()
    return routes


class _ErrorHandlers:
    """The application's answers to an HTTP error (404, 405) and to an unhandled exception.

    :param openai: the ``/v1`` routes are served: their errors take the OpenAI shape.
    """

    def __init__(self, openai: bool) -> None:
        self.openai = openai

    async def http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = {404: "Not Found", 405: "Method Not Allowed"}.get(exc.status_code, str(exc.detail))
        if self.openai and request.url.path.startswith("/v1/"):  # OpenAI clients read their own error shape
            return OpenAIError(exc.status_code, message).response()
        return status_error(exc.status_code, message)

    async def internal_error(self, request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return status_error(500, f"internal server error: {type(exc).__name__}: {exc}")


def create_app(
    dataplane: ServingPlane, *, max_input_size: int, restrictions: Restrictions | None = None,
    status_page: bool = False,
    openai: bool = True, openai_metrics: OpenAIMetrics | None = None,
) -> InferFastPath | RestrictedHttp:
    """Build the ASGI application serving ``dataplane``: the infer fast path in front of
    the Starlette routes for everything else (``/infer`` of a non-decoupled model is answered by
    the fast path, or natively by ``pyserve.frontends.http.native_infer.InferHttpServer``; a
    decoupled model's streams from here, ``pyserve.frontends.http.infer_stream``).

    :param max_input_size: the largest request body accepted, compressed or not.
    :param restrictions: ``--http-restricted-api`` rules; when given, a 403 check sits in
        front of everything.
    :param status_page: serve the status page (``/status``, and ``/`` for browsers;
        ``pyserve.frontends.status``).
    :param openai: serve the OpenAI-compatible ``/v1`` routes (``pyserve.frontends.http.openai``).
    :param openai_metrics: where those routes count tokens and their timings (None: nowhere).
    """
    routes = kserve_routes(dataplane, max_input_size)
    if status_page:
        from pyserve.frontends.status import status_routes

        routes += status_routes(dataplane, restrictions)
    if openai:
        routes += openai_routes(dataplane, max_input_size, openai_metrics)
    handlers = _ErrorHandlers(openai)
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: handlers.http_error, Exception: handlers.internal_error},
    )
    app.router.redirect_slashes = False  # as Triton: '/infer/' is an unknown route (404 JSON), not a 307
    fast = InferFastPath(app, dataplane, max_input_size)
    return RestrictedHttp(fast, restrictions) if restrictions else fast
