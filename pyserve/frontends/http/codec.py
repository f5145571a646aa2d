"""KServe v2 REST bodies ⇄ ``InferRequest`` / ``InferResponse``, with Triton's binary extension.

A request body is a JSON header, optionally followed by binary tensor data
(``Inference-Header-Content-Length`` gives the JSON length). Binary inputs become numpy
views of the received bytes, so no tensor is copied between the socket and the backend.
A response carries JSON ``data`` or, per output, binary data after the JSON header.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal, overload

import numpy as np
import orjson

from pyserve.api import datatypes
from pyserve.api.errors import InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.dataplane.classification import classify
from pyserve.dataplane.interface import SharedMemoryAccess
from pyserve.dataplane.shared_memory import (
    Region,
    ShmTarget,
    write_output,
)
from pyserve.frontends.http.wire import SINGLE_WRITE_LIMIT, BodyParts
from pyserve.repository.model_config import ModelIO, TensorSpec
from pyserve.repository.tensor_checks import (
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

_REQUEST_ONLY_PARAMETERS = frozenset({"binary_data_output"})
"""Request parameters ``_decode_header`` reads itself (``parse_parameters`` lets them through)."""
HEADER_LENGTH = "inference-header-content-length"
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"


@dataclass(slots=True)
class OutputOptions:
    """How the client wants one output returned."""

    binary: bool
    classification: int = 0
    shm: ShmTarget | None = None


@dataclass(slots=True)
class DecodedRequest:
    """A decoded ``/infer`` body: the request plus the per-output wire options."""

    request: InferRequest
    outputs: dict[str, OutputOptions]


def parse_header_length(value: str | None, body_length: int) -> int | None:
    """The JSON length from ``Inference-Header-Content-Length``, checked against the body."""
    if value is None:
        return None
    try:
        length = int(value)
    except ValueError:
        raise InferError.invalid(
            f"Inference-Header-Content-Length must be an integer, got '{value}'"
        ) from None
    if length < 0 or length > body_length:
        raise InferError.invalid(
            f"Inference-Header-Content-Length {length} is outside the request body of {body_length} byte(s)"
        )
    return length


def _load_json(data: bytes | memoryview) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        error = exc
    # Triton also reads the literals NaN, Infinity and -Infinity, which orjson refuses: the
    # standard library parses those; what it takes beyond them (lone surrogates, integers
    # beyond 64 bits) orjson cannot write back, so that keeps orjson's error.
    try:
        payload = json.loads(bytes(data))
        orjson.dumps(payload)
    except (ValueError, TypeError, RecursionError):
        raise InferError.invalid(f"failed to parse the request JSON buffer: {error}") from None
    return payload


def decode_infer(
    body: bytes | bytearray, header_length: int | None, model: ModelVersion, shm: SharedMemoryAccess | None = None
) -> DecodedRequest:
    """Decode and validate an ``/infer`` body for ``model``.

    :param shm: the server's shared-memory regions (tensors naming a region need it).
    :raises InferError: anything malformed or not matching the model config (INVALID_ARG).
    """
    assert model.io is not None
    if header_length == 0:
        return _decode_raw_binary(body, model)
    view = memoryview(body)
    if header_length is None:
        header = _load_json(view)
        binary = view[:0]
    else:
        header = _load_json(view[:header_length])
        binary = view[header_length:]
    if not isinstance(header, dict):
        raise InferError.invalid("the request body must be a JSON object")
    return _decode_header(header, binary, model, shm)


def _decode_header(
    header: dict[str, Any], binary: memoryview, model: ModelVersion, shm: SharedMemoryAccess | None = None
) -> DecodedRequest:
    io = model.io
    assert io is not None
    name = model.name
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise InferError.invalid("request 'id' must be a string")
    params = header.get("parameters")
    if params is None:
        params = {}
    elif not isinstance(params, dict):
        raise InferError.invalid("request 'parameters' must be a JSON object")
    options = parse_parameters(params, allow=_REQUEST_ONLY_PARAMETERS)
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise InferError.invalid("parameter 'binary_data_output' must be a boolean")
    raw_inputs = header.get("inputs", [] if io.has_no_required_inputs else None)
    if not isinstance(raw_inputs, list):  # an empty list: finish_inputs names what is missing
        raise InferError.invalid("request 'inputs' must be a non-empty list")
    inputs: dict[str, np.ndarray] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    offset = 0
    regions: list[Region] = []  # the shared-memory regions the request uses
    if not all(isinstance(entry, dict) for entry in raw_inputs):
        raise InferError.invalid("each entry of 'inputs' must be a JSON object")
    try:
        check_input_count(name, io, len(raw_inputs), lambda: (entry.get("name") for entry in raw_inputs))
    except InferError:
        _refuse_mismatched_data(raw_inputs)
        raise
    for entry in raw_inputs:
        try:
            spec, shape = check_input(name, io, entry.get("name"), entry.get("datatype"), entry.get("shape"))
        except InferError:
            _refuse_mismatched_data(raw_inputs)
            raise
        if spec.name in inputs:
            raise InferError.invalid(f"input '{spec.name}' is given more than once for model '{name}'")
        array, offset = _decode_input(entry, spec, shape, binary, offset, name, shm, regions)
        inputs[spec.name] = array
        shapes[spec.name] = shape
    if offset != len(binary):
        raise InferError.invalid(
            f"the request carries {len(binary) - offset} byte(s) of binary data that no input claims"
        )
    batch = finish_inputs(name, io, inputs, shapes)
    outputs = _decode_outputs(header.get("outputs"), io, name, binary_default, shm)
    request = InferRequest(
        name,
        model.version,
        inputs,
        tuple(outputs),
        id=request_id,
        parameters=options.custom,
        flags=options.flags,
        correlation_id=options.correlation_id,
        priority=options.priority,
        timeout_us=options.timeout_us,
        batch_size=batch,
    )
    for output in outputs.values():
        if output.shm is not None:
            regions.append(output.shm.region)
    if regions:
        request.shm_regions = regions
    return DecodedRequest(request, outputs)


def _decode_input(
    entry: dict[str, Any],
    spec: TensorSpec,
    shape: tuple[int, ...],
    binary: memoryview,
    offset: int,
    model: str,
    shm: SharedMemoryAccess | None = None,
    regions: list[Region] | None = None,
) -> tuple[np.ndarray, int]:
    params = entry.get("parameters") or {}
    if not isinstance(params, dict):
        raise InferError.invalid(f"'parameters' of input '{spec.name}' must be a JSON object")
    has_data = "data" in entry
    size = params.get("binary_data_size")
    if "shared_memory_region" in params:
        if has_data or size is not None:
            raise InferError.invalid(
                f"input '{spec.name}' must have exactly one of 'data', parameter 'binary_data_size' or "
                "parameter 'shared_memory_region'"
            )
        if shm is None:
            raise InferError.unsupported(f"input '{spec.name}': shared memory is not enabled on this endpoint")
        what = f"input '{spec.name}'"
        return shm_input_array(shm.input_bytes(params, what, regions), spec, shape, what, model), offset
    if (size is not None) == has_data:
        raise InferError.invalid(
            f"input '{spec.name}' must have exactly one of 'data' or parameter 'binary_data_size'"
        )
    count = element_count(shape)
    dtype = spec.datatype
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InferError.invalid(
                f"input '{spec.name}': 'binary_data_size' must be a non-negative integer"
            )
        end = offset + size
        if end > len(binary):
            raise InferError.invalid(
                f"input '{spec.name}': 'binary_data_size' is {size} but only {len(binary) - offset} "
                "byte(s) of binary data remain in the request"
            )
        chunk = binary[offset:end]
        if dtype.is_bytes:
            array = decode_bytes_elements(chunk, count, spec.name)
        else:
            expected = count * dtype.itemsize
            if size != expected:
                raise byte_size_mismatch(spec.name, model, expected, size,
                                         f"shape {list(shape)} of {dtype.name}; 'binary_data_size' is {size}")
            array = np.frombuffer(chunk, dtype=dtype.dtype, count=count)
        return array.reshape(shape), end
    return _json_to_array(entry["data"], spec, shape, count, model), offset


def shm_input_array(
    data: memoryview | bytes, spec: TensorSpec, shape: tuple[int, ...], what: str, model: str
) -> np.ndarray:
    """An input read from shared memory: a read-only view on the region (BYTES are split).

    :raises InferError: ``shared_memory_byte_size`` does not match the tensor's shape.
    """
    count = element_count(shape)
    dtype = spec.datatype
    if dtype.is_bytes:
        return decode_bytes_elements(data, count, spec.name).reshape(shape)
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise byte_size_mismatch(spec.name, model, expected, len(data),
                                 f"shape {list(shape)} of {dtype.name}; 'shared_memory_byte_size' is {len(data)}")
    array = np.frombuffer(data, dtype=dtype.dtype, count=count)
    array.flags.writeable = False
    return array.reshape(shape)


def _json_to_array(data: Any, spec: TensorSpec, shape: tuple[int, ...], count: int, model: str) -> np.ndarray:
    """Convert JSON ``data`` to an array of the input's dtype.

    As Triton does, ``data`` may be flat or nested in any way (even ragged): its elements are
    read in order and only their number must match ``shape``.
    """
    name = spec.name
    dtype = spec.datatype
    if not isinstance(data, list):
        raise InferError.invalid(f"'data' of input '{name}' must be a JSON array")
    if dtype.name in ("FP16", "BF16"):
        raise InferError.invalid(
            f"input '{name}': receiving {dtype.name} data via JSON is not supported; send it as binary data"
        )
    if dtype.is_bytes:
        return _json_to_bytes_array(_flatten_json(data), name, shape, count)
    try:
        raw = np.array(data)
        elements = data
    except (ValueError, TypeError, OverflowError):  # ragged nesting, or beyond numpy's 64 dims
        elements = _flatten_json(data)
        raw = np.array(elements)
    _check_element_count(raw.size, name, shape, count)
    kind = raw.dtype.kind
    if dtype.name != "BOOL" and kind in "biuf" and _holds_bools(elements):  # numpy reads true as 1
        raise InferError.invalid(f"'data' of {dtype.name} input '{name}' must hold numbers, not true/false")
    if dtype.name == "BOOL":
        if kind != "b":  # Triton's words first (its scripts match them)
            raise InferError.invalid(
                f"attempt to access JSON non-boolean as boolean: 'data' of BOOL input '{name}' must hold "
                "true/false values")
    elif dtype.dtype.kind in "iu":
        if kind not in "iu":
            # numpy infers float64 (or object) for integers beyond int64, e.g. large UINT64
            # values: re-read those exactly instead of refusing or rounding them.
            exact = _exact_integers(elements, shape)
            if exact is None:
                raise InferError.invalid(f"'data' of {dtype.name} input '{name}' must hold integers")
            raw = exact
        info = np.iinfo(dtype.dtype)
        if raw.size and (raw.min() < info.min or raw.max() > info.max):
            raise InferError.invalid(f"'data' of input '{name}' has values out of range for {dtype.name}")
    elif kind not in "iuf":
        raise InferError.invalid(f"'data' of {dtype.name} input '{name}' must hold numbers")
    return raw.astype(dtype.dtype, copy=False).reshape(shape)


def _holds_bools(data: list[Any]) -> bool:
    """Whether nested JSON lists hold ``true``/``false`` (a C-level pass over each list's types)."""
    types = set(map(type, data))
    if bool in types:
        return True
    return list in types and any(_holds_bools(item) for item in data if type(item) is list)


def _json_to_bytes_array(elements: list[Any], name: str, shape: tuple[int, ...], count: int) -> np.ndarray:
    _check_element_count(len(elements), name, shape, count)
    out = np.empty(count, dtype=object)
    for i, item in enumerate(elements):
        if not isinstance(item, str):
            raise InferError.invalid(
                "Unable to parse JSON bytes array: attempt to access JSON non-string as string: "
                f"'data' of BYTES input '{name}' must hold strings")
        out[i] = item.encode("utf-8")
    return out.reshape(shape)


SHAPE_MISMATCH = "Unable to parse 'data': Shape does not match true shape of 'data' field"
"""Triton's words, whole, for JSON ``data`` with another element count than its ``shape``
(its test scripts match the whole ``{"error": ...}`` body)."""


def _check_element_count(size: int, name: str, shape: tuple[int, ...], count: int) -> None:
    if size != count:
        raise InferError.invalid(SHAPE_MISMATCH)


def _refuse_mismatched_data(raw_inputs: list[dict[str, Any]]) -> None:
    """As Triton, which reads every input's JSON before it checks them against the config:
    on a config check's failure, a JSON ``data`` whose element count is not its ``shape``'s
    is the error reported (only called on that failure path)."""
    for entry in raw_inputs:
        data, shape = entry.get("data"), entry.get("shape")
        if (isinstance(data, list) and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape)
                and len(_flatten_json(data)) != math.prod(shape)):
            raise InferError.invalid(SHAPE_MISMATCH)


