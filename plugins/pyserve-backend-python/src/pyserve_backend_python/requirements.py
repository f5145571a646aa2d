"""A model's own ``requirements.txt``: installed once into a cached virtual environment.

A Python model with a ``requirements.txt`` next to its ``model.py`` (in the version directory,
else in the model directory), or one named by the config parameter ``requirements`` (a path;
relative to the model directory; ``$$TRITON_MODEL_DIRECTORY`` works as for
``EXECUTION_ENV_PATH``), runs in process mode in a virtual environment holding those packages
(``pyserve_backend_python.environment``: the worker finds the server's own packages after
the environment's).

Environments are cached: one per distinct requirements set, named by a hash of the file's
text (with the files its ``-r`` / ``-c`` lines include, and its directory when it names local
paths) and of the server's Python (implementation, version, base interpreter, machine), so a
second start, and every other model with the same set, reuses it. They are made with ``uv``
when it is installed (``uv venv``, ``uv pip install``; uv's own settings apply), otherwise
with ``python -m venv`` and pip (pip's configuration and ``PIP_*`` variables apply, so an
index, ``--find-links`` wheel folders or ``--no-index`` set there are used). Backend settings
(``--backend-config python,<key>=<value>``):

* ``requirements-cache-dir``: where environments live (default
  ``$XDG_CACHE_HOME/pyserve/python-envs``, ``~/.cache/pyserve/python-envs`` without it);
* ``requirements-installer``: ``auto`` (default: uv if found, else pip), ``uv`` or ``pip``;
* ``requirements-timeout``: seconds an install may take (default 900).

Layout of the cache: each environment is built in ``builds/<key>-<token>/``, where it stays
(virtual environments cannot be moved), and is published by atomically renaming a symbolic
link ``<key>`` onto it once ``pyserve-env.json`` (its creation marker) is written. Builders of
the same key take ``<key>.lock`` (``flock``) first, so concurrent server starts build it once;
a build that died is removed by the next builder. Everything here runs on model-loading
threads, or in ``pyserve validate``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import secrets
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from pyserve_backend_python.environment import MODEL_DIRECTORY, ExecutionEnvironment
from pyserve_backend_python.loader import PythonModelError

log = logging.getLogger("pyserve.python_backend")

PARAMETER = "requirements"
"""The model config parameter naming a requirements file."""
FILENAME = "requirements.txt"
"""The file looked for next to ``model.py``, then in the model directory."""
MARKER = "pyserve-env.json"
"""Written into an environment once it is complete; its presence makes the environment usable."""
CACHE_DIR_KEY = "requirements-cache-dir"
INSTALLER_KEY = "requirements-installer"
TIMEOUT_KEY = "requirements-timeout"
INSTALLERS = ("auto", "uv", "pip")
DEFAULT_TIMEOUT_S = 900.0
_LOG_TAIL = 30
"""Output lines kept for the error message of a failed install."""
_MAX_INCLUDES = 32
_PIP_TARGETING = ("PIP_TARGET", "PIP_PREFIX", "PIP_ROOT", "PIP_USER", "PIP_REQUIRE_VIRTUALENV")
"""pip settings that would install somewhere else than the environment: not passed on."""
_PIP_PYTHON_OPTION = (22, 3)
"""pip versions from this one install into another interpreter's environment (``--python``)."""


@dataclass(frozen=True)
class Settings:
    """The backend settings for requirements environments.

    :ivar cache_dir: where the environments are kept.
    :ivar installer: ``auto``, ``uv`` or ``pip``.
    :ivar timeout_s: how long creating one may take.
    """

    cache_dir: Path
    installer: str = "auto"
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def from_config(cls, config: Mapping[str, str]) -> Settings:
        """Read ``--backend-config python,...`` settings.

        :raises PythonModelError: an unknown installer or a timeout that is not a positive number.
        """
        installer = (config.get(INSTALLER_KEY) or "auto").strip().lower()
        if installer not in INSTALLERS:
            raise PythonModelError(f"backend setting {INSTALLER_KEY} '{installer}' is not one of {', '.join(INSTALLERS)}")
        text = (config.get(TIMEOUT_KEY) or "").strip()
        try:
            timeout = float(text) if text else DEFAULT_TIMEOUT_S
        except ValueError:
            timeout = -1.0
        if not 0 < timeout < 1e9:
            raise PythonModelError(f"backend setting {TIMEOUT_KEY} '{text}' must be a positive number of seconds")
        directory = (config.get(CACHE_DIR_KEY) or "").strip()
        return cls(Path(directory).expanduser() if directory else default_cache_dir(), installer, timeout)


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/pyserve/python-envs`` (an absolute XDG_CACHE_HOME only, as the XDG
    specification says), else ``~/.cache/pyserve/python-envs``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "pyserve" / "python-envs"


