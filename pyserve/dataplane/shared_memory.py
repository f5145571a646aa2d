"""Triton's shared-memory extensions: client-registered regions that tensors are read from
and written to in place.

A client creates a POSIX shared-memory object (``/dev/shm/<key>``), registers a window of it
under a region name, then names that region in an input's or output's
``shared_memory_region`` / ``shared_memory_offset`` / ``shared_memory_byte_size``
parameters. Inputs become numpy views on the mapping (no copy); outputs are written into it
and the response carries no data for them.

Each server owns one ``SharedMemoryManager``. System and CUDA regions share one name space,
as in Triton. Only objects a client registered are ever mapped, and every offset and size is
checked against the registered window before any byte is touched.

What a client may register (the server must not become a confused deputy that reads or writes
memory it can open but the client was never given): a regular file directly in ``/dev/shm``
(no link, no sub-directory) that was made to be shared with the server, which the server
recognizes as an object that is *not* one of these:

* an object this server process created for itself (``note_server_segment``: the Python
  backend's input arenas), recognized by its inode, so a link or rename does not hide it;
* an object whose name starts with a prefix in ``RESERVED_PREFIXES``: pyserve's own segments
  (those of any pyserve server on the host), POSIX named semaphores, Python ``multiprocessing``
  and PyTorch shared tensors, OpenMP's registration objects.

Registering such an object answers 400 naming the rule. At most ``MAX_REGIONS`` regions may be
registered at once. The descriptor opened to map an object is closed once it is mapped; the one
the mapping itself keeps (Python's ``mmap`` holds it for ``size()``) is what later checks the
object's size, so each region holds exactly one descriptor.

A client may shrink (``ftruncate``) its object after registering it; touching a mapped page
past the object's new end would kill the server with SIGBUS. So every use of a system region
(each input read and each output write) first ``fstat``s the object and refuses, with the same
INVALID_ARG as an out-of-range offset, a window the object no longer covers. What remains is a
race the server cannot close without copying: a client that shrinks its object *after* that
check (while a request waits in a queue or runs, since inputs are views read by the backend,
or during an output copy) can still crash it. Only a client that can register regions, which is
a local process sharing ``/dev/shm`` with the server, can do this, as with Triton.

Lifetime: a region is in use from when a request naming it is submitted until that request
is finished (its outputs written); unregistering it meanwhile fails, as in Triton 2.51 ("Cannot
unregister shared memory region 'x', it is currently in use."). Numpy views of inputs keep the
mapping's buffer alive, so the mapping is unmapped only when the last of them goes.
"""

from __future__ import annotations

import abc
import base64
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyserve.api.errors import ErrorCode, InferError

SHM_DIRECTORY = "/dev/shm"
"""Where POSIX shared-memory objects live (``shm_open`` names) on Linux."""
CLIENT_SHM_DISABLED = "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable."
"""Triton's answer to a shared-memory registration while client shared memory is off."""

RESERVED_PREFIXES = ("pyserve_py_", "sem.", "psm_", "torch_", "__KMP_REGISTERED_LIB")
"""Names of objects a client may not register: other programs' and pyserve's own memory."""
MAX_REGIONS = 4096
"""Regions (system and CUDA) that may be registered at once."""

_server_segments: set[tuple[int, int]] = set()
_server_segments_lock = threading.Lock()


def note_server_segment(fd: int) -> tuple[int, int]:
    """Record a shared-memory object this process created for itself (by device and inode), so
    that no client can register it; returns the key to pass to ``forget_server_segment``."""
    info = os.fstat(fd)
    key = (info.st_dev, info.st_ino)
    with _server_segments_lock:
        _server_segments.add(key)
    return key


def forget_server_segment(key: tuple[int, int]) -> None:
    """The object noted under ``key`` was released (its inode may be reused)."""
    with _server_segments_lock:
        _server_segments.discard(key)


def _invalid_key(key: str) -> bool:
    name = key.removeprefix("/")
    return not name or "/" in name or name in (".", "..") or "\0" in name


