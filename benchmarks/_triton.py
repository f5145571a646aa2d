"""Find (or install) a real Triton server for the benchmarks: the one inside ``nvidia-pytriton``.

The ``nvidia-pytriton`` wheel ships ``pytriton/tritonserver/bin/tritonserver`` (Triton 2.51 for
0.7.0), the Python backend ``backends/python/libtriton_python.so`` with
``triton_python_backend_utils.py``, and one ``triton_python_backend_stub`` per Python version
under ``python_backend_stubs/<major.minor>/``; the shared libraries they need sit in
``nvidia_pytriton.libs`` next to the package. It runs on a CPU-only machine (it logs CUDA and
NVML warnings and carries on).

Three things have to be arranged before the Python backend can load a model:

* a backend directory holding ``python/`` with the backend library, ``pb_utils`` and the stub
  for the interpreter's Python version (the stub is not in ``backends/python`` in the wheel);
* ``LD_LIBRARY_PATH`` with ``nvidia_pytriton.libs``, because the copied stub loses the relative
  RPATH that finds ``libcudart`` there;
* ``numpy`` (``<2``) importable by the stub: its embedded interpreter is the system
  ``libpython3.X.so.1.0`` and ignores ``PYTHONPATH``, but the backend directory is on its
  ``sys.path``, so ``numpy`` and ``numpy.libs`` are linked there from the venv.

The wheel is installed on demand into its own virtual environment (never pyserve's), by
default ``$XDG_CACHE_HOME/pyserve-bench/triton-venv`` (``~/.cache/...``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PYTRITON_REQUIREMENT = "nvidia-pytriton==0.7.0"
NUMPY_REQUIREMENT = "numpy<2"


def default_venv() -> Path:
    """Where ``--with-triton`` installs ``nvidia-pytriton`` unless told otherwise."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "pyserve-bench" / "triton-venv"


@dataclass(frozen=True)
class TritonInstall:
    """A usable ``tritonserver`` and what it needs to run the Python backend.

    :ivar site_packages: the directory holding ``pytriton`` and ``nvidia_pytriton.libs``.
    :ivar python_version: ``"3.11"`` etc.: the stub to use (the venv's Python).
    """

    site_packages: Path
    python_version: str

    @property
    def package(self) -> Path:
        return self.site_packages / "pytriton" / "tritonserver"

    @property
    def binary(self) -> Path:
        return self.package / "bin" / "tritonserver"

    @property
    def libs(self) -> Path:
        return self.site_packages / "nvidia_pytriton.libs"

    @property
    def stub(self) -> Path:
        return self.package / "python_backend_stubs" / self.python_version / "triton_python_backend_stub"

    def environment(self) -> dict[str, str]:
        """The environment to start ``tritonserver`` with."""
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(self.libs), env.get("LD_LIBRARY_PATH", "")) if p
        )
        return env

    def prepare_backends(self, directory: Path) -> Path:
        """Build ``directory/python`` for ``--backend-directory directory``; returns ``directory``.

        :raises RuntimeError: something the Python backend needs is missing.
        """
        python_dir = directory / "python"
        python_dir.mkdir(parents=True, exist_ok=True)
        source = self.package / "backends" / "python"
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy2(source / name, python_dir / name)
        if not self.stub.is_file():
            raise RuntimeError(f"no Python backend stub for Python {self.python_version} in the wheel")
        target = python_dir / self.stub.name
        shutil.copy2(self.stub, target)
        target.chmod(0o755)
        missing = _missing_libraries(target, self.environment())
        if missing:
            raise RuntimeError(
                f"the Python {self.python_version} backend stub cannot load {', '.join(missing)} "
                f"(install the system package providing libpython{self.python_version}.so.1.0)"
            )
        for name in ("numpy", "numpy.libs"):
            if (self.site_packages / name).exists():
                (python_dir / name).symlink_to(self.site_packages / name)
        if not (python_dir / "numpy").exists():
            raise RuntimeError(f"numpy is not installed next to pytriton in {self.site_packages}")
        return directory


