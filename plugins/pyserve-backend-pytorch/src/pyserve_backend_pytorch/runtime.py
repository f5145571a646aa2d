"""The pytorch backend's model and instance state: loading, Triton's naming rules, execution.

Nothing here imports ``torch`` at module level; the functions that need it import it, and
they run inside the backend's hooks.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from pyserve import (
    ErrorCode,
    InferError,
    InstanceContext,
    ModelContext,
    ModelFileError,
    ModelFileNotFound,
)
from pyserve.api.backend_support import (
    MAX_THREAD_COUNT,
    NUMPY_NAME_TO_CONFIG,
    ConfigTensor,
    FrameworkInstance,
    FrameworkModel,
    ProcessWideSettings,
    bool_parameter,
    config_tensors,
    int_parameter,
    sequence_tensors,
)
from pyserve.api.datatypes import from_config_name

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pyserve.backend.pytorch")

DEFAULT_FILENAME = "model.pt"
"""TorchScript file inside the version directory, unless ``default_model_filename`` says otherwise."""

EXPORTED_SUFFIX = ".pt2"
"""A model file with this suffix is a ``torch.export`` program (``torch.export.save``)."""

INDEX_NAME = re.compile(r"^(?P<base>.+)__(?P<index>\d+)$")
"""Triton's ``<name>__<index>`` convention for positional inputs and outputs."""

TORCH_TO_CONFIG: dict[str, str] = NUMPY_NAME_TO_CONFIG
"""torch dtype names (``str(dtype)`` without ``torch.``) → ModelConfig datatype names."""


@dataclass(frozen=True)
class RuntimeInfo:
    """What ``pyserve_backend_initialize`` stores as ``backend.state``."""

    version: str
    cuda_devices: int


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ImportError(f"the pytorch backend needs PyTorch: pip install torch ({exc})") from exc
    return torch


def initialize_runtime(cpu_threads: int | None = None) -> RuntimeInfo:
    """Import torch once and log its version and CUDA devices.

    :param cpu_threads: intra-op threads for torch's pool (None: torch's default).
    :raises ImportError: torch is not installed.
    """
    torch = _import_torch()
    if cpu_threads:
        torch.set_num_threads(cpu_threads)
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    info = RuntimeInfo(str(torch.__version__), devices)
    log.info("torch %s, CUDA devices: %d", info.version, info.cuda_devices)
    return info


def grad_guard(inference_mode: bool) -> Callable[[], AbstractContextManager[Any]]:
    """What forward runs under: a new context per call, inference mode (Triton's default) or
    ``torch.no_grad``.

    Inference mode is torch's own C++ guard, ``torch._C._InferenceMode``, which
    ``torch.inference_mode()`` enters through a Python decorator object built per call: the
    guard alone takes ~2 µs where the decorator takes ~15 µs with its code cold, as it is
    between two requests. A torch without the guard gets ``torch.inference_mode``.
    """
    torch = _import_torch()
    if not inference_mode:
        return torch.no_grad
    guard = getattr(torch._C, "_InferenceMode", None)
    if guard is None:
        return torch.inference_mode
    return functools.partial(guard, True)


def config_type_of(dtype: Any) -> str:
    """The ModelConfig datatype name of a torch dtype (its torch name when there is none)."""
    name = str(dtype).removeprefix("torch.")
    return TORCH_TO_CONFIG.get(name, name)


# --------------------------------------------------------------------------- tensors in and out


BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def to_torch(array: np.ndarray, device: Any) -> Any:
    """A torch tensor over a numpy array, through DLPack.

    No copy for a C-contiguous array on a CPU device (read-only arrays included); the result
    is moved to ``device`` otherwise. BF16 arrays travel as int16 bits.
    """
    torch = _import_torch()
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    if array.dtype == BFLOAT16:
        tensor = torch.from_dlpack(array.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_dlpack(array)
    if device.type != "cpu":
        tensor = tensor.to(device)
    return tensor


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy array for a result tensor: a view for CPU tensors, one device→host copy otherwise."""
    torch = _import_torch()
    if tensor.requires_grad:  # forward returned a parameter, say; .numpy() refuses those
        tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(BFLOAT16)
    return tensor.numpy()


COPIED_UP_TO = 64 * 1024
"""CPU results of at most this many bytes are copied without looking where they lie."""

STRING = "TYPE_STRING"
"""TorchScript takes and returns these as ``List[str]``: one dimension, batch included (as Triton)."""


def to_strings(array: np.ndarray, name: str) -> list[str]:
    """A BYTES input as the ``List[str]`` TorchScript takes (UTF-8, row-major order).

    :raises InferError: an element is not UTF-8 text (INVALID_ARG).
    """
    try:
        return [item.decode("utf-8") if isinstance(item, bytes) else str(item) for item in array.reshape(-1)]
    except UnicodeDecodeError as exc:
        raise InferError.invalid(
            f"input '{name}' holds bytes that are not UTF-8 text ({exc.reason} at byte {exc.start}), "
            "which a TorchScript List[str] cannot take"
        ) from None


def from_strings(value: Any, name: str) -> np.ndarray:
    """A ``List[str]`` result as a BYTES array (UTF-8 encoded elements, one dimension).

    :raises InferError: the value is not a list of strings.
    """
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
        raise InferError(
            f"output '{name}' is TYPE_STRING, so forward must return a List[str] for it, not "
            f"{type(value).__name__}",
            ErrorCode.INTERNAL,
        )
    result = np.empty(len(value), dtype=object)
    result[:] = [item.encode("utf-8") for item in value]
    return result


def string_tensors_checked(tensors: tuple[ConfigTensor, ...], kind: str, config: Any) -> tuple[ConfigTensor, ...]:
    """The config's tensors, after checking that every TYPE_STRING one is one-dimensional
    with the batch dimension counted (Triton's rule: a ``List[str]`` has one dimension).

    :raises ValueError: a TYPE_STRING tensor with more dimensions.
    """
    batching = int(config.max_batch_size) > 0
    for tensor in tensors:
        if tensor.config_type == STRING and len(tensor.dims) + batching > 1:
            shape = (["batch"] if batching else []) + list(tensor.dims)
            raise ValueError(
                f"{kind} '{tensor.name}' is TYPE_STRING with shape {shape}: the pytorch backend passes "
                "strings as a one-dimensional List[str], so its dims must be one dimension without "
                "batching, or none with batching (dims: [ 1 ] with reshape: { shape: [ ] })"
            )
    return tensors


# --------------------------------------------------------------------------- config


def _indexed(names: Sequence[str]) -> dict[str, int] | None:
    """``{name: index}`` when every name follows ``<name>__<index>``, else None."""
    indices = {}
    for name in names:
        match = INDEX_NAME.match(name)
        if match is None:
            return None
        indices[name] = int(match["index"])
    return indices


def model_file(model: ModelContext) -> Path:
    """The model file of a version: ``default_model_filename`` or model.pt.

    :raises ModelFileNotFound: the file does not exist.
    """
    path = model.version_path / (model.default_model_filename or DEFAULT_FILENAME)
    if not path.is_file():
        raise ModelFileNotFound(f"model file '{path}' not found for PyTorch model '{model.name}' version {model.version}")
    return path


# --------------------------------------------------------------------------- loading


@dataclass
class LoadedModule:
    """A loaded module and the names of its forward arguments (without ``self``).

    :ivar required: how many leading arguments have no default value.
    """

    module: Any
    arg_names: tuple[str, ...]
    required: int
    exported: bool


def load_module(path: Path, device: Any) -> LoadedModule:
    """Load a TorchScript file (``torch.jit.load``) or a ``.pt2`` ``torch.export`` program on ``device``.

    :raises ValueError: the file is not a loadable model; the message names the file.
    """
    torch = _import_torch()
    try:
        if path.suffix == EXPORTED_SUFFIX:
            from torch.export.graph_signature import InputKind

            program = torch.export.load(str(path))
            names = tuple(
                spec.arg.name for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT
            )
            module = program.module().to(device)
            return LoadedModule(module, names, len(names), exported=True)
        with warnings.catch_warnings():
            # torch marks TorchScript deprecated; it is still the format Triton's backend serves.
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.load.*deprecated", category=DeprecationWarning)
            module = torch.jit.load(str(path), map_location=device)
    except Exception as exc:
        raise ModelFileError(f"cannot load PyTorch model '{path}': {type(exc).__name__}: {exc}") from None
    module.eval()
    arguments = list(module.forward.schema.arguments)[1:]
    required = sum(1 for a in arguments if a.default_value is None and not a.kwarg_only)
    return LoadedModule(module, tuple(a.name for a in arguments), required, exported=False)


# --------------------------------------------------------------------------- process-wide threads

SETTINGS = ProcessWideSettings("torch", log)
"""torch's process-wide settings chosen by models (thread pools, cuDNN, the JIT executor)."""


def apply_thread_counts(model_name: str, intra_op: int | None, inter_op: int | None) -> None:
    """Triton's ``INTRA_OP_THREAD_COUNT`` / ``INTER_OP_THREAD_COUNT``: torch's thread pools are
    shared by every model of the process, so the first model that sets one wins (as in
    Triton; see ``ProcessWideSettings``). 0 keeps torch's default. torch refuses to resize its
    inter-op pool once it has been used: that is logged, and the model still loads.
    """
    torch = _import_torch()
    for key, value, setter in (
        ("INTRA_OP_THREAD_COUNT", intra_op, torch.set_num_threads),
        ("INTER_OP_THREAD_COUNT", inter_op, torch.set_num_interop_threads),
    ):
        if value:
            SETTINGS.apply(model_name, key, value, setter)


_FLAGS = ("DISABLE_CUDNN", "ENABLE_JIT_EXECUTOR", "ENABLE_JIT_PROFILING")


def apply_process_flags(model_name: str, parameters: Mapping[str, str]) -> None:
    """Triton's ``DISABLE_CUDNN``, ``ENABLE_JIT_EXECUTOR`` and ``ENABLE_JIT_PROFILING``: torch
    settings of the whole process, applied when a model that sets them loads (as in Triton);
    the first model that sets one wins (``ProcessWideSettings``).

    :raises ValueError: a value that is not a boolean.
    """
    wanted = {key: value for key in _FLAGS if (value := bool_parameter(parameters, key)) is not None}
    if not wanted:
        return
    torch = _import_torch()

    def disable_cudnn(on: bool) -> None:
        torch.backends.cudnn.enabled = not on

    setters = {
        "DISABLE_CUDNN": disable_cudnn,
        "ENABLE_JIT_EXECUTOR": torch._C._jit_set_profiling_executor,
        "ENABLE_JIT_PROFILING": torch._C._jit_set_profiling_mode,
    }
    for key, value in wanted.items():
        SETTINGS.apply(model_name, key, value, setters[key])


# --------------------------------------------------------------------------- model state


@dataclass
class TorchModel(FrameworkModel):
    """What ``pyserve_model_create`` stores as ``model.state``: file, settings and naming.

    Parameters read from the config (all optional):

    * ``INFERENCE_MODE`` (Triton's name, default true): ``torch.inference_mode`` around
      forward; false uses ``torch.no_grad``;
    * ``torch_compile`` (default false): ``torch.compile`` the module (``.pt2`` programs only:
      torch cannot compile TorchScript), with ``torch_compile_backend`` (default inductor)
      and ``torch_compile_mode``;
    * ``probe_run`` (default true): at load, run forward once on zeros shaped from the config
      and check the outputs' datatypes and dims against it;
    * ``INTRA_OP_THREAD_COUNT`` / ``INTER_OP_THREAD_COUNT`` (Triton's names): torch's thread
      pools, process-wide; see ``apply_thread_counts``;
    * Triton's ``DISABLE_OPTIMIZED_EXECUTION`` (TorchScript forward under
      ``torch.jit.optimized_execution(False)``), ``ENABLE_WEIGHT_SHARING`` (instances on the same
      device share one loaded module), ``ENABLE_CACHE_CLEANING`` (``torch.cuda.empty_cache()``
      after each GPU execute), and the process-wide ``DISABLE_CUDNN``, ``ENABLE_JIT_EXECUTOR``,
      ``ENABLE_JIT_PROFILING`` (applied when the model loads, as Triton does).
    """

    inference_mode: bool = True
    compile: bool = False
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    probe_run: bool = True
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None
    optimized_execution: bool = True
    weight_sharing: bool = False
    cache_cleaning: bool = False
    _shared: dict[str, LoadedModule] = field(default_factory=dict, init=False, repr=False)
    _shared_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @classmethod
    def from_context(cls, model: ModelContext) -> TorchModel:
        """Read the normalized config and parameters of a model version.

        :raises ValueError: a missing model file, a bad parameter value, an unsupported datatype.
        """
        config = model.config
        params = model.parameters
        apply_process_flags(model.name, params)
        sequence_inputs, state_outputs = sequence_tensors(config)
        return cls(
            name=model.name,
            path=model_file(model),
            max_batch_size=int(config.max_batch_size),
            inputs=string_tensors_checked(config_tensors(config.input, "input", "pytorch"), "input", config),
            outputs=string_tensors_checked(config_tensors(config.output, "output", "pytorch"), "output", config),
            sequence_inputs=sequence_inputs,
            state_outputs=state_outputs,
            inference_mode=bool(bool_parameter(params, "INFERENCE_MODE", True)),
            compile=bool(bool_parameter(params, "torch_compile", False)),
            compile_backend=params.get("torch_compile_backend", "").strip() or "inductor",
            compile_mode=params.get("torch_compile_mode", "").strip() or None,
            probe_run=bool(bool_parameter(params, "probe_run", True)),
            intra_op_threads=int_parameter(params, "INTRA_OP_THREAD_COUNT", MAX_THREAD_COUNT),
            inter_op_threads=int_parameter(params, "INTER_OP_THREAD_COUNT", MAX_THREAD_COUNT),
            optimized_execution=not bool_parameter(params, "DISABLE_OPTIMIZED_EXECUTION", False),
            weight_sharing=bool(bool_parameter(params, "ENABLE_WEIGHT_SHARING", False)),
            cache_cleaning=bool(bool_parameter(params, "ENABLE_CACHE_CLEANING", False)),
        )

    def device_for(self, instance: InstanceContext) -> Any:
        """``cuda:<id>`` for KIND_GPU instances, the CPU otherwise.

        :raises ValueError: a GPU instance but this torch build sees no such CUDA device.
        """
        torch = _import_torch()
        if instance.kind != "GPU":
            return torch.device("cpu")
        if not torch.cuda.is_available() or instance.device_id >= torch.cuda.device_count():
            raise ValueError(
                f"instance '{instance.name}' is KIND_GPU on GPU {instance.device_id}, but torch "
                f"{torch.__version__} sees {torch.cuda.device_count() if torch.cuda.is_available() else 0} "
                "CUDA device(s)"
            )
        return torch.device("cuda", instance.device_id)

    def create_instance(self, instance: InstanceContext) -> TorchInstance:
        """Load the module on the instance's device, map the config's names, probe it.

        :raises ValueError: unloadable file, names that match no forward argument, or a probe
            run whose outputs disagree with the config (naming the tensor and both sides).
        """
        device = self.device_for(instance)
        if self.weight_sharing:  # Triton's ENABLE_WEIGHT_SHARING: one module per device
            with self._shared_lock:
                loaded = self._shared.get(str(device))
                if loaded is None:
                    loaded = self._shared[str(device)] = load_module(self.path, device)
        else:
            loaded = load_module(self.path, device)
        call = self._input_binding(loaded)
        module = loaded.module
        if self.compile:
            module = self._compiled(loaded)
        result = TorchInstance(self, module, device, call, self._output_indices())
        if self.probe_run:
            result.probe()
        self.announce(log, logging.INFO, f"model '{self.name}': {instance.kind} instances run on {device}")
        return result

    def _compiled(self, loaded: LoadedModule) -> Any:
        torch = _import_torch()
        if not loaded.exported:
            raise ValueError(
                f"parameter 'torch_compile' is set, but '{self.path.name}' is TorchScript, which "
                "torch.compile cannot compile; serve a torch.export program ('.pt2') instead"
            )
        try:
            return torch.compile(loaded.module, backend=self.compile_backend, mode=self.compile_mode, dynamic=True)
        except Exception as exc:
            raise ValueError(f"torch.compile failed for '{self.path.name}': {type(exc).__name__}: {exc}") from None

    def _input_binding(self, loaded: LoadedModule) -> InputBinding:
        """How config inputs become forward arguments: by argument name or by ``__<index>``. The
        sequence batcher's control and state inputs count as inputs, as in Triton."""
        names = [t.name for t in (*self.inputs, *self.sequence_inputs)]
        signature = f"forward({', '.join(loaded.arg_names)})"
        if all(name in loaded.arg_names for name in names):
            missing = [a for a in loaded.arg_names[: loaded.required] if a not in names]
            if missing:
                raise ValueError(
                    f"forward argument '{missing[0]}' of {signature} has no input in the config "
                    f"(config inputs: {', '.join(names)})"
                )
            if loaded.exported:  # a torch.export module takes its user inputs positionally
                return InputBinding(keywords=(), positions=tuple(a for a in loaded.arg_names if a in names))
            return InputBinding(keywords=tuple(names), positions=())
        indices = _indexed(names)
        if indices is None:  # neither convention: config order, as Triton's STRICT_CONFIG_ORDERING
            if not loaded.required <= len(names) <= len(loaded.arg_names):
                stray = next(n for n in names if n not in loaded.arg_names and INDEX_NAME.match(n) is None)
                raise ValueError(
                    f"input '{stray}' of the config matches no argument of {signature} and does not "
                    f"follow the '<name>__<index>' convention, and the config's {len(names)} input(s) "
                    f"cannot be passed in their order ({signature} takes {loaded.required}..{len(loaded.arg_names)})"
                )
            log.info("model '%s': inputs %s match neither the arguments of %s nor '<name>__<index>': "
                     "passed in config order", self.name, names, signature)
            return InputBinding(keywords=(), positions=tuple(names))
        order = sorted(indices.values())
        if order != list(range(len(order))):
            raise ValueError(
                f"the config's inputs {names} must be numbered 0..{len(order) - 1} by their "
                "'__<index>' suffixes, each once"
            )
        if not loaded.required <= len(order) <= len(loaded.arg_names):
            raise ValueError(
                f"the config has {len(order)} input(s) but {signature} takes "
                f"{loaded.required}..{len(loaded.arg_names)}"
            )
        by_index = {index: name for name, index in indices.items()}
        return InputBinding(keywords=(), positions=tuple(by_index[i] for i in range(len(order))))

    def _output_indices(self) -> dict[str, int]:
        """Output name → position in forward's result (``__<index>`` names, else config order,
        then the implicit state outputs)."""
        names = [t.name for t in (*self.outputs, *self.state_outputs)]
        indexed = _indexed(names)
        return indexed if indexed is not None else {name: i for i, name in enumerate(names)}

    def probe_inputs(self) -> dict[str, np.ndarray]:
        """Zeros shaped from the config (batch 1, variable dims 1), one array per required input."""
        arrays = {}
        for tensor in (*self.inputs, *self.sequence_inputs):
            if tensor.optional:
                continue
            shape = ((1,) if self.batching else ()) + tuple(d if d > 0 else 1 for d in tensor.dims)
            if tensor.config_type == STRING:
                arrays[tensor.name] = np.full(shape, b"", dtype=object)
                continue
            dtype = from_config_name(tensor.config_type)
            assert dtype is not None
            arrays[tensor.name] = np.zeros(shape, dtype=dtype.dtype)
        return arrays


@dataclass(frozen=True)
class InputBinding:
    """Config input names passed by keyword, or by position (``positions[i]`` is argument i)."""

    keywords: tuple[str, ...]
    positions: tuple[str, ...]


# --------------------------------------------------------------------------- execution


class TorchInstance(FrameworkInstance):
    """One instance: a module on a device, and how it runs a batch (``FrameworkInstance.execute``).

    Thread-safety: ``execute`` runs on the instance's own thread only.
    """

    model: TorchModel

    def __init__(
        self, model: TorchModel, module: Any, device: Any, binding: InputBinding, output_indices: dict[str, int]
    ) -> None:
        self.model = model
        self.module: torch.nn.Module | None = module
        self.device = device
        self.binding = binding
        self.output_indices = output_indices
        self.torch = _import_torch()
        self.guard = grad_guard(model.inference_mode)
        self.string_inputs = frozenset(t.name for t in model.inputs if t.config_type == STRING)
        self.text_inputs = self.string_inputs  # List[str] takes UTF-8 text: checked per request
        self.string_outputs = tuple(t.name for t in model.outputs if t.config_type == STRING)
        self._one_string_output = len(model.outputs) == 1 and bool(self.string_outputs)
        self._input_memory: frozenset[int] = frozenset()

    def close(self) -> None:
        """Drop the module (and the CUDA cache of its device)."""
        self.module = None
        if self.device.type == "cuda":
            _import_torch().cuda.empty_cache()

    def forward(self, inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """Run forward on host arrays; output name → result tensor (on the instance's device).

        On a GPU the instance's device is CUDA's current device while forward runs (as Triton's
        device guard): tensors a model creates on ``"cuda"`` land on its own GPU, not on GPU 0.

        :raises InferError: forward's result lacks a configured output.
        """
        if self.device.type == "cuda":
            with self.torch.cuda.device(self.device):
                return self._forward(inputs)
        return self._forward(inputs)

    def _forward(self, inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
        with self.guard():
            if self.model.optimized_execution:
                result = self._call(inputs)
            else:
                with self.torch.jit.optimized_execution(False):
                    result = self._call(inputs)
        if self.model.cache_cleaning and self.device.type == "cuda":
            self.torch.cuda.empty_cache()
        return self._outputs(result)

    def _call(self, inputs: Mapping[str, np.ndarray]) -> Any:
        device = self.device
        if self.string_inputs:
            return self._call_with_strings(inputs)
        if self.binding.positions:
            args = [to_torch(inputs[name], device) for name in self.binding.positions if name in inputs]
            return self.module(*args)  # type: ignore[misc]
        kwargs = {name: to_torch(inputs[name], device) for name in self.binding.keywords if name in inputs}
        return self.module(**kwargs)  # type: ignore[misc]

    def _call_with_strings(self, inputs: Mapping[str, np.ndarray]) -> Any:
        strings, device = self.string_inputs, self.device

        def argument(name: str) -> Any:
            return to_strings(inputs[name], name) if name in strings else to_torch(inputs[name], device)

        if self.binding.positions:
            return self.module(*[argument(name) for name in self.binding.positions if name in inputs])  # type: ignore[misc]
        return self.module(**{name: argument(name) for name in self.binding.keywords if name in inputs})  # type: ignore[misc]

    def _outputs(self, result: Any) -> dict[str, Any]:
        torch = _import_torch()
        if isinstance(result, torch.Tensor):
            result = (result,)
        elif isinstance(result, list) and (self._one_string_output or (result and all(isinstance(x, str) for x in result))):
            result = (result,)  # a List[str] is one result, not a list of results
        if isinstance(result, Mapping):
            every = (*self.model.outputs, *self.model.state_outputs)
            missing = [t.name for t in every if t.name not in result]
            if missing:
                raise InferError(
                    f"forward of model '{self.model.name}' returned a dict without output '{missing[0]}' "
                    f"(keys: {', '.join(map(str, result))})"
                )
            return {t.name: result[t.name] for t in every}
        if not isinstance(result, (tuple, list)):
            raise InferError(
                f"forward of model '{self.model.name}' returned {type(result).__name__}; expected a "
                "tensor, a tuple or list of tensors, or a dict of tensors"
            )
        outputs = {}
        for name, index in self.output_indices.items():
            if index >= len(result):
                raise InferError(
                    f"output '{name}' is result {index} of forward, but model '{self.model.name}' "
                    f"returned {len(result)} value(s)"
                )
            outputs[name] = result[index]
        return outputs

    def probe(self) -> None:
        """Run forward once on zeros and compare the outputs with the config.

        :raises ValueError: forward fails, or an output's datatype or dims disagree.
        """
        model = self.model
        inputs = model.probe_inputs()
        try:
            outputs = self.forward(inputs)
        except Exception as exc:
            shapes = ", ".join(f"{n}: {list(a.shape)} {model_input_type(model, n)}" for n, a in inputs.items())
            raise ValueError(
                f"a probe run of forward on zeros shaped from the config ({shapes}) failed: "
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''} "
                "(the config's inputs disagree with the model; set parameter 'probe_run' to 'false' to skip)"
            ) from None
        for tensor in model.outputs:
            value = outputs[tensor.name]
            if isinstance(value, list) and all(isinstance(x, str) for x in value):
                value = np.empty(len(value), dtype=object)
                actual_type = STRING
            elif isinstance(value, self.torch.Tensor):
                actual_type = config_type_of(value.dtype)
            else:
                actual_type = type(value).__name__
            if actual_type != tensor.config_type:
                raise ValueError(
                    f"output '{tensor.name}': the config declares data_type {tensor.config_type}, but "
                    f"the model produces {actual_type}"
                )
            shape = tuple(value.shape[1:] if model.batching else value.shape)
            if len(shape) != len(tensor.dims) or any(d != -1 and d != s for d, s in zip(tensor.dims, shape)):
                raise ValueError(
                    f"output '{tensor.name}': the config declares dims {list(tensor.dims)}, but the "
                    f"model produces {list(shape)}" + (" after the batch dimension" if model.batching else "")
                )

    def run(self, inputs: dict[str, Any], wanted: list[str]) -> dict[str, Any]:
        self._input_memory = frozenset(  # where large inputs lie: an output over them needs no copy
            array.ctypes.data for array in inputs.values()
            if isinstance(array, np.ndarray) and array.nbytes > COPIED_UP_TO
        )
        outputs = self.forward(inputs)
        for name in self.string_outputs:
            if name in outputs:
                outputs[name] = from_strings(outputs[name], name)
        return outputs

    def to_host(self, value: Any) -> np.ndarray:
        """The host array the server sends for one result of ``run``: memory the module cannot
        change any more, as Triton copies every result into the response. A result on a GPU
        comes over in one fresh copy; a CPU result is copied unless it lies over one of this
        batch's large inputs (an echoed input), since it may be module state that the next
        forward updates in place (a buffer ``forward`` fills and returns, or a view of it)."""
        if isinstance(value, np.ndarray):  # a TYPE_STRING output, made an array in run
            return value
        if not isinstance(value, self.torch.Tensor):
            raise InferError(
                f"forward of model '{self.model.name}' returned {type(value).__name__} for a tensor output",
                ErrorCode.INTERNAL,
            )
        array = to_numpy(value)
        if not value.is_cpu or (
            array.nbytes > COPIED_UP_TO and value.untyped_storage().data_ptr() in self._input_memory
        ):
            return array
        return array.copy()

    def error(self, exc: Exception) -> InferError:
        return InferError(
            f"PyTorch execute failure for model '{self.model.name}': {type(exc).__name__}: {str(exc).strip()}",
            ErrorCode.INTERNAL,
        )


def model_input_type(model: TorchModel, name: str) -> str:
    """The config datatype of an input, for messages."""
    return next((t.config_type for t in model.inputs if t.name == name), "?")
