"""Request payloads for ``pyserve bench``: input tensors from the model's metadata, then the
pre-encoded bytes the workers send (raw HTTP/1.1 requests or serialized gRPC messages).

Input values come from ``--input-data``: ``random``, ``zero``, or perf_analyzer's JSON file::

    {"data": [{"INPUT0": [1, 2, 3], "INPUT1": {"content": [[1], [2]], "shape": [2, 1]}}, ...]}

Each entry of ``data`` is one sample (shapes without the batch dimension); a request of
batch size ``b`` stacks ``b`` consecutive entries. Values are flat or nested lists, or
``{"content": [...], "shape": [...]}``, or ``{"b64": "..."}`` (the raw little-endian bytes).
A list of lists under ``data`` (perf_analyzer's streams) is read as one stream after another.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pyserve.api import datatypes
from pyserve.tools.bench.options import BenchError, BenchOptions

MAX_DISTINCT_REQUESTS = 64
"""At most this many different request bodies are pre-encoded (cycled through by the workers)."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as the model metadata describes it (``shape`` has the batch dim)."""

    name: str
    datatype: str
    shape: list[int]


@dataclass
class ModelInfo:
    """What the bench needs to know about the model, from the metadata and config endpoints."""

    name: str
    version: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int = 0
    decoupled: bool = False
    optional_inputs: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class ShmSlot:
    """Where one input of one request lies in the registered system shared memory region."""

    region: str
    offset: int
    byte_size: int


Sample = dict[str, np.ndarray]
"""One request's input tensors, batch dimension included when the model batches."""


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype of a KServe datatype name.

    :raises BenchError: for an unknown datatype.
    """
    found = datatypes.from_name(datatype)
    if found is None:
        raise BenchError(f"the model uses datatype '{datatype}', which pyserve bench does not know")
    return found.dtype


def sample_shapes(info: ModelInfo, options: BenchOptions) -> dict[str, list[int] | None]:
    """Per input, its shape without the batch dimension; None where a dimension stays variable."""
    unknown = set(options.shapes) - {t.name for t in info.inputs}
    if unknown:
        names = ", ".join(sorted(unknown))
        raise BenchError(f"--shape names input(s) {names} that model '{info.name}' does not have")
    shapes: dict[str, list[int] | None] = {}
    for spec in info.inputs:
        dims = list(spec.shape[1:] if info.max_batch_size > 0 else spec.shape)
        given = options.shapes.get(spec.name)
        if given is not None:
            if len(given) != len(dims) or any(d >= 0 and d != g for d, g in zip(dims, given)):
                raise BenchError(
                    f"--shape {spec.name}:{','.join(map(str, given))} does not fit the model's shape "
                    f"{dims} (without the batch dimension)"
                )
            dims = list(given)
        shapes[spec.name] = None if any(d < 0 for d in dims) else dims
    return shapes


def _variable_error(info: ModelInfo, name: str) -> BenchError:
    spec = next(t for t in info.inputs if t.name == name)
    dims = spec.shape[1:] if info.max_batch_size > 0 else spec.shape
    return BenchError(
        f"input '{name}' of model '{info.name}' has variable dimensions {dims} (without the batch dimension); "
        f"give its shape with --shape {name}:d1,d2,... (without the batch dimension) "
        f"or in an --input-data file"
    )


def _random_tensor(datatype: str, shape: list[int], rng: np.random.Generator, string_length: int) -> np.ndarray:
    dtype = numpy_dtype(datatype)
    if datatype == "BYTES":
        letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789", dtype=np.uint8)
        count = int(np.prod(shape)) if shape else 1
        codes = rng.choice(letters, size=(count, string_length))
        flat = np.array([row.tobytes() for row in codes], dtype=object)
        return flat.reshape(shape)
    if datatype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype.kind in "iu":
        return rng.integers(0, 64, size=shape).astype(dtype)
    return rng.random(size=shape).astype(np.float64).astype(dtype)


def _zero_tensor(datatype: str, shape: list[int]) -> np.ndarray:
    if datatype == "BYTES":
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtype=numpy_dtype(datatype))


def generated_samples(info: ModelInfo, options: BenchOptions, seed: int = 0) -> list[Sample]:
    """One request's inputs of random or zero values (``--input-data random|zero``)."""
    shapes = sample_shapes(info, options)
    rng = np.random.default_rng(seed)
    batch = [options.batch_size] if info.max_batch_size > 0 else []
    sample: Sample = {}
    for spec in info.inputs:
        dims = shapes[spec.name]
        if dims is None:
            if spec.name in info.optional_inputs:
                continue
            raise _variable_error(info, spec.name)
        full = batch + dims
        if options.input_data == "zero":
            sample[spec.name] = _zero_tensor(spec.datatype, full)
        else:
            sample[spec.name] = _random_tensor(spec.datatype, full, rng, options.string_length)
    return [sample]


