"""The frames frontend processes and the model owner exchange over a Unix socket.

A frame is ``<u32 payload length><u8 kind><u32 request id>`` followed by the payload. Most
payloads are ``<u32 header length><orjson header>`` then raw bytes (tensor data, an HTTP body,
a serialized protobuf message). Tensors travel as their bytes: numeric arrays as they are in
memory (little-endian, C order), BYTES arrays in Triton's length-prefixed element format, so
neither side pickles anything and the receiver views numeric data without a copy.

Frames are small and many: writers queue them and write once per event-loop iteration
(``FrameWriter``); readers parse as many as a read delivered (``FrameReader``), collecting a
large payload straight into one buffer of its final size.
"""

from __future__ import annotations

import asyncio
import enum
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from pyserve.repository.tensor_checks import decode_bytes_elements, encode_bytes_elements

_HEAD = struct.Struct("<IBI")
_U32 = struct.Struct("<I")
HEAD_SIZE = _HEAD.size
MAX_PAYLOAD = (1 << 32) - 1
"""The largest payload a frame can carry (the length field is 32 bits)."""
_BIG = 1 << 20
"""Payloads over this many bytes are collected into a buffer of their own size."""


class Kind(enum.IntEnum):
    """What a frame carries; the comment says who sends it (F = frontend, O = owner)."""

    HELLO = 1  # F: the frontend listens and is ready ({"pid"})
    SNAPSHOT = 2  # O: the READY models a frontend may decode for (see ``snapshot_payload``)
    INFER = 3  # F: a decoded request (``request_payload``)
    CANCEL = 4  # F: the client of request ``id`` went away
    RESULT = 5  # O: the response or error of request ``id`` (``result_payload``)
    RAW_HTTP = 6  # F: an HTTP infer the owner must decode itself (shared memory, unknown model)
    RAW_HTTP_REPLY = 7  # O: ``{"s": status, "h": headers}`` + body
    RAW_GRPC = 8  # F: a serialized ModelInferRequest the owner must decode itself
    RAW_GRPC_REPLY = 9  # O: the serialized ModelInferResponse, or ``{"e", "c"}``
    STATS_PULL = 10  # O: send the replicas' counters now (a statistics request or a scrape waits)
    STATS = 11  # F: ``{"d": [[generation, counters delta], ...]}`` (answer to ``id``, or 0 unasked)
    REPLICAS = 12  # F: ``{"g": [generation, ...], "u": [[name, version], ...]}``: the owner versions
    # it now answers itself, and its replicas of versions the owner unloaded that still unload
    SNAPSHOT_APPLIED = 13  # F: the SNAPSHOT with this id is in use (sent for ids other than 0)
    READY_PULL = 14  # O: ``{"g": [generation, ...]}``: run these replicas' readiness checks now
    READY = 15  # F: ``{"n": [generation, ...]}``: those of the pull ``id`` whose replica is not ready
    LOG_SETTINGS = 16  # O: the logging extension's settings to apply (``logs.changeable_settings``)
    TRACING = 17  # O: ``{"g": bool, "on": [model, ...], "off": [...]}``: which models the owner may
    # trace now (``TraceManager.traced_models``); their requests go to the owner, which samples


def frame(kind: Kind, request_id: int, header: Any = None, data: Sequence[bytes | memoryview] = ()) -> list[Any]:
    """The parts of one frame (to ``FrameWriter.send``): head, optional JSON header, data.

    :raises ValueError: the payload does not fit in a frame.
    """
    parts: list[Any] = []
    size = 0
    if header is not None:
        encoded = orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)
        parts += (_U32.pack(len(encoded)), encoded)
        size = 4 + len(encoded)
    for blob in data:
        parts.append(blob)
        size += blob.nbytes if isinstance(blob, memoryview) else len(blob)
    if size > MAX_PAYLOAD:
        raise ValueError(f"a hand-off frame of {size} bytes is over the {MAX_PAYLOAD}-byte limit")
    parts.insert(0, _HEAD.pack(size, kind, request_id))
    return parts


def retarget(head: bytes, request_id: int) -> bytes:
    """A frame head with another request id (to send a cached frame for one request)."""
    length, kind, _ = _HEAD.unpack(head)
    return _HEAD.pack(length, kind, request_id)


