"""Decoupled Python models over gRPC streams, and BLS calls between models."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from python_backend_helpers import ADD_100_CONFIG, ADD_100_SOURCE
from python_backend_helpers import PROCESS_MODE as PROCESS
from tritonclient.utils import InferenceServerException

from pyserve.server.core import ServerThread


def _input(name: str, array: np.ndarray, datatype: str, module: Any = grpcclient) -> Any:
    item = module.InferInput(name, list(array.shape), datatype)
    item.set_data_from_numpy(array)
    return item


@pytest.fixture
def stream(python_server: ServerThread) -> Iterator[tuple[grpcclient.InferenceServerClient, queue.Queue[Any]]]:
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(python_server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put(error if error is not None else result))
    yield client, results
    client.stop_stream()
    client.close()


def _collect(results: queue.Queue[Any], request_id: str, timeout: float = 10.0) -> list[Any]:
    """Responses of one request until its final flag (final-only empty responses dropped)."""
    got = []
    deadline = time.monotonic() + timeout
    while True:
        item = results.get(timeout=max(deadline - time.monotonic(), 0.01))
        if isinstance(item, Exception):
            raise item
        response = item.get_response()
        assert response.id == request_id
        if response.outputs:
            got.append(item)
        if response.parameters["triton_final_response"].bool_param:
            return got


def test_decoupled_model_streams_one_response_per_element(stream: Any) -> None:
    client, results = stream
    values = np.array([4, 5, 6, 7], dtype=np.int32)
    client.async_stream_infer("repeat_py", [_input("IN", values, "INT32")], request_id="r1",
                              enable_empty_final_response=True)
    responses = _collect(results, "r1")
    assert [int(r.as_numpy("OUT")[0]) for r in responses] == [4, 5, 6, 7]
    assert [int(r.as_numpy("IDX")[0]) for r in responses] == [0, 1, 2, 3]


def test_decoupled_model_with_zero_responses(stream: Any) -> None:
    client, results = stream
    client.async_stream_infer("repeat_py", [_input("IN", np.zeros(0, dtype=np.int32), "INT32")],
                              request_id="empty", enable_empty_final_response=True)
    assert _collect(results, "empty") == []


def test_decoupled_async_execute_overlaps_requests(stream: Any) -> None:
    client, results = stream
    for i in range(3):  # each counts down only once all three are under way at once ("meet")
        client.async_stream_infer("countdown_async", [_input("N", np.array([5], dtype=np.int32), "INT32")],
                                  request_id=f"c{i}", enable_empty_final_response=True, parameters={"meet": 3})
    by_id: dict[str, list[int]] = {}
    finals = 0
    while finals < 3:
        item = results.get(timeout=120)
        assert not isinstance(item, Exception), item
        response = item.get_response()
        if response.outputs:
            by_id.setdefault(response.id, []).append(int(item.as_numpy("LEFT")[0]))
        finals += response.parameters["triton_final_response"].bool_param
    assert by_id == {f"c{i}": [5, 4, 3, 2, 1] for i in range(3)}


def test_decoupled_async_execute_raising_ends_the_request_with_an_error(stream: Any) -> None:
    client, results = stream
    client.async_stream_infer("countdown_async", [_input("N", np.array([-1], dtype=np.int32), "INT32")],
                              request_id="neg")
    item = results.get(timeout=60)
    assert isinstance(item, InferenceServerException)
    assert "N must not be negative" in str(item)
    assert "countdown_async" in str(item)


def test_decoupled_model_is_refused_over_http(python_server: ServerThread) -> None:
    client = httpclient.InferenceServerClient(python_server.url)
    with pytest.raises(InferenceServerException, match="decoupled"):
        client.infer("repeat_py", [_input("IN", np.array([1], dtype=np.int32), "INT32", httpclient)])


@pytest.mark.parametrize("model", ["bls_sync", "bls_async"])
def test_bls_calls_add_sub(python_server: ServerThread, model: str) -> None:
    a = np.array([1, 2, 3, 4], dtype=np.float32)
    b = np.array([10, 20, 30, 40], dtype=np.float32)
    inputs = [_input("INPUT0", a, "FP32", httpclient), _input("INPUT1", b, "FP32", httpclient)]
    result = httpclient.InferenceServerClient(python_server.url).infer(model, inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), b - a if model == "bls_async" else a - b)


def test_bls_error_comes_back_as_a_response_error(python_server: ServerThread) -> None:
    a = np.zeros(4, dtype=np.float32)
    inputs = [_input("INPUT0", a, "FP32"), _input("INPUT1", a, "FP32"),
              _input("MODEL_NAME", np.array([b"no_such_model"], dtype=np.object_), "BYTES")]
    with grpcclient.InferenceServerClient(python_server.grpc_url) as client:
        with pytest.raises(InferenceServerException, match="BLS failed: .*no_such_model"):
            client.infer("bls_sync", inputs)


@pytest.mark.parametrize("use_async", [False, True])
def test_bls_reads_every_response_of_a_decoupled_model(python_server: ServerThread, use_async: bool) -> None:
    values = np.array([3, 4, 5], dtype=np.int32)
    inputs = [_input("IN", values, "INT32"), _input("ASYNC", np.array([use_async]), "BOOL")]
    with grpcclient.InferenceServerClient(python_server.grpc_url) as client:
        result = client.infer("bls_decoupled", inputs)
    assert int(result.as_numpy("SUM")[0]) == 12
    assert int(result.as_numpy("COUNT")[0]) == 3


FORKING_BLS_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "MESSAGE" data_type: TYPE_STRING dims: [ 1 ] } ]
"""
FORKING_BLS_SOURCE = """
import multiprocessing
import numpy as np
import triton_python_backend_utils as pb_utils

def call_target(value):
    request = pb_utils.InferenceRequest(model_name="target", requested_output_names=["OUT"],
                                        inputs=[pb_utils.Tensor("IN", np.array([value], dtype=np.int32))])
    try:
        response = request.exec()
    except pb_utils.TritonModelException as exc:  # execution_mode "process" raises
        return str(exc)
    if response.has_error():
        return response.error().message()
    return str(int(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0]))

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            value = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            with multiprocessing.get_context("fork").Pool(2) as pool:  # as Triton's own bls QA model
                from_children = pool.map(call_target, [value, value])
            here = call_target(value)  # the model's own process still calls the server
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.array([int(here)], dtype=np.int32)),
                pb_utils.Tensor("MESSAGE", np.array([from_children[0].encode()], dtype=np.object_))]))
        return out
"""


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_bls_from_a_process_the_model_forked_is_an_error_not_a_hang(serve: Any, mode: str) -> None:
    """Triton's bls QA model maps BLS calls over a forked ``multiprocessing.Pool``; the model
    runs in the server's process (or its worker's), whose event loop (pipe reader) a forked
    child does not have: the child's call fails naming the fork (it used to wait for ever)."""
    config = FORKING_BLS_CONFIG + (PROCESS if mode == "process" else "")
    server = serve({"forking": (config, FORKING_BLS_SOURCE), "target": (ADD_100_CONFIG, ADD_100_SOURCE)})
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        result = client.infer("forking", [_input("IN", np.array([7], dtype=np.int32), "INT32", httpclient)])
    finally:
        client.close()
    assert result.as_numpy("OUT").tolist() == [107]
    message = result.as_numpy("MESSAGE")[0].decode()
    assert "cannot be made from process" in message or "cannot be called from process" in message
    assert ("forked off the server's process" if mode == "thread" else "forked off its worker") in message


