"""The tensorflow backend's model and instance state: SavedModel signatures, GraphDefs, execution.

Nothing here imports ``tensorflow`` at module level; the functions that need it import it,
and they run inside the backend's hooks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    FrameworkInstance,
    FrameworkModel,
    ModelTensor,
    ProcessWideSettings,
    check_config,
    complete_config,
    config_tensors,
    needs_auto_complete,
)

log = logging.getLogger("pyserve.backend.tensorflow")

SAVEDMODEL_PLATFORM = "tensorflow_savedmodel"
GRAPHDEF_PLATFORM = "tensorflow_graphdef"
DEFAULT_FILENAMES = {SAVEDMODEL_PLATFORM: "model.savedmodel", GRAPHDEF_PLATFORM: "model.graphdef"}
DEFAULT_SIGNATURE = "serving_default"
SIGNATURE_PARAMETER = "signature_name"
"""Model parameter: the SavedModel signature to serve (default ``serving_default``)."""
TRITON_SIGNATURE_PARAMETER = "TF_SIGNATURE_DEF"
"""Triton's name for the same parameter; it wins when both are given."""
GRAPH_TAG_PARAMETER = "TF_GRAPH_TAG"
"""Model parameter (Triton's): the SavedModel tag set to load (default: TensorFlow's ``serve``)."""
THREAD_PARAMETERS = ("TF_NUM_INTRA_THREADS", "TF_NUM_INTER_THREADS")
"""Triton's thread-count parameters; TensorFlow's pools are process-wide (first model wins)."""
SESSION_PARAMETERS = ("TF_USE_PER_SESSION_THREADS", "MAX_SESSION_SHARE_COUNT", "TF_INIT_OPS_FILE")
"""Triton parameters about TF1 sessions, which TensorFlow 2 models loaded eagerly do not have."""


def signature_name(parameters: Mapping[str, str]) -> str:
    """The signature a model serves: ``TF_SIGNATURE_DEF``, else ``signature_name``, else
    ``serving_default``."""
    return (parameters.get(TRITON_SIGNATURE_PARAMETER, "").strip()
            or parameters.get(SIGNATURE_PARAMETER, "").strip() or DEFAULT_SIGNATURE)


SETTINGS = ProcessWideSettings("TensorFlow", log)
"""TensorFlow's process-wide settings chosen by models (its thread pools)."""


def apply_model_parameters(model_name: str, parameters: Mapping[str, str], warn: bool = True) -> None:
    """Triton's ``TF_NUM_INTRA_THREADS`` / ``TF_NUM_INTER_THREADS``: TensorFlow's thread pools
    belong to the process, so the first model that sets one wins and a later model asking for
    another value is told so in the log; once TensorFlow has run anything it refuses new values
    (logged; the model still loads). The TF1 session parameters are logged as having no effect
    (``warn``: off for the auto-complete call, which precedes the model's creation).

    :raises ValueError: a thread count that is not a whole number from 0 to ``MAX_THREAD_COUNT``.
    """
    for key in SESSION_PARAMETERS if warn else ():
        if parameters.get(key, "").strip():
            log.warning("model '%s': parameter %s has no effect: TensorFlow 2 models run eagerly, "
                        "without TF1 sessions", model_name, key)
    tf = None
    for key in THREAD_PARAMETERS:
        text = parameters.get(key, "").strip()
        if not text:
            continue
        try:
            value = int(text)
        except ValueError:
            value = -1
        if not 0 <= value <= MAX_THREAD_COUNT:
            raise ValueError(f"model parameter {key} must be a whole number from 0 to {MAX_THREAD_COUNT}, got '{text}'")
        if value == 0:  # TensorFlow's own choice
            continue
        tf = tf or _import_tf()
        setter = (tf.config.threading.set_intra_op_parallelism_threads if key == "TF_NUM_INTRA_THREADS"
                  else tf.config.threading.set_inter_op_parallelism_threads)
        SETTINGS.apply(model_name, key, value, setter)


