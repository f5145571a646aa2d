"""Shared fixtures: real servers on loopback ports, and model repositories written per test."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from pyserve.plugins import PluginHost
from pyserve.server import Server, ServerOptions, ServerThread

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_REPOSITORY = REPO_ROOT / "examples" / "model_repository"


def write_model(repo: Path, name: str, config: str, versions: tuple[int, ...] = (1,), files: Mapping[str, str] | None = None) -> Path:
    """Create ``repo/name`` with a config.pbtxt, version folders and extra files."""
    model_dir = repo / name
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(textwrap.dedent(config))
    for v in versions:
        (model_dir / str(v)).mkdir(exist_ok=True)
    for rel, text in (files or {}).items():
        path = model_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return model_dir


@pytest.fixture
def make_repo(tmp_path: Path) -> Callable[..., Path]:
    """``make_repo({"name": config_text, ...})`` → a repository directory."""

    def make(models: Mapping[str, str], versions: tuple[int, ...] = (1,)) -> Path:
        repo = tmp_path / "repo"
        repo.mkdir(exist_ok=True)
        for name, config in models.items():
            write_model(repo, name, config, versions)
        return repo

    return make


StartServer = Callable[..., ServerThread]


@pytest.fixture
def start_server() -> Iterator[StartServer]:
    """Start a real server on a free loopback port; stopped at the end of the test.

    ``start_server(repo, backends={...}, server_plugins=[...], **options)``
    """
    running: list[ServerThread] = []

    def start(
        *repos: Path,
        backends: Mapping[str, object] | None = None,
        server_plugins: tuple[object, ...] = (),
        use_entry_points: bool = True,
        **options: object,
    ) -> ServerThread:
        host = PluginHost(extra_backends=backends, server_plugins=server_plugins, use_entry_points=use_entry_points)
        options.setdefault("grpc_port", 0)
        options.setdefault("metrics_port", 0)
        settings = ServerOptions(model_repositories=list(repos), host="127.0.0.1", http_port=0, **options)  # type: ignore[arg-type]
        thread = ServerThread(Server(settings, host))
        thread.start()
        running.append(thread)
        return thread

    yield start
    for thread in reversed(running):
        thread.stop()


@pytest.fixture(scope="module")
def example_server() -> Iterator[ServerThread]:
    """One server on the bundled example repository, shared by a test module."""
    settings = ServerOptions(
        model_repositories=[EXAMPLE_REPOSITORY], host="127.0.0.1", http_port=0, grpc_port=0, metrics_port=0
    )
    thread = ServerThread(Server(settings))
    thread.start()
    yield thread
    thread.stop()
