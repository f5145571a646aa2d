"""The onnxruntime backend's model and instance state, auto-complete and config checks.

Nothing here imports ``onnxruntime`` at module level: it is imported by the functions that
need it, which run inside the backend's hooks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pyserve import (
    ErrorCode,
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelContext,
    gather_inputs,
    split_outputs,
)
from pyserve.protocol import data_type_name, data_type_value

if TYPE_CHECKING:
    import onnxruntime

log = logging.getLogger("pyserve.backend.onnxruntime")

DEFAULT_FILENAME = "model.onnx"
"""The model file inside the version directory (or inside ``default_model_filename``)."""

ONNX_TO_CONFIG: dict[str, str] = {
    "tensor(bool)": "TYPE_BOOL",
    "tensor(uint8)": "TYPE_UINT8",
    "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32",
    "tensor(uint64)": "TYPE_UINT64",
    "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16",
    "tensor(int32)": "TYPE_INT32",
    "tensor(int64)": "TYPE_INT64",
    "tensor(float16)": "TYPE_FP16",
    "tensor(float)": "TYPE_FP32",
    "tensor(double)": "TYPE_FP64",
    "tensor(string)": "TYPE_STRING",
    "tensor(bfloat16)": "TYPE_BF16",
}
"""ONNX Runtime's type strings → ModelConfig datatype names."""

UNSUPPORTED_TYPES = frozenset({"TYPE_BF16"})
"""Config datatypes the onnxruntime Python API cannot feed from numpy."""

GRAPH_LEVELS = {-1: "ORT_ENABLE_BASIC", 1: "ORT_ENABLE_EXTENDED"}
"""``optimization { graph { level } }`` → ``GraphOptimizationLevel`` (anything else: all)."""

_DLPACK_CUDA = 2  # DLDeviceType kDLCUDA


@dataclass(frozen=True)
class RuntimeInfo:
    """What ``pyserve_backend_initialize`` stores as ``backend.state``."""

    version: str
    providers: tuple[str, ...]


def _import_ort() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise ImportError(
            "the onnxruntime backend needs ONNX Runtime: pip install 'pyserve-backend-onnxruntime[cpu]' "
            f"(or [gpu] for onnxruntime-gpu) ({exc})"
        ) from exc
    return onnxruntime


def initialize_runtime() -> RuntimeInfo:
    """Import onnxruntime once; the versions and providers are logged.

    :raises ImportError: onnxruntime is not installed.
    """
    ort = _import_ort()
    info = RuntimeInfo(str(ort.__version__), tuple(ort.get_available_providers()))
    log.info("onnxruntime %s, execution providers: %s", info.version, ", ".join(info.providers))
    return info


# --------------------------------------------------------------------------- model files and I/O


def model_file(model: ModelContext) -> Path:
    """The ONNX file of a model version: ``default_model_filename`` (file or directory) or model.onnx.

    :raises ValueError: the file does not exist.
    """
    name = model.default_model_filename or DEFAULT_FILENAME
    path = model.version_path / name
    if path.is_dir():
        path = path / DEFAULT_FILENAME
    if not path.is_file():
        raise ValueError(f"model file '{path}' not found for ONNX model '{model.name}' version {model.version}")
    return path


@dataclass(frozen=True)
class ModelTensor:
    """An input or output as the ONNX model declares it.

    :ivar config_type: the ModelConfig datatype name, or the ONNX type string when it has none.
    :ivar shape: the full shape; ``-1`` for symbolic or unknown dimensions.
    """

    name: str
    config_type: str
    shape: tuple[int, ...]


def _model_tensor(arg: Any) -> ModelTensor:
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or ()))
    return ModelTensor(arg.name, ONNX_TO_CONFIG.get(arg.type, arg.type), shape)


def model_tensors(session: Any) -> tuple[list[ModelTensor], list[ModelTensor]]:
    """The session's inputs and outputs, in model order."""
    return [_model_tensor(a) for a in session.get_inputs()], [_model_tensor(a) for a in session.get_outputs()]