def graph_tags(parameters: Mapping[str, str]) -> list[str] | None:
    """``TF_GRAPH_TAG`` as the tag list ``tf.saved_model.load`` takes (None: its default)."""
    tag = parameters.get(GRAPH_TAG_PARAMETER, "").strip()
    return [tag] if tag else None


TF_TO_CONFIG: dict[str, str] = {**NUMPY_NAME_TO_CONFIG, "string": "TYPE_STRING"}
"""TensorFlow dtype names → ModelConfig datatype names."""

_DLPACK_KINDS = frozenset("iuf")  # numpy kinds TensorFlow imports through DLPack
TF_ALIGNMENT = 64
"""Bytes of alignment TensorFlow's CPU kernels require of a tensor buffer (EIGEN_MAX_ALIGN_BYTES)."""


@dataclass(frozen=True)
class RuntimeInfo:
    """What ``pyserve_backend_initialize`` stores as ``backend.state``."""

    version: str
    gpus: int


def _import_tf() -> Any:
    try:
        import tensorflow
    except ImportError as exc:
        raise ImportError(
            "the tensorflow backend needs TensorFlow: pip install tensorflow-cpu "
            f"(or 'tensorflow[and-cuda]'; the plugin's extras [cpu] / [gpu] name them) ({exc})"
        ) from exc
    return tensorflow


def initialize_runtime(settings: Mapping[str, str] | None = None) -> RuntimeInfo:
    """Import TensorFlow and turn on memory growth for every GPU, so that it does not take them whole.

    ``settings`` are the ``--backend-config tensorflow,<key>=<value>`` values Triton defines:
    ``allow-soft-placement`` is applied (``tf.config.set_soft_device_placement``);
    ``gpu-memory-fraction`` other than 0 and ``version`` other than 2 are logged as not honoured
    (memory growth stands in for the first; only TensorFlow 2 exists here).

    :raises ImportError: TensorFlow is not installed.
    :raises ValueError: ``allow-soft-placement`` is not a boolean.
    """
    tf = _import_tf()
    settings = settings or {}
    soft = settings.get("allow-soft-placement")
    if soft is not None:
        flag = soft.strip().lower()
        if flag not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            raise ValueError(f"--backend-config tensorflow,allow-soft-placement must be a boolean, got '{soft}'")
        tf.config.set_soft_device_placement(flag in ("true", "1", "yes", "on"))
    fraction = settings.get("gpu-memory-fraction", "").strip()
    if fraction and fraction not in ("0", "0.0"):
        log.warning("tensorflow: gpu-memory-fraction=%s is not honoured; GPUs use memory growth", fraction)
    version = settings.get("version", "").strip()
    if version and version != "2":
        log.warning("tensorflow: version=%s is not honoured; TensorFlow %s is used", version, tf.__version__)
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError as exc:  # the GPUs were initialized before this backend loaded
            log.warning("tensorflow: cannot enable memory growth on %s: %s", gpu.name, exc)
    info = RuntimeInfo(str(tf.__version__), len(gpus))
    log.info("tensorflow %s, GPUs: %d (memory growth on)", info.version, info.gpus)
    return info


def config_type_of(dtype: Any) -> str:
    """The ModelConfig datatype name of a TensorFlow dtype (its TF name when there is none)."""
    return TF_TO_CONFIG.get(dtype.name, dtype.name)


# --------------------------------------------------------------------------- model files and signatures


def model_path(model: ModelContext) -> Path:
    """The SavedModel directory or GraphDef file of a model version.

    :raises ModelFileNotFound: it does not exist (or a SavedModel directory lacks saved_model.pb).
    """
    platform = model.config.platform or SAVEDMODEL_PLATFORM
    path = model.version_path / (model.default_model_filename or DEFAULT_FILENAMES[platform])
    if platform == GRAPHDEF_PLATFORM:
        if not path.is_file():
            raise ModelFileNotFound(f"GraphDef file '{path}' not found for model '{model.name}' version {model.version}")
    elif not (path / "saved_model.pb").is_file():
        raise ModelFileNotFound(
            f"SavedModel directory '{path}' (with saved_model.pb) not found for model '{model.name}' "
            f"version {model.version}"
        )
    return path


