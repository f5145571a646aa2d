"""config.pbtxt: parsing (protobuf ``text_format``), Triton's normalization, and validation.

``parse_config`` turns the text into a ``ModelConfig`` message and reports syntax errors and
unknown fields with file, line and column. ``normalize`` applies the defaults Triton fills
in (name, platform/backend, default filename, version policy, instance groups, batching
defaults). ``validate`` lists every remaining problem, each naming the field it is about.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from pyserve.api import datatypes
from pyserve.api.datatypes import DataType
from pyserve.api.errors import ModelConfigError
from pyserve.host.platforms import TRITON_PLATFORMS
from pyserve.protocol import ModelConfig, ModelQueuePolicy, data_type_name
from pyserve.repository.devices import gpu_count
from pyserve.repository.scan import contained_path

ENSEMBLE_PLATFORM = "ensemble"
NO_INPUT = "the model declares no 'input'"
NO_OUTPUT = "the model declares no 'output'"
"""``validate``'s problems for an ensemble without tensors (other models may have none, as in Triton)."""

DEFAULT_FILENAMES: dict[str, str] = {
    "tensorrt_plan": "model.plan",
    "onnxruntime_onnx": "model.onnx",
    "pytorch_libtorch": "model.pt",
    "libtorch": "model.pt",
    "torch_aoti": "model.pt2",
    "tensorflow_savedmodel": "model.savedmodel",
    "tensorflow_graphdef": "model.graphdef",
    "python": "model.py",
    "openvino": "model.xml",
    "dali": "model.dali",
}
"""Platform (or backend, for backends without a platform) → Triton's default model file."""

_FILE_TO_PLATFORM: tuple[tuple[str, str, str], ...] = (
    ("model.plan", "tensorrt_plan", "tensorrt"),
    ("model.onnx", "onnxruntime_onnx", "onnxruntime"),
    ("model.pt", "pytorch_libtorch", "pytorch"),
    ("model.savedmodel", "tensorflow_savedmodel", "tensorflow"),
    ("model.graphdef", "tensorflow_graphdef", "tensorflow"),
    ("model.py", "", "python"),
)

_BACKEND_DEFAULT_PLATFORM = {
    "onnxruntime": "onnxruntime_onnx",
    "pytorch": "pytorch_libtorch",
    "tensorrt": "tensorrt_plan",
}


def parse_config(text: str, path: Path | str) -> Any:
    """Parse config.pbtxt text into a ``ModelConfig`` message.

    :raises ModelConfigError: with ``<path>:<line>:<column>: <protobuf's message>``.
    """
    config = ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        line, column = exc.GetLine(), exc.GetColumn()
        message = str(exc)
        message = re.sub(r"^\d+:\d+ : ", "", message)
        where = f"{path}:{line}:{column}" if line else str(path)
        raise ModelConfigError(f"{where}: {message}") from None
    return config


def kind_name(message: Any) -> str:
    """The enum name of a message's ``kind`` field (an instance group's ``KIND_CPU``, a sequence
    control's ``CONTROL_SEQUENCE_START``)."""
    return message.DESCRIPTOR.fields_by_name["kind"].enum_type.values_by_number[message.kind].name


def _kind_value(group: Any, name: str) -> int:
    return group.DESCRIPTOR.fields_by_name["kind"].enum_type.values_by_name[name].number


LOAD_REQUEST_CONFIG = "the load request's 'config' parameter"
"""Where a config given with a model-control load request (instead of a file) came from, for messages."""


class DevicesUnavailable(ModelConfigError):
    """The config asks for GPUs this machine does not have (``KIND_GPU`` without a GPU, GPU
    ids past the visible ones). Unlike other config errors this is one of the machine, so, as
    in Triton, the model's versions fail to load with it (UNAVAILABLE, not ready) instead of
    the model being left unregistered. ``config`` is the otherwise normalized config."""

    def __init__(self, message: str, config: Any) -> None:
        super().__init__(message)
        self.config = config