def _exact_integers(data: list[Any], shape: tuple[int, ...]) -> np.ndarray | None:
    """``data`` as an object array of Python ints, or None if any element is not an int."""
    flat = np.array(_flatten_json(data), dtype=object)
    if not all(type(v) is int for v in flat):
        return None
    return flat.reshape(shape)


def _flatten_json(data: list[Any]) -> list[Any]:
    """The elements of nested JSON lists in order, however deep or ragged (no recursion)."""
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def _decode_raw_binary(body: bytes | bytearray, model: ModelVersion) -> DecodedRequest:
    """Triton's raw binary request: the whole body is the single input's bytes, batch 1."""
    io = model.io
    assert io is not None
    if len(io.inputs) != 1:  # Triton's words (its scripts match them), then what pyserve adds
        raise InferError.invalid(
            f"Raw request must only have 1 input (found 1) to be deduced but got {len(io.inputs)} inputs in "
            f"'{model.name}' model configuration (a raw binary request, Inference-Header-Content-Length: 0, "
            "is the one input's bytes)"
        )
    spec = next(iter(io.inputs.values()))
    dims = list(spec.dims)
    variable = [i for i, d in enumerate(dims) if d == -1]
    if len(variable) > 1:
        raise InferError.invalid(
            f"The shape of the raw input '{spec.name}' can not be deduced because there are more than one "
            f"variable-sized dimension (dims {dims})"
        )
    if spec.datatype.is_bytes:
        if dims != [1]:  # one element: the whole body
            raise InferError.invalid(
                f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1] (it has {dims})"
            )
        shape = [1]
        array = np.empty(1, dtype=object)
        array[0] = bytes(body)
    else:
        itemsize = spec.datatype.itemsize
        if len(body) % itemsize:
            raise InferError.invalid(
                f"raw binary input of {len(body)} byte(s) is not a whole number of {spec.datatype.name} elements"
            )
        fixed = element_count([d for d in dims if d != -1])
        total = len(body) // itemsize
        if variable:
            if fixed == 0 or total % fixed:
                raise InferError.invalid("raw binary input size does not fit the input's dims")
            dims[variable[0]] = total // fixed
        elif fixed != total:
            raise InferError.invalid(
                f"raw binary input has {total} element(s) but the input's dims need {fixed}"
            )
        shape = dims
        array = np.frombuffer(body, dtype=spec.datatype.dtype)
    full = (1, *shape) if io.batching else tuple(shape)
    inputs = {spec.name: array.reshape(full)}
    finish_inputs(model.name, io, inputs, {spec.name: full})
    outputs = {n: OutputOptions(binary=True) for n in io.outputs}
    return DecodedRequest(InferRequest(model.name, model.version, inputs, tuple(outputs)), outputs)


