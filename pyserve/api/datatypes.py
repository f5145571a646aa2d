"""Tensor datatypes: KServe/Triton names, ModelConfig enum names, numpy dtypes and sizes.

BYTES tensors are numpy ``object`` arrays whose elements are ``bytes``. BF16 uses the
``ml_dtypes.bfloat16`` numpy dtype, so a BF16 tensor is an ordinary numpy array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np


@dataclass(frozen=True, slots=True)
class DataType:
    """One tensor datatype.

    :ivar name: the protocol name (``"FP32"``, ``"BYTES"``).
    :ivar config_name: the ModelConfig enum name (``"TYPE_FP32"``, ``"TYPE_STRING"``).
    :ivar dtype: the numpy dtype (``object`` for BYTES).
    :ivar itemsize: bytes per element on the wire; 0 for BYTES (length-prefixed elements).
    """

    name: str
    config_name: str
    dtype: np.dtype
    itemsize: int

    @property
    def is_bytes(self) -> bool:
        return self.itemsize == 0


def _dt(name: str, config_name: str, dtype: Any) -> DataType:
    np_dtype = np.dtype(dtype)
    itemsize = 0 if np_dtype == np.dtype(object) else np_dtype.itemsize
    return DataType(name, config_name, np_dtype.newbyteorder("<") if itemsize > 1 else np_dtype, itemsize)


_ALL = (
    _dt("BOOL", "TYPE_BOOL", np.bool_),
    _dt("UINT8", "TYPE_UINT8", np.uint8),
    _dt("UINT16", "TYPE_UINT16", np.uint16),
    _dt("UINT32", "TYPE_UINT32", np.uint32),
    _dt("UINT64", "TYPE_UINT64", np.uint64),
    _dt("INT8", "TYPE_INT8", np.int8),
    _dt("INT16", "TYPE_INT16", np.int16),
    _dt("INT32", "TYPE_INT32", np.int32),
    _dt("INT64", "TYPE_INT64", np.int64),
    _dt("FP16", "TYPE_FP16", np.float16),
    _dt("FP32", "TYPE_FP32", np.float32),
    _dt("FP64", "TYPE_FP64", np.float64),
    _dt("BYTES", "TYPE_STRING", object),
    _dt("BF16", "TYPE_BF16", ml_dtypes.bfloat16),
)

BY_NAME: dict[str, DataType] = {d.name: d for d in _ALL}
"""Protocol name (``"FP32"``) → DataType."""

BY_CONFIG_NAME: dict[str, DataType] = {d.config_name: d for d in _ALL}
"""ModelConfig enum name (``"TYPE_FP32"``) → DataType."""

_BY_NUMPY: dict[np.dtype, DataType] = {}
for _d in _ALL:
    _BY_NUMPY[_d.dtype] = _d
    _BY_NUMPY[_d.dtype.newbyteorder("=")] = _d
_BY_NUMPY[np.dtype(np.str_)] = BY_NAME["BYTES"]
_BY_NUMPY[np.dtype(np.bytes_)] = BY_NAME["BYTES"]


def from_name(name: str) -> DataType | None:
    """The DataType for a protocol name, or None if the name is not a datatype."""
    return BY_NAME.get(name)


def from_config_name(config_name: str) -> DataType | None:
    """The DataType for a ModelConfig enum name, or None (``TYPE_INVALID`` included)."""
    return BY_CONFIG_NAME.get(config_name)


def from_numpy(dtype: np.dtype) -> DataType | None:
    """The DataType of a numpy dtype; str/bytes arrays of any width map to BYTES."""
    found = _BY_NUMPY.get(dtype)
    if found is None and dtype.kind in "SU":
        return BY_NAME["BYTES"]
    return found


def of_output(array: np.ndarray, declared: DataType | None) -> DataType | None:
    """The datatype an output array is sent as: the declared one when the array holds it, else
    the array's own, as Triton sends what a model produced (None: numpy's dtype has no datatype).

    Cheap on the hot path: one dtype comparison when the model produced what its config says.
    """
    if declared is not None and (array.dtype == declared.dtype or (declared.is_bytes and array.dtype.kind in "OSU")):
        return declared
    return from_numpy(array.dtype)