def normalize(
    config: Any, model_dir: Path, platform_backend: Any = None, config_file: Path | str | None = None
) -> None:
    """Fill in Triton's defaults in place.

    :param config: the parsed ``ModelConfig``.
    :param model_dir: the model directory (its name is the model name).
    :param platform_backend: ``callable(platform) -> backend name | None`` for platforms
        beyond Triton's own table (the plugin host's ``platform_backend``).
    :param config_file: the file the config came from, for messages (default
        ``<model_dir>/config.pbtxt``; ``configs/<name>.pbtxt`` with ``--model-config-name``),
        or a description such as ``LOAD_REQUEST_CONFIG`` when it came from no file.
    :raises ModelConfigError: when the config cannot be completed (name mismatch, no way to
        tell the backend); ``DevicesUnavailable`` (once the rest is filled in) for GPU
        instances this machine cannot give.
    """
    name = model_dir.name
    where = config_file if config_file is not None else model_dir / "config.pbtxt"
    if not config.name:
        config.name = name
    elif config.name != name:
        raise ModelConfigError(
            f"{where}: field 'name': '{config.name}' does not match the model directory name '{name}'"
        )
    _resolve_backend(config, model_dir, platform_backend, where)
    if not config.default_model_filename:
        default = DEFAULT_FILENAMES.get(config.platform) or DEFAULT_FILENAMES.get(config.backend)
        if default:
            config.default_model_filename = default
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if config.platform == ENSEMBLE_PLATFORM:
        config.model_transaction_policy.SetInParent()  # Triton 2.51 shows {decoupled: false} for ensembles
        return
    device_problems = _normalize_instance_groups(config, where)
    if config.HasField("dynamic_batching") and not config.dynamic_batching.preferred_batch_size:
        if config.max_batch_size > 0:
            config.dynamic_batching.preferred_batch_size.append(config.max_batch_size)
    if config.HasField("sequence_batching") and not config.sequence_batching.max_sequence_idle_microseconds:
        config.sequence_batching.max_sequence_idle_microseconds = 1_000_000
    if not config.optimization.HasField("input_pinned_memory"):
        config.optimization.input_pinned_memory.enable = True
    if not config.optimization.HasField("output_pinned_memory"):
        config.optimization.output_pinned_memory.enable = True
    if device_problems:
        raise DevicesUnavailable("; ".join(device_problems), config)


def _resolve_backend(config: Any, model_dir: Path, platform_backend: Any, where: Path | str) -> None:
    if config.platform == ENSEMBLE_PLATFORM:
        if config.backend:
            raise ModelConfigError(
                f"{where}: field 'backend' must be empty for platform 'ensemble'"
            )
        return
    if config.platform and not config.backend:
        config.backend = _backend_of_platform(config.platform, platform_backend, where)
        return
    if not config.backend:
        _guess_backend(config, model_dir, where)
        return
    if not config.platform and config.backend in _BACKEND_DEFAULT_PLATFORM:
        config.platform = _BACKEND_DEFAULT_PLATFORM[config.backend]
    if not config.platform and config.backend == "tensorflow":
        first = _first_version_dir(model_dir)
        graphdef = config.default_model_filename.endswith(".graphdef") or (
            first is not None and (first / "model.graphdef").exists()
        )
        config.platform = "tensorflow_graphdef" if graphdef else "tensorflow_savedmodel"


def _backend_of_platform(platform: str, platform_backend: Any, where: Path | str) -> str:
    """The backend that serves ``platform``: an installed backend claiming it, else Triton's."""
    backend = None
    if platform_backend is not None:
        backend = platform_backend(platform)
    if backend is None:
        backend = TRITON_PLATFORMS.get(platform)
    if backend is None:
        raise ModelConfigError(
            f"{where}: field 'platform': unknown platform "
            f"'{platform}'; no installed backend claims it"
        )
    return backend


def _guess_backend(config: Any, model_dir: Path, where: Path | str) -> None:
    """Set platform and backend (or the backend alone) from the model file's name or the
    model directory's suffix, for a config naming neither."""
    if config.default_model_filename:
        for filename, platform, backend in _FILE_TO_PLATFORM:
            if config.default_model_filename.endswith(Path(filename).suffix):
                config.platform, config.backend = platform, backend
                return
    first = _first_version_dir(model_dir)
    if first is not None:
        for filename, platform, backend in _FILE_TO_PLATFORM:
            if (first / filename).exists():
                config.platform, config.backend = platform, backend
                return
    if "." in model_dir.name:
        config.backend = model_dir.name.rsplit(".", 1)[1]
        return
    raise ModelConfigError(
        f"{where}: the config names no 'backend' or 'platform', and "
        "no model file in the version directory shows which backend to use"
    )


