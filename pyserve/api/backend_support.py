"""Shared pieces of the framework backends (onnxruntime, pytorch, tensorflow).

What a backend that runs a framework's model on batches of requests repeats, in one place:

* ``ConfigTensor`` / ``config_tensors``: config inputs and outputs as the model sees them
  (``reshape`` applied) and as clients see them (``dims``);
* ``ModelTensor``, ``check_config``: the tensors a model file declares, and the comparison of
  the config with them (names, datatypes, shapes with the batch dimension);
* ``needs_auto_complete`` / ``complete_config``: Triton-style auto-complete of inputs, outputs,
  ``max_batch_size`` and dynamic batching from the model's tensors;
* ``int_parameter`` / ``bool_parameter``: model ``parameters`` values;
* ``FrameworkModel`` / ``FrameworkInstance``: ``model.state`` and ``instance.state`` bases with
  the gather → run → split execute (errors mapped to one ``InferError`` per request);
* ``pyserve_instance_create``, ``pyserve_instance_finalize``, ``pyserve_execute``: hook
  implementations for a module plugin whose model state is a ``FrameworkModel``; import them
  into the plugin module to register them;
* ``missing_model_file``: what a plugin's ``pyserve_model_validate`` reports, from the
  function that locates its model file.

Importing this module imports numpy, but no framework.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pyserve.api.backend import InstanceContext, ModelContext
from pyserve.api.batching import gather_inputs, split_outputs
from pyserve.api.errors import ErrorCode, InferError, ModelFileNotFound
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.protocol import data_type_name, data_type_value
from pyserve_hookspecs import hookimpl

__all__ = [
    "CONFIG_TYPE_NAMES",
    "NUMPY_NAME_TO_CONFIG",
    "ConfigTensor",
    "ProcessWideSettings",
    "FrameworkInstance",
    "FrameworkModel",
    "INT32_MAX",
    "MAX_THREAD_COUNT",
    "ModelTensor",
    "bool_parameter",
    "check_config",
    "complete_config",
    "config_tensors",
    "int_parameter",
    "missing_model_file",
    "needs_auto_complete",
    "pyserve_execute",
    "pyserve_instance_create",
    "pyserve_instance_finalize",
    "sequence_tensors",
]

NUMPY_NAME_TO_CONFIG: dict[str, str] = {
    "bool": "TYPE_BOOL",
    "uint8": "TYPE_UINT8",
    "uint16": "TYPE_UINT16",
    "uint32": "TYPE_UINT32",
    "uint64": "TYPE_UINT64",
    "int8": "TYPE_INT8",
    "int16": "TYPE_INT16",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float16": "TYPE_FP16",
    "float32": "TYPE_FP32",
    "float64": "TYPE_FP64",
    "bfloat16": "TYPE_BF16",
}
"""numpy-style dtype names (also torch's and TensorFlow's) → ModelConfig datatype names."""

CONFIG_TYPE_NAMES = frozenset({*NUMPY_NAME_TO_CONFIG.values(), "TYPE_STRING"})
"""The ModelConfig datatype names auto-complete may write."""


# --------------------------------------------------------------------------- config tensors


@dataclass(frozen=True)
class ConfigTensor:
    """One config input or output as the backend uses it.

    :ivar dims: the non-batch shape the model sees (``reshape`` when the config has one).
    :ivar client_dims: the config ``dims`` (outputs are reshaped back to them).
    """

    name: str
    config_type: str
    dims: tuple[int, ...]
    client_dims: tuple[int, ...]
    optional: bool = False

    @property
    def reshaped(self) -> bool:
        return self.dims != self.client_dims


def config_tensors(
    tensors: Iterable[Any], kind: str, backend: str, unsupported: Iterable[str] = ()
) -> tuple[ConfigTensor, ...]:
    """The config's ``input`` (or ``output``) entries as ``ConfigTensor``.

    :param kind: ``"input"`` or ``"output"``, for messages.
    :param backend: the backend's name, for messages.
    :param unsupported: config datatype names the backend cannot serve.
    :raises ValueError: a tensor has an unsupported datatype.
    """
    refused = frozenset(unsupported)
    result = []
    for tensor in tensors:
        config_type = data_type_name(tensor.data_type)
        if config_type in refused:
            raise ValueError(f"{kind} '{tensor.name}': {config_type} is not supported by the {backend} backend")
        dims = tensor.reshape.shape if tensor.HasField("reshape") else tensor.dims
        result.append(
            ConfigTensor(
                tensor.name,
                config_type,
                tuple(int(d) for d in dims),
                tuple(int(d) for d in tensor.dims),
                bool(getattr(tensor, "optional", False)),
            )
        )
    return tuple(result)


def sequence_tensors(config: Any) -> tuple[tuple[ConfigTensor, ...], tuple[ConfigTensor, ...]]:
    """What the sequence batcher adds to the requests of a ``sequence_batching`` model, as
    ``ConfigTensor``: the ``control_input`` tensors (dims ``[1]``, the datatype their
    false/true values or CORRID ``data_type`` give) and the implicit ``state`` inputs, then the
    state outputs it keeps for the sequence's next request. A framework backend feeds the
    first to the framework beside the config inputs (Triton's libtorch counts them among
    forward's arguments) and returns the second with every response. ``((), ())`` for a model
    without sequence batching."""
    if not config.HasField("sequence_batching"):
        return (), ()
    batching = config.sequence_batching
    inputs = []
    for control_input in batching.control_input:
        for control in control_input.control:
            if len(control.int32_false_true) == 2:
                config_type = "TYPE_INT32"
            elif len(control.fp32_false_true) == 2:
                config_type = "TYPE_FP32"
            elif len(control.bool_false_true) == 2:
                config_type = "TYPE_BOOL"
            else:  # CORRID
                config_type = data_type_name(control.data_type) if control.data_type else "TYPE_UINT64"
            inputs.append(ConfigTensor(control_input.name, config_type, (1,), (1,)))
    outputs = []
    for state in batching.state:
        dims = tuple(int(d) for d in state.dims)
        inputs.append(ConfigTensor(state.input_name, data_type_name(state.data_type), dims, dims))
        outputs.append(ConfigTensor(state.output_name, data_type_name(state.data_type), dims, dims))
    return tuple(inputs), tuple(outputs)


INT32_MAX = 2**31 - 1
"""The largest value ``int_parameter`` accepts by default (frameworks take C ``int`` settings)."""

MAX_THREAD_COUNT = 1024
"""The largest thread-count parameter the framework backends accept."""


def int_parameter(parameters: Mapping[str, str], key: str, maximum: int = INT32_MAX) -> int | None:
    """A model parameter as an integer in ``0..maximum``; ``None`` when unset or empty.

    :raises ValueError: the value is not such an integer; the message names the parameter.
    """
    raw = parameters.get(key)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= maximum:
        raise ValueError(f"model parameter '{key}' must be an integer from 0 to {maximum} (got {raw!r})")
    return value


def bool_parameter(parameters: Mapping[str, str], key: str, default: bool | None = None) -> bool | None:
    """A model parameter as a bool (true/false, 1/0, yes/no); ``default`` when unset or empty.

    :raises ValueError: any other value.
    """
    raw = parameters.get(key)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"model parameter '{key}' must be 'true' or 'false' (got {raw!r})")
    return value in ("true", "1", "yes")


# --------------------------------------------------------------------------- model tensors


class ProcessWideSettings:
    """Framework settings that belong to the whole process (thread pools, global flags), set
    from model parameters as Triton's backends do: the first model that sets one wins, and a
    later model asking for another value is told so in the log (its own load goes on).

    Thread-safety: ``apply`` may be called from concurrent model-loading threads.

    :param framework: the framework's name, for the log lines.
    :param logger: where those lines go.
    """

    def __init__(self, framework: str, logger: logging.Logger) -> None:
        self.framework = framework
        self._log = logger
        self._lock = threading.Lock()
        self._chosen: dict[str, tuple[Any, str]] = {}

    def apply(self, model_name: str, key: str, value: Any, setter: Any) -> None:
        """Call ``setter(value)`` unless ``key`` was set already (by this or another model).

        A ``RuntimeError`` from ``setter`` (the framework refuses a change once it has run) is
        logged and the setting stays unset.
        """
        with self._lock:
            earlier = self._chosen.get(key)
            if earlier is not None:
                if earlier[0] != value:
                    self._log.warning("model '%s': parameter %s=%s ignored: model '%s' set it to %s for the "
                                      "whole process", model_name, key, value, earlier[1], earlier[0])
                return
            try:
                setter(value)
            except RuntimeError as exc:
                self._log.warning("model '%s': parameter %s=%s not applied: %s", model_name, key, value, exc)
                return
            self._chosen[key] = (value, model_name)
            self._log.info("model '%s': %s %s set to %s for the whole process", model_name, self.framework, key, value)


@dataclass(frozen=True)
class ModelTensor:
    """An input or output as the model file declares it.

    :ivar config_type: the ModelConfig datatype name, or the framework's name when it has none.
    :ivar shape: the full shape, ``-1`` for unknown dimensions; ``None`` when the rank is unknown.
    """

    name: str
    config_type: str
    shape: tuple[int, ...] | None


def check_config(
    model: FrameworkModel, inputs: Sequence[ModelTensor], outputs: Sequence[ModelTensor], source: str
) -> None:
    """Compare the config's inputs and outputs with the model's (``source`` names the model).

    :raises ValueError: naming the tensor, what the config says and what the model says.
    """
    model_inputs = {t.name: t for t in inputs}
    model_outputs = {t.name: t for t in outputs}
    for kind, declared, found in (("input", model.inputs, model_inputs), ("output", model.outputs, model_outputs)):
        for tensor in declared:
            match = found.get(tensor.name)
            if match is None:
                raise ValueError(
                    f"{kind} '{tensor.name}' of the config is not an {kind} of {source} "
                    f"(model {kind}s: {', '.join(found) or 'none'})"
                )
            _compare(model, kind, tensor, match)
    declared_inputs = {t.name for t in (*model.inputs, *model.sequence_inputs)}
    for name, model_tensor in model_inputs.items():
        if name not in declared_inputs:
            shape = "" if model_tensor.shape is None else f" {list(model_tensor.shape)}"
            raise ValueError(
                f"model input '{name}' of {source} ({model_tensor.config_type}{shape}) is not declared in the config"
            )


def _compare(model: FrameworkModel, kind: str, tensor: ConfigTensor, found: ModelTensor) -> None:
    if tensor.config_type != found.config_type:
        raise ValueError(
            f"{kind} '{tensor.name}': the config declares data_type {tensor.config_type}, but the "
            f"model has {found.config_type}"
        )
    if found.shape is None:
        return
    if model.batching and (not found.shape or found.shape[0] != -1):
        raise ValueError(
            f"{kind} '{tensor.name}': max_batch_size {model.max_batch_size} needs a variable first "
            f"dimension, but the model's shape is {list(found.shape)}"
        )
    shape = ((-1,) if model.batching else ()) + tensor.dims
    if len(shape) != len(found.shape) or any(a != b and -1 not in (a, b) for a, b in zip(shape, found.shape)):
        detail = (
            f" (batch dimension of max_batch_size {model.max_batch_size} + dims {list(tensor.dims)})"
            if model.batching else ""
        )
        raise ValueError(
            f"{kind} '{tensor.name}': the config's shape {list(shape)}{detail} does not match the "
            f"model's shape {list(found.shape)}"
        )


# --------------------------------------------------------------------------- auto-complete


def _incomplete(tensor: Any) -> bool:
    return tensor.data_type == 0 or (not tensor.dims and not tensor.HasField("reshape"))


def needs_auto_complete(config: Any) -> bool:
    """Whether auto-complete could change ``config`` (so the model must be read)."""
    tensors = (*config.input, *config.output)
    return not (config.input and config.output and config.max_batch_size > 0 and not any(map(_incomplete, tensors)))


def _default_max_batch_size(backend_config: Mapping[str, str]) -> int:
    raw = backend_config.get("default-max-batch-size", "4")
    try:
        return max(int(raw), 0)
    except ValueError:
        raise ValueError(f"backend config 'default-max-batch-size' must be an integer (got {raw!r})") from None


def complete_config(
    config: Any, backend_config: Mapping[str, str], inputs: Sequence[ModelTensor], outputs: Sequence[ModelTensor]
) -> bool:
    """Complete ``config`` from the model's tensors, as Triton's framework backends do.

    Adds every model input (output) when the config declares none, fills a declared tensor's
    missing datatype or dims, and, when ``max_batch_size`` is 0 and every model tensor has a
    variable first dimension (which no declared tensor spells out), sets ``max_batch_size`` to
    the backend config ``default-max-batch-size`` (default 4) and, when that is above 1 and no
    scheduler is configured, enables ``dynamic_batching``. Values the user set are kept.

    :returns: True when the config was changed.
    :raises ValueError: a tensor to fill has an unknown rank, or a bad ``default-max-batch-size``.
    """
    changed = False
    every = (*inputs, *outputs)
    if config.max_batch_size == 0 and all(t.shape and t.shape[0] == -1 for t in every):
        by_name = {t.name: t for t in every}
        without_batch = all(
            len(t.dims) == len(by_name[t.name].shape or ()) - 1
            for t in (*config.input, *config.output)
            if t.name in by_name and not _incomplete(t)
        )
        default = _default_max_batch_size(backend_config)
        if default > 0 and without_batch:
            config.max_batch_size = default
            changed = True
            if default > 1 and config.WhichOneof("scheduling_choice") is None:
                config.dynamic_batching.SetInParent()
    batching = config.max_batch_size > 0
    changed |= _fill(config.input, inputs, batching)
    changed |= _fill(config.output, outputs, batching)
    return changed


def _fill(collection: Any, tensors: Sequence[ModelTensor], batching: bool) -> bool:
    declared = {t.name: t for t in collection}
    if not declared:
        for model_tensor in tensors:
            _set_tensor(collection.add(), model_tensor, batching, name=True)
        return bool(tensors)
    changed = False
    by_name = {t.name: t for t in tensors}
    for name, tensor in declared.items():
        found = by_name.get(name)
        if found is not None and _incomplete(tensor):
            _set_tensor(tensor, found, batching, name=False)
            changed = True
    return changed


def _set_tensor(tensor: Any, found: ModelTensor, batching: bool, *, name: bool) -> None:
    if found.shape is None:
        raise ValueError(f"tensor '{found.name}' has an unknown rank; declare its dims in config.pbtxt")
    if name:
        tensor.name = found.name
    if tensor.data_type == 0 and found.config_type in CONFIG_TYPE_NAMES:
        tensor.data_type = data_type_value(found.config_type)
    if not tensor.dims and not tensor.HasField("reshape"):
        dims = found.shape[1:] if batching else found.shape
        if dims:
            tensor.dims.extend(dims)
        else:  # a scalar per batch entry: Triton's convention is dims [1] reshaped to []
            tensor.dims.append(1)
            tensor.reshape.SetInParent()


# --------------------------------------------------------------------------- model and instance state


@dataclass
class FrameworkModel(abc.ABC):
    """The base of a framework backend's ``model.state``: file, batching and config tensors.

    Subclasses implement ``create_instance``. Thread-safety: ``create_instance`` and
    ``announce`` may be called from loading threads; the rest is read-only.
    """

    name: str
    path: Path
    max_batch_size: int
    inputs: tuple[ConfigTensor, ...]
    outputs: tuple[ConfigTensor, ...]
    sequence_inputs: tuple[ConfigTensor, ...] = field(default=(), kw_only=True)
    """The sequence batcher's control and state inputs the framework takes (``sequence_tensors``)."""
    state_outputs: tuple[ConfigTensor, ...] = field(default=(), kw_only=True)
    """The implicit state outputs every response carries back to the sequence batcher."""
    _announced: set[str] = field(default_factory=set, repr=False, kw_only=True)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, kw_only=True)

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 0

    def announce(self, log: logging.Logger, level: int, message: str) -> None:
        """Log a message once per model version (instances repeat the same choice)."""
        with self._lock:
            if message in self._announced:
                return
            self._announced.add(message)
        log.log(level, "%s", message)

    @abc.abstractmethod
    def create_instance(self, instance: InstanceContext) -> FrameworkInstance:
        """Load the model for one instance (its ``instance.state``)."""