def find(model_name: str, parameters: Mapping[str, str], model_path: Path, version_path: Path) -> Path | None:
    """The model's requirements file, or None when it has none.

    :raises PythonModelError: the ``requirements`` parameter names something that is not a file.
    """
    value = (parameters.get(PARAMETER) or "").strip()
    if value:
        if value.startswith(MODEL_DIRECTORY):
            value = str(model_path) + value[len(MODEL_DIRECTORY):]
        path = Path(value)
        if not path.is_absolute():
            path = model_path / path
        if not path.is_file():
            raise PythonModelError(f"model '{model_name}': parameter '{PARAMETER}' names '{path}', which is not a file")
        return path
    for directory in (version_path, model_path):
        candidate = directory / FILENAME
        if candidate.is_file():
            return candidate
    return None


def _includes(path: Path, seen: set[Path], parts: list[bytes]) -> None:
    """Add ``path``'s text and that of the files its ``-r`` / ``-c`` lines name to ``parts``."""
    if path in seen or len(seen) >= _MAX_INCLUDES:
        return
    seen.add(path)
    data = path.read_bytes()
    parts += [str(len(seen)).encode(), data]
    local = False
    for raw in data.decode("utf-8", "replace").splitlines():
        line = raw.split(" #", 1)[0].strip()
        for option in ("-r", "--requirement", "-c", "--constraint"):
            if line.startswith(option + " ") or line.startswith(option + "="):
                name = line[len(option) + 1:].strip()
                if name and "://" not in name:
                    _includes((path.parent / name).resolve(), seen, parts)
        if line.startswith((".", "/", "file:", "-e .", "-e /", "--editable")):
            local = True
    if local:  # names files relative to its own folder: another folder is another set
        parts.append(str(path.parent.resolve()).encode())


def environment_key(requirements: Path) -> str:
    """The cache key of a requirements set for this Python (hex digits).

    :raises PythonModelError: the file (or one it includes) cannot be read.
    """
    parts: list[bytes] = [b"pyserve-python-env-1", _python_identity().encode()]
    try:
        _includes(requirements.resolve(), set(), parts)
    except OSError as exc:
        raise PythonModelError(f"requirements '{requirements}' cannot be read: {exc.strerror or exc}") from None
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()[:20]


def _python_identity() -> str:
    base = getattr(sys, "_base_executable", sys.executable)
    return (f"{sys.implementation.name}-{'.'.join(map(str, sys.version_info[:3]))}-{platform.machine()}-"
            f"{os.path.realpath(base)}")


