"""Shared-memory segments and the tensor layout the server and a worker process exchange.

Used by both ends of ``execution_mode: "process"`` (``pyserve_backend_python.process`` in the
server, ``pyserve_backend_python.worker`` in the worker). Segments are untracked: whoever is
done with a name unlinks it explicitly (``unlink``). A *layout* describes tensors placed in one
segment: one ``LayoutEntry`` per tensor, ``(name, dtype, shape, offset)`` for fixed-size
tensors (offsets 64-byte aligned) and ``(name, "BYTES", shape, serialized bytes)`` for BYTES
tensors, which travel with the layout rather than in the segment.
"""

from __future__ import annotations

import _posixshmem  # CPython's POSIX shared-memory primitives (as multiprocessing.shared_memory)
import mmap
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pyserve.dataplane.shared_memory import forget_server_segment, note_server_segment

SHM_PREFIX = "pyserve_py_"
"""Prefix of every shared-memory segment name this backend creates."""

LayoutEntry = tuple[str, Any, tuple[int, ...], Any]
"""``(name, numpy dtype, shape, offset in the segment)``, or ``(name, "BYTES", shape, bytes)``."""

Shared = tuple[str, int, list[LayoutEntry]]
"""``share_arrays``' result: ``(segment name or "", segment size, layout)``."""

_SHM_DIR = "/dev/shm"
_BYTES = "BYTES"
_noted: dict[str, tuple[int, int]] = {}  # segments of this process that no client may register


def create_segment(name: str, size: int) -> mmap.mmap:
    """A new segment ``name`` of ``size`` bytes, mapped (fails if the name exists)."""
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        _noted[name] = note_server_segment(fd)
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def open_segment(name: str, size: int) -> mmap.mmap:
    """The existing segment ``name``, mapped (its first ``size`` bytes)."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0o600)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    """Remove the name ``name`` (mappings live on); no error if it is gone already."""
    noted = _noted.pop(name, None)
    if noted is not None:
        forget_server_segment(noted)
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


def unlink_prefix(prefix: str) -> None:
    """Unlink leftover segments whose names start with ``prefix`` (a worker that died mid-batch)."""
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix):
            unlink(name)


def _align(n: int) -> int:
    return (n + 63) & ~63


def pack(arrays: Sequence[tuple[str, np.ndarray]], segment: mmap.mmap | None, base: int = 0) -> list[LayoutEntry]:
    """Layout entries for ``arrays``; fixed-size ones are copied into ``segment`` at offsets
    from ``base`` on (``fixed_size(arrays)`` bytes from there)."""
    from pyserve_backend_python.tensor import serialize_byte_tensor

    entries: list[LayoutEntry] = []
    offset = base
    for name, array in arrays:
        if array.dtype == np.object_:
            packed = serialize_byte_tensor(array)  # bytes, or () for an empty tensor
            entries.append((name, _BYTES, array.shape, packed or b""))
            continue
        array = np.ascontiguousarray(array)
        nbytes = array.nbytes
        if segment is not None and nbytes:
            np.frombuffer(segment, np.uint8, nbytes, offset)[:] = array.reshape(-1).view(np.uint8)
        entries.append((name, array.dtype, array.shape, offset))
        offset = _align(offset + nbytes)
    return entries


def fixed_size(arrays: Sequence[tuple[str, np.ndarray]]) -> int:
    """The segment bytes ``pack`` needs for ``arrays`` (BYTES tensors take none)."""
    return sum(_align(a.nbytes) for _, a in arrays if a.dtype != np.object_)


def unpack(entries: Sequence[LayoutEntry], segment: mmap.mmap | None, writeable: bool) -> dict[str, np.ndarray]:
    """The arrays of a layout: views of ``segment`` (read-only unless ``writeable``) for
    fixed-size tensors, new arrays for BYTES and empty ones."""
    from pyserve_backend_python.tensor import deserialize_bytes_tensor

    out: dict[str, np.ndarray] = {}
    for name, dtype, shape, where in entries:
        if isinstance(dtype, str) and dtype == _BYTES:
            out[name] = deserialize_bytes_tensor(where).reshape(shape)
            continue
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0 or segment is None:
            array = np.empty(shape, dtype)
        else:
            array = np.frombuffer(segment, dtype, count, where).reshape(shape)
            if not writeable:
                array.flags.writeable = False
        out[name] = array
    return out


def share_arrays(arrays: Mapping[str, np.ndarray], name: str) -> Shared:
    """Copy ``arrays`` once into a new segment ``name`` (none when they hold no fixed-size bytes)
    for the other process: ``(segment name or "", size, entries)``, what ``take_arrays`` takes."""
    items = [(n, np.asarray(a)) for n, a in arrays.items()]
    size = fixed_size(items)
    segment = create_segment(name, size) if size else None
    try:
        entries = pack(items, segment)
    finally:
        if segment is not None:
            segment.close()
    return (name if segment is not None else ""), size, entries


def take_arrays(shared: Shared) -> dict[str, np.ndarray]:
    """The arrays ``share_arrays`` wrote, as views of its segment; the segment's name is
    unlinked at once (the mapping lives on while the arrays do)."""
    name, size, entries = shared
    segment = None
    if name:
        segment = open_segment(name, size)
        unlink(name)
    return unpack(entries, segment, True)