DECOUPLED_IO = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
"""
WAITS_FOR_GO_SOURCE = """
import pathlib
import threading
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.go = pathlib.Path(args["model_repository"]).parent / "go"

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.answer, args=(request,), daemon=True).start()
        return None

    def answer(self, request):
        sender = request.get_response_sender()
        for _ in range(1200):  # until the caller's other coroutine says go (60 s at most)
            if self.go.exists():
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", request.inputs()[0].as_numpy())]))
                break
            time.sleep(0.05)
        else:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("no go")))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""
AWAITING_CALLER_SOURCE = """
import asyncio
import pathlib
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.go = pathlib.Path(args["model_repository"]).parent / "go"

    async def streamed(self, request):
        call = pb_utils.InferenceRequest(model_name="waits_for_go", requested_output_names=["OUT"],
                                         inputs=[request.inputs()[0]])
        responses = await call.async_exec(decoupled=True)
        for response in responses:  # a plain for, as Triton's async_execute_decouple_bls model
            if response.has_error():
                return response.error().message()
            if response.output_tensors():
                return int(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0])
        return "no response"

    async def says_go(self):
        ping = pb_utils.InferenceRequest(model_name="ping", requested_output_names=["OUT"],
                                         inputs=[pb_utils.Tensor("IN", np.array([0], dtype=np.int32))])
        await ping.async_exec()  # needs this event loop free while the other coroutine waits
        self.go.touch()

    async def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            value, _ = await asyncio.gather(self.streamed(request), self.says_go())
            if isinstance(value, str):
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(value)))
            else:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], dtype=np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def test_awaited_decoupled_bls_lets_the_other_coroutines_run(serve: Any) -> None:
    """``await async_exec(decoupled=True)`` ends once the first response is there (as Triton),
    so iterating it with a plain ``for`` does not hold the model's event loop while that
    response is awaited: the model's other coroutine (whose own BLS call lets the first one
    be answered) runs meanwhile."""
    server = serve({"waits_for_go": (DECOUPLED_IO, WAITS_FOR_GO_SOURCE), "caller": (DECOUPLED_IO, AWAITING_CALLER_SOURCE),
                    "ping": (ADD_100_CONFIG, ADD_100_SOURCE)})
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put(error if error is not None else result))
    try:
        client.async_stream_infer("caller", [_input("IN", np.array([5], dtype=np.int32), "INT32")])
        item = results.get(timeout=120)
    finally:
        client.stop_stream()
        client.close()
    assert not isinstance(item, Exception), item
    assert item.as_numpy("OUT").tolist() == [5]


REFUSED_CALLER_SOURCE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        unknown = pb_utils.InferenceRequest(model_name="non_existent_model", inputs=[], requested_output_names=[])
        short = pb_utils.InferenceRequest(model_name="two_inputs", requested_output_names=["OUT"],
                                          inputs=[pb_utils.Tensor("A", np.ones(2, dtype=np.float64))])
        messages = [call.exec().error().message() for call in (unknown, short)]
        messages.append(next(iter(unknown.exec(decoupled=True))).error().message())
        return [pb_utils.InferenceResponse([pb_utils.Tensor("MESSAGE", np.array([m.encode() for m in messages], dtype=np.object_))])
                for _ in requests]
"""
REFUSED_CALLER_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "MESSAGE" data_type: TYPE_STRING dims: [ 3 ] } ]
"""
TWO_INPUTS_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "A" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_refused_bls_request_is_reported_in_tritons_words(serve: Any, mode: str) -> None:
    """As Triton's bls QA model expects: a request the server refuses before queueing it says
    "Model <name> - Error when running inference: <reason>", and a missing input is reported
    before a wrong datatype."""
    config = REFUSED_CALLER_CONFIG + (PROCESS if mode == "process" else "")
    server = serve({"refused": (config, REFUSED_CALLER_SOURCE), "two_inputs": (TWO_INPUTS_CONFIG, ADD_100_SOURCE)})
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        result = client.infer("refused", [_input("IN", np.array([1], dtype=np.int32), "INT32", httpclient)])
    finally:
        client.close()
    unknown, short, unknown_decoupled = (m.decode() for m in result.as_numpy("MESSAGE"))
    assert unknown == unknown_decoupled == ("Model non_existent_model - Error when running inference: "
                                            "Request for unknown model: 'non_existent_model' is not found")
    assert short.startswith("Model two_inputs - Error when running inference: expected 2 inputs but got 1 inputs "
                            "for model 'two_inputs'")


MARKS_THEN_ANSWERS_SOURCE = """
import pathlib
import threading
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.sent = pathlib.Path(args["model_repository"]).parent / "sent"

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.answer, args=(request,), daemon=True).start()
        return None

    def answer(self, request):
        time.sleep(0.3)  # the caller's exec() would long have returned if it did not wait
        self.sent.touch()
        sender = request.get_response_sender()
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", request.inputs()[0].as_numpy() + 1)]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""
BLOCKING_CALLER_SOURCE = """
import pathlib
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.sent = pathlib.Path(args["model_repository"]).parent / "sent"

    def execute(self, requests):
        out = []
        for request in requests:
            call = pb_utils.InferenceRequest(model_name="marks_then_answers", requested_output_names=["OUT"],
                                             inputs=[request.inputs()[0]])
            responses = call.exec(decoupled=True)
            sent_when_returned = self.sent.exists()
            values = [int(pb_utils.get_output_tensor_by_name(r, "OUT").as_numpy()[0])
                      for r in responses if r.output_tensors()]
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.array([int(sent_when_returned)] + values, dtype=np.int32))]))
        return out
"""
BLOCKING_CALLER_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_blocking_decoupled_bls_returns_once_the_first_response_is_there(serve: Any, mode: str) -> None:
    """``exec(decoupled=True)`` blocks until the first response (or the end) is there, as
    Triton's stub does: the target marks a file just before it sends, and the caller finds
    the mark as soon as ``exec`` returns."""
    config = BLOCKING_CALLER_CONFIG + (PROCESS if mode == "process" else "")
    server = serve({"marks_then_answers": (DECOUPLED_IO, MARKS_THEN_ANSWERS_SOURCE),
                    "blocking_caller": (config, BLOCKING_CALLER_SOURCE)})
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        result = client.infer("blocking_caller", [_input("IN", np.array([7], dtype=np.int32), "INT32", httpclient)])
    finally:
        client.close()
    assert result.as_numpy("OUT").tolist() == [1, 8]


