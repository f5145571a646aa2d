"""``pb_utils.Tensor`` and the datatype helpers Triton's Python backend offers.

Tensors live in host memory as numpy arrays; creating one from a numpy array, handing an
input to ``as_numpy`` and exchanging through DLPack never copy, except that a read-only
array the server handed over (request inputs may be read-only views of received bytes, or
arrays another consumer also sees) is copied once, when the model first asks for it, so that
model code may write into its inputs as it can in Triton.

What the backend hands to another model (BLS inputs) goes through ``server_array``: a
read-only view (no copy), so that whoever receives it copies before writing, and BYTES
elements as ``bytes``, as Triton's serialisation leaves them; a BLS caller receives read-only
views. A response's outputs go through ``owned_output`` when the model hands the response over:
the memory is the server's from then on, copied unless nothing of the model can still write it.
"""

from __future__ import annotations

import struct
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from pyserve.api import datatypes
from pyserve.api.inference import read_only
from pyserve_backend_python import dlpack_bf16
from pyserve_backend_python.errors import TritonModelException

_DLPACK_CPU = 1  # kDLCPU

TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
    "TYPE_BF16": ml_dtypes.bfloat16,  # pyserve extension: Triton has no numpy BF16
}
"""Config ``data_type`` name → numpy type, as Triton's ``TRITON_STRING_TO_NUMPY``."""

_TRITON_NUMBER: dict[str, int] = {
    "BOOL": 1, "UINT8": 2, "UINT16": 3, "UINT32": 4, "UINT64": 5, "INT8": 6, "INT16": 7,
    "INT32": 8, "INT64": 9, "FP16": 10, "FP32": 11, "FP64": 12, "BYTES": 13, "BF16": 14,
}
_NUMBER_TO_NAME = {number: name for name, number in _TRITON_NUMBER.items()}


def triton_string_to_numpy(triton_type_string: str) -> Any:
    """The numpy type of a config ``data_type`` name (``"TYPE_FP32"`` → ``np.float32``).

    :raises KeyError: an unknown name.
    """
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int) -> Any:
    """The numpy type of a ``TRITONSERVER_DataType`` number, or None if it has none."""
    name = _NUMBER_TO_NAME.get(int(data_type))
    if name is None:
        return None
    if name == "BYTES":
        return np.object_
    if name == "BOOL":
        return np.bool_
    return datatypes.BY_NAME[name].dtype.type


def numpy_to_triton_type(data_type: Any) -> int | None:
    """The ``TRITONSERVER_DataType`` number of a numpy dtype (object/bytes → BYTES), or None."""
    try:
        dtype = np.dtype(data_type)
    except TypeError:
        return None
    found = datatypes.from_numpy(dtype)
    return _TRITON_NUMBER[found.name] if found is not None else None


def bytes_element(item: Any) -> bytes:
    """One BYTES element as Triton serialises it: ``bytes`` as they are, ``str`` as UTF-8, and
    anything else as the UTF-8 of ``str(item)`` (the int 12 becomes ``b"12"``)."""
    if isinstance(item, bytes):
        return item
    return (item if isinstance(item, str) else str(item)).encode("utf-8")


def serialize_byte_tensor(input_tensor: np.ndarray) -> bytes | tuple[()]:
    """Pack a BYTES tensor as Triton does: each element (see ``bytes_element``) as a 4-byte
    little-endian length and its bytes, in C order. Returns the packed ``bytes``, or ``()``
    for an empty tensor, as Triton's ``pb_utils`` does.

    :raises TritonModelException: the array is neither an object nor a bytes array.
    """
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.kind != "S":
        raise TritonModelException("cannot serialize bytes tensor: invalid datatype")
    parts: list[bytes] = []
    pack = struct.pack
    for item in np.asarray(input_tensor).reshape(-1, order="C"):
        element = bytes_element(item)
        parts.append(pack("<I", len(element)))
        parts.append(element)
    return b"".join(parts)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray:
    """Unpack length-prefixed elements (see ``serialize_byte_tensor``) into a 1-D object array."""
    data = bytes(encoded_tensor)
    items: list[bytes] = []
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack_from("<I", data, offset)
        offset += 4
        items.append(data[offset:offset + length])
        offset += length
    array = np.empty(len(items), dtype=np.object_)
    array[:] = items
    return array