def _first_version_dir(model_dir: Path) -> Path | None:
    from pyserve.repository.scan import version_numbers

    try:
        versions = version_numbers(model_dir)
    except OSError:
        return None
    return model_dir / str(versions[0]) if versions else None


def _short(config_file: Path | str) -> str:
    """``<model>/config.pbtxt`` or ``<model>/configs/<name>.pbtxt``, for messages."""
    if isinstance(config_file, str):
        return config_file
    if config_file.parent.name == "configs":
        return f"{config_file.parent.parent.name}/configs/{config_file.name}"
    return f"{config_file.parent.name}/{config_file.name}"


def _normalize_instance_groups(config: Any, config_file: Path | str) -> list[str]:
    """Name and complete the instance groups; returns the GPUs they ask for that this
    machine lacks (one line each).

    :raises ModelConfigError: a group that can never be valid (KIND_CPU listing gpus).
    """
    device_problems: list[str] = []
    if not config.instance_group:  # Triton 2.51 names the group it adds after the model ...
        config.instance_group.add(name=config.name)
    gpus = gpu_count()
    for index, group in enumerate(config.instance_group):
        where = f"instance_group[{index}]"
        if not group.name:  # ... and an unnamed group of the config "<model>_<index>"
            group.name = f"{config.name}_{index}"
        if group.count < 1:  # as Triton: a count below 1 means the default, one instance
            group.count = 1
        kind = kind_name(group)
        if kind == "KIND_AUTO":
            kind = "KIND_GPU" if gpus else "KIND_CPU"
            group.kind = _kind_value(group, kind)
        if kind == "KIND_GPU":
            if not gpus:
                device_problems.append(
                    f"{_short(config_file)}: {where} ('{group.name}') has kind KIND_GPU "
                    "but no GPU is available"
                )
                continue
            if not group.gpus:
                group.gpus.extend(range(gpus))
            bad = [g for g in group.gpus if g < 0 or g >= gpus]
            if bad:
                device_problems.append(
                    f"{_short(config_file)}: {where} ('{group.name}') names GPU(s) {bad}, "
                    f"but only {gpus} GPU(s) are available"
                )
        elif group.gpus and kind == "KIND_CPU":
            raise ModelConfigError(
                f"{_short(config_file)}: {where} ('{group.name}') has kind KIND_CPU but lists gpus"
            )
    return device_problems


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One input or output as the config declares it.

    :ivar dims: the declared non-batch dims (``-1`` = any size).
    :ivar reshape: the shape the backend sees instead of ``dims``, if the config reshapes.
    :ivar labels: classification labels from ``label_filename`` (outputs only).
    """

    name: str
    datatype: DataType
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None = None
    optional: bool = False
    allow_ragged_batch: bool = False
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelIO:
    """The inputs and outputs of a model, in config order, ready for fast validation."""

    max_batch_size: int
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    batching: bool = field(init=False)
    """``max_batch_size > 0``: the first dim of every input and output is the batch."""
    reshaped_inputs: tuple[str, ...] = field(init=False)
    """The inputs with a config ``reshape``."""
    has_no_required_inputs: bool = field(init=False)
    """Every input is optional (or there is none): a request may carry no input at all."""

    def __post_init__(self) -> None:  # derived once: the request checks read them per request
        object.__setattr__(self, "batching", self.max_batch_size > 0)
        object.__setattr__(self, "has_no_required_inputs", all(s.optional for s in self.inputs.values()))
        object.__setattr__(
            self, "reshaped_inputs", tuple(n for n, s in self.inputs.items() if s.reshape is not None)
        )


def _tensor_problems(kind: str, index: int, tensor: Any) -> list[str]:
    where = f"{kind}[{index}]" + (f" '{tensor.name}'" if tensor.name else "")
    problems = []
    if not tensor.name:
        problems.append(f"{where}: field 'name' must not be empty")
    if datatypes.from_config_name(data_type_name(tensor.data_type)) is None:
        problems.append(f"{where}: field 'data_type' must be set to a valid type (got {data_type_name(tensor.data_type)})")
    has_reshape = tensor.HasField("reshape")
    if not tensor.dims and not (has_reshape and not tensor.reshape.shape):
        problems.append(f"{where}: field 'dims' must not be empty (use reshape {{ shape: [] }} for scalars)")
    for d in tensor.dims:
        if d < -1 or d == 0:
            problems.append(f"{where}: field 'dims': dimension {d} must be >= 1, or -1 for a variable size")
            break
    if has_reshape:
        for d in tensor.reshape.shape:
            if d < -1 or d == 0:
                problems.append(f"{where}: field 'reshape': dimension {d} must be >= 1, or -1")
                break
        fixed_dims = all(d > 0 for d in tensor.dims)
        fixed_reshape = all(d > 0 for d in tensor.reshape.shape)
        if fixed_dims and fixed_reshape and _product(tensor.dims) != _product(tensor.reshape.shape):
            problems.append(
                f"{where}: field 'reshape': shape {list(tensor.reshape.shape)} has a different "
                f"element count than dims {list(tensor.dims)}"
            )
    return problems


def _product(values: Any) -> int:
    total = 1
    for v in values:
        total *= int(v)
    return total


def validate(config: Any, model_dir: Path) -> list[str]:
    """Every problem left in a normalized config; empty when it can be served."""
    problems: list[str] = []
    if config.max_batch_size < 0:
        problems.append(f"field 'max_batch_size' must be >= 0 (got {config.max_batch_size})")
    if config.default_model_filename:
        try:
            contained_path(model_dir, config.default_model_filename)
        except ValueError as exc:
            problems.append(f"field 'default_model_filename': {exc}")
    problems.extend(_ensemble_problems(config))
    problems.extend(_tensors_problems(config))
    problems.extend(_label_problems(config, model_dir))
    if config.version_policy.WhichOneof("policy_choice") == "latest" and config.version_policy.latest.num_versions < 1:
        problems.append("field 'version_policy.latest.num_versions' must be >= 1")
    if config.HasField("dynamic_batching"):
        problems.extend(_dynamic_batching_problems(config))
    if config.HasField("sequence_batching"):
        problems.extend(_sequence_batching_problems(config))
    problems.extend(_model_metrics_problems(config))
    problems.extend(_cache_problems(config))
    return problems


def _dynamic_batching_problems(config: Any) -> list[str]:
    """The rules Triton checks in ``dynamic_batching``, in its words, the field after them:
    preferred sizes within max_batch_size; with priority levels, the default level and the
    levels of priority queue policies within them; with ``preserve_ordering``, one level and
    no DELAY timeout action (responses cannot both keep arrival order and overtake)."""
    batching = config.dynamic_batching
    problems: list[str] = []
    for size in batching.preferred_batch_size:
        if size < 1:
            problems.append(f"dynamic batching preferred size must be positive "
                            f"(field 'dynamic_batching.preferred_batch_size': {size})")
        elif config.max_batch_size > 0 and size > config.max_batch_size:
            problems.append(f"dynamic batching preferred size must be <= max batch size (field "
                            f"'dynamic_batching.preferred_batch_size': {size}, max_batch_size {config.max_batch_size})")
    levels = batching.priority_levels
    if levels:
        if not 1 <= batching.default_priority_level <= levels:
            problems.append(f"default priority level must be in range [1, {levels}] "
                            f"(field 'dynamic_batching.default_priority_level': {batching.default_priority_level})")
        for level in sorted(batching.priority_queue_policy):
            if not 1 <= level <= levels:
                problems.append(f"priority queue policy must have priority level in range [1, {levels}] "
                                f"(field 'dynamic_batching.priority_queue_policy' has level {level})")
    if batching.preserve_ordering:
        if levels > 1:
            problems.append("Only one priority level is allowed when 'preserve_ordering' is true "
                            f"(field 'dynamic_batching.priority_levels': {levels})")
        policies = [batching.default_queue_policy, *batching.priority_queue_policy.values()]
        if any(p.default_timeout_microseconds and p.timeout_action == ModelQueuePolicy.DELAY for p in policies):
            problems.append("Queue policy can not have DELAY as timeout action when 'preserve_ordering' is true")
    return problems


CORRID_TYPES = ("TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32", "TYPE_STRING")
"""The datatypes a CONTROL_SEQUENCE_CORRID control may have, in Triton's order."""
FALSE_TRUE_FIELDS = ("int32_false_true", "fp32_false_true", "bool_false_true")