PAIRS_UP_SOURCE = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.lock = threading.Lock()
        self.waiting = []

    def execute(self, requests):
        with self.lock:
            self.waiting.extend(requests)
            if len(self.waiting) < 2:  # answered with the next one, or after 60 s without it
                timer = threading.Timer(60, self.give_up, args=(requests[0],))
                timer.daemon = True
                timer.start()
                return None
            pair, self.waiting = self.waiting, []
        for request in pair:
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([len(pair)], dtype=np.int32))]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def give_up(self, request):
        with self.lock:
            if request not in self.waiting:
                return
            self.waiting.remove(request)
        request.get_response_sender().send(pb_utils.InferenceResponse(error=pb_utils.TritonError("alone")),
                                           flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""
TWO_THREADS_CALLER_SOURCE = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def call(self, request, answers, index):
        call = pb_utils.InferenceRequest(model_name="pairs_up", requested_output_names=["OUT"],
                                         inputs=[request.inputs()[0]])
        for response in call.exec(decoupled=True):
            if response.has_error():
                answers[index] = -1
            elif response.output_tensors():
                answers[index] = int(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0])

    def execute(self, requests):
        out = []
        for request in requests:
            answers = [0, 0]
            threads = [threading.Thread(target=self.call, args=(request, answers, i)) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array(answers, dtype=np.int32))]))
        return out
"""


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_bls_calls_from_two_threads_are_in_flight_together(serve: Any, mode: str) -> None:
    """Two threads of one execute call a target that answers only once both calls are in:
    in process mode too, the worker's calls do not wait for each other on its pipe."""
    config = BLOCKING_CALLER_CONFIG + (PROCESS if mode == "process" else "")
    server = serve({"pairs_up": (DECOUPLED_IO, PAIRS_UP_SOURCE), "caller": (config, TWO_THREADS_CALLER_SOURCE)})
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        result = client.infer("caller", [_input("IN", np.array([1], dtype=np.int32), "INT32", httpclient)])
    finally:
        client.close()
    assert result.as_numpy("OUT").tolist() == [2, 2]
