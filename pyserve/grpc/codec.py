"""``ModelInferRequest`` ⇄ ``InferRequest`` / ``InferResponse`` ⇄ ``ModelInferResponse``.

Inputs come as ``raw_input_contents`` (little-endian bytes, BYTES length-prefixed) or typed
``contents``; both are validated against the model config with the same checks and messages
as HTTP before any tensor is allocated. Replies always carry ``raw_output_contents``, as
Triton's do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pyserve.classification import classify
from pyserve.errors import InferError
from pyserve.inference import InferRequest, InferResponse, ParameterValue
from pyserve.models import ModelVersion
from pyserve.protocol import ModelInferResponse
from pyserve.validation import (
    check_input,
    check_outputs_requested,
    decode_bytes_elements,
    element_count,
    encode_bytes_elements,
    finish_inputs,
    parse_parameters,
)

_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
"""Which typed ``InferTensorContents`` field carries each datatype (FP16/BF16: raw only)."""

_FIELD_DTYPE = {
    "bool_contents": np.dtype(np.bool_),
    "int_contents": np.dtype(np.int32),
    "int64_contents": np.dtype(np.int64),
    "uint_contents": np.dtype(np.uint32),
    "uint64_contents": np.dtype(np.uint64),
    "fp32_contents": np.dtype(np.float32),
    "fp64_contents": np.dtype(np.float64),
}
"""The numpy type of each numeric contents field: the proto's own type, so every value fits."""


def model_version(value: str) -> str | None:
    """A request's ``model_version`` field: None for the latest, else a version number.

    :raises InferError: not a number (NOT_FOUND).
    """
    if not value:
        return None
    if not value.isdigit():
        raise InferError.not_found(f"model version '{value}' is not a number")
    return value


def parameter_value(param: Any) -> ParameterValue:
    """The Python value of an ``InferParameter``."""
    which = param.WhichOneof("parameter_choice")
    if which is None:
        raise InferError.invalid("a parameter has no value set")
    return getattr(param, which)


def parameters_dict(params: Mapping[str, Any]) -> dict[str, ParameterValue]:
    return {key: parameter_value(value) for key, value in params.items()}


def set_parameter(target: Any, value: ParameterValue) -> None:
    """Fill an ``InferParameter`` from a Python value."""
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        if value >= 2**63:
            target.uint64_param = value
        else:
            target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = str(value)


class DecodedGrpcRequest:
    """A decoded ``ModelInferRequest``: the request plus per-output classification counts."""

    __slots__ = ("classification", "request")

    def __init__(self, request: InferRequest, classification: dict[str, int]) -> None:
        self.request = request
        self.classification = classification


STREAM_PARAMETERS = frozenset({"triton_enable_empty_final_response"})
"""Request parameters only ``ModelStreamInfer`` understands."""