def _file_value(
    info: ModelInfo, spec: TensorSpec, value: Any, dims: list[int] | None, where: str
) -> np.ndarray:
    """One input of one entry of an input-data file, as an array of the sample's shape."""
    dtype = numpy_dtype(spec.datatype)
    shape: list[int] | None = dims
    if isinstance(value, Mapping):
        if "shape" in value:
            shape = [int(d) for d in value["shape"]]
        if "b64" in value:
            if spec.datatype == "BYTES":
                raise BenchError(f"{where}: 'b64' is not supported for BYTES input '{spec.name}'")
            raw = base64.b64decode(value["b64"])
            array = np.frombuffer(raw, dtype=dtype)
            return _reshape(array, shape, spec, where)
        if "content" not in value:
            raise BenchError(f"{where}: input '{spec.name}' needs 'content' or 'b64'")
        value = value["content"]
    if spec.datatype == "BYTES":
        array = np.array(value, dtype=object)
        array = np.vectorize(
            lambda v: v.encode() if isinstance(v, str) else json.dumps(v).encode(), otypes=[object]
        )(array) if array.size else array
    else:
        try:
            array = np.array(value, dtype=np.float64 if dtype.kind in "fV" else dtype)
        except (TypeError, ValueError) as exc:
            raise BenchError(f"{where}: input '{spec.name}' holds values that are not {spec.datatype}: {exc}") from None
        array = array.astype(dtype)
    if shape is None and array.ndim > 1:
        shape = list(array.shape)
    return _reshape(array, shape, spec, where)


