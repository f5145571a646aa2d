"""Ensembles on Ray Serve: run by the ingress, their steps sent to the steps' deployments.

An ensemble computes nothing itself, so it gets no deployment of its own (which would reserve
CPUs and hold copies of its step models): the ingress runs pyserve's ensemble scheduler on its
event loop, and each step goes to the deployment of the step's model like a client request
(sequence routing included). Ensembles of ensembles run in the ingress too.

What callers may rely on: ``build_ensembles`` turns the specs into ``RemoteEnsemble`` models once the step models are
described, reporting the ensembles whose plan does not fit their steps by name and reason
(what ``pyserve run`` would make UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pyserve import protocol as pb
from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import FutureSender, InferRequest, InferResponse
from pyserve.handoff.frontend import RemoteModel
from pyserve.repository import model_config
from pyserve.repository.ensemble_plan import build_plan
from pyserve.runtime.scheduling.ensemble import EnsembleScheduler
from pyserve.runtime.versions import ModelState
from pyserve.tools.ray_serve import EnsembleSpec

log = logging.getLogger("pyserve.tools.ray_serve")

Runner = Callable[[RemoteModel, InferRequest], Awaitable["InferResponse | InferError"]]
"""How the ingress runs a request on a model deployment (``PyserveIngress._run``)."""


class RemoteEnsemble(RemoteModel):
    """An ensemble version served by the ingress: ``run`` answers one request."""

    scheduler: EnsembleScheduler | None = None

    async def run(self, request: InferRequest) -> InferResponse | InferError:
        assert self.scheduler is not None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[InferResponse | InferError] = loop.create_future()
        request.attach_sender(FutureSender(loop, future))
        self.scheduler.enqueue(request)
        return await future

    def enqueue(self, request: InferRequest) -> None:
        """As a step of another ensemble (the request's sender is attached)."""
        assert self.scheduler is not None
        self.scheduler.enqueue(request)


class _RemoteStep:
    """A step model as the ensemble scheduler sees it: its tables, and ``enqueue`` sending the
    step's request to the model's deployment."""

    __slots__ = ("_model", "_run", "_tasks", "decoupled", "io", "name", "version")

    def __init__(self, model: RemoteModel, run: Runner) -> None:
        self._model = model
        self._run = run
        self._tasks: set[asyncio.Task[None]] = set()
        self.name = model.name
        self.version = model.version
        self.io = model.io
        self.decoupled = model.decoupled

    def enqueue(self, request: InferRequest) -> None:
        task = asyncio.get_running_loop().create_task(self._call(request))
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    async def _call(self, request: InferRequest) -> None:
        try:
            result = await self._run(self._model, request)
        except Exception as exc:  # noqa: BLE001 - a failed call to a deployment answers the step
            result = InferError(f"model '{self.name}' could not be reached: {type(exc).__name__}: {exc}",
                                ErrorCode.UNAVAILABLE)
        request.reply(result, final=True)


def build_ensembles(specs: list[EnsembleSpec], models: dict[tuple[str, str | None], RemoteModel],
                    run: Runner) -> dict[str, str]:
    """Add a ``RemoteEnsemble`` to ``models`` (keys ``(name, str(version))`` and ``(name,
    None)``) for every spec whose plan fits the models described so far; ensembles of ensembles
    are built once the ensembles they use are.

    :returns: ensemble name → why it is not served (the plan check's problems).
    """
    steps: dict[tuple[str, str | None], Any] = {}

    def lookup(name: str, version: int | None) -> Any:
        key = (name, None if version is None else str(version))
        found = steps.get(key)
        if found is None:
            model = models.get(key)
            if model is None:
                detail = "" if version is None else f" version {version}"
                raise InferError.not_found(f"Request for unknown model: '{name}'{detail} is not found")
            found = model if isinstance(model, RemoteEnsemble) else _RemoteStep(model, run)
            steps[key] = found
        return found

    failed: dict[str, str] = {}
    pending = list(specs)
    while pending:
        waiting = {spec.name for spec in pending}
        progressed = False
        for spec in list(pending):
            config = pb.ModelConfig.FromString(spec.config)
            if {step.model_name for step in config.ensemble_scheduling.step} & waiting - {spec.name}:
                continue  # it uses an ensemble not built yet
            pending.remove(spec)
            progressed = True
            try:
                _add(spec, config, models, lookup)
            except (ValueError, OSError) as exc:
                failed[spec.name] = "; ".join(str(exc).splitlines())
                log.error("ensemble '%s' is not served: %s", spec.name, failed[spec.name])
        if not progressed:  # a cycle among ensembles
            for spec in pending:
                failed[spec.name] = "the ensemble depends on ensembles that depend on it (a cycle)"
            break
    return failed


def _add(spec: EnsembleSpec, config: Any, models: dict[tuple[str, str | None], RemoteModel], lookup: Any) -> None:
    folder = Path(spec.folder)
    io = model_config.model_io(config, folder)
    plan = build_plan(config, io, lookup)
    if config.model_transaction_policy.decoupled:
        raise ValueError("a step is decoupled: decoupled models are not served over Ray Serve")
    latest = None
    for version in spec.versions:
        model = RemoteEnsemble(name=spec.name, version=version, state=ModelState.READY, config=config, io=io)
        model.scheduler = EnsembleScheduler(spec.name, plan, io, lookup)
        models[(spec.name, str(version))] = model
        latest = model
    if latest is not None:
        models[(spec.name, None)] = latest