def _decode_outputs(
    raw: Any, io: ModelIO, model: str, binary_default: bool, shm: SharedMemoryAccess | None = None
) -> dict[str, OutputOptions]:
    if raw is None:
        return {n: OutputOptions(binary=binary_default) for n in io.outputs}
    if not isinstance(raw, list):
        raise InferError.invalid("request 'outputs' must be a list")
    names = []
    for entry in raw:
        if not isinstance(entry, dict):
            raise InferError.invalid("each entry of 'outputs' must be a JSON object")
        names.append(entry.get("name"))
    check_outputs_requested(model, io, names)
    outputs: dict[str, OutputOptions] = {}
    for entry in raw:
        params = entry.get("parameters") or {}
        if not isinstance(params, dict):
            raise InferError.invalid(f"'parameters' of output '{entry['name']}' must be a JSON object")
        binary = params.get("binary_data", False)  # as Triton: 'binary_data_output' is for unlisted outputs
        if not isinstance(binary, bool):
            raise InferError.invalid(f"output '{entry['name']}': 'binary_data' must be a boolean")
        k = params.get("classification", 0)
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise InferError.invalid(
                f"output '{entry['name']}': 'classification' must be a non-negative integer"
            )
        target = None
        if "shared_memory_region" in params:
            what = f"output '{entry['name']}'"
            if k:
                raise InferError.invalid(f"{what}: classification cannot be combined with shared memory")
            if binary:  # Triton 2.51's words (checked side by side)
                raise InferError.invalid("Output can't set both 'shared_memory_region' and 'binary_data'")
            if shm is None:
                raise InferError.unsupported(f"{what}: shared memory is not enabled on this endpoint")
            target = shm.output_target(params, what)
        outputs[entry["name"]] = OutputOptions(binary=binary, classification=k, shm=target)
    if not outputs:
        return {n: OutputOptions(binary=binary_default) for n in io.outputs}
    return outputs


