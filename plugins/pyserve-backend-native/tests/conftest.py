"""Fixtures: C test backends compiled with gcc, model repositories, real servers."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from pyserve.plugins import PluginHost
from pyserve.server import Server, ServerOptions, ServerThread
from pyserve_backend_native import include_dir

BACKEND_SOURCES = Path(__file__).resolve().parent / "backends"
TEST_BACKENDS = ("identity", "errors", "initfail", "missing", "newapi", "decoupled", "stateful", "bls")


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


def write_model(repo: Path, name: str, config: str, versions: tuple[int, ...] = (1,)) -> Path:
    model_dir = repo / name
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(textwrap.dedent(config))
    for v in versions:
        (model_dir / str(v)).mkdir(exist_ok=True)
    return model_dir


def install_backend(directory: Path, library: Path, name: str | None = None) -> Path:
    """Copy a built library into ``directory`` (as ``name`` or its own file name)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / (name or library.name)
    shutil.copy(library, target)
    return target


StartServer = Callable[..., ServerThread]


@pytest.fixture
def start_server() -> Iterator[StartServer]:
    """``start_server(repo, backends=..., **ServerOptions fields)``: stopped at test end."""
    running: list[ServerThread] = []

    def start(*repos: Path, backends: Mapping[str, object] | None = None, **options: object) -> ServerThread:
        host = PluginHost(extra_backends=backends)
        options.setdefault("grpc_port", 0)
        settings = ServerOptions(model_repositories=list(repos), host="127.0.0.1", http_port=0, **options)  # type: ignore[arg-type]
        thread = ServerThread(Server(settings, host))
        thread.start()
        running.append(thread)
        return thread

    yield start
    for thread in reversed(running):
        thread.stop()
