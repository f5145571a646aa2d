"""Finding and loading native Triton backends (``libtriton_<name>.so``).

Load order, so that every TRITON* reference of a backend binds to pyserve's shim:

1. the shim (SONAME ``libtritonserver.so``) with ``RTLD_GLOBAL``: backends built with Triton's
   CMake list ``libtritonserver.so`` as NEEDED, and the dynamic loader satisfies that entry with
   the already-loaded shim; global symbols are searched before the backend's own dependencies;
2. for a NEEDED entry naming a renamed core library (``libtritonserver-<hash>.so``, as in the
   ``nvidia-pytriton`` wheel, found through the backend's RPATH), an empty alias library with
   that SONAME, also ``RTLD_GLOBAL``, so the real core library is never loaded;
3. the backend itself with ``RTLD_NOW | RTLD_LOCAL`` (as Triton does): unresolved symbols fail
   the load at once and backends cannot see each other's symbols.

Before loading, the backend's dynamic symbol table is read: every TRITONSERVER_* /
TRITONBACKEND_* function it imports must be exported by the shim, otherwise the load fails
with the library path and the symbol name.
"""

from __future__ import annotations

import ctypes
import os
import re
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pyserve_backend_native import _build

BACKEND_API_VERSION = (1, 19)
"""The TRITONBACKEND API version pyserve declares (backends built for 1.0–1.19 are served)."""
SERVER_API_VERSION = (1, 34)
"""The TRITONSERVER API version of the functions pyserve exports."""

TRITON_PREFIXES = ("TRITONSERVER_", "TRITONBACKEND_", "TRITONREPOAGENT_", "TRITONCACHE_")
_CORE_LIBRARY = re.compile(r"^libtritonserver([-_.].*)?\.so(\.\d+)*$")

ENTRY_POINTS = (
    "TRITONBACKEND_Initialize",
    "TRITONBACKEND_Finalize",
    "TRITONBACKEND_GetBackendAttribute",
    "TRITONBACKEND_ModelInitialize",
    "TRITONBACKEND_ModelFinalize",
    "TRITONBACKEND_ModelInstanceInitialize",
    "TRITONBACKEND_ModelInstanceFinalize",
    "TRITONBACKEND_ModelInstanceExecute",
    "TRITONBACKEND_ModelInstanceReady",
)
"""What the server may call in a backend; only ``ModelInstanceExecute`` is required."""


class BackendLoadError(RuntimeError):
    """A backend library cannot be used; the message names the library and the reason."""


# -- ELF ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ElfInfo:
    """What the loader needs from a shared library's dynamic section."""

    needed: tuple[str, ...]
    defined: frozenset[str]
    undefined: frozenset[str]  # global (non-weak) undefined symbols
    weak_undefined: frozenset[str] = field(default_factory=frozenset)


_SHT_DYNAMIC = 6
_SHT_DYNSYM = 11
_DT_NULL = 0
_DT_NEEDED = 1
_STB_GLOBAL = 1
_STB_WEAK = 2
_SHN_UNDEF = 0

_Section = tuple[int, int, int, int, int]  # sh_type, sh_offset, sh_size, sh_link, sh_entsize


def read_elf(path: Path) -> ElfInfo:
    """Read NEEDED entries and dynamic symbols of a 64-bit little-endian ELF file.

    :raises BackendLoadError: not such an ELF shared object.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BackendLoadError(f"{path}: cannot read the backend library: {exc.strerror or exc}") from exc
    if data[:4] != b"\x7fELF":
        raise BackendLoadError(f"{path}: not an ELF shared library")
    if data[4] != 2 or data[5] != 1:
        raise BackendLoadError(f"{path}: only 64-bit little-endian ELF libraries are supported")
    sections = _sections(data)
    needed: list[str] = []
    defined: set[str] = set()
    undefined: set[str] = set()
    weak: set[str] = set()
    for section in sections:
        if section[0] == _SHT_DYNAMIC:
            needed.extend(_needed(data, sections, section))
        elif section[0] == _SHT_DYNSYM:
            _sort_symbols(data, sections, section, defined, undefined, weak)
    return ElfInfo(tuple(needed), frozenset(defined), frozenset(undefined), frozenset(weak))


def _sections(data: bytes) -> list[_Section]:
    """The section headers' fields ``read_elf`` uses, in file order."""
    (e_shoff,) = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(e_shnum):
        sh_type, _flags, _addr, sh_offset, sh_size, sh_link, _info, _align, sh_entsize = struct.unpack_from(
            "<IQQQQIIQQ", data, e_shoff + i * e_shentsize + 4
        )
        sections.append((sh_type, sh_offset, sh_size, sh_link, sh_entsize))
    return sections


