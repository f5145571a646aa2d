"""``ModelStreamInfer`` against a real server: decoupled models, final flags, multiplexing,
per-request errors, ``triton_grpc_error``, cancellation, and the aio client's stream.

Uses the first-party ``square`` and ``repeat`` backends plus an inline decoupled ``counter``
backend that records how many responses it sent and whether it saw the cancellation.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from suite_support import SQUARE_CONFIG, QueuedStream, write_model
from tritonclient.utils import InferenceServerException

from pyserve import (
    Backend,
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from pyserve.frontends.grpc.server import GRPC_SERVERS, GrpcOptions
from pyserve.host.plugins import PluginHost
from pyserve.server.core import Server, ServerOptions, ServerThread

TIMEOUT = 10.0


@dataclass
class Run:
    """What the counter backend did for one request."""

    sent: int = 0
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class CounterBackend(Backend):
    """Decoupled: for ``N`` = n sends n responses ``OUT`` = 0..n-1, ``delay_ms`` apart (request
    parameter), stopping when the request is cancelled; request parameter ``fail_at`` = i sends
    an error instead of response i. Records each request's ``Run`` by request id."""

    def __init__(self) -> None:
        self.runs: dict[str, Run] = {}
        self.lock = threading.Lock()

    def run(self, request_id: str) -> Run:
        with self.lock:
            return self.runs.setdefault(request_id, Run())

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> None:
        for request in requests:
            threading.Thread(target=self._send, args=(request, self.run(request.id)), daemon=True).start()

    def _send(self, request: InferRequest, run: Run) -> None:
        sender = request.response_sender()
        count = int(request.inputs["N"].reshape(-1)[0])
        delay = float(request.parameters.get("delay_ms", 0)) / 1000
        fail_at = request.parameters.get("fail_at", -1)
        try:
            for i in range(count):
                time.sleep(delay)
                if sender.is_cancelled():
                    run.cancelled = True
                    break
                if i == fail_at:
                    sender.send(InferError.invalid(f"counter failed at {i}"))
                else:
                    sender.send(InferResponse({"OUT": np.array([i], dtype=np.int32)}))
                run.sent += 1
            sender.send(final=True)
        finally:
            run.done.set()


MODELS = {
    "square": SQUARE_CONFIG,
    "repeat": """
        backend: "repeat"
        max_batch_size: 0
        model_transaction_policy { decoupled: true }
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
                { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] optional: true },
                { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] optional: true } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
                 { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]
    """,
    "counter": """
        backend: "counter"
        max_batch_size: 0
        model_transaction_policy { decoupled: true }
        input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
    """,
    "ident": """
        backend: "identity"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
    """,
}


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def grpc_server_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def counter(grpc_server_kind: str) -> CounterBackend:
    return CounterBackend()  # one per server: request ids repeat across the two


@pytest.fixture(scope="module")
def server(grpc_server_kind: str, tmp_path_factory: pytest.TempPathFactory, counter: CounterBackend) -> Iterator[ServerThread]:
    repo = tmp_path_factory.mktemp("grpc_stream")
    for name, config in MODELS.items():
        write_model(repo, name, config)
    host = PluginHost(extra_backends={"counter": counter})
    options = ServerOptions(model_repositories=[repo], host="127.0.0.1", http_port=0, grpc_port=0,
                            grpc=GrpcOptions(implementation=grpc_server_kind))  # both gRPC servers
    thread = ServerThread(Server(options, host))
    thread.start()
    yield thread
    thread.stop()


class Stream(QueuedStream):
    """The stream client of these tests (``suite_support.QueuedStream``)."""

    def send(self, model: str, inputs: list[grpcclient.InferInput], **kwargs: Any) -> None:
        self.client.async_stream_infer(model, inputs, **kwargs)

    def response(self) -> Any:
        """The next message, which must be a response (the ``ModelInferResponse``)."""
        result, error = self.next()
        assert error is None, error
        return result


@pytest.fixture
def stream(server: ServerThread) -> Iterator[Stream]:
    s = Stream(server.grpc_url, timeout=TIMEOUT)
    yield s
    s.close(cancel_requests=True)


def int32(name: str, values: list[int]) -> grpcclient.InferInput:
    return tensor(name, values, "INT32")