def decode_infer(message: Any, model: ModelVersion, *, stream: bool = False) -> DecodedGrpcRequest:
    """Decode and validate a ``ModelInferRequest`` for ``model``.

    :param stream: the request came on ``ModelStreamInfer`` (stream-only parameters allowed).

    :raises InferError: malformed or not matching the config (INVALID_ARG).
    """
    io = model.io
    assert io is not None
    name = model.name
    raw = message.raw_input_contents
    if raw and len(raw) != len(message.inputs):
        raise InferError.invalid(
            f"expected {len(message.inputs)} raw_input_contents (one per input) but got {len(raw)} "
            f"for model '{name}'"
        )
    if not message.inputs:
        raise InferError.invalid(f"the request for model '{name}' has no inputs")
    inputs: dict[str, np.ndarray] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for index, tensor in enumerate(message.inputs):
        spec, shape = check_input(name, io, tensor.name, tensor.datatype, list(tensor.shape))
        if spec.name in inputs:
            raise InferError.invalid(f"input '{spec.name}' is given more than once for model '{name}'")
        if "shared_memory_region" in tensor.parameters:
            raise InferError.unsupported(f"input '{spec.name}': shared memory inputs are not supported by this server yet")
        count = element_count(shape)
        dtype = spec.datatype
        if raw:
            if tensor.HasField("contents"):
                raise InferError.invalid(
                    f"input '{spec.name}': contents must be empty when raw_input_contents is used"
                )
            data = raw[index]
            if dtype.is_bytes:
                array = decode_bytes_elements(data, count, spec.name)
            else:
                expected = count * dtype.itemsize
                if len(data) != expected:
                    raise InferError.invalid(
                        f"input '{spec.name}' has shape {list(shape)} of {dtype.name}, which needs "
                        f"{expected} byte(s), but its raw_input_contents holds {len(data)}"
                    )
                array = np.frombuffer(data, dtype=dtype.dtype, count=count)
        else:
            array = _typed_contents(tensor, dtype, count, spec.name)
        inputs[spec.name] = array.reshape(shape)
        shapes[spec.name] = shape
    batch = finish_inputs(name, io, inputs, shapes)
    options = parse_parameters(parameters_dict(message.parameters), allow=STREAM_PARAMETERS if stream else frozenset())
    requested = [o.name for o in message.outputs]
    names = check_outputs_requested(name, io, requested)
    classification: dict[str, int] = {}
    for output in message.outputs:
        params = output.parameters
        if "shared_memory_region" in params:
            raise InferError.unsupported(
                f"output '{output.name}': shared memory outputs are not supported by this server yet"
            )
        if "classification" in params:
            k = parameter_value(params["classification"])
            if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                raise InferError.invalid(f"output '{output.name}': 'classification' must be a non-negative integer")
            if k:
                classification[output.name] = k
    request = InferRequest(
        name,
        model.version,
        inputs,
        names,
        id=message.id,
        parameters=options.custom,
        flags=options.flags,
        correlation_id=options.correlation_id,
        priority=options.priority,
        timeout_us=options.timeout_us,
        batch_size=batch,
    )
    return DecodedGrpcRequest(request, classification)


def _typed_contents(tensor: Any, dtype: Any, count: int, name: str) -> np.ndarray:
    field = _CONTENTS_FIELD.get(dtype.name)
    if field is None:
        raise InferError.invalid(f"input '{name}': {dtype.name} data must be sent in raw_input_contents")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise InferError.invalid(
            f"input '{name}' has shape {list(tensor.shape)} ({count} element(s)) but its contents hold "
            f"{len(values)} element(s)"
        )
    if dtype.is_bytes:
        out = np.empty(count, dtype=object)
        for i, item in enumerate(values):
            out[i] = item
        return out
    array = np.array(values, dtype=_FIELD_DTYPE[field])
    if array.dtype != dtype.dtype and dtype.dtype.kind in "iu" and array.size:
        info = np.iinfo(dtype.dtype)
        if array.min() < info.min or array.max() > info.max:
            raise InferError.invalid(f"contents of input '{name}' have values out of range for {dtype.name}")
    return array.astype(dtype.dtype, copy=False)


def encode_infer(response: InferResponse, decoded: DecodedGrpcRequest, model: ModelVersion) -> Any:
    """A ``ModelInferResponse`` with every output in ``raw_output_contents``."""
    io = model.io
    assert io is not None
    request = decoded.request
    message = ModelInferResponse(model_name=model.name, model_version=str(model.version), id=request.id)
    for key, value in response.parameters.items():
        set_parameter(message.parameters[key], value)
    raw = message.raw_output_contents
    for name in request.requested_outputs:
        array = response.outputs[name]
        spec = io.outputs.get(name)
        datatype = spec.datatype.name if spec else "BYTES"
        k = decoded.classification.get(name)
        if k:
            array = classify(array, k, spec.labels if spec else (), io.batching, name)
            datatype = "BYTES"
        out = message.outputs.add(name=name, datatype=datatype)
        out.shape.extend(array.shape)
        if datatype == "BYTES":
            raw.append(encode_bytes_elements(array))
        else:
            contiguous = np.ascontiguousarray(array)
            raw.append(contiguous.tobytes())
    return message


def error_only_response(request: InferRequest, model: ModelVersion) -> Any:
    """An empty response carrying only the ids (the stream's empty final response)."""
    return ModelInferResponse(model_name=model.name, model_version=str(model.version), id=request.id)