class FrameworkInstance(abc.ABC):
    """The base of a framework backend's ``instance.state``: the gather → run → split execute.

    Subclasses implement ``run`` (and may override ``to_host``, ``error`` and ``close``).
    Thread-safety: ``execute`` runs on the instance's own thread only.
    """

    model: FrameworkModel
    text_inputs: frozenset[str] = frozenset()
    """BYTES inputs the framework takes as text: ``execute`` refuses a request whose elements
    of one of them are not UTF-8, before the batch is joined. Empty (the default): no check."""

    def close(self) -> None:  # noqa: B027 - optional: most instances hold nothing to release
        """Release what the instance holds."""

    @abc.abstractmethod
    def run(self, inputs: dict[str, Any], wanted: list[str]) -> Mapping[str, Any]:
        """Run one batch; output name → result for (at least) every ``wanted`` output."""

    def to_host(self, value: Any) -> np.ndarray:
        """A host array for one result."""
        return np.asarray(value)

    def error(self, exc: Exception) -> InferError:
        """The error every request of a failed batch gets."""
        return InferError(f"model '{self.model.name}' failed: {type(exc).__name__}: {exc}", ErrorCode.INTERNAL)

    def execute(self, requests: Sequence[InferRequest]) -> list[InferResponse | InferError]:
        """One response (or error) per request, in order; a batching model runs them as one batch.

        A request whose ``text_inputs`` hold bytes that are not UTF-8 gets its own INVALID_ARG
        error, and is left out of the batch the other requests run in.
        """
        if self.text_inputs:
            refused = [_not_text(request, self.text_inputs) for request in requests]
            if any(refused):
                accepted = iter(self._execute([r for r, e in zip(requests, refused) if e is None]))
                return [e if e is not None else next(accepted) for e in refused]
        return self._execute(requests)

    def _execute(self, requests: Sequence[InferRequest]) -> list[InferResponse | InferError]:
        model = self.model
        if not requests:
            return []
        if not model.batching and len(requests) > 1:
            return [self._execute([r])[0] for r in requests]
        try:
            present = requests[0].inputs
            names = [t.name for t in model.inputs if t.name in present]
            if model.sequence_inputs:
                names += [t.name for t in model.sequence_inputs if t.name in present]
            if len(requests) == 1:  # the common case at low load: no joining, no name merging
                inputs = {n: present[n] for n in names}
                requested = requests[0].requested_outputs
                wanted = [t.name for t in model.outputs if t.name in requested]
                rows = requests[0].batch_size
            else:
                inputs = gather_inputs(requests, names)
                wanted = [t.name for t in model.outputs if any(t.name in r.requested_outputs for r in requests)]
                rows = sum(r.batch_size for r in requests)
            if model.state_outputs:
                wanted += [t.name for t in model.state_outputs]
            results = self.run(inputs, wanted)
            outputs: dict[str, np.ndarray] = {}
            for tensor in (*model.outputs, *model.state_outputs) if model.state_outputs else model.outputs:
                if tensor.name in wanted:
                    outputs[tensor.name] = self._client_shape(tensor, self.to_host(results[tensor.name]), rows)
            if not model.batching:
                return [InferResponse(outputs)]
            return list(split_outputs(requests, outputs))
        except InferError as exc:
            return [exc] * len(requests)
        except Exception as exc:
            return [self.error(exc)] * len(requests)

    def _client_shape(self, tensor: ConfigTensor, array: np.ndarray, rows: int) -> np.ndarray:
        if not tensor.reshaped:
            return array
        target = ((rows,) if self.model.batching else ()) + tensor.client_dims
        try:
            return array.reshape(target)
        except ValueError:
            raise InferError(
                f"output '{tensor.name}' of shape {list(array.shape)} cannot be reshaped to the config's "
                f"dims {list(tensor.client_dims)}"
            ) from None


