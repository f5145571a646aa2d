"""Fixtures: real pyserve servers running the model.py files under ``models/``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from python_backend_helpers import copy_models, start, write_python_model

from pyserve.server.core import ServerThread


@pytest.fixture(scope="session")
def python_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """One server with every model under ``models/``, shared by the tests."""
    thread = start(copy_models(tmp_path_factory.mktemp("python_models")))
    yield thread
    thread.stop()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[Mapping[str, tuple[str | None, str]]], ServerThread]]:
    """``serve({"name": (config_text_or_None, model_py_text)})`` → a running server."""
    running: list[ServerThread] = []

    def make(models: Mapping[str, tuple[str | None, str]]) -> ServerThread:
        repo = tmp_path / f"repo{len(running)}"
        repo.mkdir()
        for name, (config, source) in models.items():
            write_python_model(repo, name, config, source)
        thread = start(repo)
        running.append(thread)
        return thread

    yield make
    for thread in reversed(running):
        thread.stop()