def _reshape(array: np.ndarray, shape: list[int] | None, spec: TensorSpec, where: str) -> np.ndarray:
    if shape is None:
        declared = spec.shape[1:] if len(spec.shape) and spec.shape[0] == -1 else spec.shape
        if sum(1 for d in declared if d < 0) == 1 and all(d != 0 for d in declared):
            known = int(np.prod([d for d in declared if d >= 0])) if len(declared) > 1 else 1
            shape = [array.size // known if d < 0 else d for d in declared]
        else:
            shape = [array.size]
    if int(np.prod(shape)) != array.size:
        raise BenchError(f"{where}: input '{spec.name}' has {array.size} value(s), but shape {shape} needs "
                         f"{int(np.prod(shape))}")
    return array.reshape(shape)


def file_samples(info: ModelInfo, options: BenchOptions, path: Path) -> list[Sample]:
    """Requests built from a perf_analyzer JSON input-data file."""
    try:
        document = json.loads(path.read_text())
    except OSError as exc:
        raise BenchError(f"cannot read --input-data file '{path}': {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise BenchError(f"--input-data file '{path}' is not valid JSON: {exc}") from None
    entries = document.get("data") if isinstance(document, Mapping) else None
    if not isinstance(entries, list) or not entries:
        raise BenchError(f"--input-data file '{path}' must hold {{\"data\": [{{...}}, ...]}} with one entry or more")
    if all(isinstance(e, list) for e in entries):  # streams: one list of steps each
        entries = [step for stream in entries for step in stream]
    shapes = sample_shapes(info, options)
    samples: list[Sample] = []
    for index, entry in enumerate(entries):
        where = f"--input-data '{path.name}' entry {index}"
        if not isinstance(entry, Mapping):
            raise BenchError(f"{where} must be an object of input name -> values")
        unknown = set(entry) - {t.name for t in info.inputs}
        if unknown:
            raise BenchError(f"{where} names input(s) {', '.join(sorted(unknown))} that model '{info.name}' "
                             f"does not have")
        sample: Sample = {}
        for spec in info.inputs:
            if spec.name not in entry:
                if spec.name in info.optional_inputs:
                    continue
                raise BenchError(f"{where} has no value for input '{spec.name}'")
            sample[spec.name] = _file_value(info, spec, entry[spec.name], shapes[spec.name], where)
        samples.append(sample)
    if info.max_batch_size <= 0:
        return samples[:MAX_DISTINCT_REQUESTS]
    batched: list[Sample] = []
    b = options.batch_size
    for k in range(min(len(samples), MAX_DISTINCT_REQUESTS)):
        group = [samples[(k * b + j) % len(samples)] for j in range(b)]
        stacked: Sample = {}
        for name in group[0]:
            parts = [g[name] for g in group if name in g]
            if len(parts) != b or len({p.shape for p in parts}) != 1:
                raise BenchError(f"--input-data: input '{name}' cannot be batched ({b}) across entries with "
                                 f"different shapes or missing values")
            stacked[name] = np.stack(parts)
        batched.append(stacked)
    return batched


def build_samples(info: ModelInfo, options: BenchOptions) -> list[Sample]:
    """The distinct requests' inputs for ``--input-data``.

    :raises BenchError: the input data does not fit the model.
    """
    if info.max_batch_size <= 0 and options.batch_size > 1:
        raise BenchError(f"model '{info.name}' does not batch (max_batch_size 0): -b must be 1")
    if info.max_batch_size > 0 and options.batch_size > info.max_batch_size:
        raise BenchError(f"-b {options.batch_size} exceeds model '{info.name}' max_batch_size "
                         f"{info.max_batch_size}")
    if options.input_data in ("random", "zero"):
        return generated_samples(info, options)
    return file_samples(info, options, Path(options.input_data))


# -- encoding --------------------------------------------------------------------------------------


def raw_bytes(array: np.ndarray, datatype: str) -> bytes:
    """A tensor's bytes as the binary extension and gRPC ``raw_input_contents`` carry them."""
    if datatype == "BYTES":
        parts: list[bytes] = []
        for item in array.reshape(-1):
            data = item if isinstance(item, bytes) else str(item).encode()
            parts.append(struct.pack("<I", len(data)))
            parts.append(data)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=numpy_dtype(datatype)).tobytes()


def _json_data(array: np.ndarray, datatype: str) -> list[Any]:
    if datatype == "BF16":
        raise BenchError("BF16 inputs cannot be sent as JSON; use --http-binary true")
    if datatype == "BYTES":
        try:
            return [b.decode() if isinstance(b, bytes) else str(b) for b in array.reshape(-1)]
        except UnicodeDecodeError:
            raise BenchError("a BYTES input holds non-UTF-8 data, which JSON cannot carry; "
                             "use --http-binary true") from None
    if datatype == "FP16":
        return array.astype(np.float32).reshape(-1).tolist()
    return array.reshape(-1).tolist()


def infer_path(info: ModelInfo) -> str:
    """The HTTP path of the model's infer endpoint."""
    version = f"/versions/{info.version}" if info.version else ""
    return f"/v2/models/{info.name}{version}/infer"


def _datatype_of(info: ModelInfo, name: str) -> str:
    return next(t.datatype for t in info.inputs if t.name == name)


def http_request(
    info: ModelInfo,
    sample: Sample,
    host: str,
    binary: bool,
    shm: Mapping[str, ShmSlot] | None = None,
) -> bytes:
    """A complete HTTP/1.1 infer request (request line, headers and body), ready to write."""
    inputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, array in sample.items():
        datatype = _datatype_of(info, name)
        entry: dict[str, Any] = {"name": name, "shape": list(array.shape), "datatype": datatype}
        if shm is not None:
            slot = shm[name]
            entry["parameters"] = {"shared_memory_region": slot.region, "shared_memory_byte_size": slot.byte_size,
                                   "shared_memory_offset": slot.offset}
        elif binary:
            blob = raw_bytes(array, datatype)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = _json_data(array, datatype)
        inputs.append(entry)
    document: dict[str, Any] = {"inputs": inputs}
    if binary:
        document["outputs"] = [{"name": o.name, "parameters": {"binary_data": True}} for o in info.outputs]
    header = json.dumps(document, separators=(",", ":")).encode()
    body = header + b"".join(blobs)
    lines = [
        f"POST {infer_path(info)} HTTP/1.1",
        f"Host: {host}",
        "Connection: keep-alive",
    ]
    if blobs:
        lines.append("Content-Type: application/octet-stream")
        lines.append(f"Inference-Header-Content-Length: {len(header)}")
    else:
        lines.append("Content-Type: application/json")
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def grpc_request(
    info: ModelInfo,
    sample: Sample,
    streaming: bool = False,
    shm: Mapping[str, ShmSlot] | None = None,
) -> bytes:
    """A serialized ``ModelInferRequest`` (also the message of ``ModelStreamInfer``)."""
    from pyserve import protocol as pb

    request = pb.ModelInferRequest(model_name=info.name, model_version=info.version)
    for name, array in sample.items():
        datatype = _datatype_of(info, name)
        tensor = request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if shm is not None:
            slot = shm[name]
            tensor.parameters["shared_memory_region"].string_param = slot.region
            tensor.parameters["shared_memory_byte_size"].int64_param = slot.byte_size
            tensor.parameters["shared_memory_offset"].int64_param = slot.offset
        else:
            request.raw_input_contents.append(raw_bytes(array, datatype))
    if streaming:
        request.parameters["triton_enable_empty_final_response"].bool_param = True
    return bytes(request.SerializeToString())


def shm_layout(samples: Sequence[Sample], info: ModelInfo, region: str) -> tuple[list[dict[str, ShmSlot]], bytes]:
    """Where each request's inputs go in one shared memory region, and the region's contents."""
    layout: list[dict[str, ShmSlot]] = []
    chunks: list[bytes] = []
    offset = 0
    for sample in samples:
        slots: dict[str, ShmSlot] = {}
        for name, array in sample.items():
            blob = raw_bytes(array, _datatype_of(info, name))
            slots[name] = ShmSlot(region, offset, len(blob))
            padding = (-len(blob)) % 64
            chunks.append(blob + b"\0" * padding)
            offset += len(blob) + padding
        layout.append(slots)
    return layout, b"".join(chunks)