def _bytes_elements(array: np.ndarray) -> np.ndarray:
    """An object array as one whose elements are all ``bytes`` (see ``bytes_element``): the
    array itself when they already are, else a new array (the given one is left alone)."""
    for item in array.flat:
        if type(item) is not bytes:
            break
    else:
        return array
    out = np.empty(array.shape, dtype=np.object_)
    flat = out.reshape(-1)
    for index, item in enumerate(array.flat):
        flat[index] = bytes_element(item)
    return out


def output_array(array: np.ndarray) -> np.ndarray:
    """``array`` with BYTES elements as ``bytes`` (no copy of any other array)."""
    return _bytes_elements(array) if array.dtype == np.object_ else array


COPIED_UP_TO = 64 * 1024
"""Outputs of at most this many bytes are copied outright by ``owned_output``: cheaper than
finding out whether the model still holds them."""


def owned_output(tensors: list[Tensor], index: int, received: Sequence[Tensor] = ()) -> np.ndarray:
    """The array of ``tensors[index]`` (an output of a response the model hands over: execute
    returned it, or a response sender sends it) as memory the model can no longer change, which
    Triton guarantees by copying every output at that moment. A model may keep a buffer and
    fill it again for its next request (``self.out[:] = ...``) while the server still encodes
    or sends the last answer from it.

    No copy when nothing of the model reaches the memory: the tensor and every array, buffer
    view and ``bytearray`` under it are held once, by the one above (so by nothing the model
    keeps), none is weakly referenced, and the memory under them is a numpy array or
    immutable ``bytes``; or it is the memory of one of the request's own inputs
    (``received``, the tensors ``execute`` got). Otherwise (and for outputs of at most
    ``COPIED_UP_TO`` bytes) a C-contiguous copy. BYTES elements become ``bytes``
    (``output_array``). Call it with no other reference to the tensor or its array in hand:
    the caller's own references would count as the model's.
    """
    array = tensors[index]._array
    if array.dtype == np.object_:
        converted = _bytes_elements(array)
        if converted is not array:
            return converted  # a new array that nothing else holds
        del converted
    if array.nbytes <= COPIED_UP_TO:
        return array.copy()
    del array  # not counted as a holder below
    most, memory = _holders(tensors, index)
    array = tensors[index]._array
    if most <= _HELD_ONCE or any(memory is _memory_under(tensor._array) for tensor in received):
        return array
    return array.copy()


_UNSHARED = 1 << 30  # what ``_holders`` reports for a chain it cannot prove private


def _holders(tensors: list[Tensor], index: int) -> tuple[int, Any]:
    """Walk from ``tensors[index]`` down to the memory under its array: the tensor, its array,
    the arrays, memoryviews and ``bytearray`` that array is a view of. Returns the largest
    reference count met (``_HELD_ONCE`` when each is held by the one above alone; ``_UNSHARED``
    when one is weakly referenced or the memory is of a kind whose other holders cannot be
    counted, such as a DLPack capsule or an ``mmap``) and the object that holds the memory."""
    link: Any = tensors[index]
    most = sys.getrefcount(link)
    link = link._array
    while True:
        if type(link) is bytes:  # immutable: however many hold it, nobody writes it
            return most, link
        most = max(most, sys.getrefcount(link))
        if weakref.getweakrefcount(link):
            return _UNSHARED, link
        if isinstance(link, np.ndarray):
            if link.base is None:
                return most, link
            link = link.base
        elif isinstance(link, memoryview):
            link = link.obj
        elif type(link) is bytearray:
            return most, link
        else:
            return _UNSHARED, link