class Region(abc.ABC):
    """One registered region: a window ``[offset, offset + byte_size)`` of a mapping.

    Subclasses implement ``read``/``write``; ``status`` is the region's status entry.
    """

    kind = "system"

    def __init__(self, name: str, byte_size: int) -> None:
        self.name = name
        self.byte_size = byte_size
        self.users = 0  # requests using it now (SharedMemoryManager.hold / let_go, under its lock)

    def check_window(self, offset: int, byte_size: int, what: str) -> None:
        """Refuse an ``offset``/``byte_size`` pair that leaves the region, in Triton's words
        ("Invalid offset for shared memory region: 'r'", "Invalid offset + byte size for shared
        memory region: 'r'"), then the numbers.

        :raises InferError: INVALID_ARG naming the region and ``what`` (the tensor).
        """
        if offset < 0 or byte_size < 0 or offset + byte_size > self.byte_size:
            which = "offset" if offset < 0 or (offset > 0 and offset >= self.byte_size) else "offset + byte size"
            raise InferError.invalid(
                f"Invalid {which} for shared memory region: '{self.name}' ({what}: offset {offset} and "
                f"byte size {byte_size}; the region holds {self.byte_size} byte(s))"
            )

    def check_backing(self, offset: int, byte_size: int, what: str) -> None:
        """Refuse a window (already inside the region) whose memory is no longer there.

        The base class has nothing to check; ``SystemRegion`` checks its object's current size.

        :raises InferError: INVALID_ARG naming ``what`` and the region.
        """
        return

    @abc.abstractmethod
    def read(self, offset: int, byte_size: int) -> memoryview | bytes:
        """The bytes of ``[offset, offset + byte_size)`` (a view where possible)."""

    @abc.abstractmethod
    def write(self, offset: int, data: memoryview | bytes) -> None:
        """Copy ``data`` into the region at ``offset``."""

    @abc.abstractmethod
    def status(self) -> dict[str, Any]:
        """The region's entry in the status answer."""


