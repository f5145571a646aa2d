"""The data plane as the transports see it: the protocols frontends are typed against.

Two objects serve them: ``pyserve.dataplane.plane.DataPlane`` in the model owner (every
operation) and ``pyserve.handoff.frontend.FrontendDataPlane`` in a frontend process (the
infer path only: everything else is relayed to the owner). Both satisfy ``InferencePlane``
structurally, checked by mypy; ``DataPlane`` also satisfies ``ServingPlane``. A transport
takes the narrowest one it needs: the native infer paths an ``InferencePlane``, the control
and extension routes a ``ServingPlane``.

Members are read-only properties here (an implementation may hold them as plain
attributes): transports read them; the server that owns the plane sets them.
"""

from __future__ import annotations

from typing import Any, Protocol

from pyserve.api.errors import InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.dataplane.header_forwarding import HeaderForwarding
from pyserve.dataplane.shared_memory import Region, SharedMemoryManager, ShmTarget
from pyserve.runtime.manager import ModelManager
from pyserve.runtime.versions import ModelVersion
from pyserve.tracing import TraceManager


class SharedMemoryAccess(Protocol):
    """What the codecs ask of the registered shared-memory regions while decoding a request."""

    def input_bytes(self, params: Any, what: str, regions: list[Region] | None = None) -> memoryview | bytes:
        """The bytes an input names by ``shared_memory_region`` (appending its region to ``regions``).

        :raises InferError: unknown region, or a window outside it.
        """
        ...

    def output_target(self, params: Any, what: str) -> ShmTarget:
        """Where an output that names a ``shared_memory_region`` is to be written.

        :raises InferError: unknown region, or a window outside it.
        """
        ...


class TraceSwitch(Protocol):
    """Whether requests carry their client's ``traceparent`` into the server."""

    @property
    def active(self) -> bool: ...


class InferencePlane(Protocol):
    """What a transport's infer path calls: find the model, schedule or run a decoded request.

    Every member is used on the event loop.
    """

    @property
    def live(self) -> bool:
        """The server is up (false before start and after shutdown)."""
        ...

    @property
    def exiting(self) -> bool:
        """Shutdown began: live answers "exiting"."""
        ...

    @property
    def accepting(self) -> bool:
        """New requests are scheduled (false while draining)."""
        ...

    @property
    def shared_memory(self) -> SharedMemoryAccess: ...

    @property
    def tracing(self) -> TraceSwitch: ...

    @property
    def http_forwarding(self) -> HeaderForwarding | None:
        """``--http-header-forward-pattern``: headers copied into request parameters, or None."""
        ...

    @property
    def grpc_forwarding(self) -> HeaderForwarding | None:
        """``--grpc-header-forward-pattern``: metadata copied into request parameters, or None."""
        ...

    def model(self, name: str, version: str | None = None) -> ModelVersion:
        """The version serving ``name`` (latest READY when ``version`` is None).

        :raises InferError: NOT_FOUND / UNAVAILABLE, with Triton's messages.
        """
        ...

    def submit(self, model: ModelVersion, request: InferRequest) -> InferRequest:
        """Schedule ``request`` (its sender attached); its responses go to that sender.

        :returns: the request, held by the server until ``request.release()`` (or the end of
            ``with dataplane.submit(model, request):``), which the caller runs once the final
            response is handled or the request is given up.
        :raises InferError: refused (shutting down, not ready, queue full); nothing to release.
        """
        ...

    async def infer(self, model: ModelVersion, request: InferRequest) -> InferResponse | InferError:
        """Schedule a decoded request and wait for its single response (released by then).

        Cancelling the awaiting task cancels the request.
        """
        ...


class ServingPlane(InferencePlane, Protocol):
    """The whole API of the model owner's data plane: the infer path, health, metadata,
    model control, statistics and the extensions (shared memory, trace settings)."""

    @property
    def server_name(self) -> str: ...

    @property
    def server_version(self) -> str: ...

    @property
    def models(self) -> ModelManager:
        """The server's models (read by the status page and the OpenAI model list)."""
        ...

    @property
    def shared_memory(self) -> SharedMemoryManager: ...

    @property
    def tracing(self) -> TraceManager: ...

    def server_metadata(self) -> dict[str, Any]: ...

    def model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]: ...

    def model_config(self, name: str, version: str | None = None) -> dict[str, Any]: ...

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]: ...

    def model_statistics(self, name: str = "", version: str | None = None) -> dict[str, Any]: ...

    def check_trace_model(self, name: str) -> None: ...

    async def check_model_ready(self, name: str, version: str | None = None) -> bool: ...

    async def check_server_ready(self) -> bool: ...

    async def collect_statistics(self) -> None: ...

    async def load_model(self, name: str, parameters: dict[str, Any] | None = None) -> None: ...

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None: ...