@overload
def encode_infer(
    response: InferResponse, decoded: DecodedRequest, model: ModelVersion, parts: Literal[False] = False
) -> tuple[bytes, dict[str, str]]: ...


@overload
def encode_infer(
    response: InferResponse, decoded: DecodedRequest, model: ModelVersion, parts: bool
) -> tuple[bytes | BodyParts, dict[str, str]]: ...


def encode_infer(
    response: InferResponse, decoded: DecodedRequest, model: ModelVersion, parts: bool = False
) -> tuple[bytes | BodyParts, dict[str, str]]:
    """The HTTP body and headers for a successful response.

    :param parts: the caller writes a ``BodyParts`` itself: a body over ``SINGLE_WRITE_LIMIT``
        with binary outputs is then the JSON header and views of the outputs, not joined.
        Otherwise the body is always ``bytes``.
    """
    io = model.io
    assert io is not None
    request = decoded.request
    out_entries: list[dict[str, Any]] = []
    blobs: list[bytes | memoryview] = []
    produced = response.outputs
    for name, opts in decoded.outputs.items():
        array = produced.get(name)
        if array is None:  # the model did not produce it: left out, as Triton does
            continue
        spec = io.outputs.get(name)
        sent = datatypes.of_output(array, spec.datatype if spec else None)  # as produced, as Triton
        datatype = sent.name if sent is not None else "BYTES"
        if opts.classification:
            labels = spec.labels if spec else ()
            array = classify(array, opts.classification, labels, io.batching, name)
            datatype = "BYTES"
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if opts.shm is not None:
            # no "parameters", as Triton 2.51 answers: NVIDIA's C++ client reads any output
            # parameters as binary data ("non-existing object member 'binary_data_size'")
            write_output(opts.shm, _to_wire_bytes(array, datatype), name)
        elif opts.binary:
            blob = _to_wire_bytes(array, datatype)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = _to_json_data(array, datatype, name)
        out_entries.append(entry)
    header: dict[str, Any] = {}
    if request.id:
        header["id"] = request.id
    header["model_name"] = model.name
    header["model_version"] = str(model.version)
    if response.parameters:
        header["parameters"] = response.parameters
    header["outputs"] = out_entries
    try:
        json_bytes = orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:  # e.g. a backend's response parameter of an unsupported type
        raise InferError(f"the response of model '{model.name}' cannot be written as JSON: {exc}") from None
    if b"null" in json_bytes:
        json_bytes = _with_non_finite(header)
    if not blobs:
        return json_bytes, {"content-type": JSON_TYPE}
    out_headers = {"content-type": BINARY_TYPE, HEADER_LENGTH: str(len(json_bytes))}
    if parts:
        body = BodyParts([json_bytes, *blobs])
        if body.size > SINGLE_WRITE_LIMIT:
            return body, out_headers
    return b"".join([json_bytes, *blobs]), out_headers