def _memory_under(array: Any) -> Any:
    """The object that holds the memory of ``array`` (the end of ``_holders``' walk)."""
    link = array
    while True:
        if isinstance(link, np.ndarray) and link.base is not None:
            link = link.base
        elif isinstance(link, memoryview):
            link = link.obj
        else:
            return link


def _held_once_count() -> int:
    """The reference count ``_holders`` sees on a link held by the one above alone, measured
    on a chain made for it (the interpreter's own references differ between versions)."""
    chain = [Tensor._wrap("", np.frombuffer(bytearray(16), np.uint8)[1:])]
    return _holders(chain, 0)[0]


def server_array(array: np.ndarray) -> np.ndarray:
    """``array`` as the backend hands it to another model (a BLS input, a BLS answer): a
    read-only view of it (``pyserve.api.inference.read_only``, no copy), so that the receiver copies
    before writing instead of changing the sender's array; an object (BYTES) array whose
    elements are not all ``bytes`` is first converted into a new array of ``bytes`` (see
    ``bytes_element``)."""
    return read_only(output_array(array))


def _as_object_bytes(array: np.ndarray) -> np.ndarray:
    """A str/bytes array of fixed width as an object array of ``bytes``."""
    out = np.empty(array.shape, dtype=np.object_)
    flat = out.reshape(-1)
    for index, item in enumerate(array.reshape(-1)):
        flat[index] = item.encode("utf-8") if isinstance(item, str) else bytes(item)
    return out