def _not_text(request: InferRequest, names: frozenset[str]) -> InferError | None:
    """An INVALID_ARG error naming the first input of ``names`` in ``request`` whose bytes are
    not UTF-8 text, or None."""
    for name in names:
        array = request.inputs.get(name)
        if array is None:
            continue
        for index, item in enumerate(array.flat):
            if isinstance(item, bytes):
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError as exc:
                    return InferError.invalid(
                        f"input '{name}' holds bytes that are not UTF-8 text (element {index}: {exc.reason} at "
                        f"byte {exc.start}), which model '{request.model_name}' takes as text"
                    )
    return None


# --------------------------------------------------------------------------- hooks


@hookimpl
def pyserve_instance_create(instance: InstanceContext) -> FrameworkInstance:
    """``instance.model.state.create_instance(instance)`` becomes ``instance.state``.

    :raises ValueError: the model cannot be loaded, or the config disagrees with it.
    """
    state: FrameworkModel = instance.model.state
    return state.create_instance(instance)


@hookimpl
def pyserve_instance_finalize(instance: InstanceContext) -> None:
    """Close the instance's state (release the framework's model)."""
    state: FrameworkInstance | None = instance.state
    if state is not None:
        state.close()


@hookimpl
def pyserve_execute(instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse | InferError]:
    """Run the requests as one batch and split the outputs back per request.

    :returns: one response per request, in order; when the run fails every request gets the
        same error (``FrameworkInstance.error``).
    """
    state: FrameworkInstance = instance.state
    return state.execute(requests)


def missing_model_file(locate: Callable[[ModelContext], object], model: ModelContext) -> list[str]:
    """The problems ``pyserve validate`` reports for ``model``: the message of the
    ``ModelFileNotFound`` that ``locate(model)`` raises, or none when it returns.

    Meant for a plugin's ``pyserve_model_validate``, with ``locate`` its function that finds
    the model file without importing the framework. Other exceptions propagate.
    """
    try:
        locate(model)
    except ModelFileNotFound as exc:
        return [str(exc)]
    return []