def _sequence_batching_problems(config: Any) -> list[str]:
    """The rules Triton checks in ``sequence_batching``, in its words, the detail after them:
    each control kind on one tensor only; a correlation-id control of an integer or string
    datatype; a start/end/ready control with exactly one of the false/true value pairs, of
    two values; the oldest strategy's preferred sizes positive and within max_batch_size; the
    direct strategy's minimum slot utilization within [0, 1]."""
    batching = config.sequence_batching
    problems: list[str] = []
    seen: set[str] = set()
    for control_input in batching.control_input:
        for control in control_input.control:
            kind = kind_name(control)
            where = f"(control input '{control_input.name}')"
            if kind in seen:
                problems.append(f"sequence batching specifies multiple {kind} tensors {where}")
            seen.add(kind)
            if kind == "CONTROL_SEQUENCE_CORRID":
                datatype = data_type_name(control.data_type)
                if datatype not in CORRID_TYPES:
                    allowed = f"{', '.join(CORRID_TYPES[:-1])} and {CORRID_TYPES[-1]}"
                    problems.append(f"unexpected data type for control {kind}. Allowed data types are {allowed} "
                                    f"(control input '{control_input.name}' has {datatype})")
                continue
            given = [name for name in FALSE_TRUE_FIELDS if len(getattr(control, name))]
            if len(given) > 1:
                problems.append("sequence batching specifies more than one from 'int32_false_true', "
                                f"'fp32_false_true' and 'bool_false_true' for {kind} {where}")
            elif not given:
                problems.append("sequence batching must specify either 'int32_false_true', 'fp32_false_true' "
                                f"or 'bool_false_true' for {kind} {where}")
            elif len(getattr(control, given[0])) != 2:
                problems.append(f"sequence batching control '{given[0]}' must have exactly 2 entries for {kind} {where}")
    if batching.WhichOneof("strategy_choice") == "direct":
        utilization = batching.direct.minimum_slot_utilization
        if not 0.0 <= utilization <= 1.0:  # Triton's message says (0.0, 1.0]; it accepts 0, the default
            problems.append(f"sequence batching minimum slot utilization must be in range (0.0, 1.0] (field "
                            f"'sequence_batching.direct.minimum_slot_utilization': {utilization:g})")
    if batching.WhichOneof("strategy_choice") == "oldest":
        for size in batching.oldest.preferred_batch_size:
            if size < 1:
                problems.append(f"sequence batching preferred batch size must be positive "
                                f"(field 'sequence_batching.oldest.preferred_batch_size': {size})")
            elif config.max_batch_size > 0 and size > config.max_batch_size:
                problems.append(f"sequence batching preferred batch size must be <= max batch size (field "
                                f"'sequence_batching.oldest.preferred_batch_size': {size}, max_batch_size "
                                f"{config.max_batch_size})")
    return problems


