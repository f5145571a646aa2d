"""Ensembles (``platform: "ensemble"``): a DAG of steps run by the core, not by a backend.

``build_plan`` checks an ensemble's ``ensemble_scheduling`` against the models it names
(unknown models, unmapped or unknown tensors, tensors written twice, cycles, datatype
mismatches, unused inputs, outputs nothing produces) with messages naming the step and
tensor. ``EnsembleScheduler`` runs one request as an asyncio task on the event loop: a step
starts as soon as all its input tensors exist, independent steps run concurrently on their
models' own instances, and tensors pass between steps as the very arrays the previous step
produced (no copies, no host round trip for device arrays). An error in a step fails only
that request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyserve import datatypes
from pyserve.errors import ErrorCode, InferError
from pyserve.inference import FutureSender, InferRequest, InferResponse, RunningLoop
from pyserve.model_config import ModelIO
from pyserve.scheduling.instance import STOP, Batch, check_outputs
from pyserve.validation import check_input

ModelLookup = Callable[[str, int | None], Any]
"""``lookup(name, version or None)`` → the READY ``ModelVersion``; raises ``InferError``."""


@dataclass(frozen=True)
class Step:
    """One validated step: which model, and how its tensors map to ensemble tensors."""

    index: int
    model_name: str
    version: int | None
    inputs: dict[str, str]  # step model input -> ensemble tensor
    outputs: dict[str, str]  # step model output -> ensemble tensor


def build_plan(config: Any, io: ModelIO, lookup: ModelLookup) -> list[Step]:
    """Validate ``ensemble_scheduling`` against the step models.

    :raises ValueError: every problem found, one per line.
    """
    problems: list[str] = []
    steps: list[Step] = []
    dtypes: dict[str, str] = {name: spec.datatype.name for name, spec in io.inputs.items()}
    producers: dict[str, int] = {}
    for index, raw in enumerate(config.ensemble_scheduling.step):
        where = f"step {index} (model '{raw.model_name}')"
        version = None if raw.model_version in (-1, 0) else int(raw.model_version)
        try:
            model = lookup(raw.model_name, version)
        except InferError as exc:
            problems.append(f"{where}: {exc.message}")
            continue
        step_io: ModelIO = model.io
        for step_input in raw.input_map:
            if step_input not in step_io.inputs:
                problems.append(f"{where}: input_map names '{step_input}', which is not an input of the model")
        for name, spec in step_io.inputs.items():
            if name not in raw.input_map and not spec.optional:
                problems.append(f"{where}: the model's input '{name}' is not mapped in input_map")
        for step_output, tensor in raw.output_map.items():
            if step_output not in step_io.outputs:
                problems.append(f"{where}: output_map names '{step_output}', which is not an output of the model")
                continue
            if tensor in io.inputs or tensor in producers:
                problems.append(f"{where}: ensemble tensor '{tensor}' is already written by "
                                + ("the ensemble's inputs" if tensor in io.inputs else f"step {producers.get(tensor)}"))
                continue
            producers[tensor] = index
            dtypes[tensor] = step_io.outputs[step_output].datatype.name
        steps.append(Step(index, raw.model_name, version, dict(raw.input_map), dict(raw.output_map)))
    if problems:
        raise ValueError("\n".join(problems))
    for step in steps:
        step_io = lookup(step.model_name, step.version).io
        for step_input, tensor in step.inputs.items():
            if tensor not in dtypes:
                problems.append(f"step {step.index} (model '{step.model_name}'): input '{step_input}' reads "
                                f"ensemble tensor '{tensor}', which no input or step provides")
            elif dtypes[tensor] != step_io.inputs[step_input].datatype.name:
                problems.append(f"step {step.index} (model '{step.model_name}'): input '{step_input}' is "
                                f"{step_io.inputs[step_input].datatype.name} but ensemble tensor '{tensor}' is {dtypes[tensor]}")
    consumed = {t for s in steps for t in s.inputs.values()}
    for name in io.inputs:
        if name not in consumed:
            problems.append(f"ensemble input '{name}' is not used by any step")
    for name, spec in io.outputs.items():
        if name not in producers:
            problems.append(f"ensemble output '{name}' is not produced by any step")
        elif dtypes[name] != spec.datatype.name:
            problems.append(f"ensemble output '{name}' is {spec.datatype.name} but step {producers[name]} "
                            f"produces it as {dtypes[name]}")
    cycle = _find_cycle(steps, producers)
    if cycle:
        problems.append("the steps form a cycle: " + " -> ".join(f"step {i}" for i in cycle))
    if problems:
        raise ValueError("\n".join(problems))
    return steps


def _find_cycle(steps: list[Step], producers: dict[str, int]) -> list[int]:
    edges = {s.index: {producers[t] for t in s.inputs.values() if t in producers} for s in steps}
    state: dict[int, int] = {}
    path: list[int] = []

    def visit(node: int) -> list[int]:
        state[node] = 1
        path.append(node)
        for dep in edges.get(node, ()):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return []

    for node in edges:
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


class EnsembleScheduler:
    """Runs an ensemble's requests as asyncio tasks on the server's event loop.

    :param name: the ensemble's model name.
    :param steps: the validated plan.
    :param io: the ensemble's own tensor tables.
    :param lookup: resolves step models at run time (they may be reloaded).
    """

    observe = None

    def __init__(self, name: str, steps: list[Step], io: ModelIO, lookup: ModelLookup) -> None:
        self.name = name
        self.steps = steps
        self.io = io
        self._lookup = lookup
        self._tasks: set[asyncio.Task[None]] = set()
        self._running_loop = RunningLoop()  # no getpid system call per request

    def _loop(self) -> asyncio.AbstractEventLoop:
        loop = self._running_loop.get()
        if loop is None:
            raise RuntimeError(f"ensemble '{self.name}': requests are enqueued on the server's event loop")
        return loop

    def enqueue(self, request: InferRequest) -> None:
        task = self._loop().create_task(self._run(request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def batch_source(self, index: int) -> Callable[[], Batch | None]:
        return lambda: STOP  # an ensemble has no instances

    def stop(self, workers: int) -> None:
        """In-flight ensemble requests finish on their own (the server drains them first)."""

    async def _run(self, request: InferRequest) -> None:
        try:
            result: InferResponse | InferError = await self._execute(request)
        except InferError as exc:
            result = exc
        except Exception as exc:  # a bug must still answer the request
            result = InferError(f"ensemble '{self.name}' failed: {type(exc).__name__}: {exc}", ErrorCode.INTERNAL)
        if isinstance(result, InferResponse):
            result = check_outputs(request, result, self.io, self.name)
        request.reply(result)

    async def _execute(self, request: InferRequest) -> InferResponse:
        pool: dict[str, Any] = dict(request.inputs)
        waiting = list(self.steps)
        running: dict[asyncio.Task[InferResponse | InferError], Step] = {}
        needed = set(request.requested_outputs)
        try:
            while not needed.issubset(pool):
                for step in [s for s in waiting if all(t in pool for t in s.inputs.values())]:
                    waiting.remove(step)
                    task = asyncio.ensure_future(self._call_step(step, request, pool))
                    running[task] = step
                if not running:
                    missing = sorted(needed - set(pool))
                    raise InferError(f"ensemble '{self.name}' cannot produce {missing}", ErrorCode.INTERNAL)
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    step = running.pop(task)
                    result = task.result()
                    if isinstance(result, InferError):
                        raise InferError(
                            f"in ensemble '{self.name}', step {step.index} (model '{step.model_name}'): "
                            f"{result.message}",
                            result.code,
                        )
                    for step_output, tensor in step.outputs.items():
                        if step_output in result.outputs:
                            pool[tensor] = result.outputs[step_output]
                if request.is_cancelled():
                    raise InferError("request was cancelled", ErrorCode.CANCELLED)
        finally:
            for task in running:
                task.cancel()
        return InferResponse({name: pool[name] for name in request.requested_outputs})

    async def _call_step(self, step: Step, parent: InferRequest, pool: dict[str, Any]) -> InferResponse | InferError:
        try:
            model = self._lookup(step.model_name, step.version)
        except InferError as exc:
            return exc
        io: ModelIO = model.io
        inputs = {}
        batch = 1
        try:
            for step_input, tensor in step.inputs.items():
                array = pool[tensor]
                _, shape = check_input(step.model_name, io, step_input, _datatype(array, io, step_input),
                                       list(array.shape))
                inputs[step_input] = array
                if io.batching:
                    batch = shape[0]
        except InferError as exc:
            return exc
        child = InferRequest(
            step.model_name,
            model.version,
            inputs,
            tuple(step.outputs),
            id=parent.id,
            parameters=parent.parameters,
            flags=parent.flags,
            correlation_id=parent.correlation_id,
            priority=parent.priority,
            timeout_us=parent.timeout_us,
            batch_size=batch,
        )
        loop = self._loop()
        future: asyncio.Future[InferResponse | InferError] = loop.create_future()
        child.attach_sender(FutureSender(loop, future))
        try:
            model.enqueue(child)
        except InferError as exc:
            return exc
        try:
            return await future
        except asyncio.CancelledError:
            child.cancel()
            raise


def _datatype(array: Any, io: ModelIO, name: str) -> str:
    """The datatype of a tensor an ensemble passes on, checked against the step model's current
    config (the model may have been reloaded with other types since the plan was built).

    numpy arrays are checked by their own dtype; other DLPack-capable arrays (torch, cupy...)
    come from a backend that already checked them against its model's declared outputs.
    """
    if isinstance(array, np.ndarray):
        found = datatypes.from_numpy(array.dtype)
        if found is not None:
            return found.name
    spec = io.inputs.get(name)
    return spec.datatype.name if spec is not None else ""

