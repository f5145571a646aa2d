"""Building pyserve's TRITON shim (``libtritonserver.so``) and SONAME aliases with a C compiler.

The shim is compiled on first use into a cache directory, keyed by a hash of its sources and
the compiler command, so ``pip install -e`` and plain installs behave the same and an edited
source is rebuilt automatically. Only a C compiler is needed (``$CC``, default ``gcc``): no
CMake, no Triton sources.

Cache directory: ``$PYSERVE_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/pyserve/native``, else
``~/.cache/pyserve/native``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "shim"
"""The C sources and the header test backends compile against (``triton_shim.h``)."""

SHIM_SONAME = "libtritonserver.so"
"""The shim's SONAME: what backends built with Triton's CMake list as NEEDED."""

CFLAGS = ("-std=c11", "-O2", "-g", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-pthread")


class BuildError(RuntimeError):
    """The shim (or an alias) could not be compiled; the message says what to install or fix."""


def cache_root() -> Path:
    """Where compiled libraries are kept."""
    env = os.environ.get("PYSERVE_NATIVE_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pyserve" / "native"


def compiler() -> list[str]:
    """The C compiler command (``$CC`` or ``gcc``).

    :raises BuildError: no compiler found.
    """
    command = shlex.split(os.environ.get("CC", "gcc")) or ["gcc"]
    if shutil.which(command[0]) is None:
        raise BuildError(
            f"pyserve-backend-native compiles its TRITON API shim with a C compiler, but "
            f"'{command[0]}' was not found; install gcc (e.g. apt-get install gcc) or set CC"
        )
    return command


def _sources() -> list[Path]:
    return sorted(SHIM_DIR.glob("*.c")) + sorted(SHIM_DIR.glob("*.h"))


def _digest(parts: Sequence[str | bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _compile(output: Path, args: Sequence[str]) -> None:
    """Run the compiler into a temporary file, then move it into place atomically."""
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=output.name + ".", suffix=".tmp", dir=output.parent)
    os.close(fd)
    try:
        command = [*compiler(), *args, "-o", tmp]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise BuildError(
                f"building {output.name} failed ({shlex.join(command)}):\n{result.stderr.strip()}"
            )
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _locked_build(target: Path, build: object) -> Path:
    """Build ``target`` once, also across processes (an flock next to it)."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not target.is_file():
                build()  # type: ignore[operator]
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def shim_library() -> Path:
    """The compiled shim, built now if the cache has no build of the current sources.

    :raises BuildError: no compiler, or the build failed.
    """
    sources = _sources()
    command = compiler()
    key = _digest([*command, *CFLAGS, *(p.name.encode() + p.read_bytes() for p in sources)])
    target = cache_root() / key / SHIM_SONAME
    c_files = [str(p) for p in sources if p.suffix == ".c"]
    return _locked_build(
        target,
        lambda: _compile(target, [*CFLAGS, "-shared", f"-Wl,-soname,{SHIM_SONAME}", *c_files]),
    )


def soname_alias(soname: str) -> Path:
    """An empty library whose SONAME is ``soname``.

    Loaded (RTLD_GLOBAL) after the shim, it satisfies a backend's NEEDED entry for a renamed
    Triton core library (e.g. a wheel's ``libtritonserver-<hash>.so``), so the real core is
    never loaded and every TRITON* symbol binds to the shim.

    :raises BuildError: no compiler, or the build failed.
    """
    if "/" in soname or not soname:
        raise BuildError(f"invalid SONAME {soname!r}")
    key = _digest([*compiler(), "alias", soname])
    target = cache_root() / "alias" / key / soname
    source = '/* SONAME alias of pyserve\'s TRITON shim: no symbols of its own */\nint pyserve_triton_alias;\n'

    def build() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            c_file = Path(tmp) / "alias.c"
            c_file.write_text(source)
            _compile(target, ["-shared", "-fPIC", f"-Wl,-soname,{soname}", str(c_file)])

    return _locked_build(target, build)


def include_dir() -> Path:
    """The directory holding ``triton_shim.h``, for compiling backends against the shim."""
    return SHIM_DIR