def _string(data: bytes, sections: list[_Section], table: int, offset: int) -> str:
    """The NUL-terminated string at ``offset`` of string table section ``table``."""
    start = sections[table][1] + offset
    end = data.index(b"\0", start)
    return data[start:end].decode("utf-8", "replace")


def _needed(data: bytes, sections: list[_Section], dynamic: _Section) -> list[str]:
    """The DT_NEEDED library names of a SHT_DYNAMIC section, up to its DT_NULL."""
    _type, offset, size, link, entsize = dynamic
    needed = []
    for pos in range(offset, offset + size, entsize or 16):
        tag, value = struct.unpack_from("<qQ", data, pos)
        if tag == _DT_NULL:
            break
        if tag == _DT_NEEDED:
            needed.append(_string(data, sections, link, value))
    return needed


def _sort_symbols(data: bytes, sections: list[_Section], dynsym: _Section,
                  defined: set[str], undefined: set[str], weak: set[str]) -> None:
    """Add the named symbols of a SHT_DYNSYM section to ``defined`` (global or weak, with a
    section), ``undefined`` (global, without one) or ``weak`` (weak, without one)."""
    _type, offset, size, link, entsize = dynsym
    for pos in range(offset + (entsize or 24), offset + size, entsize or 24):
        st_name, st_info, _other, st_shndx = struct.unpack_from("<IBBH", data, pos)
        if not st_name:
            continue
        name = _string(data, sections, link, st_name)
        binding = st_info >> 4
        if st_shndx != _SHN_UNDEF:
            if binding in (_STB_GLOBAL, _STB_WEAK):
                defined.add(name)
        elif binding == _STB_WEAK:
            weak.add(name)
        elif binding == _STB_GLOBAL:
            undefined.add(name)


# -- the shim ------------------------------------------------------------------------------
_lock = threading.Lock()
_shim: ctypes.CDLL | None = None
_shim_symbols: frozenset[str] = frozenset()
_aliases: dict[str, ctypes.CDLL] = {}
_libraries: dict[Path, NativeLibrary] = {}


def shim() -> ctypes.CDLL:
    """The process-wide shim, built and loaded (``RTLD_GLOBAL``) on first use.

    :raises BackendLoadError: it cannot be built or loaded.
    """
    global _shim, _shim_symbols
    if _shim is not None:
        return _shim
    with _lock:
        if _shim is None:
            try:
                path = _build.shim_library()
            except _build.BuildError as exc:
                raise BackendLoadError(str(exc)) from exc
            symbols = read_elf(path).defined
            _shim = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
            _shim_symbols = symbols
    return _shim


def shim_symbols() -> frozenset[str]:
    """Every symbol the shim exports."""
    shim()
    return _shim_symbols


@dataclass(eq=False)
class NativeLibrary:
    """One loaded backend library (process-wide: a library is loaded once, like in Triton).

    :ivar path: the library file (resolved).
    :ivar handle: the ctypes handle (``RTLD_LOCAL``).
    :ivar entry_points: the backend's entry points that exist, by name.
    :ivar imports: the TRITON functions it imports (from the shim).
    """

    path: Path
    handle: ctypes.CDLL
    entry_points: dict[str, ctypes._CFuncPtr]  # type: ignore[name-defined]
    imports: frozenset[str] = frozenset()

    def single_process_reason(self) -> str:
        """Why its models need the process that holds every model, from what it imports: it
        calls the server (BLS, model control) or creates custom metrics; "" when neither."""
        calls = sorted(self.imports & SERVER_CALLS)
        if calls:
            return f"its library imports {calls[0]}: it calls the server"
        if "TRITONSERVER_MetricFamilyNew" in self.imports:
            return "its library imports TRITONSERVER_MetricFamilyNew: it keeps custom metrics"
        return ""


SERVER_CALLS = frozenset({
    "TRITONSERVER_ServerInferAsync", "TRITONSERVER_ServerLoadModel", "TRITONSERVER_ServerLoadModelWithParameters",
    "TRITONSERVER_ServerUnloadModel", "TRITONSERVER_ServerUnloadModelAndDependents",
})
"""The server functions whose use ties a backend's models to the process holding every model."""


