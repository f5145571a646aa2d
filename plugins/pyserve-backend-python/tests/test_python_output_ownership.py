"""Outputs belong to the server once a model hands its response over, as in Triton, which copies
them then: a model.py that keeps one buffer and fills it again for every request (a common
way to save allocations) must not change answers still being encoded or sent. Outputs nothing
of the model holds any more are taken without a copy."""

from __future__ import annotations

import queue
import weakref
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from pyserve_backend_python.response import InferenceResponse
from pyserve_backend_python.tensor import COPIED_UP_TO, Tensor
from python_backend_helpers import PROCESS_MODE

from pyserve.testing import wrong_echo_answers

LARGE = 2 * COPIED_UP_TO  # elements of FP32: 8x the size copied outright

REUSING_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

REUSING_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.buffer = None

    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if self.buffer is None or self.buffer.shape != values.shape:
                self.buffer = np.empty_like(values)
            self.buffer[...] = values
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", self.buffer)]))
        return responses
"""

DECOUPLED_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "SIZE" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

DECOUPLED_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            size = int(pb_utils.get_input_tensor_by_name(request, "SIZE").as_numpy()[0])
            sender = request.get_response_sender()
            buffer = np.empty(size, dtype=np.float32)
            for step in range(count):
                buffer[...] = step
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", buffer)]))
            buffer[...] = -1
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def _handed_over(make: Any, received: Any = ()) -> tuple[np.ndarray, np.ndarray]:
    """The array a response built by ``make(keep)`` hands the server, and the model's array."""
    keep: dict[str, Any] = {}
    response = InferenceResponse([make(keep)])
    sent = response.to_server(received).outputs["OUT"]
    return sent, response.output_tensors()[0]._array


def _fresh(keep: dict[str, Any]) -> Tensor:
    return Tensor("OUT", np.arange(LARGE, dtype=np.float32) * 2)


def _kept_buffer(keep: dict[str, Any]) -> Tensor:
    keep["buffer"] = np.zeros(LARGE, np.float32)
    return Tensor("OUT", keep["buffer"])


def _view_of_kept_buffer(keep: dict[str, Any]) -> Tensor:
    keep["buffer"] = np.zeros(2 * LARGE, np.float32)
    return Tensor("OUT", keep["buffer"][:LARGE])


def _kept_tensor(keep: dict[str, Any]) -> Tensor:
    keep["tensor"] = Tensor("OUT", np.zeros(LARGE, np.float32))
    return keep["tensor"]


def _weakly_kept(keep: dict[str, Any]) -> Tensor:
    array = np.zeros(LARGE, np.float32)
    keep["ref"] = weakref.ref(array)
    return Tensor("OUT", array)


def _kept_bytearray(keep: dict[str, Any]) -> Tensor:
    keep["bytes"] = bytearray(LARGE * 4)
    return Tensor("OUT", np.frombuffer(keep["bytes"], np.float32))


def _small_kept_buffer(keep: dict[str, Any]) -> Tensor:
    keep["buffer"] = np.zeros(4, np.float32)
    return Tensor("OUT", keep["buffer"])


@pytest.mark.parametrize("make", [_kept_buffer, _view_of_kept_buffer, _kept_tensor, _weakly_kept, _kept_bytearray,
                                  _small_kept_buffer])
def test_an_output_the_model_still_reaches_is_copied_when_handed_over(make: Any) -> None:
    sent, own = _handed_over(make)
    assert not np.shares_memory(sent, own)
    own[...] = 7  # the model fills its buffer again for the next request
    assert not (sent == 7).any()


@pytest.mark.parametrize("make", [
    _fresh,
    lambda keep: Tensor("OUT", np.zeros(2 * LARGE, np.float32)[:LARGE]),  # a view of an array nobody keeps
    lambda keep: Tensor("OUT", np.frombuffer(bytearray(LARGE * 4), np.float32)),
    lambda keep: Tensor("OUT", np.frombuffer(bytes(LARGE * 4), np.float32)),  # immutable
])
def test_an_output_only_the_response_holds_is_taken_without_a_copy(make: Any) -> None:
    sent, own = _handed_over(make)
    assert np.shares_memory(sent, own)


