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

from pyserve.api import datatypes
from pyserve.api.errors import InferError
from pyserve.api.inference import InferRequest, InferResponse, ParameterValue
from pyserve.dataplane.classification import classify
from pyserve.dataplane.interface import SharedMemoryAccess
from pyserve.dataplane.shared_memory import (
    Region,
    ShmTarget,
    write_output,
)
from pyserve.protocol import ModelInferRequest, ModelInferResponse
from pyserve.repository.model_config import ModelIO, TensorSpec
from pyserve.repository.scan import is_version_number
from pyserve.repository.tensor_checks import (
    RequestOptions,
    byte_size_mismatch,
    check_input,
    check_input_count,
    check_outputs_requested,
    decode_bytes_elements,
    element_count,
    encode_bytes_elements,
    finish_inputs,
    parse_parameters,
)
from pyserve.runtime.versions import ModelVersion

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

    :raises InferError: not a number (INVALID_ARG, as Triton 2.51).
    """
    if not value:
        return None
    if not is_version_number(value):
        raise InferError.invalid(
            f"failed to get model version from specified version string '{value}': "
            "version should be an integral value > 0"
        )
    return value


def parameter_value(param: Any) -> ParameterValue:
    """The Python value of an ``InferParameter``."""
    which = param.WhichOneof("parameter_choice")
    if which is None:
        raise InferError.invalid("a parameter has no value set")
    return getattr(param, which)


def parameters_dict(params: Mapping[str, Any]) -> dict[str, ParameterValue]:
    """A ``map<string, InferParameter>`` as plain values (a new dict)."""
    if not params:
        return {}
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
    """A decoded ``ModelInferRequest``: the request plus per-output classification counts and
    shared-memory targets."""

    __slots__ = ("classification", "request", "shm_outputs")

    def __init__(
        self,
        request: InferRequest,
        classification: dict[str, int],
        shm_outputs: dict[str, ShmTarget] | None = None,
    ) -> None:
        self.request = request
        self.classification = classification
        self.shm_outputs = shm_outputs


GRPC_PARAMETERS = frozenset({"triton_enable_empty_final_response"})
"""The ``triton_`` request parameters gRPC accepts, on ``ModelStreamInfer`` and (as Triton does,
ignoring it there: perf_analyzer sets it on every gRPC request) on ``ModelInfer`` too."""



def decode_infer(
    message: Any, model: ModelVersion, *, stream: bool = False, shm: SharedMemoryAccess | None = None
) -> DecodedGrpcRequest:
    """Decode and validate a ``ModelInferRequest`` for ``model``.

    :param stream: the request came on ``ModelStreamInfer``. Both calls accept the same
        parameters (``GRPC_PARAMETERS``; a unary call ignores them, as Triton does).
    :param shm: the server's shared-memory regions (tensors naming a region need it).

    :raises InferError: malformed or not matching the config (INVALID_ARG).
    """
    io = model.io
    assert io is not None
    name = model.name
    inputs: dict[str, np.ndarray] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    regions = _decode_inputs(message, name, io, shm, inputs, shapes)  # the shared-memory regions used
    batch = finish_inputs(name, io, inputs, shapes)
    options = _request_options(message.parameters)
    outputs = message.outputs[:]
    names = check_outputs_requested(name, io, [o.name for o in outputs])
    classification: dict[str, int] = {}
    shm_outputs = _output_parameters(outputs, shm, classification)
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
    if shm_outputs:
        regions = (regions or []) + [target.region for target in shm_outputs.values()]
    if regions:
        request.shm_regions = regions
    return DecodedGrpcRequest(request, classification, shm_outputs)


def _decode_inputs(
    message: Any, name: str, io: ModelIO, shm: SharedMemoryAccess | None,
    inputs: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]],
) -> list[Region] | None:
    """Fill ``inputs`` (arrays in their request shape) and ``shapes`` from the request's input
    tensors; the shared-memory regions they are read from (None if none)."""
    raw = message.raw_input_contents
    tensors = message.inputs[:]  # read each upb field once (every access builds a new wrapper); a
    # slice is a plain list, which iterates for less than the repeated field itself
    in_region = [("shared_memory_region" in t.parameters) for t in tensors]
    in_shm = sum(in_region) if shm is not None else 0
    if raw and len(raw) < len(in_region) - in_shm:  # more are ignored, as Triton 2.51 does
        which = "one per input not in shared memory" if in_shm else "one per input"
        raise InferError.invalid(
            f"expected {len(in_region) - in_shm} raw_input_contents ({which}) but got {len(raw)} "
            f"for model '{name}'"
        )
    raw_index = 0
    regions: list[Region] | None = None
    check_input_count(name, io, len(tensors), lambda: (t.name for t in tensors))
    for tensor, region in zip(tensors, in_region):
        spec, shape = check_input(name, io, tensor.name, tensor.datatype, tensor.shape[:])
        if spec.name in inputs:
            raise InferError.invalid(f"input '{spec.name}' is given more than once for model '{name}'")
        if region:
            if regions is None:
                regions = []
            array = _shm_input(tensor, spec, shape, shm, regions, name)
        elif raw:
            array = _raw_input(tensor, spec, shape, raw[raw_index], name)
            raw_index += 1
        else:
            array = _typed_contents(tensor, spec.datatype, element_count(shape), spec.name)
        inputs[spec.name] = array.reshape(shape)
        shapes[spec.name] = shape
    return regions


def _shm_input(
    tensor: Any, spec: TensorSpec, shape: tuple[int, ...], shm: SharedMemoryAccess | None,
    regions: list[Region], model: str,
) -> np.ndarray:
    """An input read from the shared-memory region its parameters name (added to ``regions``)."""
    what = f"input '{spec.name}'"
    if shm is None:
        raise InferError.unsupported(f"{what}: shared memory is not enabled on this endpoint")
    if tensor.HasField("contents"):
        raise InferError.invalid(f"{what}: contents must be empty when 'shared_memory_region' is used")
    data = shm.input_bytes(parameters_dict(tensor.parameters), what, regions)
    return _shm_input_array(data, spec, shape, what, model)


def _raw_input(tensor: Any, spec: TensorSpec, shape: tuple[int, ...], data: bytes, model: str) -> np.ndarray:
    """An input whose bytes are its ``raw_input_contents`` entry ``data`` (not copied)."""
    if tensor.HasField("contents"):
        raise InferError.invalid(f"input '{spec.name}': contents must be empty when raw_input_contents is used")
    count = element_count(shape)
    dtype = spec.datatype
    if dtype.is_bytes:
        return decode_bytes_elements(data, count, spec.name)
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise byte_size_mismatch(spec.name, model, expected, len(data),
                                 f"shape {list(shape)} of {dtype.name}; its raw_input_contents "
                                 f"holds {len(data)} byte(s)")
    return np.frombuffer(data, dtype=dtype.dtype, count=count)


def _request_options(request_parameters: Any) -> RequestOptions:
    """The request-level parameters, checked as Triton checks them (``GRPC_PARAMETERS`` allowed)."""
    empty_final = request_parameters.get("triton_enable_empty_final_response") if request_parameters else None
    if empty_final is not None and empty_final.WhichOneof("parameter_choice") != "bool_param":
        raise InferError.invalid(
            "invalid value type for 'triton_enable_empty_final_response' parameter, expected bool_param."
        )
    return parse_parameters(parameters_dict(request_parameters), allow=GRPC_PARAMETERS)


def _output_parameters(
    outputs: list[Any], shm: SharedMemoryAccess | None, classification: dict[str, int]
) -> dict[str, ShmTarget] | None:
    """Read the requested outputs' parameters: their ``classification`` counts into
    ``classification``; the shared-memory targets of those written to a region (None if none)."""
    shm_outputs: dict[str, ShmTarget] | None = None
    for output in outputs:
        params = output.parameters
        if not params:
            continue
        if "classification" in params:
            k = parameter_value(params["classification"])
            if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                raise InferError.invalid(f"output '{output.name}': 'classification' must be a non-negative integer")
            if k:
                classification[output.name] = k
        if "shared_memory_region" in params:
            what = f"output '{output.name}'"
            if output.name in classification:
                raise InferError.invalid(f"{what}: classification cannot be combined with shared memory")
            if shm is None:
                raise InferError.unsupported(f"{what}: shared memory is not enabled on this endpoint")
            if shm_outputs is None:
                shm_outputs = {}
            shm_outputs[output.name] = shm.output_target(parameters_dict(params), what)
    return shm_outputs


def _shm_input_array(data: Any, spec: Any, shape: tuple[int, ...], what: str, model: str) -> np.ndarray:
    from pyserve.frontends.http.codec import shm_input_array  # one implementation for both frontends

    return shm_input_array(data, spec, shape, what, model)


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
    raw: list[bytes | memoryview] = []
    message = _encode_head(response, decoded, model, raw)
    contents = message.raw_output_contents
    for payload in raw:
        contents.append(payload if type(payload) is bytes else bytes(payload))
    return message


_RAW_OUTPUT_TAG = bytes([(6 << 3) | 2])
"""``ModelInferResponse.raw_output_contents`` (field 6, length-delimited) wire tag."""


def _varint(value: int) -> bytes:
    """``value`` (non-negative) as a protobuf base-128 varint."""
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class WireParts(list[Any]):
    """A serialized message as consecutive pieces (``bytes`` / ``memoryview``), not joined.

    pyserve's gRPC server writes the pieces as they are; anything else calls :meth:`join`.
    """

    __slots__ = ("nbytes",)
    nbytes: int

    def join(self) -> bytes:
        return b"".join(self)


UNJOINED_ABOVE = 64 * 1024
"""Replies with more output bytes than this stay :class:`WireParts` when the caller allows it."""


def encode_infer_wire(
    response: InferResponse, decoded: DecodedGrpcRequest, model: ModelVersion, join: bool = True
) -> bytes | WireParts:
    """``encode_infer(...).SerializeToString()``, byte for byte, with at most one copy of each output.

    upb only stores ``bytes`` in a repeated bytes field, so the message path copies every
    output three times (``tobytes``, ``append``, serialize). Here the message is serialized
    without its ``raw_output_contents`` — field 6, the highest, which the serializer emits
    last — and each output's tag, length and data (a view of the array) follow it. With
    ``join=False`` a large reply is returned as :class:`WireParts` and no output is copied here.
    """
    raw: list[bytes | memoryview] = []
    head = _encode_head(response, decoded, model, raw).SerializeToString()
    if not raw:
        return head
    parts = WireParts([head])
    total = len(head)
    for payload in raw:
        size = len(payload) if type(payload) is bytes else payload.nbytes  # type: ignore[union-attr]
        length = _varint(size)
        parts.append(_RAW_OUTPUT_TAG)
        parts.append(length)
        parts.append(payload)
        total += 1 + len(length) + size
    if join or total <= UNJOINED_ABOVE:
        return b"".join(parts)
    parts.nbytes = total
    return parts


SPLIT_ABOVE = 64 * 1024
"""Requests larger than this are parsed by :func:`parse_infer_request` without copying tensors."""


class SplitInferRequest:
    """A ``ModelInferRequest`` whose ``raw_input_contents`` are views of the received bytes.

    Every other field is the parsed message's (attribute access is passed on to it);
    ``SerializeToString`` gives the original wire bytes.
    """

    __slots__ = ("message", "raw_input_contents", "_wire")

    def __init__(self, message: Any, raw: list[memoryview], wire: bytes | bytearray | memoryview) -> None:
        self.message = message
        self.raw_input_contents = raw
        self._wire = wire

    def __getattr__(self, name: str) -> Any:
        return getattr(self.message, name)

    def SerializeToString(self) -> bytes:  # noqa: N802 - the protobuf method name
        return bytes(self._wire)

    @property
    def wire(self) -> memoryview:
        """The original wire bytes, not copied."""
        return memoryview(self._wire)


def parse_infer_request(data: bytes | bytearray | memoryview) -> Any:
    """Parse a serialized ``ModelInferRequest``; large ones keep their tensors in ``data``.

    protobuf copies a bytes field into its arena and again into every ``bytes`` object read
    from it: a 16 MB tensor would be copied twice more after arriving. Above
    :data:`SPLIT_ABOVE` bytes the top-level fields are walked here instead: each
    ``raw_input_contents`` entry (field 7) becomes a ``memoryview`` of ``data``, and only the
    other fields go through protobuf.

    :raises ValueError: the bytes are not a valid message (truncated, bad wire type).
    """
    if len(data) <= SPLIT_ABOVE:
        return ModelInferRequest.FromString(data)
    view = memoryview(data)
    end = len(view)
    position = 0
    keep: list[memoryview] = []
    raw: list[memoryview] = []
    while position < end:
        start = position
        tag, position = _read_varint(view, position, end)
        wire_type = tag & 7
        if wire_type == 2:
            length, position = _read_varint(view, position, end)
            stop = position + length
            if stop > end:
                raise ValueError("truncated ModelInferRequest")
            if tag >> 3 == 7:
                raw.append(view[position:stop])
                position = stop
                continue
            position = stop
        elif wire_type == 0:
            _, position = _read_varint(view, position, end)
        elif wire_type == 1:
            position += 8
        elif wire_type == 5:
            position += 4
        else:
            raise ValueError(f"wire type {wire_type} in ModelInferRequest")
        if position > end:
            raise ValueError("truncated ModelInferRequest")
        keep.append(view[start:position])
    message = ModelInferRequest.FromString(b"".join(keep))
    return SplitInferRequest(message, raw, data)


def _read_varint(view: memoryview, position: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= end or shift > 63:
            raise ValueError("truncated varint in ModelInferRequest")
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _encode_head(
    response: InferResponse, decoded: DecodedGrpcRequest, model: ModelVersion, raw: list[bytes | memoryview]
) -> Any:
    """The response message without ``raw_output_contents``; each output's wire bytes go to ``raw``."""
    io = model.io
    assert io is not None
    request = decoded.request
    message = ModelInferResponse(model_name=model.name, model_version=str(model.version), id=request.id)
    if response.parameters:
        for key, value in response.parameters.items():
            set_parameter(message.parameters[key], value)
    add_output = message.outputs.add
    produced = response.outputs
    for name in request.requested_outputs:
        array = produced.get(name)
        if array is None:  # the model did not produce it: left out, as Triton does
            continue
        spec = io.outputs.get(name)
        sent = datatypes.of_output(array, spec.datatype if spec else None)  # as produced, as Triton
        datatype = sent.name if sent is not None else "BYTES"
        k = decoded.classification.get(name)
        if k:
            array = classify(array, k, spec.labels if spec else (), io.batching, name)
            datatype = "BYTES"
        add_output(name=name, datatype=datatype, shape=array.shape)
        target = decoded.shm_outputs.get(name) if decoded.shm_outputs else None
        if target is not None:
            wire = encode_bytes_elements(array) if datatype == "BYTES" else _byte_view(array)
            write_output(target, wire, name)  # no parameters on the output, as Triton 2.51 answers
            raw.append(b"")  # keeps raw_output_contents index-aligned with outputs
            continue
        if datatype == "BYTES":
            raw.append(encode_bytes_elements(array))
        else:  # a view, not a copy: the caller copies it once into the wire bytes
            raw.append(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))  # type: ignore[arg-type]  # an ndarray is a buffer (numpy's stubs say so from Python 3.12)
    return message


def _byte_view(array: np.ndarray) -> memoryview:
    contiguous = np.ascontiguousarray(array)
    if contiguous.dtype.byteorder == ">":
        contiguous = contiguous.astype(contiguous.dtype.newbyteorder("<"))
    return memoryview(contiguous.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # an ndarray is a buffer (numpy's stubs say so from Python 3.12)


def error_only_response(request: InferRequest, model: ModelVersion) -> Any:
    """An empty response carrying only the ids (the stream's empty final response)."""
    return ModelInferResponse(model_name=model.name, model_version=str(model.version), id=request.id)