def split_payload(payload: bytes | bytearray) -> tuple[Any, memoryview]:
    """``(header, data)`` of a payload made with a header."""
    view = memoryview(payload)
    (length,) = _U32.unpack_from(view, 0)
    return orjson.loads(view[4 : 4 + length]), view[4 + length :]


# -- tensors ---------------------------------------------------------------------------------

_BF16: Any = None


_DTYPES: dict[str, np.dtype] = {}
"""Wire dtype name → dtype, filled as names are first read (a handful of distinct names)."""
_NAMES: dict[np.dtype, str] = {}
"""dtype → wire name (``dtype.name`` is computed in Python by numpy on every access)."""


def _dtype(name: str) -> np.dtype:
    dtype = _DTYPES.get(name)
    if dtype is not None:
        return dtype
    global _BF16
    if name == "bfloat16":
        if _BF16 is None:
            import ml_dtypes

            _BF16 = np.dtype(ml_dtypes.bfloat16)
        dtype = _BF16
    else:
        dtype = np.dtype(name)
    if len(_DTYPES) < 64:
        _DTYPES[name] = dtype
    return dtype


def _name(dtype: np.dtype) -> str:
    name = _NAMES.get(dtype)
    if name is None:
        name = dtype.name
        if len(_NAMES) < 64:
            _NAMES[dtype] = name
    return name


def tensor_parts(arrays: Mapping[str, Any]) -> tuple[list[list[Any]], list[bytes | memoryview]]:
    """Describe arrays as ``[name, dtype, shape, nbytes]`` entries plus their bytes.

    Object, ``str`` and ``bytes`` arrays go as BYTES elements (``dtype`` ``"object"``).
    """
    entries: list[list[Any]] = []
    blobs: list[bytes | memoryview] = []
    for name, value in arrays.items():
        array = value if type(value) is np.ndarray else np.asarray(value)
        if array.dtype.kind in "OUS":
            blob: bytes | memoryview = encode_bytes_elements(array)
            dtype = "object"
        else:
            if not array.flags.c_contiguous:
                array = np.ascontiguousarray(array)
            if array.dtype.byteorder == ">":
                array = array.astype(array.dtype.newbyteorder("<"))
            blob = memoryview(array.reshape(-1).view(np.uint8)) if array.size else b""  # type: ignore[arg-type]  # an ndarray is a buffer (numpy's stubs say so from Python 3.12)
            dtype = _name(array.dtype)
        entries.append([name, dtype, list(array.shape), len(blob)])
        blobs.append(blob)
    return entries, blobs


def read_tensors(entries: Iterable[Sequence[Any]], data: memoryview) -> dict[str, np.ndarray]:
    """The arrays ``tensor_parts`` described, as views of ``data`` (BYTES arrays are rebuilt).

    :raises ValueError: the entries do not fit the data.
    """
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        end = offset + nbytes
        if end > len(data):
            raise ValueError(f"tensor '{name}' runs past the end of its frame")
        if dtype == "object":
            count = 1
            for d in shape:
                count *= d
            array = decode_bytes_elements(data[offset:end], count, name).reshape(shape)
        else:
            kind = _dtype(dtype)
            array = np.frombuffer(data, dtype=kind, count=nbytes // kind.itemsize if nbytes else 0,
                                  offset=offset).reshape(shape)
        arrays[name] = array
        offset = end
    return arrays


# -- reading and writing ---------------------------------------------------------------------

FrameHandler = Callable[[int, int, bytes | bytearray], None]
"""``(kind, request id, payload)``."""