# -- the cache -----------------------------------------------------------------------------------
def _valid(root: Path, key: str) -> bool:
    try:
        marker = json.loads((root / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("key") == key and _python_of(root) is not None


def _python_of(root: Path) -> Path | None:
    for name in ("python3", "python"):
        candidate = root / "bin" / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def cached(settings: Settings, key: str) -> Path | None:
    """The published environment of ``key`` (its real directory) when it is complete, else None."""
    link = settings.cache_dir / key
    if not link.is_symlink() and not link.is_dir():
        return None
    root = link.resolve()
    return root if _valid(root, key) else None


@contextlib.contextmanager
def _locked(path: Path, model_name: str, timeout_s: float) -> Iterator[None]:
    """Hold ``flock`` on ``path``, waiting at most ``timeout_s`` for another builder."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("model '%s': waiting for another process building the same Python environment (%s)",
                     model_name, path.name)
            deadline = time.monotonic() + timeout_s
            while True:
                time.sleep(0.2)
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise PythonModelError(f"model '{model_name}': the Python environment lock {path} was held "
                                               f"for more than {timeout_s:.0f} s by another process") from None
        yield
    finally:
        os.close(descriptor)  # releases the lock


def ensure(model_name: str, requirements: Path, settings: Settings) -> ExecutionEnvironment:
    """The environment of ``requirements``: reused from the cache, or created now.

    :raises PythonModelError: it cannot be created (the installer's message is in the text).
    """
    key = environment_key(requirements)
    label = f"the environment of requirements '{requirements}'"
    root = cached(settings, key)
    if root is None:
        try:
            (settings.cache_dir / "builds").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PythonModelError(f"model '{model_name}': the environment cache {settings.cache_dir} cannot be "
                                   f"created: {exc.strerror or exc}") from None
        with _locked(settings.cache_dir / f"{key}.lock", model_name, settings.timeout_s + 60):
            root = cached(settings, key)  # another process may have built it meanwhile
            if root is None:
                root = _build(model_name, requirements, settings, key)
            else:
                _log_reuse(model_name, root, requirements)
    else:
        _log_reuse(model_name, root, requirements)
    return ExecutionEnvironment(label, root, _python_of(root) or root / "bin" / "python", False, PARAMETER)


def _log_reuse(model_name: str, root: Path, requirements: Path) -> None:
    log.info("model '%s': reusing the Python environment %s for %s", model_name, root, requirements)


def _clear_leftovers(settings: Settings, key: str) -> None:
    """Remove what died builders of ``key`` left (called while holding its lock)."""
    link = settings.cache_dir / key
    if link.is_symlink() or link.exists():
        with contextlib.suppress(OSError):
            link.unlink() if link.is_symlink() else shutil.rmtree(link)
    for leftover in (settings.cache_dir / "builds").glob(f"{key}-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _build(model_name: str, requirements: Path, settings: Settings, key: str) -> Path:
    _clear_leftovers(settings, key)
    installer, uv = _installer(settings)
    root = settings.cache_dir / "builds" / f"{key}-{os.getpid()}-{secrets.token_hex(3)}"
    log.info("model '%s': creating a Python environment for %s with %s in %s", model_name, requirements,
             installer, root)
    started = time.monotonic()
    deadline = started + settings.timeout_s
    try:
        for step in _steps(installer, uv, root, requirements):
            _run(model_name, installer, step, requirements, deadline)
        marker = {"key": key, "requirements": str(requirements), "python": sys.version.split()[0],
                  "installer": installer, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        temporary = root / f".{MARKER}.tmp"
        temporary.write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")
        os.replace(temporary, root / MARKER)
        link = settings.cache_dir / f".{key}-{secrets.token_hex(3)}.link"
        os.symlink(os.path.join("builds", root.name), link)
        os.replace(link, settings.cache_dir / key)  # published: atomically, complete
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    log.info("model '%s': Python environment ready in %.1f s", model_name, time.monotonic() - started)
    return root


def _installer(settings: Settings) -> tuple[str, str | None]:
    """``("uv", path)`` or ``("pip", None)`` as the settings choose.

    :raises PythonModelError: ``uv`` was asked for and none is installed.
    """
    uv = find_uv() if settings.installer in ("auto", "uv") else None
    if settings.installer == "uv" and uv is None:
        raise PythonModelError(f"backend setting {INSTALLER_KEY} is 'uv', but no uv executable was found")
    return ("uv", uv) if uv is not None else ("pip", None)


def find_uv() -> str | None:
    """The ``uv`` executable on ``PATH`` or beside this Python's scripts, or None."""
    found = shutil.which("uv")
    if found:
        return found
    beside = Path(sysconfig.get_path("scripts")) / "uv"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def _server_pip_targets_others() -> bool:
    """Whether this Python's pip can install into another interpreter (``pip --python``)."""
    try:
        parts = tuple(int(p) for p in metadata.version("pip").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    return parts >= _PIP_PYTHON_OPTION


def _steps(installer: str, uv: str | None, root: Path, requirements: Path) -> list[list[str]]:
    """The commands that create the environment ``root`` and install ``requirements`` into it."""
    python = str(root / "bin" / "python")
    if installer == "uv":
        assert uv is not None
        return [[uv, "venv", "--quiet", "--python", sys.executable, str(root)],
                [uv, "pip", "install", "--python", python, "-r", str(requirements)]]
    install = ["install", "--no-input", "--progress-bar", "off", "--disable-pip-version-check", "-r", str(requirements)]
    if _server_pip_targets_others():  # no pip inside the environment: the server's installs into it
        return [[sys.executable, "-m", "venv", "--without-pip", str(root)],
                [sys.executable, "-m", "pip", "--python", python, *install]]
    return [[sys.executable, "-m", "venv", str(root)], [python, "-m", "pip", *install]]


def _child_environment() -> dict[str, str]:
    """The server's environment for the installer, less what would point it elsewhere."""
    blocked = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", *_PIP_TARGETING}
    return {k: v for k, v in os.environ.items() if k not in blocked}


def _run(model_name: str, installer: str, command: list[str], requirements: Path, deadline: float) -> None:
    """Run one step, logging its output line by line.

    :raises PythonModelError: it failed or ran past ``deadline`` (the message quotes its errors).
    """
    tail: deque[str] = deque(maxlen=_LOG_TAIL)
    try:
        process = subprocess.Popen(command, cwd=requirements.parent, env=_child_environment(), text=True,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   errors="replace", start_new_session=True)
    except OSError as exc:
        raise PythonModelError(f"model '{model_name}': {command[0]} cannot be started: {exc.strerror or exc}") from None

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
                log.info("model '%s': %s: %s", model_name, installer, line)

    reader = threading.Thread(target=read, name=f"pyserve-requirements-{model_name}", daemon=True)
    reader.start()
    try:
        code = process.wait(max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        process.wait()
        raise PythonModelError(f"model '{model_name}': installing the requirements '{requirements}' took longer "
                               f"than {TIMEOUT_KEY} allows; stopped") from None
    finally:
        reader.join(5)
        assert process.stdout is not None
        process.stdout.close()
    if code != 0:
        raise PythonModelError(f"model '{model_name}': installing the requirements '{requirements}' failed "
                               f"({installer} exited with code {code}):\n{_errors(list(tail))}")


def _errors(lines: list[str]) -> str:
    """The part of an installer's output that says what went wrong: from pip's first ``ERROR:``
    line on, else the last lines."""
    for index, line in enumerate(lines):
        if line.startswith("ERROR:"):
            return "\n".join(lines[index:index + 20])
    return "\n".join(lines[-20:])


def check(model_name: str, requirements: Path, settings: Settings) -> list[str]:
    """What ``pyserve validate`` says about ``requirements``: nothing when its environment is
    already cached or the set resolves (a dry run: nothing is installed, no environment made);
    else why it does not resolve.

    :raises PythonModelError: the settings name ``uv`` and none is installed.
    """
    try:
        key = environment_key(requirements)
    except PythonModelError as exc:
        return [str(exc)]
    if cached(settings, key) is not None:
        return []
    installer, uv = _installer(settings)
    if installer == "uv":
        assert uv is not None
        command = [uv, "pip", "compile", "--quiet", "--python", sys.executable, "--output-file", os.devnull,
                   str(requirements)]
    else:
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--no-input",
                   "--progress-bar", "off", "--disable-pip-version-check", "-r", str(requirements)]
    try:
        done = subprocess.run(command, cwd=requirements.parent, env=_child_environment(), capture_output=True,
                              text=True, errors="replace", timeout=settings.timeout_s, check=False,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"requirements '{requirements}' could not be resolved with {installer}: {exc}"]
    if done.returncode == 0:
        return []
    lines = [line.rstrip() for line in (done.stdout + "\n" + done.stderr).splitlines() if line.strip()]
    said = "; ".join(_errors(lines).splitlines())  # one line per problem
    return [f"requirements '{requirements}' cannot be resolved ({installer}): {said}"]
