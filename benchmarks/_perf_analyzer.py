"""Find (or install) NVIDIA's ``perf_analyzer`` and a C library it can run on.

The PyPI wheel ``perf-analyzer`` (2.60) holds one x86-64 binary, ``perf_analyzer/bin/
perf_analyzer``, built for glibc 2.38 and libstdc++ 3.4.32; Debian 12 ships glibc 2.36 and
libstdc++ 3.4.30, so on Debian 12 the binary cannot start. Nothing is built here and nothing is
committed: the binary comes from the wheel and, where the host's C library is too old, the
runtime libraries come from Debian 13 ("trixie") packages, unpacked into a private folder and
used through trixie's own dynamic loader::

    <cache>/sysroot/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 --library-path <that folder> \\
        <cache>/perf_analyzer/bin/perf_analyzer ...

The packages (``libc6 libstdc++6 libgcc-s1 libssl3t64 zlib1g``) are fetched with ``apt-get
download`` under a private apt configuration (its own sources list, lists and cache, signed by
the ``debian-archive-keyring`` the host already has), so the host's apt state is not touched.
The archive is the one the host's own apt sources use for Debian (``$PYSERVE_DEBIAN_MIRROR``
overrides it).
``dpkg-deb -x`` unpacks them; nothing is installed into the system.

Everything goes to ``$XDG_CACHE_HOME/pyserve-bench/perf-analyzer-<version>`` (``~/.cache/...``)
and is reused on later runs. ``ensure()`` does all of it and returns the command prefix;
``find()`` only looks. Run ``python benchmarks/_perf_analyzer.py`` to install and print it.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

VERSION = "2.60.0"
WHEEL_PLATFORM = "manylinux_2_38_x86_64"
DEBIAN_SUITE = "trixie"
APT_SOURCES = (Path("/etc/apt/sources.list.d"), Path("/etc/apt/sources.list"))
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
RUNTIME_PACKAGES = ("libc6", "libstdc++6", "libgcc-s1", "libssl3t64", "zlib1g")
_LIBDIR = Path("usr/lib/x86_64-linux-gnu")


def default_cache() -> Path:
    """Where ``ensure`` puts the binary and the runtime libraries unless told otherwise."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "pyserve-bench" / f"perf-analyzer-{VERSION}"


@dataclass(frozen=True)
class PerfAnalyzer:
    """A ``perf_analyzer`` that runs here.

    :ivar command: what to put before perf_analyzer's own arguments.
    :ivar how: one line saying how it runs (native, or through which loader).
    """

    command: tuple[str, ...]
    how: str

    def run(self, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """Run perf_analyzer with ``args``; stdout and stderr together in ``stdout``.

        :raises subprocess.TimeoutExpired: it ran past ``timeout`` seconds (it was killed).
        """
        return subprocess.run([*self.command, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, check=False)


def _binary(cache: Path) -> Path:
    return cache / "perf_analyzer" / "bin" / "perf_analyzer"


def _starts(command: list[str]) -> bool:
    """Whether ``command --version`` starts the binary (it prints its version; a loader error does not)."""
    try:
        result = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    text = result.stdout + result.stderr
    return "Perf Analyzer Version" in text


def _candidates(cache: Path) -> list[tuple[list[str], str]]:
    binary = _binary(cache)
    libs = cache / "sysroot" / _LIBDIR
    loader = libs / "ld-linux-x86-64.so.2"
    found = [([str(binary)], "the wheel's binary on the host's C library")]
    if loader.is_file():
        found.append(([str(loader), "--library-path", str(libs), str(binary)],
                      f"the wheel's binary through Debian {DEBIAN_SUITE}'s loader and libraries"))
    return found


def find(cache: Path | None = None) -> PerfAnalyzer | None:
    """An installed perf_analyzer that starts, or None. Looks only; installs nothing."""
    cache = cache or default_cache()
    if not _binary(cache).is_file():
        return None
    for command, how in _candidates(cache):
        if _starts(command):
            return PerfAnalyzer(tuple(command), how)
    return None


def _run(step: list[str], log: Path, cwd: Path | None = None) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(step)}\n")
        out.flush()
        code = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, check=False).returncode
    if code:
        raise RuntimeError(f"'{' '.join(step[:3])} ...' exited with {code}; see {log}")


