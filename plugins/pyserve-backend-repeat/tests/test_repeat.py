"""The ``repeat`` backend served by a real server, over gRPC streams."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyserve_backend_repeat
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from pyserve.server.core import ServerThread
from pyserve.testing import serve, write_model

CONFIG = """
    backend: "repeat"
    max_batch_size: 0
    model_transaction_policy { decoupled: true }
    input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
            { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] optional: true },
            { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] optional: true } ]
    output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
             { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]
"""

NOT_DECOUPLED = CONFIG.replace("model_transaction_policy { decoupled: true }", "")

BROKEN = {
    "no_idx": (
        CONFIG.replace('name: "IDX"', 'name: "INDEX"'),
        "the repeat backend needs the tensors ['IDX'] in the model config",
    ),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repo = tmp_path_factory.mktemp("repeat")
    models = {"repeat": CONFIG, "not_decoupled": NOT_DECOUPLED, **{n: c for n, (c, _) in BROKEN.items()}}
    for name, config in models.items():
        write_model(repo, name, config)
    with serve(repo, backends={"repeat": pyserve_backend_repeat}, use_entry_points=False) as thread:
        yield thread


def tensor(name: str, values: list[int], datatype: str = "INT32") -> grpcclient.InferInput:
    array = np.array(values, dtype=np.int32 if datatype == "INT32" else np.uint32)
    t = grpcclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


class Stream:
    def __init__(self, server: ServerThread) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def send(self, inputs: list[grpcclient.InferInput], request_id: str) -> None:
        self.client.async_stream_infer("repeat", inputs, request_id=request_id, enable_empty_final_response=True)

    def until_final(self) -> list[Any]:
        """Responses up to and including the next final one (errors fail the test)."""
        out = []
        while True:
            result, error = self.results.get(timeout=60)
            assert error is None, error
            out.append(result.get_response())
            if out[-1].parameters["triton_final_response"].bool_param:
                return out

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


@pytest.fixture
def stream(server: ServerThread) -> Iterator[Stream]:
    s = Stream(server)
    yield s
    s.close(cancel=True)


def values(response: Any, name: str) -> list[int]:
    return grpcclient.InferResult(response).as_numpy(name).tolist()


def test_one_response_per_element_in_order(stream: Stream) -> None:
    stream.send([tensor("IN", [4, -2, 9]), tensor("DELAY", [10, 30, 0], "UINT32")], "r")
    responses = stream.until_final()
    assert [values(r, "OUT") for r in responses[:-1]] == [[4], [-2], [9]]
    assert [values(r, "IDX") for r in responses[:-1]] == [[0], [1], [2]]
    assert not responses[-1].outputs and responses[-1].id == "r"


def test_delays_are_waited(stream: Stream) -> None:
    start = time.monotonic()
    stream.send([tensor("IN", [1, 2]), tensor("DELAY", [100, 100], "UINT32")], "slow")
    assert len(stream.until_final()) == 3
    assert time.monotonic() - start >= 0.2


def test_wait_delays_the_final_flag(stream: Stream) -> None:
    start = time.monotonic()
    stream.send([tensor("IN", [1]), tensor("WAIT", [150], "UINT32")], "w")
    first, error = stream.results.get(timeout=60)
    assert error is None and values(first.get_response(), "OUT") == [1]
    responses = stream.until_final()
    assert len(responses) == 1 and time.monotonic() - start >= 0.15


def test_empty_input_sends_only_the_final_flag(stream: Stream) -> None:
    stream.send([tensor("IN", [])], "empty")
    responses = stream.until_final()
    assert len(responses) == 1 and not responses[0].outputs


def test_delay_count_mismatch_is_an_error(stream: Stream) -> None:
    stream.send([tensor("IN", [1, 2, 3]), tensor("DELAY", [1], "UINT32")], "bad")
    result, error = stream.results.get(timeout=60)
    assert result is None
    assert error.message() == "DELAY has 1 element(s) but IN has 3; give one delay per element"
    stream.send([tensor("IN", [5])], "after")
    assert len(stream.until_final()) == 2


def test_cancelling_stops_the_responses(server: ServerThread) -> None:
    s = Stream(server)
    s.send([tensor("IN", list(range(200))), tensor("DELAY", [10] * 200, "UINT32")], "long")
    for _ in range(3):
        result, error = s.results.get(timeout=60)
        assert error is None
    s.close(cancel=True)
    # the sender thread (in this process) sees the cancellation and ends long before 2 s
    deadline = time.monotonic() + 1.0
    while any(t.name.startswith("repeat-") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name.startswith("repeat-") for t in threading.enumerate())
    assert s.results.qsize() < 20
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        assert client.is_server_ready() is False  # the broken models keep the server not ready
        assert client.is_model_ready("repeat")


@pytest.mark.parametrize("name", list(BROKEN))
def test_wrong_configs_make_the_model_unavailable(server: ServerThread, name: str) -> None:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        assert not client.is_model_ready(name)
        index = {m.name: m for m in client.get_model_repository_index().models}
    assert index[name].state == "UNAVAILABLE"
    assert BROKEN[name][1] in index[name].reason


def test_a_model_that_is_not_decoupled_answers_one_element_requests(server: ServerThread) -> None:
    """As Triton's repeat backend: one response then the final flag alone make one answer."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        result = client.infer("not_decoupled", [tensor("IN", [7])])
        assert result.as_numpy("OUT").tolist() == [7] and result.as_numpy("IDX").tolist() == [0]
        with pytest.raises(InferenceServerException, match="expected a single response, got 2"):
            client.infer("not_decoupled", [tensor("IN", [1, 2])])