def _model_tensor(name: str, spec: Any) -> ModelTensor:
    shape = None if spec.shape.rank is None else tuple(-1 if d is None else int(d) for d in spec.shape.as_list())
    return ModelTensor(name, config_type_of(spec.dtype), shape)


def load_savedmodel(path: Path, device: str = "/CPU:0", tags: list[str] | None = None) -> Any:
    """``tf.saved_model.load`` under ``device``, of the meta graph with ``tags`` (``TF_GRAPH_TAG``).

    :raises ValueError: the directory is not a loadable SavedModel (or has no such tag set).
    """
    tf = _import_tf()
    try:
        with tf.device(device):
            return tf.saved_model.load(str(path), tags=tags)
    except Exception as exc:
        tagged = f" with tags {tags}" if tags else ""
        raise ModelFileError(
            f"cannot load TensorFlow SavedModel '{path}'{tagged}: {type(exc).__name__}: {exc}"
        ) from None


def signature(loaded: Any, name: str, path: Path) -> Any:
    """The concrete function of a signature.

    :raises ValueError: the SavedModel has no such signature (the message lists those it has).
    """
    signatures = loaded.signatures
    if name not in signatures:
        raise ValueError(
            f"SavedModel '{path}' has no signature '{name}' (signatures: {', '.join(signatures) or 'none'}); "
            f"set model parameter '{TRITON_SIGNATURE_PARAMETER}' (or '{SIGNATURE_PARAMETER}')"
        )
    return signatures[name]


def signature_tensors(function: Any) -> tuple[list[ModelTensor], list[ModelTensor]]:
    """A signature's inputs and outputs (sorted by name, as SavedModel signatures store them)."""
    _, keyword_specs = function.structured_input_signature
    outputs = function.structured_outputs
    return (
        [_model_tensor(n, s) for n, s in sorted(keyword_specs.items())],
        [_model_tensor(n, s) for n, s in sorted(outputs.items())],
    )


# --------------------------------------------------------------------------- auto-complete


def auto_complete(model: ModelContext) -> bool:
    """Complete ``model.config`` from a SavedModel signature, like the onnxruntime backend does.

    Adds the signature's inputs (outputs) when the config declares none, fills a declared
    tensor's missing datatype or dims and, when ``max_batch_size`` is 0 and every signature
    tensor has an unknown first dimension (and no declared tensor spells it out), sets
    ``max_batch_size`` to ``default-max-batch-size`` and enables ``dynamic_batching`` when that is
    above 1 and no scheduler is configured (``pyserve.api.backend_support.complete_config``).
    GraphDefs cannot be completed.

    :returns: True when the config was changed.
    :raises ValueError: a GraphDef without inputs or outputs in the config, or a SavedModel
        that cannot be loaded or lacks the signature.
    """
    config = model.config
    if not needs_auto_complete(config):
        return False
    if config.platform == GRAPHDEF_PLATFORM:
        if config.input and config.output:
            return False
        raise ValueError("a TensorFlow GraphDef model needs its inputs and outputs declared in config.pbtxt")
    path = model_path(model)
    apply_model_parameters(model.name, model.parameters, warn=False)  # before TensorFlow runs anything for it
    name = signature_name(model.parameters)
    loaded = load_savedmodel(path, tags=graph_tags(model.parameters))
    inputs, outputs = signature_tensors(signature(loaded, name, path))
    return complete_config(config, model.backend.config, inputs, outputs)


# --------------------------------------------------------------------------- config


def _graph_tensor_name(name: str) -> str:
    """A config name as a graph tensor name: ``x`` → ``x:0``; ``x:1`` stays."""
    return name if ":" in name else f"{name}:0"


# --------------------------------------------------------------------------- model state


