"""Shared fixtures: real servers on loopback ports, and model repositories written per test.

Servers and model folders come from ``pyserve.testing`` (the pytest plugin installed with pyserve).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from gpu_support import gpu_reason
from suite_support import EXAMPLE_REPOSITORY

from pyserve.server.core import ServerThread
from pyserve.testing import ServerFactory, serve, write_model


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip, saying why, where no NVIDIA GPU is listed by ``nvidia-smi``."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    reason = gpu_reason() if gpu_items else None
    if reason is not None:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def make_repo(tmp_path: Path) -> Callable[..., Path]:
    """``make_repo({"name": config_text, ...})`` → a repository directory."""

    def make(models: Mapping[str, str], versions: tuple[int, ...] = (1,)) -> Path:
        repo = tmp_path / "repo"
        repo.mkdir(exist_ok=True)
        for name, config in models.items():
            write_model(repo, name, config, versions=versions)
        return repo

    return make


@pytest.fixture
def start_server(pyserve_server_factory: ServerFactory) -> ServerFactory:
    """``start_server(repo, backends={...}, server_plugins=[...], **options)``: the
    ``pyserve_server_factory`` of ``pyserve.testing`` (servers stopped at the end of the test)."""
    return pyserve_server_factory


@pytest.fixture(scope="module")
def example_server() -> Iterator[ServerThread]:
    """One server on the bundled example repository, shared by a test module."""
    with serve(EXAMPLE_REPOSITORY) as thread:
        yield thread