def tensor(name: str, values: list[int], datatype: str) -> grpcclient.InferInput:
    array = np.array(values, dtype=np.int32 if datatype == "INT32" else np.uint32)
    t = grpcclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def is_final(result: Any) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def is_empty(result: Any) -> bool:
    response = result.get_response()
    return not response.outputs and not response.raw_output_contents


# -- decoupled responses and final flags -------------------------------------------------------------


def test_square_sends_n_responses_then_an_empty_final(stream: Stream) -> None:
    stream.send("square", [int32("IN", [3])], request_id="sq", enable_empty_final_response=True)
    for _ in range(3):
        result = stream.response()
        assert result.get_response().id == "sq"
        assert result.as_numpy("OUT").tolist() == [3]
        assert not is_final(result)
    final = stream.response()
    assert is_final(final) and is_empty(final)
    response = final.get_response()
    assert (response.id, response.model_name, response.model_version) == ("sq", "square", "1")
    stream.assert_quiet()
    # N = 0: only the empty final response
    stream.send("square", [int32("IN", [0])], request_id="zero", enable_empty_final_response=True)
    final = stream.response()
    assert final.get_response().id == "zero" and is_final(final) and is_empty(final)


def test_without_empty_final_response_nothing_marks_the_end(stream: Stream) -> None:
    stream.send("square", [int32("IN", [2])], request_id="a")
    stream.send("square", [int32("IN", [0])], request_id="b")
    for _ in range(2):
        result = stream.response()
        assert result.get_response().id == "a" and not is_final(result) and not is_empty(result)
    stream.assert_quiet()


def test_repeat_in_order_with_delays(stream: Stream) -> None:
    values = [5, -6, 7, 0]
    stream.send(
        "repeat",
        [int32("IN", values), tensor("DELAY", [30, 10, 20, 0], "UINT32")],
        request_id="rep",
        enable_empty_final_response=True,
    )
    results = [stream.response() for _ in range(len(values) + 1)]
    assert [r.get_response().id for r in results] == ["rep"] * 5
    assert [r.as_numpy("OUT").tolist() for r in results[:-1]] == [[v] for v in values]
    assert [r.as_numpy("IDX").tolist() for r in results[:-1]] == [[i] for i in range(4)]
    assert [is_final(r) for r in results] == [False, False, False, False, True]
    assert is_empty(results[-1])


def test_many_requests_multiplexed_on_one_stream(stream: Stream) -> None:
    plans = {f"r{i}": ([i * 10 + k for k in range(3 + i)], [10 + (i * 7 + k * 3) % 25 for k in range(3 + i)])
             for i in range(6)}
    for request_id, (values, delays) in plans.items():
        stream.send(
            "repeat",
            [int32("IN", values), tensor("DELAY", delays, "UINT32")],
            request_id=request_id,
            enable_empty_final_response=True,
        )
    got: dict[str, list[tuple[int, int]]] = {rid: [] for rid in plans}
    finals: set[str] = set()
    arrival: list[str] = []
    first_final = 10**6
    while len(finals) < len(plans):
        result = stream.response()
        request_id = result.get_response().id
        arrival.append(request_id)
        assert request_id not in finals
        if is_final(result):
            assert is_empty(result)
            finals.add(request_id)
            first_final = min(first_final, len(arrival))
        else:
            got[request_id].append((int(result.as_numpy("IDX")[0]), int(result.as_numpy("OUT")[0])))
    for request_id, (values, _) in plans.items():
        assert got[request_id] == list(enumerate(values))
    # the responses of different requests really were interleaved, not sent one request after another
    switches = sum(1 for a, b in zip(arrival, arrival[1:]) if a != b)
    assert switches > len(plans) - 1
    assert len(set(arrival[:first_final])) > 1


def test_non_decoupled_model_over_the_stream(stream: Stream) -> None:
    for i in range(3):
        stream.send("ident", [int32("IN", [i, i + 1])], request_id=f"n{i}")
    seen = {}
    for _ in range(3):
        result = stream.response()
        assert is_final(result)
        seen[result.get_response().id] = result.as_numpy("OUT").tolist()
    assert seen == {f"n{i}": [i, i + 1] for i in range(3)}
    stream.assert_quiet()


# -- errors --------------------------------------------------------------------------------------------


