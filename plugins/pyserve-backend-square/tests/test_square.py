"""The ``square`` backend served by a real server, over a gRPC stream and ``/generate_stream``."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pyserve_backend_square
import pytest
import tritonclient.grpc as grpcclient

from pyserve.server.core import ServerThread
from pyserve.testing import serve, write_model

CONFIG = """
    backend: "square"
    max_batch_size: 0
    model_transaction_policy { decoupled: true }
    input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
    output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

BROKEN = {
    "not_decoupled": (
        CONFIG.replace("model_transaction_policy { decoupled: true }", ""),
        "the square backend needs model_transaction_policy { decoupled: true }",
    ),
    "no_out": (
        CONFIG.replace('name: "OUT"', 'name: "RESULT"'),
        "the square backend needs input 'IN' and output 'OUT' in the model config",
    ),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repo = tmp_path_factory.mktemp("square")
    for name, config in {"square": CONFIG, **{n: c for n, (c, _) in BROKEN.items()}}.items():
        write_model(repo, name, config)
    with serve(repo, backends={"square": pyserve_backend_square}, use_entry_points=False) as thread:
        yield thread


def square_input(n: int) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([n], dtype=np.int32))
    return tensor


def stream_all(server: ServerThread, requests: list[tuple[str, int]]) -> list[tuple[Any, Any]]:
    """Send ``(id, N)`` requests on one stream with empty final responses; all messages, in order."""
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        for request_id, n in requests:
            client.async_stream_infer("square", [square_input(n)], request_id=request_id,
                                      enable_empty_final_response=True)
        client.stop_stream()  # waits for every response
    return [results.get_nowait() for _ in range(results.qsize())]


def test_n_responses_then_the_final_flag(server: ServerThread) -> None:
    messages = stream_all(server, [("a", 3)])
    assert all(error is None for _, error in messages)
    responses = [result.get_response() for result, _ in messages]
    assert [grpcclient.InferResult(r).as_numpy("OUT").tolist() for r in responses[:3]] == [[3]] * 3
    assert [r.parameters["triton_final_response"].bool_param for r in responses] == [False] * 3 + [True]
    assert not responses[3].outputs and responses[3].id == "a"


def test_zero_sends_only_the_final_flag(server: ServerThread) -> None:
    messages = stream_all(server, [("z", 0)])
    assert len(messages) == 1
    response = messages[0][0].get_response()
    assert response.parameters["triton_final_response"].bool_param and not response.outputs


def test_negative_is_an_error(server: ServerThread) -> None:
    messages = stream_all(server, [("neg", -2), ("ok", 1)])
    errors = [error for _, error in messages if error is not None]
    assert [e.message() for e in errors] == ["IN must hold exactly one non-negative integer"]
    assert sum(1 for result, _ in messages if result is not None) == 2


def test_generate_stream(server: ServerThread) -> None:
    with httpx.Client(base_url=f"http://{server.url}", timeout=30) as http:
        response = http.post("/v2/models/square/generate_stream", json={"IN": 2})
        assert response.status_code == 200
        assert response.text == 'data: {"OUT":2,"model_name":"square","model_version":"1"}\n\n' * 2
        response = http.post("/v2/models/square/generate", json={"IN": 1})
        assert response.json() == {"OUT": 1, "model_name": "square", "model_version": "1"}


@pytest.mark.parametrize("name", list(BROKEN))
def test_wrong_configs_make_the_model_unavailable(server: ServerThread, name: str) -> None:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        assert not client.is_model_ready(name)
        assert client.is_model_ready("square")
        index = {m.name: m for m in client.get_model_repository_index().models}
    assert index[name].state == "UNAVAILABLE"
    assert BROKEN[name][1] in index[name].reason