class SystemRegion(Region):
    """A window of a POSIX shared-memory object, mapped read-write.

    The descriptor opened here is closed once the object is mapped; ``check_backing`` asks the
    mapping for the size of the very object that is mapped (not whatever the key names now).
    """

    _map: mmap.mmap | None = None

    def __init__(self, name: str, key: str, offset: int, byte_size: int) -> None:
        super().__init__(name, byte_size)
        self.key = key
        self.offset = offset
        path = os.path.join(SHM_DIRECTORY, key.removeprefix("/"))
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise InferError.invalid(
                f"Unable to open shared memory region: '{key}': {exc.strerror or exc}"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InferError.invalid(f"shared memory key '{key}' does not name a shared memory object")
            with _server_segments_lock:
                owned = (info.st_dev, info.st_ino) in _server_segments
            if owned:
                raise InferError.invalid(
                    f"shared memory key '{key}' names memory of the server itself; register an object "
                    "created for sharing with the server"
                )
            if offset + byte_size > info.st_size:
                raise InferError.invalid(
                    f"failed to register shared memory region '{name}': invalid args (offset {offset} plus "
                    f"byte size {byte_size} exceeds the {info.st_size} byte(s) of shared memory object '{key}')"
                )
            if offset + byte_size == 0:
                self._view = memoryview(b"")
            else:
                # map from 0: mmap offsets must be page aligned, region offsets need not be
                self._map = mmap.mmap(fd, offset + byte_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                self._view = memoryview(self._map)[offset : offset + byte_size]
        finally:
            os.close(fd)  # the mapping keeps its own

    def check_backing(self, offset: int, byte_size: int, what: str) -> None:
        """Refuse ``[offset, offset + byte_size)`` when the object was shrunk below its end.

        One ``fstat`` per call. A shrink after this check is not caught (see the module docstring).
        """
        if byte_size == 0 or self._map is None:
            return
        end = self.offset + offset + byte_size
        size = self._map.size()  # fstat of the mapping's own descriptor
        if end > size:
            raise InferError.invalid(
                f"{what}: shared memory offset {offset} and byte size {byte_size} of region '{self.name}' "
                f"exceed the {size} byte(s) that shared memory object '{self.key}' now holds "
                "(it was shrunk after registration)"
            )

    def read(self, offset: int, byte_size: int) -> memoryview:
        return self._view[offset : offset + byte_size]

    def write(self, offset: int, data: memoryview | bytes) -> None:
        self._view[offset : offset + len(data)] = data

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


def _cupy() -> Any:
    """The cupy module when it and a CUDA device are usable, else None."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:  # ImportError, or a CUDA runtime error without a driver/device
        return None


def cuda_available() -> bool:
    """Whether CUDA shared memory can be registered (cupy installed and a GPU present)."""
    return _cupy() is not None


CUDA_IPC_HANDLE_SIZE = 64
"""Bytes of a ``cudaIpcMemHandle_t``: what ``raw_handle`` must hold."""


class CudaRegion(Region):
    """Device memory of another process, opened from a ``cudaIpcMemHandle_t`` with cupy.

    Inputs are copied to host memory once (backends take numpy arrays: the view returned is
    of that copy); outputs are copied to the device. A CUDA error in either copy (say, a
    ``byte_size`` larger than the client's allocation) is the request's INVALID_ARG error.
    """

    kind = "cuda"

    def __init__(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        super().__init__(name, byte_size)
        cupy = _cupy()
        if cupy is None:
            raise InferError.unsupported(
                "CUDA shared memory is not available on this server (it needs cupy and a CUDA device)"
            )
        self.device_id = device_id
        self._cupy = cupy
        try:
            with cupy.cuda.Device(device_id):
                self._pointer = int(cupy.cuda.runtime.ipcOpenMemHandle(raw_handle))
        except Exception as exc:
            raise InferError.invalid(f"failed to open CUDA IPC handle for region '{name}': {exc}") from None

    def _copy(self, destination: int, source: int, size: int, direction: str) -> None:
        runtime = self._cupy.cuda.runtime
        try:
            with self._cupy.cuda.Device(self.device_id):
                runtime.memcpy(destination, source, size, getattr(runtime, direction))
        except Exception as exc:  # cupy's CUDARuntimeError: the region is not what was registered
            raise InferError.invalid(
                f"CUDA shared memory region '{self.name}': copying {size} byte(s) failed: {exc}"
            ) from None

    def read(self, offset: int, byte_size: int) -> memoryview:
        host = np.empty(byte_size, dtype=np.uint8)
        if byte_size:
            self._copy(host.ctypes.data, self._pointer + offset, byte_size, "memcpyDeviceToHost")
        return host.data

    def write(self, offset: int, data: memoryview | bytes) -> None:
        host = np.frombuffer(data, dtype=np.uint8)
        if host.size:
            self._copy(self._pointer + offset, host.ctypes.data, host.size, "memcpyHostToDevice")

    def close(self) -> None:
        try:
            with self._cupy.cuda.Device(self.device_id):
                self._cupy.cuda.runtime.ipcCloseMemHandle(self._pointer)
        except Exception:  # the handle's owner may already be gone
            pass

    def __del__(self) -> None:
        if getattr(self, "_pointer", None) is not None:
            self.close()

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}


@dataclass(slots=True)
class ShmTarget:
    """Where one output goes: a region, an offset in it and the bytes the client reserved."""

    region: Region
    offset: int
    byte_size: int


class SharedMemoryManager:
    """The regions clients registered with one server. Thread-safe."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()
        self.allow_client = True
        """``--allow-client-shm``: False refuses every registration and unregistration."""

    def _check_allowed(self) -> None:
        if not self.allow_client:
            raise InferError(CLIENT_SHM_DISABLED, ErrorCode.UNSUPPORTED)

    # -- registration ----------------------------------------------------------------------------
    def register_system(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map ``/dev/shm/<key>`` from ``offset`` for ``byte_size`` bytes under ``name``.

        :raises InferError: bad arguments, an object that cannot be opened, or the name taken;
            UNSUPPORTED with ``--allow-client-shm false``.
        """
        self._check_allowed()
        _check_name(name)
        if not isinstance(key, str) or _invalid_key(key):
            raise InferError.invalid(f"invalid shared memory key '{key}': expected a POSIX shared memory name")
        if key.removeprefix("/").startswith(RESERVED_PREFIXES):
            raise InferError.invalid(
                f"shared memory key '{key}' is reserved (names starting with {', '.join(RESERVED_PREFIXES)} "
                "belong to the server or other programs)"
            )
        _check_uint(offset, "offset")
        _check_uint(byte_size, "byte_size")
        self._refuse_taken(name)
        region = SystemRegion(name, key, offset, byte_size)
        self._add(region)

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Open a CUDA IPC memory handle under ``name``.

        The arguments are checked first (a ``raw_handle`` of other than ``CUDA_IPC_HANDLE_SIZE``
        bytes is INVALID_ARG before CUDA sees it), then whether CUDA can be used.

        :raises InferError: bad arguments; UNSUPPORTED without cupy/a GPU, or with
            ``--allow-client-shm false``; the name taken.
        """
        self._check_allowed()
        if not isinstance(name, str) or not name:  # Triton's words first, which its scripts match
            raise InferError.invalid("failed to register shared memory region: invalid args: a shared memory "
                                     "region needs a non-empty name")
        if not isinstance(raw_handle, (bytes, bytearray)) or len(raw_handle) != CUDA_IPC_HANDLE_SIZE:
            size = len(raw_handle) if isinstance(raw_handle, (bytes, bytearray)) else type(raw_handle).__name__
            raise InferError.invalid(
                f"failed to register CUDA shared memory region '{name}': invalid args: 'raw_handle' must be a "
                f"{CUDA_IPC_HANDLE_SIZE}-byte cudaIpcMemHandle_t (got {size})"
            )
        _check_uint(device_id, "device_id")
        _check_uint(byte_size, "byte_size")
        self._refuse_taken(name)
        self._add(CudaRegion(name, bytes(raw_handle), device_id, byte_size))

    def register_cuda_json(self, name: str, body: dict[str, Any]) -> None:
        """``register_cuda`` from the HTTP body ``{"raw_handle": {"b64": ...}, "device_id", "byte_size"}``."""
        self._check_allowed()
        handle = body.get("raw_handle")
        if not isinstance(handle, dict) or not isinstance(handle.get("b64"), str):
            raise InferError.invalid("'raw_handle' must be an object with a base64 'b64' string")
        try:
            raw = base64.b64decode(handle["b64"], validate=True)
        except ValueError:
            raise InferError.invalid("'raw_handle.b64' is not valid base64") from None
        self.register_cuda(name, raw, body.get("device_id", 0), body.get("byte_size"))  # type: ignore[arg-type]

    def unregister(self, name: str = "", kind: str = "system") -> None:
        """Drop region ``name`` of ``kind`` (every region of that kind when ``name`` is empty).

        Unknown names are not an error, as in Triton. A region a request is using stays.

        :raises InferError: INTERNAL, as Triton 2.51: "Cannot unregister shared memory region
            'r', it is currently in use."; for all regions, "Failed to unregister the following
            system shared memory regions: a ,b ," naming those in use (the others are gone);
            UNSUPPORTED with ``--allow-client-shm false``.
        """
        self._check_allowed()
        with self._lock:
            if name:
                region = self._regions.get(name)
                if region is not None and region.kind == kind:
                    if region.users:
                        raise InferError(
                            f"Cannot unregister shared memory region '{name}', it is currently in use.",
                            ErrorCode.INTERNAL,
                        )
                    del self._regions[name]
                return
            busy = []
            for key in sorted(k for k, r in self._regions.items() if r.kind == kind):
                if self._regions[key].users:
                    busy.append(key)
                else:
                    del self._regions[key]
        if busy:
            label = "system" if kind == "system" else "cuda"
            raise InferError(
                f"Failed to unregister the following {label} shared memory regions: "
                + "".join(f"{key} ," for key in busy),
                ErrorCode.INTERNAL,
            )

    def hold(self, regions: list[Region]) -> None:
        """Mark ``regions`` in use by one more request (``DataPlane.submit``)."""
        with self._lock:
            for region in regions:
                region.users += 1

    def let_go(self, regions: list[Region]) -> None:
        """Undo ``hold`` for a request that was released (``InferRequest.release``)."""
        with self._lock:
            for region in regions:
                region.users -= 1

    def status(self, name: str = "", kind: str = "system") -> list[dict[str, Any]]:
        """Status entries of every region of ``kind`` (by name, as Triton lists them), or of region
        ``name``.

        :raises InferError: NOT_FOUND for an unknown ``name``.
        """
        with self._lock:
            if not name:
                return [r.status() for _, r in sorted(self._regions.items()) if r.kind == kind]  # by name, as Triton
            region = self._regions.get(name)
        if region is None or region.kind != kind:
            label = "system" if kind == "system" else "cuda"
            raise InferError.not_found(f"Unable to find {label} shared memory region: '{name}'")
        return [region.status()]

    # -- use by requests -------------------------------------------------------------------------
    def region(self, name: object, what: str) -> Region:
        """The region a tensor names.

        :raises InferError: INVALID_ARG for a non-string name, NOT_FOUND (as Triton 2.51) for
            an unregistered one.
        """
        if not isinstance(name, str):
            raise InferError.invalid(f"{what}: 'shared_memory_region' must be a string")
        region = self._regions.get(name)
        if region is None:
            raise InferError.not_found(f"{what}: Unable to find shared memory region: '{name}'")
        return region

    def input_bytes(self, params: Any, what: str, regions: list[Region] | None = None) -> memoryview | bytes:
        """The bytes an input's shm parameters designate (``params`` maps key → value); the
        region is appended to ``regions`` (the request's, see ``hold``)."""
        region, offset, byte_size = self._window(params, what)
        if regions is not None:
            regions.append(region)
        return region.read(offset, byte_size)

    def output_target(self, params: Any, what: str) -> ShmTarget:
        """Where an output with shm parameters is to be written."""
        region, offset, byte_size = self._window(params, what)
        return ShmTarget(region, offset, byte_size)

    def _window(self, params: Any, what: str) -> tuple[Region, int, int]:
        region = self.region(params.get("shared_memory_region"), what)
        offset = params.get("shared_memory_offset", 0)
        byte_size = params.get("shared_memory_byte_size")
        if byte_size is None:
            raise InferError.invalid(f"{what}: 'shared_memory_byte_size' is required with 'shared_memory_region'")
        for label, value in (("shared_memory_offset", offset), ("shared_memory_byte_size", byte_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InferError.invalid(f"{what}: '{label}' must be a non-negative integer")
        region.check_window(offset, byte_size, what)
        region.check_backing(offset, byte_size, what)
        return region, offset, byte_size

    # -- internals -------------------------------------------------------------------------------
    def _refuse_taken(self, name: str) -> None:
        if name in self._regions:
            raise InferError(f"shared memory region '{name}' already in manager", ErrorCode.ALREADY_EXISTS)
        if len(self._regions) >= MAX_REGIONS:
            raise InferError.invalid(
                f"{MAX_REGIONS} shared memory regions are registered, the most the server holds; unregister some first"
            )

    def _add(self, region: Region) -> None:
        with self._lock:
            if region.name in self._regions:
                raise InferError(
                    f"shared memory region '{region.name}' already in manager", ErrorCode.ALREADY_EXISTS
                )
            self._regions[region.name] = region


def write_output(target: ShmTarget, data: memoryview | bytes, what: str) -> None:
    """Write an output's wire bytes into its region.

    :raises InferError: the output does not fit in the bytes the client reserved, or the
        region's object was shrunk below the output's window.
    """
    if len(data) > target.byte_size:
        raise InferError.invalid(
            f"shared memory size specified with the request for output '{what}' ({target.byte_size} bytes) "
            f"should be at least {len(data)} bytes to hold the results"
        )
    target.region.check_backing(target.offset, len(data), f"output '{what}'")
    target.region.write(target.offset, data)


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name:
        raise InferError.invalid("a shared memory region needs a non-empty name")


def _check_uint(value: object, label: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InferError.invalid(f"'{label}' must be a non-negative integer")