def test_per_request_errors_keep_the_stream_open(server: ServerThread, stream: Stream) -> None:
    stream.send("nope", [int32("IN", [1])], request_id="e1")
    unknown = stream.error()
    with grpcclient.InferenceServerClient(server.grpc_url) as c, pytest.raises(InferenceServerException) as info:
        c.infer("nope", [int32("IN", [1])])
    assert unknown.message() == info.value.message()

    stream.send("ident", [tensor("IN", [1], "UINT32")], request_id="e2")  # wrong datatype
    wrong = stream.error()
    body = {"inputs": [{"name": "IN", "datatype": "UINT32", "shape": [1], "data": [1]}]}
    response = httpx.post(f"http://{server.url}/v2/models/ident/infer", json=body)
    assert response.status_code == 400
    assert wrong.message() == response.json()["error"]
    assert wrong.message() == "inference input 'IN' data-type is 'UINT32', but model 'ident' expects 'INT32'"

    stream.send("square", [int32("IN", [1])], model_version="x", request_id="e5")  # not a version
    assert stream.error().message() == ("failed to get model version from specified version string 'x': "
                                        "version should be an integral value > 0")
    stream.send("square", [int32("IN", [1])], model_version="3", request_id="e6")
    assert stream.error().message() == "Request for unknown model: 'square' version 3 is not found"

    stream.send("square", [int32("IN", [-1])], request_id="e3")  # the backend refuses it
    assert stream.error().message() == "IN must hold exactly one non-negative integer"

    stream.send("counter", [int32("N", [3])], request_id="e4", parameters={"fail_at": 1})
    first, error, third = stream.next(), stream.next(), stream.next()
    assert first[0].as_numpy("OUT").tolist() == [0]
    assert error[0] is None and error[1] is not None and error[1].message() == "counter failed at 1"
    assert third[0].as_numpy("OUT").tolist() == [2]

    stream.send("square", [int32("IN", [1])], request_id="ok", enable_empty_final_response=True)
    assert stream.response().as_numpy("OUT").tolist() == [1]
    assert is_final(stream.response())


def test_triton_grpc_error_header_closes_on_first_error(server: ServerThread) -> None:
    s = Stream(server.grpc_url, headers={"triton_grpc_error": "true"})
    try:
        s.send("square", [int32("IN", [1])], request_id="good", enable_empty_final_response=True)
        assert s.response().get_response().id == "good"
        assert is_final(s.response())
        s.send("nope", [int32("IN", [1])], request_id="bad")
        error = s.error()
        assert error.status() == "StatusCode.NOT_FOUND"
        assert "nope" in error.message()
        s.assert_quiet()
    finally:
        s.close(cancel_requests=True)

    s = Stream(server.grpc_url, headers={"triton_grpc_error": "true"})
    try:
        s.send("square", [int32("IN", [-1])], request_id="bad")  # an error from the backend
        error = s.error()
        assert error.status() == "StatusCode.INVALID_ARGUMENT"
        assert error.message() == "IN must hold exactly one non-negative integer"
        s.assert_quiet()
    finally:
        s.close(cancel_requests=True)


# -- closing and cancelling ----------------------------------------------------------------------------


def test_half_close_still_delivers_every_response(server: ServerThread, counter: CounterBackend) -> None:
    s = Stream(server.grpc_url)
    s.send("counter", [int32("N", [5])], request_id="half", parameters={"delay_ms": 20})
    s.client.stop_stream(cancel_requests=False)  # blocks until the server ends the stream
    received = []
    while not s.results.empty():
        result, error = s.results.get_nowait()
        assert error is None
        received.append(result.as_numpy("OUT").tolist())
    assert received == [[i] for i in range(5)]
    assert counter.run("half").sent == 5 and not counter.run("half").cancelled
    s.client.close()


def test_cancelling_the_stream_stops_the_backend(server: ServerThread, counter: CounterBackend) -> None:
    s = Stream(server.grpc_url)
    s.send("counter", [int32("N", [100])], request_id="cancel", parameters={"delay_ms": 20})
    s.send("repeat", [int32("IN", list(range(100))), tensor("DELAY", [20] * 100, "UINT32")], request_id="rep")
    got = [s.response() for _ in range(4)]
    assert {r.get_response().id for r in got} <= {"cancel", "rep"}
    s.close(cancel_requests=True)
    run = counter.run("cancel")
    assert run.done.wait(TIMEOUT)
    assert run.cancelled
    assert run.sent < 20
    # the server is fine afterwards
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        assert c.is_server_ready()