class FrameReader:
    """Cuts a byte stream into frames and hands each to ``on_frame`` (in order).

    :raises ValueError: from ``feed``, a frame of an unknown kind (the stream is then unusable).
    """

    __slots__ = ("_big", "_big_filled", "_big_head", "_buffer", "_on_frame")

    def __init__(self, on_frame: FrameHandler) -> None:
        self._on_frame = on_frame
        self._buffer = bytearray()
        self._big: bytearray | None = None
        self._big_filled = 0
        self._big_head = (0, 0)

    def feed(self, data: bytes) -> None:
        if self._big is not None:
            data = self._fill_big(data)
            if not data:
                return
        buffer = self._buffer
        buffer += data
        start = 0
        end = len(buffer)
        on_frame = self._on_frame
        while end - start >= HEAD_SIZE:
            length, kind, request_id = _HEAD.unpack_from(buffer, start)
            if kind not in _KINDS:
                raise ValueError(f"hand-off stream out of step: unknown frame kind {kind}")
            body = start + HEAD_SIZE
            if end - body >= length:
                payload = bytes(buffer[body : body + length])
                start = body + length
                on_frame(kind, request_id, payload)
                continue
            if length > _BIG:  # collect the rest straight into a buffer of the frame's size
                big = bytearray(length)
                have = end - body
                big[:have] = buffer[body:end]
                self._big, self._big_filled, self._big_head = big, have, (kind, request_id)
                start = end
            break
        del buffer[:start]

    def _fill_big(self, data: bytes) -> bytes:
        big = self._big
        assert big is not None
        take = min(len(big) - self._big_filled, len(data))
        big[self._big_filled : self._big_filled + take] = data[:take]
        self._big_filled += take
        if self._big_filled < len(big):
            return b""
        self._big = None
        kind, request_id = self._big_head
        self._on_frame(kind, request_id, big)
        return data[take:]


_KINDS = frozenset(int(k) for k in Kind)


class FrameWriter:
    """Queues frames for one transport and writes them once per loop iteration."""

    __slots__ = ("_loop", "_parts", "_scheduled", "transport")

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport) -> None:
        self._loop = loop
        self.transport = transport
        self._parts: list[Any] = []
        self._scheduled = False

    def send(self, parts: list[Any]) -> None:
        self._parts += parts
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        parts, self._parts = self._parts, []
        if not parts or self.transport.is_closing():
            return
        if sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts) <= 1 << 16:
            self.transport.write(b"".join(parts))
        else:
            self.transport.writelines(parts)


# -- requests and results --------------------------------------------------------------------


def io_to_json(io: Any) -> list[Any]:
    """A ``ModelIO`` as JSON (labels included), for a frontend's snapshot."""

    def specs(table: Mapping[str, Any]) -> list[list[Any]]:
        return [
            [s.name, s.datatype.name, s.dims, s.reshape, s.optional, s.allow_ragged_batch, s.labels]
            for s in table.values()
        ]

    return [io.max_batch_size, specs(io.inputs), specs(io.outputs)]


def io_from_json(value: Sequence[Any]) -> Any:
    """The ``ModelIO`` ``io_to_json`` described."""
    from pyserve.api import datatypes
    from pyserve.repository.model_config import ModelIO, TensorSpec

    def specs(rows: Sequence[Sequence[Any]]) -> dict[str, TensorSpec]:
        table = {}
        for name, dtype, dims, reshape, optional, ragged, labels in rows:
            table[name] = TensorSpec(
                name=name, datatype=datatypes.from_name(dtype), dims=tuple(dims),  # type: ignore[arg-type]
                reshape=tuple(reshape) if reshape is not None else None, optional=optional,
                allow_ragged_batch=ragged, labels=tuple(labels),
            )
        return table

    return ModelIO(max_batch_size=value[0], inputs=specs(value[1]), outputs=specs(value[2]))


def request_frame(request_id: int, request: Any, generation: int, target: tuple[str, str | None]) -> list[Any]:
    """An INFER frame for a decoded ``InferRequest`` of the model snapshot ``generation``."""
    entries, blobs = tensor_parts(request.inputs)
    header = {
        "g": generation,
        "m": target,
        "i": entries,
        "o": request.requested_outputs,
        "id": request.id,
        "p": request.parameters,
        "f": request.flags,
        "c": request.correlation_id,
        "pr": request.priority,
        "t": request.timeout_us,
        "b": request.batch_size,
        "a": request.arrival_ns,
        "tp": request.trace_parent,
    }
    return frame(Kind.INFER, request_id, header, blobs)


def result_frame(request_id: int, response: Any) -> list[Any]:
    """A RESULT frame for an ``InferResponse``; an ``InferError`` becomes ``{"e", "c"}``."""
    outputs = getattr(response, "outputs", None)
    if outputs is None:  # an InferError
        return error_frame(Kind.RESULT, request_id, response)
    entries, blobs = tensor_parts(outputs)
    return frame(Kind.RESULT, request_id, {"o": entries, "p": response.parameters}, blobs)


def error_frame(kind: Kind, request_id: int, error: Any) -> list[Any]:
    """A frame carrying an ``InferError``'s message and code."""
    return frame(kind, request_id, {"e": error.message, "c": error.code.value})
