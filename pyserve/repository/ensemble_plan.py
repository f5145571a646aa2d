"""An ensemble's steps checked against its step models: the plan the ensemble scheduler runs.

``build_plan`` needs only the step models' tensors (``ModelIO``) and whether they are decoupled,
so ``pyserve validate`` checks a repository's ensembles with it before anything is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyserve.api.errors import InferError
from pyserve.repository.model_config import ModelIO

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

    On success, sets ``config.model_transaction_policy.decoupled`` as Triton derives it: true
    exactly when a step model is decoupled, whatever the config said (called again when a step
    model is reloaded, it follows the step models as they are then).

    :raises ValueError: every problem found, one per line.
    """
    problems: list[str] = []
    steps: list[Step] = []
    decoupled: set[int] = set()  # indexes of the steps whose model is decoupled
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
        if model.decoupled:
            decoupled.add(index)
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
    problems = _decoupled_origins(steps, io, decoupled)
    if problems:
        raise ValueError("\n".join(problems))
    config.model_transaction_policy.decoupled = bool(decoupled)
    return steps


def _decoupled_origins(steps: list[Step], io: ModelIO, decoupled: set[int]) -> list[str]:
    """Triton's check that waves never mix: every tensor originates from the ensemble's inputs or
    from one decoupled step (passing through non-decoupled steps keeps the origin); a step's
    inputs, and the ensemble's outputs, must all share one origin. Needs an acyclic plan.

    :returns: the problems found (empty: the plan is fine).
    """
    problems: list[str] = []
    origin: dict[str, int] = dict.fromkeys(io.inputs, -1)  # tensor -> decoupled step index, -1: the inputs
    pending = list(steps)
    while pending:
        ready = [s for s in pending if all(t in origin for t in s.inputs.values())]
        if not ready:
            break  # not in a plan that passed the checks above (acyclic, every tensor provided)
        for step in ready:
            pending.remove(step)
            sources = {origin[t] for t in step.inputs.values()}
            if len(sources) > 1:
                problems.append(f"step {step.index} (model '{step.model_name}') receives inputs originated "
                                f"from different decoupled models ({_origins(sources, steps)})")
            source = step.index if step.index in decoupled else min(sources, default=-1)
            for tensor in step.outputs.values():
                origin[tensor] = source
    sources = {origin[name] for name in io.outputs if name in origin}
    if len(sources) > 1:
        problems.append(f"the ensemble's outputs originate from different decoupled models ({_origins(sources, steps)})")
    return problems


def _origins(sources: set[int], steps: list[Step]) -> str:
    by_index = {s.index: s for s in steps}
    return ", ".join("the ensemble's inputs" if i < 0 else f"step {i} (model '{by_index[i].model_name}')"
                     for i in sorted(sources))


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