def test_aio_stream(server: ServerThread, counter: CounterBackend) -> None:
    async def requests() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": "square", "inputs": [int32("IN", [2])], "request_id": "s"}
        yield {"model_name": "ident", "inputs": [int32("IN", [4, 2])], "request_id": "i"}
        yield {"model_name": "nope", "inputs": [int32("IN", [1])], "request_id": "x"}
        yield {"model_name": "repeat", "inputs": [int32("IN", [8, 9])], "request_id": "r"}

    async def main() -> list[tuple[Any, Any]]:
        async with aioclient.InferenceServerClient(server.grpc_url) as c:
            return [item async for item in c.stream_infer(requests())]  # ends when all are done

    results = asyncio.run(main())
    errors = [e for r, e in results if e is not None]
    assert len(errors) == 1 and "nope" in errors[0].message()
    by_id: dict[str, list[list[int]]] = {}
    for result, _error in results:
        if result is not None:
            by_id.setdefault(result.get_response().id, []).append(result.as_numpy("OUT").tolist())
    assert by_id == {"s": [[2], [2]], "i": [[4, 2]], "r": [[8], [9]]}


def test_aio_stream_cancelled_stops_the_backend(server: ServerThread, counter: CounterBackend) -> None:
    async def main() -> int:
        opened = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": "counter", "inputs": [int32("N", [100])], "request_id": "aio-cancel",
                   "parameters": {"delay_ms": 20}}
            await opened.wait()  # keep the request side open until cancelled

        async with aioclient.InferenceServerClient(server.grpc_url) as c:
            responses = c.stream_infer(requests())
            count = 0
            async for _result, error in responses:
                assert error is None
                count += 1
                if count == 3:
                    responses.cancel()
                    break
            opened.set()
            return count

    assert asyncio.run(main()) == 3
    run = counter.run("aio-cancel")
    assert run.done.wait(TIMEOUT)
    assert run.cancelled and run.sent < 20


def test_stream_stays_usable_for_many_rounds(stream: Stream) -> None:
    for i in range(20):
        stream.send("square", [int32("IN", [1])], request_id=f"q{i}", enable_empty_final_response=True)
    ids = [stream.response().get_response().id for _ in range(40)]
    assert sorted(set(ids)) == sorted(f"q{i}" for i in range(20))
    assert all(ids.count(f"q{i}") == 2 for i in range(20))


def test_without_the_header_errors_are_messages_not_statuses(server: ServerThread) -> None:
    s = Stream(server.grpc_url)
    try:
        s.send("nope", [int32("IN", [1])])
        assert s.error().status() is None  # an error_message on the stream, not a gRPC status
        s.send("ident", [int32("IN", [1])])
        assert is_final(s.response())
    finally:
        s.close()


def test_stream_errors_name_their_request(server: ServerThread) -> None:
    """As Triton 2.51: a refused request's error carries ``infer_response{id}``; an error from
    the model carries its model name, the id and ``triton_final_response``."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    def request(model: str, request_id: str, values: list[int], **params: int) -> Any:
        message = service_pb2.ModelInferRequest(model_name=model, id=request_id)
        tensor = message.inputs.add(name="N" if model == "counter" else "IN", datatype="INT32", shape=[len(values)])
        tensor.contents.int_contents.extend(values)
        for key, value in params.items():
            message.parameters[key].int64_param = value
        message.parameters["triton_enable_empty_final_response"].bool_param = True
        return message

    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        replies = list(stub.ModelStreamInfer(iter([request("nope", "refused", [1]),
                                                   request("counter", "partly", [2], fail_at=0)]),
                                             timeout=TIMEOUT))
    by_id: dict[str, list[Any]] = {}
    for reply in replies:
        by_id.setdefault(reply.infer_response.id, []).append(reply)
    assert sorted(by_id) == ["partly", "refused"], replies
    [refused] = by_id["refused"]
    assert refused.error_message and refused.infer_response == service_pb2.ModelInferResponse(id="refused")
    failed, answered, last = by_id["partly"]
    assert failed.error_message == "counter failed at 0"
    assert failed.infer_response.model_name == "counter"
    assert failed.infer_response.parameters["triton_final_response"].bool_param is False
    assert not answered.error_message and answered.infer_response.outputs[0].name == "OUT"
    assert last.infer_response.parameters["triton_final_response"].bool_param is True
