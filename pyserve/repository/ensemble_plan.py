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
        mapped = _map_step(index, raw, io, lookup, _Tensors(dtypes, producers), problems)
        if mapped is None:
            continue
        step, step_decoupled = mapped
        if step_decoupled:
            decoupled.add(index)
        steps.append(step)
    _raise_problems(problems)
    problems = _input_types(steps, lookup, dtypes) + _ensemble_tensors(config.name, steps, io, dtypes, producers)
    problems += _shape_problems(config.name, steps, io, lookup)
    cycle = _find_cycle(steps, producers)
    if cycle:
        problems.append("the steps form a cycle: " + " -> ".join(f"step {i}" for i in cycle))
    _raise_problems(problems)
    _raise_problems(_decoupled_origins(steps, io, decoupled))
    config.model_transaction_policy.decoupled = bool(decoupled)
    return steps


def _raise_problems(problems: list[str]) -> None:
    """:raises ValueError: the problems, one per line (none: nothing raised)."""
    if problems:
        raise ValueError("\n".join(problems))


@dataclass(frozen=True)
class _Tensors:
    """The ensemble tensors known so far: datatype by name, and the step writing each."""

    dtypes: dict[str, str]
    producers: dict[str, int]


def _map_step(
    index: int, raw: Any, io: ModelIO, lookup: ModelLookup, tensors: _Tensors, problems: list[str]
) -> tuple[Step, bool] | None:
    """Check one step's maps against its model (problems appended), recording the tensors it
    writes. :returns: the step and whether its model is decoupled; None: no such model."""
    where = f"step {index} (model '{raw.model_name}')"
    version = None if raw.model_version in (-1, 0) else int(raw.model_version)
    try:
        model = lookup(raw.model_name, version)
    except InferError as exc:
        problems.append(f"{where}: {exc.message}")
        return None
    step_io: ModelIO = model.io
    for step_input in raw.input_map:
        if step_input not in step_io.inputs:
            problems.append(f"{where}: input_map names '{step_input}', which is not an input of the model")
    for name, spec in step_io.inputs.items():
        if name not in raw.input_map and not spec.optional:
            problems.append(f"{where}: the model's input '{name}' is not mapped in input_map")
    producers = tensors.producers
    for step_output, tensor in raw.output_map.items():
        if step_output not in step_io.outputs:
            problems.append(f"{where}: output_map names '{step_output}', which is not an output of the model")
            continue
        if tensor in io.inputs or tensor in producers:
            problems.append(f"{where}: ensemble tensor '{tensor}' is already written by "
                            + ("the ensemble's inputs" if tensor in io.inputs else f"step {producers.get(tensor)}"))
            continue
        producers[tensor] = index
        tensors.dtypes[tensor] = step_io.outputs[step_output].datatype.name
    step = Step(index, raw.model_name, version, dict(raw.input_map), dict(raw.output_map))
    return step, bool(model.decoupled)


def _input_types(steps: list[Step], lookup: ModelLookup, dtypes: dict[str, str]) -> list[str]:
    """Problems with the ensemble tensors the steps read: missing, or of another datatype."""
    problems: list[str] = []
    for step in steps:
        step_io = lookup(step.model_name, step.version).io
        for step_input, tensor in step.inputs.items():
            if tensor not in dtypes:
                problems.append(f"step {step.index} (model '{step.model_name}'): input '{step_input}' reads "
                                f"ensemble tensor '{tensor}', which no input or step provides")
            elif dtypes[tensor] != step_io.inputs[step_input].datatype.name:
                problems.append(f"step {step.index} (model '{step.model_name}'): input '{step_input}' is "
                                f"{step_io.inputs[step_input].datatype.name} but ensemble tensor '{tensor}' is {dtypes[tensor]}")
    return problems


def _shape_problems(name: str, steps: list[Step], io: ModelIO, lookup: ModelLookup) -> list[str]:
    """Triton's shape consistency of ensemble tensors, in its words: the shape a tensor's producer
    declares (the ensemble's input, or a step's output) against each reader's (a step's input, the
    ensemble's output), each with a leading -1 for a batching model's batch dimension; they must
    have the same rank and agree where neither is -1. Reshaped tensors are left to the requests."""

    def full(spec: Any, model_io: ModelIO) -> tuple[int, ...]:
        return ((-1,) if model_io.batching else ()) + tuple(spec.dims)

    written: dict[str, tuple[tuple[int, ...], str]] = {}  # tensor -> full shape, model
    for tensor, spec in io.inputs.items():
        if spec.reshape is None:
            written[tensor] = (full(spec, io), name)
    readers: list[tuple[str, tuple[int, ...], str, bool]] = []  # tensor, full shape, model, is the ensemble
    for step in steps:
        step_io: ModelIO = lookup(step.model_name, step.version).io
        for step_output, tensor in step.outputs.items():
            spec = step_io.outputs[step_output]
            if spec.reshape is None:
                written[tensor] = (full(spec, step_io), step.model_name)
        readers += [(tensor, full(step_io.inputs[i], step_io), step.model_name, False)
                    for i, tensor in step.inputs.items() if step_io.inputs[i].reshape is None]
    readers += [(tensor, full(spec, io), name, True) for tensor, spec in io.outputs.items() if spec.reshape is None]
    problems: list[str] = []
    for tensor, shape, model_name, is_ensemble in readers:
        producer = written.get(tensor)
        if producer is None or _same_shape(shape, producer[0]):
            continue
        first, second = ((shape, model_name), producer) if is_ensemble else (producer, (shape, model_name))
        problems.append(f"in ensemble {name}, ensemble tensor {tensor}: inconsistent shape: "
                        f"{_dims(first[0])} is inferred from model {first[1]} while "
                        f"{_dims(second[0])} is inferred from model {second[1]}")
    return problems


def _same_shape(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


def _dims(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _ensemble_tensors(
    name: str, steps: list[Step], io: ModelIO, dtypes: dict[str, str], producers: dict[str, int]
) -> list[str]:
    """Problems with the ensemble's own tensors: inputs no step reads, outputs no step writes
    (or writes with another datatype), and, in Triton's words, a step output that is neither
    read by a step nor an ensemble output."""
    problems: list[str] = []
    consumed = {t for s in steps for t in s.inputs.values()}
    for tensor in sorted(producers):
        if tensor not in consumed and tensor not in io.outputs:
            problems.append(f"ensemble tensor '{tensor}' is unused in ensemble '{name}' "
                            f"(written by step {producers[tensor]})")
    for tensor in io.inputs:
        if tensor not in consumed:
            problems.append(f"ensemble input '{tensor}' is not used by any step")
    for tensor, spec in io.outputs.items():
        if tensor not in producers:
            problems.append(f"ensemble output '{tensor}' is not produced by any step")
        elif dtypes[tensor] != spec.datatype.name:
            problems.append(f"ensemble output '{tensor}' is {spec.datatype.name} but step {producers[tensor]} "
                            f"produces it as {dtypes[tensor]}")
    return problems


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
