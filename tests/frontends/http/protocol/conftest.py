"""Fixtures of the HTTP/REST protocol tests: one server per test module, and its clients."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import tritonclient.http as httpclient
from http_protocol_support import (
    LABELS,
    MODELS,
    FlakyBackend,
    InspectBackend,
)
from suite_support import write_model

from pyserve.host.plugins import PluginHost
from pyserve.server.core import Server, ServerOptions, ServerThread


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repo = tmp_path_factory.mktemp("http_protocol")
    for name, config in MODELS.items():
        write_model(repo, name, config, versions=(1, 2, 3) if name == "multi" else (1,))
    (repo / "cls" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    (repo / "cls_int" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    host = PluginHost(extra_backends={"inspect": InspectBackend(), "flaky": FlakyBackend()})
    thread = ServerThread(
        Server(ServerOptions(model_repositories=[repo], host="127.0.0.1", http_port=0, grpc_port=0,
                             exit_on_error=False), host)  # a model fails on purpose
    )
    thread.start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(server.url, concurrency=8)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{server.url}", timeout=30) as c:
        yield c