def load_library(path: Path) -> NativeLibrary:
    """Check and load a backend library (once per process and path).

    :raises BackendLoadError: unreadable, imports a TRITON function pyserve does not provide,
        lacks ``TRITONBACKEND_ModelInstanceExecute``, or the dynamic loader refused it.
    """
    path = path.resolve()
    with _lock:
        loaded = _libraries.get(path)
    if loaded is not None:
        return loaded
    info = read_elf(path)
    provided = shim_symbols()
    missing = sorted(s for s in info.undefined if s.startswith(TRITON_PREFIXES) and s not in provided)
    if missing:
        more = f" (and {len(missing) - 1} more: {', '.join(missing[1:6])}{', ...' if len(missing) > 6 else ''})" if len(missing) > 1 else ""
        raise BackendLoadError(
            f"{path}: the backend needs {missing[0]}{more}, which pyserve's TRITON API "
            f"(TRITONBACKEND {BACKEND_API_VERSION[0]}.{BACKEND_API_VERSION[1]}, TRITONSERVER "
            f"{SERVER_API_VERSION[0]}.{SERVER_API_VERSION[1]}) does not provide"
        )
    if "TRITONBACKEND_ModelInstanceExecute" not in info.defined:
        raise BackendLoadError(
            f"{path}: not a Triton backend: it does not export TRITONBACKEND_ModelInstanceExecute"
        )
    for needed in info.needed:
        if _CORE_LIBRARY.match(needed) and needed != _build.SHIM_SONAME:
            _load_alias(needed)
    try:
        handle = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as exc:
        raise BackendLoadError(f"{path}: the dynamic loader refused the backend: {exc}") from exc
    entry_points = {}
    for name in ENTRY_POINTS:
        if name in info.defined:
            function = getattr(handle, name)
            function.restype = ctypes.c_void_p
            entry_points[name] = function
    entry_points["TRITONBACKEND_ModelInstanceExecute"].argtypes = [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint32,
    ]
    for name, function in entry_points.items():
        if name not in ("TRITONBACKEND_ModelInstanceExecute", "TRITONBACKEND_GetBackendAttribute"):
            function.argtypes = [ctypes.c_void_p]
    if "TRITONBACKEND_GetBackendAttribute" in entry_points:
        entry_points["TRITONBACKEND_GetBackendAttribute"].argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    imports = frozenset(s for s in info.undefined | info.weak_undefined if s.startswith(TRITON_PREFIXES))
    library = NativeLibrary(path, handle, entry_points, imports)
    with _lock:
        return _libraries.setdefault(path, library)


def _load_alias(soname: str) -> None:
    shim()
    with _lock:
        if soname in _aliases:
            return
        try:
            alias = _build.soname_alias(soname)
        except _build.BuildError as exc:
            raise BackendLoadError(str(exc)) from exc
        _aliases[soname] = ctypes.CDLL(str(alias), mode=os.RTLD_NOW | os.RTLD_GLOBAL)


# -- where a backend's library is -----------------------------------------------------------
def library_name(backend: str, runtime: str = "") -> str:
    """Triton's library file name: ``runtime`` when it names a ``.so``, else ``libtriton_<backend>.so``."""
    if runtime.endswith(".so"):
        return runtime
    return f"libtriton_{backend}.so"


def candidates(
    backend: str, runtime: str, model_path: Path | None, version_paths: list[Path], backend_directory: str | Path | None
) -> list[Path]:
    """The places Triton looks, in order: version dirs, the model dir, ``<backend dir>/<backend>/``."""
    name = library_name(backend, runtime)
    places: list[Path] = [v / name for v in version_paths]
    if model_path is not None:
        places.append(model_path / name)
    if backend_directory:
        places.append(Path(backend_directory) / backend / name)
    return places


def find_library(
    backend: str, runtime: str, model_path: Path | None, version_paths: list[Path], backend_directory: str | Path | None
) -> Path | None:
    """The first existing candidate, or None.

    :raises BackendLoadError: ``runtime`` escapes the directory it is looked up in.
    """
    name = library_name(backend, runtime)
    if "/" in name or name in (".", ".."):
        raise BackendLoadError(
            f"runtime '{runtime}' must be a library file name (e.g. libtriton_{backend}.so), not a path"
        )
    for place in candidates(backend, runtime, model_path, version_paths, backend_directory):
        if place.is_file():
            return place
    return None
