"""BF16 tensors through DLPack, which numpy cannot export or import (it has no bfloat16).

``export`` makes a DLPack capsule (``"dltensor"``, DLPack's ``kDLBfloat`` 16-bit type) over
an ``ml_dtypes.bfloat16`` array without copying it; ``import_capsule`` views the memory of a
BF16 capsule (e.g. from ``torch.utils.dlpack.to_dlpack``) as such an array, and calls the
producer's deleter once that array is gone. Both follow the DLPack capsule rules: a consumer
renames the capsule ``"used_dltensor"``, and a capsule dropped unconsumed frees its tensor.
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref
from typing import Any

import ml_dtypes
import numpy as np

_CPU = 1
_BFLOAT = 4  # kDLBfloat
_NAME = b"dltensor"
_USED = b"used_dltensor"


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Managed(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]

_exported: dict[int, tuple[Any, ...]] = {}
"""Managed tensors handed out and not deleted yet, by address: what keeps each one alive."""
_exported_lock = threading.Lock()


@_Deleter
def _delete_exported(managed: Any) -> None:
    with _exported_lock:
        _exported.pop(ctypes.addressof(managed.contents), None)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _drop_capsule(capsule: int) -> None:
    """A capsule is freed: if no consumer took its tensor, free the tensor (DLPack's rule).
    (Never hand such a capsule to numpy: it frees a capsule it refuses with its error set,
    which this Python-level destructor cannot run under.)"""
    try:
        if _api.PyCapsule_IsValid(capsule, _NAME):
            managed = _Managed.from_address(_api.PyCapsule_GetPointer(capsule, _NAME))
            if managed.deleter:
                managed.deleter(ctypes.pointer(managed))
    except Exception:  # noqa: BLE001 - a destructor must not raise; the tensor stays held
        pass


def is_bf16(array: np.ndarray) -> bool:
    return array.dtype == ml_dtypes.bfloat16


def export(array: np.ndarray) -> Any:
    """A DLPack capsule sharing the memory of the C-contiguous bfloat16 ``array``."""
    assert is_bf16(array) and array.flags.c_contiguous
    shape = (ctypes.c_int64 * max(array.ndim, 1))(*array.shape)
    managed = _Managed()
    managed.dl_tensor.data = array.ctypes.data
    managed.dl_tensor.device = _Device(_CPU, 0)
    managed.dl_tensor.ndim = array.ndim
    managed.dl_tensor.dtype = _DataType(_BFLOAT, 16, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = None  # C-contiguous
    managed.dl_tensor.byte_offset = 0
    managed.deleter = _delete_exported
    address = ctypes.addressof(managed)
    with _exported_lock:
        _exported[address] = (managed, shape, array)
    return _api.PyCapsule_New(address, _NAME, ctypes.cast(_drop_capsule, ctypes.c_void_p))


def import_capsule(capsule: Any) -> np.ndarray | None:
    """The bfloat16 array a host BF16 ``"dltensor"`` capsule holds, sharing its memory (the
    capsule is consumed); None for a capsule of any other type (left untouched).

    :raises ValueError: a BF16 capsule that is not in host memory or not C-contiguous.
    """
    handle = ctypes.c_void_p(id(capsule))
    if not _api.PyCapsule_IsValid(handle, _NAME):
        return None
    managed = _Managed.from_address(_api.PyCapsule_GetPointer(handle, _NAME))
    tensor = managed.dl_tensor
    if (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes) != (_BFLOAT, 16, 1):
        return None
    if tensor.device.device_type != _CPU:
        raise ValueError("only host (CPU) DLPack tensors are supported")
    shape = tuple(int(tensor.shape[i]) for i in range(tensor.ndim))
    if tensor.strides:
        expected = 1
        for axis in reversed(range(tensor.ndim)):
            if shape[axis] > 1 and int(tensor.strides[axis]) != expected:
                raise ValueError("DLPack tensors must be C-contiguous")
            expected *= shape[axis]
    count = math.prod(shape)
    memory = (ctypes.c_uint16 * count).from_address((tensor.data or 0) + tensor.byte_offset) if count else None
    _api.PyCapsule_SetName(capsule, _USED)
    address = ctypes.addressof(managed)
    if memory is None:
        _delete_imported(address)
        return np.zeros(shape, dtype=ml_dtypes.bfloat16)
    weakref.finalize(memory, _delete_imported, address)  # the array below keeps ``memory`` alive
    return np.frombuffer(memoryview(memory), dtype=np.uint16).reshape(shape).view(ml_dtypes.bfloat16)


def _delete_imported(address: int) -> None:
    managed = _Managed.from_address(address)
    if managed.deleter:
        managed.deleter(ctypes.pointer(managed))