def _install_wheel(cache: Path, log: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
              "--platform", WHEEL_PLATFORM, "--python-version", "3", "--dest", tmp,
              f"perf-analyzer=={VERSION}"], log)
        wheels = list(Path(tmp).glob("perf_analyzer-*.whl"))
        if not wheels:
            raise RuntimeError(f"pip downloaded no perf_analyzer wheel; see {log}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(cache)
    _binary(cache).chmod(0o755)


def debian_mirror() -> str:
    """The Debian archive the host's apt sources name (the first ``.../debian`` URI), or
    ``$PYSERVE_DEBIAN_MIRROR``.

    :raises RuntimeError: neither is there.
    """
    chosen = os.environ.get("PYSERVE_DEBIAN_MIRROR", "")
    if chosen:
        return chosen.rstrip("/")
    files: list[Path] = []
    for place in APT_SOURCES:
        if place.is_dir():
            files += sorted(p for p in place.iterdir() if p.suffix in (".sources", ".list"))
        elif place.is_file():
            files.append(place)
    for path in files:
        for line in path.read_text(errors="replace").splitlines():
            words = line.split()
            if words[:1] == ["URIs:"]:
                uris = words[1:]
            elif words[:1] == ["deb"]:
                uris = [w for w in words[1:] if "://" in w][:1]
            else:
                continue
            for uri in uris:
                if uri.rstrip("/").endswith("/debian"):
                    return uri.rstrip("/")
    raise RuntimeError("no Debian archive in the host's apt sources; set PYSERVE_DEBIAN_MIRROR to one")


def _install_runtime(cache: Path, log: Path) -> None:
    """Debian trixie's runtime libraries into ``cache/root`` via a private apt configuration."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"the host C library is too old for perf_analyzer and '{tool}' is missing")
    if not KEYRING.is_file():
        raise RuntimeError(f"{KEYRING} is missing (package debian-archive-keyring)")
    apt = cache / "apt"
    for sub in ("lists/partial", "cache/archives/partial", "etc/preferences.d", "debs"):
        (apt / sub).mkdir(parents=True, exist_ok=True)
    sources = apt / "etc" / "sources.list"
    sources.write_text(f"deb [signed-by={KEYRING}] {debian_mirror()} {DEBIAN_SUITE} main\n")
    options: list[str] = []
    for key, value in (("Dir::Etc::SourceList", sources), ("Dir::Etc::SourceParts", apt / "etc" / "none"),
                       ("Dir::Etc::Preferences", apt / "etc" / "preferences"),
                       ("Dir::Etc::PreferencesParts", apt / "etc" / "preferences.d"),
                       ("Dir::State::Lists", apt / "lists"), ("Dir::Cache", apt / "cache"),
                       ("Dir::State::status", "/dev/null"), ("APT::Architecture", "amd64")):
        options += ["-o", f"{key}={value}"]
    if os.geteuid() == 0:  # the private folders are root's: apt's '_apt' user could not write them
        options += ["-o", "APT::Sandbox::User=root"]
    _run(["apt-get", *options, "-qq", "update"], log)
    debs = apt / "debs"
    _run(["apt-get", *options, "-qq", "download", *RUNTIME_PACKAGES], log, cwd=debs)
    root = cache / "sysroot"
    for deb in sorted(debs.glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(root)], log)


def ensure(cache: Path | None = None, log: Path | None = None) -> PerfAnalyzer:
    """A perf_analyzer that runs here, installing what is missing into ``cache``.

    :raises RuntimeError: not an x86-64 Linux machine, or a download or unpack step failed; the
        message says which (and names the log).
    """
    cache = cache or default_cache()
    found = find(cache)
    if found is not None:
        return found
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise RuntimeError(f"perf_analyzer {VERSION} from PyPI is built for x86-64 Linux only")
    cache.mkdir(parents=True, exist_ok=True)
    log = log or cache / "install.log"
    if not _binary(cache).is_file():
        _install_wheel(cache, log)
    found = find(cache)
    if found is not None:
        return found
    _install_runtime(cache, log)
    found = find(cache)
    if found is None:
        raise RuntimeError(f"perf_analyzer does not start even with Debian {DEBIAN_SUITE}'s libraries; see {log}")
    return found


if __name__ == "__main__":
    tool = ensure()
    print(f"perf_analyzer {VERSION}: {tool.how}")
    print(" ".join(tool.command))