def _missing_libraries(executable: Path, env: dict[str, str]) -> list[str]:
    try:
        result = subprocess.run(["ldd", str(executable)], capture_output=True, text=True, env=env, check=False)
    except OSError:
        return []  # no ldd: find out when the model loads
    return [line.split()[0] for line in result.stdout.splitlines() if "not found" in line]


def _site_packages(venv: Path) -> Path | None:
    for candidate in sorted(venv.glob("lib/python3*/site-packages")):
        if (candidate / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file():
            return candidate
    return None


def _venv_python_version(site_packages: Path) -> str:
    return site_packages.parent.name.removeprefix("python")


def _numpy_major(site_packages: Path) -> int | None:
    for info in site_packages.glob("numpy-*.dist-info"):
        with contextlib.suppress(ValueError):
            return int(info.name.split("-")[1].split(".")[0])
    return None


def find(venv: Path) -> TritonInstall | None:
    """An installed ``nvidia-pytriton`` whose Python-backend stub can work: the dedicated
    ``venv`` first, else this interpreter's — never one beside numpy >= 2.

    The wheel's stubs are built against numpy 1.x: with numpy 2 beside them every request
    fails ("output tensor shape does not match size of output") or returns empty outputs.
    pyserve's own venv has ``nvidia-pytriton`` (for the native-backend tests) next to numpy 2,
    so it must not be picked.
    """
    found = _site_packages(venv)
    if found is not None and (_numpy_major(found) or 1) < 2:
        return TritonInstall(found, _venv_python_version(found))
    spec = importlib.util.find_spec("pytriton")  # locates without importing (which needs its deps)
    if spec is not None and spec.submodule_search_locations:
        site = Path(next(iter(spec.submodule_search_locations))).parent
        if (site / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file() and (_numpy_major(site) or 1) < 2:
            return TritonInstall(site, f"{sys.version_info.major}.{sys.version_info.minor}")
    return None


def install(venv: Path, log: Path) -> TritonInstall:
    """Create ``venv`` with this interpreter and install the wheel and numpy there (no other deps).

    :raises RuntimeError: the venv or the install failed; the message names the log.
    """
    venv.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
             PYTRITON_REQUIREMENT, NUMPY_REQUIREMENT],
        ]
        for step in steps:
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, check=False).returncode:
                raise RuntimeError(f"'{' '.join(step[:4])} ...' failed; see {log}")
    site = _site_packages(venv)
    if site is None:
        raise RuntimeError(f"installed {PYTRITON_REQUIREMENT} into {venv} but found no tritonserver in it")
    return TritonInstall(site, _venv_python_version(site))


def triton_model_py(delay_ms: float) -> str:
    """The Python-backend model: sleeps once per execute, echoes each request's input."""
    return f'''"""Benchmark model: execute costs {delay_ms} ms whatever the batch; echoes INPUT0."""

import time

import triton_python_backend_utils as pb_utils

DELAY_S = {delay_ms / 1000.0!r}


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(DELAY_S)
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]
            )
            for r in requests
        ]
'''


def install_for(args: Any, work: Path) -> tuple[TritonInstall | None, str]:
    """The Triton a benchmark run uses (``--no-triton`` / ``--with-triton`` / ``--triton-venv``),
    or None with the reason it is skipped."""
    if args.no_triton:
        return None, "Triton skipped: --no-triton"
    found = find(args.triton_venv)
    if found is not None:
        return found, ""
    if not args.with_triton:
        return None, (f"Triton skipped: nvidia-pytriton is not installed here nor in {args.triton_venv}; "
                      "pass --with-triton to install it there")
    print(f"installing {PYTRITON_REQUIREMENT} into {args.triton_venv} ...", file=sys.stderr)
    try:
        return install(args.triton_venv, work / "triton-install.log"), ""
    except RuntimeError as error:
        return None, f"Triton skipped: install failed: {error}"
