"""Fixtures: C test backends compiled with gcc (servers and model folders: ``pyserve.testing``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from pyserve_backend_native import include_dir

BACKEND_SOURCES = Path(__file__).resolve().parent / "backends"
TEST_BACKENDS = ("identity", "errors", "initfail", "missing", "newapi", "decoupled", "stateful", "bls", "iterative", "tracing")


@pytest.fixture(scope="session")
def backend_libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every C test backend compiled into ``libtriton_c_<name>.so`` (backend ``c_<name>``)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the C test backends")
    out = tmp_path_factory.mktemp("native-backends")
    built = {}
    for name in TEST_BACKENDS:
        target = out / f"libtriton_c_{name}.so"
        subprocess.run(
            ["gcc", "-std=c11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-pthread",
             f"-I{include_dir()}", f"-I{BACKEND_SOURCES}", "-o", str(target), str(BACKEND_SOURCES / f"{name}.c")],
            check=True,
        )
        built[name] = target
    return built