def _ensemble_problems(config: Any) -> list[str]:
    """An ensemble needs steps, inputs and outputs and no instances; others no steps."""
    problems: list[str] = []
    if config.platform == ENSEMBLE_PLATFORM:
        if config.instance_group:
            problems.append("field 'instance_group' is not allowed for an ensemble")
        if not config.ensemble_scheduling.step:
            problems.append("field 'ensemble_scheduling' must list at least one step for an ensemble")
        if not config.input:
            problems.append(NO_INPUT)
        if not config.output:
            problems.append(NO_OUTPUT)
    elif config.HasField("ensemble_scheduling"):
        problems.append("field 'ensemble_scheduling' is only allowed with platform 'ensemble'")
    return problems


def _tensors_problems(config: Any) -> list[str]:
    """Each input and output on its own, names declared twice, and image formats' dims."""
    problems: list[str] = []
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen: set[str] = set()
        for index, tensor in enumerate(tensors):
            problems.extend(_tensor_problems(kind, index, tensor))
            if tensor.name in seen:
                problems.append(f"{kind}[{index}]: name '{tensor.name}' is declared twice")
            seen.add(tensor.name)
    for index, tensor in enumerate(config.input):
        fmt = tensor.DESCRIPTOR.fields_by_name["format"].enum_type.values_by_number[tensor.format].name
        if fmt in ("FORMAT_NHWC", "FORMAT_NCHW") and len(tensor.dims) != 3:
            problems.append(f"input[{index}] '{tensor.name}': format {fmt} needs exactly 3 dims")
    return problems


