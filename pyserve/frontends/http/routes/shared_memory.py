"""Shared-memory routes: ``/v2/systemsharedmemory[/region/{r}]/status|register|unregister``
and the same under ``/v2/cudasharedmemory``, with Triton's bodies and errors."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.api.errors import InferError
from pyserve.dataplane.interface import ServingPlane
from pyserve.frontends.http.errors import error_response
from pyserve.frontends.http.routes.common import empty_json, json_object_body, json_response


class SharedMemoryRoutes:
    """The status, registration and unregistration of one kind of shared-memory region.

    :param dataplane: the server's data plane (its ``shared_memory`` registry).
    :param max_input_size: the largest request body accepted.
    :param kind: ``"system"`` or ``"cuda"``.
    """

    def __init__(self, dataplane: ServingPlane, max_input_size: int, kind: str) -> None:
        self.shm = dataplane.shared_memory
        self.max_input_size = max_input_size
        self.kind = kind

    def routes(self, prefix: str) -> list[Route]:
        """The routes under ``prefix`` (``/v2/systemsharedmemory`` or ``/v2/cudasharedmemory``)."""
        return [
            Route(f"{prefix}/status", self.status, methods=["GET"]),
            Route(f"{prefix}/region/{{region}}/status", self.status, methods=["GET"]),
            Route(f"{prefix}/region/{{region}}/register", self.register, methods=["POST"]),
            Route(f"{prefix}/unregister", self.unregister, methods=["POST"]),
            Route(f"{prefix}/region/{{region}}/unregister", self.unregister, methods=["POST"]),
        ]

    async def status(self, request: Request) -> Response:
        """One region's status, or every region's of this kind."""
        try:
            return json_response(self.shm.status(request.path_params.get("region", ""), self.kind))
        except InferError as exc:
            return error_response(exc)

    async def register(self, request: Request) -> Response:
        """Register a region described by the JSON body."""
        try:
            body = await json_object_body(request, self.max_input_size)
            name = request.path_params["region"]
            if self.kind == "system":
                self.shm.register_system(name, body.get("key"), body.get("offset", 0), body.get("byte_size"))
            else:
                self.shm.register_cuda_json(name, body)
        except InferError as exc:
            return error_response(exc)
        return empty_json()

    async def unregister(self, request: Request) -> Response:
        """Unregister one region, or every region of this kind."""
        try:
            self.shm.unregister(request.path_params.get("region", ""), self.kind)
        except InferError as exc:  # a region a request is using
            return error_response(exc)
        return empty_json()


def shared_memory_routes(dataplane: ServingPlane, max_input_size: int) -> list[Route]:
    """The system, then the CUDA, shared-memory routes."""
    return [
        *SharedMemoryRoutes(dataplane, max_input_size, "system").routes("/v2/systemsharedmemory"),
        *SharedMemoryRoutes(dataplane, max_input_size, "cuda").routes("/v2/cudasharedmemory"),
    ]
