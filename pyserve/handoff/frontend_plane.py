"""The data plane of a frontend process (``pyserve.handoff.frontend``): what its HTTP server
and gRPC servicer call (``pyserve.dataplane.interface.InferencePlane``).

Models come from the owner's snapshot; a request runs on a local replica when the frontend
has one for its version, else it is handed to the owner over the link. What only the owner
can do (shared-memory regions, tracing decisions) sends the request to the owner undecoded;
while the owner's trace settings may trace a model, its requests are handed to the owner (which
samples them by ``trace_rate`` and ``trace_count`` as one process would) instead of answered
by the replica.
"""

from __future__ import annotations

import asyncio
from typing import Any, NoReturn

from pyserve.api.errors import InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.dataplane.header_forwarding import HeaderForwarding
from pyserve.dataplane.shared_memory import Region
from pyserve.handoff.link import OwnerLink, RemoteModel
from pyserve.runtime.versions import ModelVersion


class NeedsOwner(Exception):
    """The frontend cannot decode this request itself; the owner must (not an error)."""


class _OwnerOnlySharedMemory:
    """Shared-memory regions are registered with the owner: any use sends the request there."""

    def input_bytes(self, params: Any, what: str, regions: list[Region] | None = None) -> NoReturn:
        raise NeedsOwner

    def output_target(self, params: Any, what: str) -> NoReturn:
        raise NeedsOwner

    def region(self, *args: Any) -> NoReturn:
        raise NeedsOwner


class _PassTraceParent:
    """Tracing is decided by the owner; the frontend always passes ``traceparent`` on."""

    active = True


class FrontendDataPlane:
    """What the HTTP server and the gRPC servicer need of a data plane (an ``InferencePlane``):
    models from the owner's snapshot, answered by a local replica when there is one, else over
    the link. Event loop only."""

    def __init__(self, link: OwnerLink) -> None:
        self.link = link
        self.live = True
        self.exiting = False
        self.accepting = True
        self.shared_memory = _OwnerOnlySharedMemory()
        self.tracing = _PassTraceParent()
        self.http_forwarding: HeaderForwarding | None = None
        self.grpc_forwarding: HeaderForwarding | None = None

    def model(self, name: str, version: str | None = None) -> ModelVersion:
        """The local replica, else the snapshot's version (a ``RemoteModel``).

        :raises NeedsOwner: not in the snapshot (the owner answers, error texts included).
        """
        model = self.link.models.get((name, version or None))
        if model is None:
            raise NeedsOwner
        replicas = self.link.replicas
        if replicas is not None and not self.link.may_trace(name):  # the owner samples traced models
            local = replicas.local_for(model.generation)
            if local is not None:
                return local
        return model

    def submit(self, model: ModelVersion, request: InferRequest) -> InferRequest:
        """Schedule a request on a local replica (``DataPlane.submit``: the replicas' data plane
        holds it until it is released)."""
        assert self.link.replicas is not None
        return self.link.replicas.dataplane.submit(model, request)

    async def infer(self, model: ModelVersion, request: InferRequest) -> InferResponse | InferError:
        """A local replica's answer (``DataPlane.infer``), else the owner's over the link."""
        if not isinstance(model, RemoteModel):
            assert self.link.replicas is not None
            return await self.link.replicas.dataplane.infer(model, request)
        request_id, future = self.link.submit(model, request)
        try:
            return await future
        except asyncio.CancelledError:
            self.link.cancel(request_id)
            raise