def _to_wire_bytes(array: np.ndarray, datatype: str) -> bytes | memoryview:
    if datatype == "BYTES":
        return encode_bytes_elements(array)
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    # a byte view, not a typed buffer: the buffer protocol has no code for BF16 ("E")
    return memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # an ndarray is a buffer (numpy's stubs say so from Python 3.12)


def _to_json_data(array: np.ndarray, datatype: str, name: str) -> Any:
    flat = np.ascontiguousarray(array).reshape(-1)
    if datatype == "BYTES":
        data = []
        for item in flat:
            if isinstance(item, str):
                data.append(item)
                continue
            if not isinstance(item, (bytes, bytearray, memoryview)):  # as the binary form: its text
                data.append(str(item))
                continue
            try:
                data.append(bytes(item).decode("utf-8"))
            except UnicodeDecodeError:
                raise InferError.invalid(
                    f"output '{name}' holds bytes that are not valid UTF-8 and cannot be returned as "
                    "JSON; request it with parameter 'binary_data': true"
                ) from None
        return data
    if datatype == "BF16":
        return flat.astype(np.float32)
    return flat


def _with_non_finite(header: dict[str, Any]) -> bytes:
    """The response header again, float outputs holding NaN or infinities written as Triton
    writes them (``NaN``, ``Infinity``, ``-Infinity``; orjson writes null). Called only when
    the plain encoding holds a ``null``, which nothing else of a response writes."""
    for entry in header["outputs"]:
        data = entry.get("data")
        if isinstance(data, np.ndarray) and data.dtype.kind == "f" and not np.isfinite(data).all():
            entry["data"] = orjson.Fragment(json.dumps(data.tolist(), separators=(",", ":")))
    return orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)
