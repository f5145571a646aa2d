"""The model deployment: one Ray Serve replica running pyserve's in-process core.

Each replica starts a ``pyserve.server.core.Server`` without listeners on a thread of its own
(its event loop, instance threads and schedulers: dynamic and sequence batchers work inside
the replica as in ``pyserve run``) and loads the model repository's models it was given,
with ``--exit-on-error`` semantics: a model that fails to load fails the replica, and Serve
reports the deployment unhealthy with the reason.

Requests arrive from the ingress (``pyserve.tools.ray_serve.ingress``) as decoded tensors; answers
go back as arrays, or as ``(code, message)`` for errors. Requests of a sequence reach the
same replica every time (``pyserve.tools.ray_serve.routing``), where the sequence state is.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from pyserve.api.errors import InferError
from pyserve.api.inference import InferRequest
from pyserve.handoff import wire
from pyserve.server.core import Server, ServerOptions, ServerThread


class PyserveModel:
    """A model replica. ``describe`` and ``infer`` are called by the ingress through handles.

    :param repositories: model repository folders (as reachable from the replica's node).
    :param models: the models to load (``["*"]``: every model of the repositories).
    :param backend_config: ``--backend-config`` settings.
    :raises pyserve.server.core.StartupError: a model failed to load (the replica fails to start).
    """

    def __init__(self, repositories: list[str], models: list[str], backend_config: dict[str, dict[str, str]]) -> None:
        options = ServerOptions(
            model_repositories=[Path(r) for r in repositories],
            allow_http=False,
            allow_grpc=False,
            allow_metrics=False,
            model_control_mode="explicit",
            load_models=list(models),
            backend_config=backend_config,
            exit_on_error=True,
        )
        self._thread = ServerThread(Server(options))
        self._thread.start()
        self._server = self._thread.server
        self._loop = self._thread._loop
        assert self._loop is not None

    def describe(self) -> list[list[Any]]:
        """``[name, version key, version, config bytes, io]`` of every READY version (key None:
        the model's default version)."""
        entries: list[list[Any]] = []
        for name, record in list(self._server.models.records.items()):
            ready = record.ready_versions()
            for version in ready:
                entries.append([name, str(version.version), version.version,
                                version.config.SerializeToString(), wire.io_to_json(version.io)])
            if ready:
                latest = ready[-1]
                entries.append([name, None, latest.version, latest.config.SerializeToString(),
                                wire.io_to_json(latest.io)])
        return entries

    async def infer(self, name: str, version: str | None, fields: dict[str, Any], inputs: dict[str, Any]) -> Any:
        """Run one request; ``("ok", outputs, parameters)`` or ``("error", code, message)``."""
        loop = self._loop
        assert loop is not None, "the replica's server loop is not running"
        future = asyncio.run_coroutine_threadsafe(self._infer(name, version, fields, inputs), loop)
        return await asyncio.wrap_future(future)

    async def _infer(self, name: str, version: str | None, fields: dict[str, Any], inputs: dict[str, Any]) -> Any:
        dataplane = self._server.dataplane
        try:
            model = dataplane.model(name, version)
            request = InferRequest(
                name, model.version, inputs, tuple(fields["outputs"]), id=fields["id"],
                parameters=fields["parameters"], flags=fields["flags"], correlation_id=fields["correlation_id"],
                priority=fields["priority"], timeout_us=fields["timeout_us"], batch_size=fields["batch_size"],
            )
            result = await dataplane.infer(model, request)
        except InferError as exc:
            return ("error", int(exc.code), exc.message)
        if isinstance(result, InferError):
            return ("error", int(result.code), result.message)
        return ("ok", dict(result.outputs), dict(result.parameters))

    def statistics(self, name: str, version: str | None) -> dict[str, Any]:
        """This replica's statistics extension JSON for a model."""
        return self._server.dataplane.model_statistics(name, version)

    def __del__(self) -> None:
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.stop()