def _label_problems(config: Any, model_dir: Path) -> list[str]:
    """Outputs' ``label_filename``: a file inside the model directory."""
    problems: list[str] = []
    for index, tensor in enumerate(config.output):
        if not tensor.label_filename:
            continue
        try:  # confined as default_model_filename is: a config override must not read other files
            labels = contained_path(model_dir, tensor.label_filename)
        except ValueError as exc:
            problems.append(f"output[{index}] '{tensor.name}': field 'label_filename': {exc}")
            continue
        if not labels.is_file():
            problems.append(
                f"output[{index}] '{tensor.name}': label_filename '{tensor.label_filename}' "
                "does not exist in the model directory"
            )
    return problems


def _cache_problems(config: Any) -> list[str]:
    """The response cache serves neither decoupled models nor the sequence batcher."""
    problems: list[str] = []
    if config.response_cache.enable:
        if config.model_transaction_policy.decoupled:
            problems.append("field 'response_cache': the response cache is not supported for decoupled models")
        if config.HasField("sequence_batching"):
            problems.append(
                "field 'response_cache': the response cache is not supported with the sequence batcher"
            )
    return problems


HISTOGRAM_FAMILIES = ("nv_inference_first_response_histogram_ms",)
"""The metric families whose buckets a config's ``model_metrics`` can set (Triton's)."""


def _model_metrics_problems(config: Any) -> list[str]:
    problems = []
    for index, control in enumerate(config.model_metrics.metric_control):
        family = control.metric_identifier.family
        where = f"field 'model_metrics.metric_control[{index}]'"
        if family not in HISTOGRAM_FAMILIES:
            problems.append(f"{where}: metric family '{family}' has no histogram to configure "
                            f"(known: {', '.join(HISTOGRAM_FAMILIES)})")
        buckets = list(control.histogram_options.buckets)
        if control.HasField("histogram_options") and (
            not buckets or any(not b < c for b, c in zip(buckets, buckets[1:]))
            or any(b != b or b in (float("inf"), float("-inf")) for b in buckets)
        ):
            problems.append(f"{where}: histogram_options.buckets must be finite and strictly increasing "
                            f"(got {buckets})")
    return problems


def histogram_buckets(config: Any, family: str) -> tuple[float, ...] | None:
    """The bucket bounds ``model_metrics`` sets for ``family``, or None (the server's)."""
    for control in config.model_metrics.metric_control:
        if control.metric_identifier.family == family and control.HasField("histogram_options"):
            return tuple(control.histogram_options.buckets)
    return None


def label_lines(text: str) -> tuple[str, ...]:
    """A labels file's lines as Triton reads them: split at ``\n`` only (a label may hold any
    other character), no empty last line after a final newline; a ``\r`` before the ``\n``
    (a Windows-edited file) is dropped, where Triton keeps it in the label."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return tuple(line[:-1] if line.endswith("\r") else line for line in lines)


def model_io(config: Any, model_dir: Path) -> ModelIO:
    """Build the validation tables for a valid config (labels are read here)."""

    def spec(tensor: Any, with_labels: bool) -> TensorSpec:
        labels: tuple[str, ...] = ()
        if with_labels and tensor.label_filename:
            text = contained_path(model_dir, tensor.label_filename).read_text(encoding="utf-8")
            labels = label_lines(text)
        reshape = tuple(int(d) for d in tensor.reshape.shape) if tensor.HasField("reshape") else None
        dtype = datatypes.from_config_name(data_type_name(tensor.data_type))
        assert dtype is not None
        return TensorSpec(
            name=tensor.name,
            datatype=dtype,
            dims=tuple(int(d) for d in tensor.dims),
            reshape=reshape,
            optional=bool(getattr(tensor, "optional", False)),
            allow_ragged_batch=bool(getattr(tensor, "allow_ragged_batch", False)),
            labels=labels,
        )

    return ModelIO(
        max_batch_size=int(config.max_batch_size),
        inputs={t.name: spec(t, False) for t in config.input},
        outputs={t.name: spec(t, True) for t in config.output},
    )


def instance_kind(group: Any) -> str:
    """``"CPU"``, ``"GPU"`` or ``"MODEL"`` for a normalized instance group."""
    return kind_name(group).removeprefix("KIND_")


def parameters(config: Any) -> dict[str, str]:
    """The config's ``parameters`` map as plain strings."""
    return {key: value.string_value for key, value in config.parameters.items()}