def open_session(path: Path, options: Any = None, providers: Sequence[Any] = ("CPUExecutionProvider",)) -> Any:
    """An ``InferenceSession`` for ``path``.

    :raises ValueError: the file is not a loadable ONNX model; the message names the file.
    """
    ort = _import_ort()
    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=list(providers))
    except Exception as exc:  # onnxruntime raises its own exception types (InvalidProtobuf, Fail, ...)
        raise ValueError(f"cannot load ONNX model '{path}': {type(exc).__name__}: {exc}") from None


def _metadata_session(path: Path) -> Any:
    ort = _import_ort()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return open_session(path, options)


# --------------------------------------------------------------------------- auto-complete


def _config_dims(tensor: Any) -> tuple[int, ...]:
    """The shape the backend sees for one config tensor: ``reshape`` if set, else ``dims``."""
    dims = tensor.reshape.shape if tensor.HasField("reshape") else tensor.dims
    return tuple(int(d) for d in dims)


def _incomplete(tensor: Any) -> bool:
    return tensor.data_type == 0 or (not tensor.dims and not tensor.HasField("reshape"))


def _default_max_batch_size(model: ModelContext) -> int:
    raw = model.backend.config.get("default-max-batch-size", "4")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"backend config 'default-max-batch-size' must be an integer (got {raw!r})") from None
    return max(value, 0)


def _can_batch(model_inputs: Sequence[ModelTensor], model_outputs: Sequence[ModelTensor]) -> bool:
    return all(t.shape and t.shape[0] == -1 for t in (*model_inputs, *model_outputs))


def _declared_without_batch(config: Any, tensors: Mapping[str, ModelTensor]) -> bool:
    """Whether every declared tensor's dims leave out the model's first dimension."""
    for tensor in (*config.input, *config.output):
        found = tensors.get(tensor.name)
        if found is None or _incomplete(tensor):
            continue
        if len(tensor.dims) != len(found.shape) - 1:
            return False
    return True


def _fill(collection: Any, tensors: Sequence[ModelTensor], batching: bool) -> bool:
    changed = False
    declared = {t.name: t for t in collection}
    if not declared:
        for found in tensors:
            _set_tensor(collection.add(), found, batching, name=True)
        return bool(tensors)
    by_name = {t.name: t for t in tensors}
    for name, tensor in declared.items():
        found = by_name.get(name)
        if found is not None and _incomplete(tensor):
            _set_tensor(tensor, found, batching, name=False)
            changed = True
    return changed


def _set_tensor(tensor: Any, found: ModelTensor, batching: bool, *, name: bool) -> None:
    if name:
        tensor.name = found.name
    if tensor.data_type == 0 and found.config_type in ONNX_TO_CONFIG.values():
        tensor.data_type = data_type_value(found.config_type)
    if not tensor.dims and not tensor.HasField("reshape"):
        dims = found.shape[1:] if batching else found.shape
        if dims:
            tensor.dims.extend(dims)
        else:  # a scalar per batch entry: Triton's convention is dims [1] reshaped to []
            tensor.dims.append(1)
            tensor.reshape.SetInParent()


def auto_complete(model: ModelContext) -> bool:
    """Complete ``model.config`` from the ONNX file, as Triton's onnxruntime backend does.

    Adds every model input (output) when the config declares none, fills a declared tensor's
    missing datatype or dims, and, when the config leaves ``max_batch_size`` at 0 and every
    model input and output has a variable first dimension (and no declared tensor spells that
    dimension out), sets ``max_batch_size`` to the backend config ``default-max-batch-size``
    (default 4) and, when that is above 1 and no scheduler is configured, enables
    ``dynamic_batching``. Values the user set are never changed.

    :returns: True when the config was changed.
    :raises ValueError: the model file is missing or not a loadable ONNX model.
    """
    config = model.config
    tensors = (*config.input, *config.output)
    if config.input and config.output and config.max_batch_size > 0 and not any(map(_incomplete, tensors)):
        return False
    session = _metadata_session(model_file(model))
    inputs, outputs = model_tensors(session)
    del session
    changed = False
    if config.max_batch_size == 0 and _can_batch(inputs, outputs):
        by_name = {t.name: t for t in (*inputs, *outputs)}
        default = _default_max_batch_size(model)
        if default > 0 and _declared_without_batch(config, by_name):
            config.max_batch_size = default
            changed = True
            if default > 1 and config.WhichOneof("scheduling_choice") is None:
                config.dynamic_batching.SetInParent()
    batching = config.max_batch_size > 0
    changed |= _fill(config.input, inputs, batching)
    changed |= _fill(config.output, outputs, batching)
    return changed