@pytest.mark.parametrize("writeable", [True, False])
def test_an_echoed_input_is_taken_without_a_copy(writeable: bool) -> None:
    received = np.frombuffer(bytearray(LARGE * 4), np.float32)
    received.flags.writeable = writeable  # a read-only input is copied once, by as_numpy
    request_input = Tensor._wrap("IN", received)
    sent, own = _handed_over(lambda keep: Tensor("OUT", request_input.as_numpy()), received=[request_input])
    assert np.shares_memory(sent, own)
    assert np.shares_memory(sent, request_input.as_numpy())
    other, _ = _handed_over(lambda keep: Tensor("OUT", request_input.as_numpy()))  # not this request's input
    assert not np.shares_memory(other, own)


def test_bytes_outputs_are_taken_as_bytes_and_a_kept_object_array_is_copied() -> None:
    kept = np.array([b"a" * 10] * (LARGE // 8), dtype=np.object_)
    sent, own = _handed_over(lambda keep: Tensor("OUT", kept))
    assert sent is not own and sent.dtype == np.object_ and sent[0] == b"a" * 10
    converted, _ = _handed_over(lambda keep: Tensor("OUT", np.array(["x", 3], dtype=np.object_)))
    assert list(converted) == [b"x", b"3"]


def test_a_dlpack_output_of_another_framework_is_copied() -> None:
    torch = pytest.importorskip("torch")
    kept = torch.zeros(LARGE)
    sent, _ = _handed_over(lambda keep: Tensor.from_dlpack("OUT", kept))
    kept.fill_(3.0)
    assert not (sent == 3).any()


@pytest.mark.parametrize("mode", ["thread", "process"])
@pytest.mark.parametrize("size", [16, LARGE])
def test_a_model_filling_one_buffer_for_every_request_answers_each_client_its_own_values(
    serve: Any, mode: str, size: int
) -> None:
    config = REUSING_CONFIG + (PROCESS_MODE if mode == "process" else "")
    server = serve({"reuse": (config, REUSING_MODEL)})
    assert wrong_echo_answers(httpclient, server.url, "reuse", size) == []
    assert wrong_echo_answers(grpcclient, server.grpc_url, "reuse", size) == []


def test_the_echo_check_reports_failed_requests_and_other_outputs(serve: Any) -> None:
    server = serve({"reuse": (REUSING_CONFIG, REUSING_MODEL)})
    missing = wrong_echo_answers(httpclient, server.url, "no_such_model", 16, threads=2, each=3)
    assert len(missing) == 2 and all("no_such_model" in line for line in missing)
    unnamed = wrong_echo_answers(grpcclient, server.grpc_url, "reuse", 16, ("IN", "NOT_AN_OUTPUT"), threads=1, each=2)
    assert len(unnamed) == 2 and all("got None" in line for line in unnamed)


@pytest.mark.parametrize("size", [16, LARGE])
def test_a_decoupled_model_refilling_its_buffer_between_sends_streams_each_value(serve: Any, size: int) -> None:
    server = serve({"steps": (DECOUPLED_CONFIG, DECOUPLED_MODEL)})
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put(error if error is not None else result))
    try:
        inputs = []
        for name, value in (("COUNT", 5), ("SIZE", size)):
            item = grpcclient.InferInput(name, [1], "INT32")
            item.set_data_from_numpy(np.array([value], dtype=np.int32))
            inputs.append(item)
        client.async_stream_infer("steps", inputs, request_id="r", enable_empty_final_response=True)
        firsts = []
        while True:
            item = results.get(timeout=60)
            assert not isinstance(item, Exception), item
            response = item.get_response()
            if response.outputs:
                answer = item.as_numpy("OUT")
                assert answer.shape == (size,) and (answer == answer[0]).all()
                firsts.append(float(answer[0]))
            if response.parameters["triton_final_response"].bool_param:
                break
        assert firsts == [0.0, 1.0, 2.0, 3.0, 4.0]
    finally:
        client.stop_stream()
        client.close()