class _Capsule:
    """Gives a bare DLPack capsule the ``__dlpack__`` protocol numpy's importer expects."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, stream: Any = None) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_DLPACK_CPU, 0)


class Tensor:
    """A named tensor in host memory (Triton's ``pb_utils.Tensor``).

    Callers may rely on: ``Tensor(name, array)`` keeping the array without a copy
    (fixed-width str/bytes arrays become object arrays of ``bytes``, as Triton's BYTES
    tensors are), the server taking an output's values when its response is handed over
    (``owned_output``); ``as_numpy()`` returning that array; ``as_numpy()`` of a tensor pyserve
    hands the model (request inputs, BLS outputs) being writeable, as in Triton, and writes
    into it never reaching anyone else; ``is_cpu()`` always being True here;
    and DLPack export/import working with numpy and PyTorch (CPU tensors; GPU tensors are
    copied to the host on import). BF16 tensors are ``ml_dtypes.bfloat16`` numpy arrays.
    """

    __slots__ = ("_array", "_name", "_received")

    def __init__(self, name: str, tensor: Any) -> None:
        if not isinstance(name, str):
            raise TypeError(f"tensor name must be a str, got {type(name).__name__}")
        if tensor is None:
            raise TypeError(f"tensor '{name}': the data must be a numpy array, got None")
        array = tensor if isinstance(tensor, np.ndarray) else np.asarray(tensor)
        if array.dtype.kind in "SU":
            array = _as_object_bytes(array)
        if datatypes.from_numpy(array.dtype) is None:
            raise TritonModelException(f"tensor '{name}': unsupported numpy dtype {array.dtype}")
        self._name = name
        self._array = array
        self._received = False

    @classmethod
    def _wrap(cls, name: str, array: np.ndarray) -> Tensor:
        """A tensor around an array the server already validated and handed to the model (no
        checks, no copy; a read-only array is copied when the model first asks for it)."""
        tensor = cls.__new__(cls)
        tensor._name = name
        tensor._array = array
        tensor._received = True
        return tensor

    def name(self) -> str:
        """The tensor's name."""
        return self._name

    def as_numpy(self) -> np.ndarray:
        """The tensor as a numpy array: the array itself, not a copy, except for a read-only
        array the server handed over, which is copied on the first call so that the model may
        write into it (every later call returns that same copy).

        :raises TritonModelException: a BF16 tensor, as in Triton (use ``to_dlpack()``).
        """
        array = self._array
        if array.dtype == ml_dtypes.bfloat16:
            raise TritonModelException(
                "Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() and from_dlpack() instead."
            )
        if self._received and not array.flags.writeable:
            array = self._array = array.copy()
        return array

    def shape(self) -> list[int]:
        """The tensor's dims."""
        return [int(d) for d in self._array.shape]

    def triton_dtype(self) -> int:
        """The ``TRITONSERVER_DataType`` number (e.g. 11 for FP32, 13 for BYTES)."""
        number = numpy_to_triton_type(self._array.dtype)
        assert number is not None
        return number

    def is_cpu(self) -> bool:
        """Whether the tensor is in host memory (always, in pyserve)."""
        return True

    def to_dlpack(self) -> Any:
        """A DLPack capsule of the tensor (host memory; not for BYTES tensors)."""
        return self.__dlpack__()

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        if self._array.dtype == np.object_:
            raise TritonModelException(f"tensor '{self._name}': BYTES tensors cannot be exported through DLPack")
        if not self._array.flags.writeable or not self._array.flags.c_contiguous:
            self._array = np.ascontiguousarray(self._array).copy()
        if dlpack_bf16.is_bf16(self._array):  # numpy cannot export bfloat16
            return dlpack_bf16.export(self._array)
        try:
            return self._array.__dlpack__(stream=stream, **kwargs)
        except TypeError:  # an older numpy without the versioned protocol keywords
            return self._array.__dlpack__(stream=stream)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_DLPACK_CPU, 0)

    @staticmethod
    def from_dlpack(name: str, dlpack: Any) -> Tensor:
        """A tensor sharing memory with a DLPack producer (an object with ``__dlpack__``,
        e.g. a numpy array or a torch tensor, or a DLPack capsule).

        :raises TritonModelException: the producer cannot be imported (unsupported dtype,
            non-contiguous data).
        """
        if not hasattr(dlpack, "__dlpack__"):
            try:
                bf16 = dlpack_bf16.import_capsule(dlpack)
            except ValueError as exc:
                raise TritonModelException(f"tensor '{name}': cannot import DLPack data: {exc}") from exc
            if bf16 is not None:
                return Tensor(name, bf16)
            dlpack = _Capsule(dlpack)
        elif hasattr(dlpack, "__dlpack_device__") and dlpack.__dlpack_device__()[0] != _DLPACK_CPU:
            to_host = getattr(dlpack, "cpu", None)  # torch tensors; other frameworks: copy first
            if to_host is None:
                raise TritonModelException(f"tensor '{name}': only host (CPU) DLPack tensors are supported")
            dlpack = to_host()
        array = _import_torch_bf16(dlpack)
        if array is None and isinstance(dlpack, Tensor) and dlpack_bf16.is_bf16(dlpack._array):
            array = dlpack._array  # numpy would refuse the capsule: share the array itself
        if array is None:
            try:
                array = np.from_dlpack(dlpack)
            except (BufferError, TypeError, ValueError, RuntimeError) as exc:
                array = _import_bf16_producer(dlpack)  # numpy has no bfloat16
                if array is None:
                    raise TritonModelException(f"tensor '{name}': cannot import DLPack data: {exc}") from exc
        if not array.flags.c_contiguous:
            raise TritonModelException(f"tensor '{name}': DLPack tensors must be C-contiguous")
        return Tensor(name, array)

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={self.shape()}, dtype={self._array.dtype})"


def _import_bf16_producer(producer: Any) -> np.ndarray | None:
    """The array of a DLPack producer whose capsule holds BF16 data (None: other data)."""
    try:
        return dlpack_bf16.import_capsule(producer.__dlpack__())
    except (BufferError, TypeError, ValueError, RuntimeError):
        return None


def _import_torch_bf16(obj: Any) -> np.ndarray | None:
    """numpy cannot import bfloat16 through DLPack; a torch bfloat16 tensor is viewed as int16."""
    dtype = getattr(obj, "dtype", None)
    if type(obj).__module__.startswith("torch") and str(dtype) == "torch.bfloat16":
        import torch

        return np.from_dlpack(obj.contiguous().view(torch.int16)).view(ml_dtypes.bfloat16)
    return None


_HELD_ONCE = _held_once_count()