# --------------------------------------------------------------------------- model state


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

    @property
    def reshaped(self) -> bool:
        return self.dims != self.client_dims


def _config_tensor(tensor: Any, kind: str) -> ConfigTensor:
    config_type = data_type_name(tensor.data_type)
    if config_type in UNSUPPORTED_TYPES:
        raise ValueError(f"{kind} '{tensor.name}': {config_type} is not supported by the onnxruntime backend")
    return ConfigTensor(tensor.name, config_type, _config_dims(tensor), tuple(int(d) for d in tensor.dims))


def _int_parameter(parameters: Mapping[str, str], key: str) -> int | None:
    raw = parameters.get(key)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"model parameter '{key}' must be an integer >= 0 (got {raw!r})")
    return value


def _bool_parameter(parameters: Mapping[str, str], key: str) -> bool | None:
    raw = parameters.get(key)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value not in ("true", "false", "1", "0"):
        raise ValueError(f"model parameter '{key}' must be 'true' or 'false' (got {raw!r})")
    return value in ("true", "1")


@dataclass
class OnnxModel:
    """What ``pyserve_model_create`` stores as ``model.state``: file, settings, config tensors.

    Thread-safety: ``create_instance`` may be called from loading threads; the rest is read-only.
    """

    name: str
    path: Path
    max_batch_size: int
    inputs: tuple[ConfigTensor, ...]
    outputs: tuple[ConfigTensor, ...]
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None
    graph_level: str = "ORT_ENABLE_ALL"
    enable_mem_arena: bool | None = None
    enable_mem_pattern: bool | None = None
    _announced: set[str] = field(default_factory=set, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_context(cls, model: ModelContext) -> OnnxModel:
        """Read the normalized config and parameters of a model version.

        :raises ValueError: missing model file, bad parameter value or unsupported datatype.
        """
        config = model.config
        params = model.parameters
        level = int(config.optimization.graph.level) if config.optimization.HasField("graph") else 0
        return cls(
            name=model.name,
            path=model_file(model),
            max_batch_size=int(config.max_batch_size),
            inputs=tuple(_config_tensor(t, "input") for t in config.input),
            outputs=tuple(_config_tensor(t, "output") for t in config.output),
            intra_op_threads=_int_parameter(params, "intra_op_thread_count"),
            inter_op_threads=_int_parameter(params, "inter_op_thread_count"),
            graph_level=GRAPH_LEVELS.get(level, "ORT_ENABLE_ALL"),
            enable_mem_arena=_bool_parameter(params, "enable_mem_arena"),
            enable_mem_pattern=_bool_parameter(params, "enable_mem_pattern"),
        )

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 0

    def session_options(self) -> Any:
        """The ``SessionOptions`` every instance of this model uses."""
        ort = _import_ort()
        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, self.graph_level)
        if self.intra_op_threads is not None:
            options.intra_op_num_threads = self.intra_op_threads
        if self.inter_op_threads is not None:
            options.inter_op_num_threads = self.inter_op_threads
        if self.enable_mem_arena is not None:
            options.enable_cpu_mem_arena = self.enable_mem_arena
        if self.enable_mem_pattern is not None:
            options.enable_mem_pattern = self.enable_mem_pattern
        return options

    def _announce(self, level: int, message: str) -> None:
        """Log a message once per model version (instances repeat the same choice)."""
        with self._lock:
            if message in self._announced:
                return
            self._announced.add(message)
        log.log(level, "%s", message)

    def providers(self, instance: InstanceContext) -> tuple[list[Any], int | None]:
        """Execution providers for an instance, and the CUDA device id (None for CPU)."""
        ort = _import_ort()
        if instance.kind == "GPU":
            if "CUDAExecutionProvider" in ort.get_available_providers():
                device = instance.device_id
                return [("CUDAExecutionProvider", {"device_id": device}), "CPUExecutionProvider"], device
            self._announce(
                logging.WARNING,
                f"model '{self.name}': KIND_GPU instances run on CPUExecutionProvider: this onnxruntime "
                "has no CUDAExecutionProvider (install onnxruntime-gpu)",
            )
        return ["CPUExecutionProvider"], None

    def create_instance(self, instance: InstanceContext) -> OnnxInstance:
        """Open the instance's session and check the config against the model.

        :raises ValueError: the file is not a valid ONNX model, or the config disagrees with it.
        """
        providers, device = self.providers(instance)
        session = open_session(self.path, self.session_options(), providers)
        if device is not None and "CUDAExecutionProvider" not in session.get_providers():
            self._announce(
                logging.WARNING,
                f"model '{self.name}': CUDAExecutionProvider could not be enabled (CUDA libraries "
                "missing?); running on CPUExecutionProvider",
            )
            device = None
        self.check(session)
        chosen = f"CUDAExecutionProvider (GPU {device})" if device is not None else "CPUExecutionProvider"
        self._announce(logging.INFO, f"model '{self.name}': {instance.kind} instances use {chosen}")
        return OnnxInstance(self, session, device)

    def check(self, session: Any) -> None:
        """Compare the config's inputs and outputs with the model's.

        :raises ValueError: naming the tensor, what the config says and what the model says.
        """
        inputs, outputs = model_tensors(session)
        model_inputs = {t.name: t for t in inputs}
        model_outputs = {t.name: t for t in outputs}
        for kind, declared, found in (("input", self.inputs, model_inputs), ("output", self.outputs, model_outputs)):
            for tensor in declared:
                match = found.get(tensor.name)
                if match is None:
                    raise ValueError(
                        f"{kind} '{tensor.name}' of the config is not an {kind} of the ONNX model "
                        f"'{self.path.name}' (model {kind}s: {', '.join(found) or 'none'})"
                    )
                self._compare(kind, tensor, match)
        declared_inputs = {t.name for t in self.inputs}
        for name, tensor in model_inputs.items():
            if name not in declared_inputs:
                raise ValueError(
                    f"model input '{name}' ({tensor.config_type} {list(tensor.shape)}) is not declared "
                    "in the config"
                )

    def _compare(self, kind: str, tensor: ConfigTensor, found: ModelTensor) -> None:
        if tensor.config_type != found.config_type:
            raise ValueError(
                f"{kind} '{tensor.name}': the config declares data_type {tensor.config_type}, but the "
                f"model has {found.config_type}"
            )
        shape = ((-1,) if self.batching else ()) + tensor.dims
        where = f"the config's shape {list(shape)}" + (
            f" (batch dimension of max_batch_size {self.max_batch_size} + dims {list(tensor.dims)})"
            if self.batching else ""
        )
        if self.batching and (not found.shape or found.shape[0] != -1):
            raise ValueError(
                f"{kind} '{tensor.name}': max_batch_size {self.max_batch_size} needs a variable first "
                f"dimension, but the model's shape is {list(found.shape)}"
            )
        compatible = len(shape) == len(found.shape) and all(
            a == b or a == -1 or b == -1 for a, b in zip(shape, found.shape)
        )
        if not compatible:
            raise ValueError(f"{kind} '{tensor.name}': {where} does not match the model's shape {list(found.shape)}")