@dataclass
class TensorFlowModel(FrameworkModel):
    """What ``pyserve_model_create`` stores as ``model.state``."""

    platform: str = SAVEDMODEL_PLATFORM
    signature_name: str = DEFAULT_SIGNATURE
    tags: list[str] | None = None

    @classmethod
    def from_context(cls, model: ModelContext) -> TensorFlowModel:
        """Read the normalized config and parameters of a model version.

        :raises ValueError: the model file or directory is missing.
        """
        config = model.config
        apply_model_parameters(model.name, model.parameters)
        return cls(
            name=model.name,
            platform=config.platform or SAVEDMODEL_PLATFORM,
            path=model_path(model),
            max_batch_size=int(config.max_batch_size),
            inputs=config_tensors(config.input, "input", "tensorflow"),
            outputs=config_tensors(config.output, "output", "tensorflow"),
            signature_name=signature_name(model.parameters),
            tags=graph_tags(model.parameters),
        )

    def device_for(self, instance: InstanceContext) -> str:
        """``/GPU:<id>`` for KIND_GPU instances, ``/CPU:0`` otherwise.

        :raises ValueError: a GPU instance but TensorFlow sees no such GPU.
        """
        if instance.kind != "GPU":
            return "/CPU:0"
        gpus = _import_tf().config.list_physical_devices("GPU")
        if instance.device_id >= len(gpus):
            raise ValueError(
                f"instance '{instance.name}' is KIND_GPU on GPU {instance.device_id}, but TensorFlow sees "
                f"{len(gpus)} GPU(s) (install tensorflow[and-cuda])"
            )
        return f"/GPU:{instance.device_id}"

    def create_instance(self, instance: InstanceContext) -> TensorFlowInstance:
        """Load the model for one instance and check the config against it.

        :raises ValueError: unloadable model, missing signature, or a config that disagrees
            with the model (naming the tensor and both sides).
        """
        device = self.device_for(instance)
        if self.platform == GRAPHDEF_PLATFORM:
            run = self._graphdef_runner(device)
        else:
            run = self._savedmodel_runner(device)
        self.announce(log, logging.INFO, f"model '{self.name}': {instance.kind} instances run on {device}")
        return TensorFlowInstance(self, device, run)

    # -- SavedModel --------------------------------------------------------------------------
    def _savedmodel_runner(self, device: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
        loaded = load_savedmodel(self.path, device, self.tags)
        function = signature(loaded, self.signature_name, self.path)
        inputs, outputs = signature_tensors(function)
        check_config(self, inputs, outputs, f"signature '{self.signature_name}'")
        return _SignatureRunner(loaded, function)

    # -- GraphDef ----------------------------------------------------------------------------
    def _graphdef_runner(self, device: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
        tf = _import_tf()
        graph_def = tf.compat.v1.GraphDef()
        try:
            graph_def.ParseFromString(self.path.read_bytes())
        except Exception as exc:
            raise ModelFileError(f"cannot load TensorFlow GraphDef '{self.path}': {type(exc).__name__}: {exc}") from None

        def import_graph() -> None:
            tf.compat.v1.import_graph_def(graph_def, name="")

        try:
            with tf.device(device):
                wrapped = tf.compat.v1.wrap_function(import_graph, [])
        except Exception as exc:
            raise ModelFileError(f"cannot import TensorFlow GraphDef '{self.path}': {type(exc).__name__}: {exc}") from None
        graph = wrapped.graph
        found: dict[str, Any] = {}
        for kind, tensors in (("input", self.inputs), ("output", self.outputs)):
            for tensor in tensors:
                try:
                    found[tensor.name] = graph.get_tensor_by_name(_graph_tensor_name(tensor.name))
                except (KeyError, ValueError):
                    placeholders = [op.name for op in graph.get_operations() if op.type == "Placeholder"]
                    raise ValueError(
                        f"{kind} '{tensor.name}' of the config is not a tensor of GraphDef '{self.path.name}' "
                        f"(placeholders: {', '.join(placeholders) or 'none'})"
                    ) from None
        check_config(
            self,
            [ModelTensor(t.name, config_type_of(found[t.name].dtype), _shape(found[t.name])) for t in self.inputs],
            [ModelTensor(t.name, config_type_of(found[t.name].dtype), _shape(found[t.name])) for t in self.outputs],
            f"GraphDef '{self.path.name}'",
        )
        pruned = wrapped.prune(
            feeds=[found[t.name] for t in self.inputs], fetches=[found[t.name] for t in self.outputs]
        )
        input_names = [t.name for t in self.inputs]
        output_names = [t.name for t in self.outputs]

        def run(feeds: dict[str, Any]) -> dict[str, Any]:
            return dict(zip(output_names, pruned(*(feeds[n] for n in input_names))))

        return run

class _SignatureRunner:
    """Calls a signature by keyword; holds the SavedModel object its variables belong to."""

    def __init__(self, loaded: Any, function: Any) -> None:
        self.loaded = loaded
        self.function = function

    def __call__(self, feeds: dict[str, Any]) -> dict[str, Any]:
        return dict(self.function(**feeds))


def _shape(tensor: Any) -> tuple[int, ...] | None:
    if tensor.shape.rank is None:
        return None
    return tuple(-1 if d is None else int(d) for d in tensor.shape.as_list())


# --------------------------------------------------------------------------- execution


def to_tf(array: np.ndarray) -> Any:
    """A TensorFlow tensor for a host array.

    Numeric arrays go through DLPack: shared when TensorFlow's kernels can use the buffer as it
    is (writable, C-contiguous and 64-byte aligned: TensorFlow aborts the process on an
    unaligned buffer), else first copied once into an aligned buffer (read-only views and
    offsets into a received message, as request inputs are). That copy and the import take
    ~5 µs for a small tensor where ``tf.convert_to_tensor`` takes ~50 µs. Strings, bool and BF16
    (no DLPack import) go through ``tf.convert_to_tensor``.
    """
    tf = _import_tf()
    if array.dtype.kind in _DLPACK_KINDS and array.size:
        if not (array.flags.c_contiguous and array.flags.writeable and array.ctypes.data % TF_ALIGNMENT == 0):
            array = aligned_copy(array)
        try:
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        except Exception:  # an unsupported dtype or layout: fall back to a copy
            pass
    return tf.convert_to_tensor(array)


def aligned_copy(array: np.ndarray) -> np.ndarray:
    """A writable, C-contiguous copy of ``array`` whose data starts on a ``TF_ALIGNMENT`` boundary."""
    buffer = np.empty(array.nbytes + TF_ALIGNMENT, np.uint8)
    start = -buffer.ctypes.data % TF_ALIGNMENT
    copy = buffer[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


def to_numpy(tensor: Any) -> np.ndarray:
    """A host array for a result tensor (one device→host copy for GPU tensors)."""
    return np.asarray(tensor.numpy())


class TensorFlowInstance(FrameworkInstance):
    """One instance: a loaded model on a device, and how it runs a batch (``FrameworkInstance.execute``).

    Thread-safety: ``execute`` runs on the instance's own thread only.
    """

    def __init__(self, model: TensorFlowModel, device: str, run: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.model = model
        self.device = device
        self._run: Callable[[dict[str, Any]], dict[str, Any]] | None = run
        self.pinned = device != "/CPU:0" or bool(_import_tf().config.list_physical_devices("GPU"))
        """Whether each run enters ``tf.device``: not for the CPU on a machine without GPUs,
        where TensorFlow has nowhere else to place an op (and the context costs ~5 µs a run)."""

    def close(self) -> None:
        """Drop the loaded model."""
        self._run = None

    def run(self, inputs: dict[str, Any], wanted: list[str]) -> dict[str, Any]:
        """One call of the signature (or pruned graph) on the instance's device."""
        assert self._run is not None
        if not self.pinned:
            return self._run({name: to_tf(array) for name, array in inputs.items()})
        with _import_tf().device(self.device):
            return self._run({name: to_tf(array) for name, array in inputs.items()})

    def to_host(self, value: Any) -> np.ndarray:
        return to_numpy(value)

    def error(self, exc: Exception) -> InferError:
        kind = type(exc).__name__
        message = f"TensorFlow execute failure for model '{self.model.name}': {kind}: {str(exc).strip()}"
        return InferError(message, ErrorCode.INVALID_ARG if kind == "InvalidArgumentError" else ErrorCode.INTERNAL)


__all__ = [
    "TensorFlowInstance",
    "TensorFlowModel",
    "auto_complete",
    "initialize_runtime",
    "to_numpy",
    "to_tf",
]
