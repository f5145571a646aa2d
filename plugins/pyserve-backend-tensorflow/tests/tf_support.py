"""Test helpers for the tensorflow backend: model folders, a module-scoped server, a batch recorder.

Kept out of conftest.py so that test modules import them under a name unique to this plugin."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from pyserve import InferRequest, InstanceContext, hookimpl
from pyserve.plugins import PluginHost
from pyserve.server import Server, ServerOptions, ServerThread

StartServer = Callable[..., ServerThread]


def write_model(repo: Path, name: str, config: str | None, files: Mapping[str, bytes] = {}) -> Path:
    """``repo/name`` with an optional config.pbtxt, a version folder ``1`` and binary files."""
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    if config is not None:
        (model_dir / "config.pbtxt").write_text(textwrap.dedent(config))
    for rel, data in files.items():
        path = model_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return model_dir


@pytest.fixture(scope="module")
def module_server() -> Iterator[StartServer]:
    """``start(repo, backends={...}, server_plugins=(...), **ServerOptions)`` → a running server, stopped after the module."""
    running: list[ServerThread] = []

    def start(
        *repos: Path, backends: Mapping[str, object], server_plugins: tuple[object, ...] = (), **options: object
    ) -> ServerThread:
        host = PluginHost(extra_backends=backends, server_plugins=server_plugins, use_entry_points=False)
        options.setdefault("grpc_port", 0)
        settings = ServerOptions(model_repositories=list(repos), host="127.0.0.1", http_port=0, **options)  # type: ignore[arg-type]
        thread = ServerThread(Server(settings, host))
        thread.start()
        running.append(thread)
        return thread

    yield start
    for thread in reversed(running):
        thread.stop()


class BatchRecorder:
    """A server plugin that records how many requests each execute of a model received."""

    def __init__(self) -> None:
        self.sizes: dict[str, list[int]] = {}

    @hookimpl(wrapper=True)
    def pyserve_execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> Generator[None, object, object]:
        self.sizes.setdefault(instance.model.name, []).append(len(requests))
        return (yield)