# --------------------------------------------------------------------------- execution


def _on_cuda(array: Any) -> bool:
    device = getattr(array, "__dlpack_device__", None)
    return device is not None and device()[0] == _DLPACK_CUDA


def _to_feed(array: Any, config_type: str) -> Any:
    """onnxruntime takes string tensors as object arrays of ``str``."""
    if config_type == "TYPE_STRING" and isinstance(array, np.ndarray):
        flat = [v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else str(v) for v in array.flat]
        return np.array(flat, dtype=object).reshape(array.shape)
    return array


def _error(model: str, exc: BaseException) -> InferError:
    kind = type(exc).__name__
    if isinstance(exc, InferError):
        return exc
    if kind in ("InvalidArgument", "InvalidGraph"):
        return InferError.invalid(f"onnxruntime rejected the inputs of model '{model}': {exc}")
    return InferError(f"onnxruntime failed to run model '{model}': {kind}: {exc}", ErrorCode.INTERNAL)


class OnnxInstance:
    """One instance: its session and how it runs a batch.

    Thread-safety: ``execute`` runs on the instance's own thread only.
    """

    def __init__(self, model: OnnxModel, session: Any, device_id: int | None) -> None:
        self.model = model
        self.session: onnxruntime.InferenceSession | None = session
        self.device_id = device_id
        self._input_types = {t.name: t.config_type for t in model.inputs}

    def close(self) -> None:
        """Release the session."""
        self.session = None

    def execute(self, requests: Sequence[InferRequest]) -> list[InferResponse | InferError]:
        """One response (or error) per request, in order."""
        if not self.model.batching and len(requests) > 1:
            return [self.execute([r])[0] for r in requests]
        try:
            outputs = self.run(requests)
            if not self.model.batching:
                return [InferResponse(outputs)]
            return list(split_outputs(requests, outputs))
        except Exception as exc:
            error = _error(self.model.name, exc)
            return [error] * len(requests)

    def run(self, requests: Sequence[InferRequest]) -> dict[str, np.ndarray]:
        """Run the requests as one batch; output name → batched array (config dims).

        :raises InferError: an input is missing or the batch cannot be joined.
        :raises Exception: whatever onnxruntime raises.
        """
        model = self.model
        present = requests[0].inputs
        names = [t.name for t in model.inputs if t.name in present]
        feeds = gather_inputs(requests, names) if model.batching else {n: present[n] for n in names}
        feeds = {name: _to_feed(array, self._input_types[name]) for name, array in feeds.items()}
        wanted = [t.name for t in model.outputs if any(t.name in r.requested_outputs for r in requests)]
        if self.device_id is None:
            assert self.session is not None
            values = self.session.run(wanted, feeds)
        else:
            values = self._run_bound(feeds, wanted)
        rows = sum(r.batch_size for r in requests)
        outputs: dict[str, np.ndarray] = {}
        specs = {t.name: t for t in model.outputs}
        for name, value in zip(wanted, values):
            array = np.asarray(value)
            spec = specs[name]
            if spec.reshaped:
                target = ((rows,) if model.batching else ()) + spec.client_dims
                try:
                    array = array.reshape(target)
                except ValueError:
                    raise InferError(
                        f"output '{name}' of shape {list(array.shape)} cannot be reshaped to the config's "
                        f"dims {list(spec.client_dims)}"
                    ) from None
            outputs[name] = array
        return outputs

    def _run_bound(self, feeds: Mapping[str, Any], wanted: Sequence[str]) -> list[np.ndarray]:
        """GPU path: I/O binding; device tensors (DLPack) are bound in place, outputs on the GPU.

        Outputs are copied to host memory once per batch, since responses carry host arrays.
        """
        ort = _import_ort()
        assert self.session is not None and self.device_id is not None
        binding = self.session.io_binding()
        for name, array in feeds.items():
            if _on_cuda(array):
                try:
                    value = ort.OrtValue.from_dlpack(array)
                except TypeError:  # onnxruntime < 1.20: (capsule, is_bool_tensor)
                    value = ort.OrtValue.from_dlpack(array.__dlpack__(), str(array.dtype) == "bool")
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name in wanted:
            binding.bind_output(name, "cuda", self.device_id)
        self.session.run_with_iobinding(binding)
        return list(binding.copy_outputs_to_cpu())
