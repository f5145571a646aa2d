"""The response sender of non-decoupled Python models, as Triton 2.51 (Triton >= 2.47) runs it.

Observed side by side on Triton 2.51 with the same model (HTTP, gRPC unary, gRPC stream):

* one response, sent before or after ``execute`` returned (from another thread), with the final
  flag or followed by it alone, reaches the client;
* a second response raises in the model ("... cannot send more than one response."); when the
  model lets that fail ``execute``, the request has two responses (the first one and the
  error): unary calls fail with "expected a single response, got 2", the stream keeps the first;
* the final flag before any response raises ("... cannot send complete final before sending a
  response."), which fails the request when the model lets it;
* after the final flag a send raises: "Unable to send response. Response sender has been
  closed." (decoupled), or the more-than-one message (non-decoupled, with a response);
* a response returned after one was sent through the sender fails the request as above.

Where Triton leaves the request open for ever (``None`` returned, nothing sent, the model
holds neither the request nor its sender), pyserve ends it with an error.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from python_backend_helpers import start, write_python_model
from tritonclient.utils import InferenceServerException

from pyserve.server.core import ServerThread

CONFIG = """
    backend: "python"
    max_batch_size: 0
    input [ { name: "IN" data_type: TYPE_STRING dims: [ 1 ] } ]
    output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
    instance_group [ { kind: KIND_CPU count: 2 } ]
"""

MODEL = """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
RAISED = []  # what the sender raised, newest last; mode "raised" answers with it


def respond(tag, shape):
    data = np.array([tag.encode()], dtype=np.object_).reshape(shape)
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", data)])


def noting(call):
    try:
        call()
    except pb_utils.TritonModelException as exc:
        RAISED.append(str(exc))


def later(call):
    def run():
        time.sleep(0.2)  # after execute returned
        noting(call)
    threading.Thread(target=run, daemon=True).start()


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            given = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            mode = given.reshape(-1)[0].decode()
            resp = lambda tag, shape=given.shape: respond(tag, shape)
            if mode == "raised":
                out.append(resp(RAISED[-1] if RAISED else "nothing"))
                continue
            sender = request.get_response_sender()
            returned = None
            if mode == "two":                   # the second send raises; execute fails
                sender.send(resp("r1"))
                sender.send(resp("r2"))
            elif mode == "two_caught":          # the model catches it and ends the request
                sender.send(resp("r1"))
                noting(lambda: sender.send(resp("r2")))
                sender.send(flags=FINAL)
            elif mode == "final_first":         # the final flag before any response
                sender.send(flags=FINAL)
            elif mode == "after_return":
                later(lambda sender=sender, resp=resp: sender.send(resp("late"), flags=FINAL))
            elif mode == "after_return_two_calls":
                later(lambda sender=sender, resp=resp: (sender.send(resp("late")), sender.send(flags=FINAL)))
            elif mode == "after_final":
                sender.send(resp("r1"), flags=FINAL)
                noting(lambda: sender.send(resp("r2")))
            elif mode == "sent_and_returned":
                sender.send(resp("r1"))
                returned = resp("returned")
            elif mode == "sent_final_and_returned":
                sender.send(resp("r1"), flags=FINAL)
                returned = resp("returned")
            elif mode == "returned_and_after":
                later(lambda sender=sender, resp=resp: sender.send(resp("late"), flags=FINAL))
                returned = resp("returned")
            elif mode == "released":            # nothing sent, nothing kept
                del sender
            elif mode == "returned":
                returned = resp("returned")
            out.append(returned)
        return None if all(item is None for item in out) else out
"""

DECOUPLED_CONFIG = CONFIG + "model_transaction_policy { decoupled: true }\n"

DECOUPLED_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
RAISED = []


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            if pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0] == b"raised":
                tensor = pb_utils.Tensor("OUT", np.array([RAISED[-1].encode()], dtype=np.object_))
                sender.send(pb_utils.InferenceResponse([tensor]), flags=FINAL)
                continue
            sender.send(flags=FINAL)
            try:
                sender.send(pb_utils.InferenceResponse([]))
                RAISED.append("nothing raised")
            except pb_utils.TritonModelException as exc:
                RAISED.append(str(exc))
        return None
"""

TWO = "expected a single response, got 2"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repo = tmp_path_factory.mktemp("sender_repo")
    write_python_model(repo, "sender", CONFIG, MODEL)
    write_python_model(repo, "sender_batching", CONFIG.replace("max_batch_size: 0", "max_batch_size: 8")
                       .replace("instance_group [ { kind: KIND_CPU count: 2 } ]",
                                "dynamic_batching { max_queue_delay_microseconds: 100000 }"), MODEL)
    write_python_model(repo, "decoupled_sender", DECOUPLED_CONFIG, DECOUPLED_MODEL)
    thread = start(repo)
    yield thread
    thread.stop()


def _http(server: ServerThread, mode: str, model: str = "sender") -> tuple[int, dict]:
    shape = [1, 1] if model == "sender_batching" else [1]
    body = {"inputs": [{"name": "IN", "shape": shape, "datatype": "BYTES", "data": [mode]}]}
    reply = httpx.post(f"http://{server.url}/v2/models/{model}/infer", json=body, timeout=60)
    return reply.status_code, reply.json()


def _grpc_input(mode: str) -> list[grpcclient.InferInput]:
    item = grpcclient.InferInput("IN", [1], "BYTES")
    item.set_data_from_numpy(np.array([mode.encode()], dtype=np.object_))
    return [item]


def _grpc(server: ServerThread, mode: str) -> str:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        try:
            return client.infer("sender", _grpc_input(mode), client_timeout=60).as_numpy("OUT")[0].decode()
        except InferenceServerException as exc:
            return f"ERROR {exc.status()}: {exc.message()}"


def _stream(server: ServerThread, mode: str, model: str = "sender") -> list[str]:
    """Every message the stream delivers for one request."""
    got: queue.Queue[str] = queue.Queue()

    def callback(result: object, error: InferenceServerException | None) -> None:
        got.put(f"ERROR: {error.message()}" if error is not None
                else result.as_numpy("OUT")[0].decode())  # type: ignore[attr-defined]

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback)
        client.async_stream_infer(model, _grpc_input(mode))
        client.stop_stream()  # waits until the server ended the stream: every request is done
    messages = []
    while not got.empty():
        messages.append(got.get())
    return messages


def _raised(server: ServerThread) -> str:
    status, body = _http(server, "raised")
    assert status == 200
    return body["outputs"][0]["data"][0]


def _output(status_body: tuple[int, dict]) -> str:
    status, body = status_body
    assert status == 200, body
    return body["outputs"][0]["data"][0]


@pytest.mark.parametrize("mode", ["after_return", "after_return_two_calls"])
def test_a_response_sent_after_execute_returned_reaches_the_client(server: ServerThread, mode: str) -> None:
    assert _output(_http(server, mode)) == "late"
    assert _grpc(server, mode) == "late"
    assert _stream(server, mode) == ["late"]


def test_two_responses_fail_the_request_and_the_second_send_raises(server: ServerThread) -> None:
    assert _http(server, "two") == (500, {"error": TWO})
    assert _grpc(server, "two") == f"ERROR StatusCode.INTERNAL: {TWO}"
    assert _stream(server, "two") == ["r1"]  # Triton's stream keeps the first response only
    assert _output(_http(server, "two_caught")) == "r1"
    assert _raised(server) == "Unable to send response. Non-decoupled model cannot send more than one response."


def test_a_returned_response_after_a_sent_one(server: ServerThread) -> None:
    assert _http(server, "sent_and_returned") == (500, {"error": TWO})
    assert _stream(server, "sent_and_returned") == ["r1"]
    assert _output(_http(server, "sent_final_and_returned")) == "r1"
    assert _output(_http(server, "returned_and_after")) == "returned"
    assert _grpc(server, "returned_and_after") == "returned"


def test_the_final_flag_before_any_response_fails_the_request(server: ServerThread) -> None:
    status, body = _http(server, "final_first")
    assert status == 500
    assert "TritonModelException: Unable to send response. Non-decoupled model cannot send complete final " \
           "before sending a response." in body["error"]
    assert "final before sending a response" in _grpc(server, "final_first")


def test_sending_after_the_final_flag_raises_in_the_model(server: ServerThread) -> None:
    assert _output(_http(server, "after_final")) == "r1"
    assert _raised(server) == "Unable to send response. Non-decoupled model cannot send more than one response."
    assert _stream(server, "after_final", "decoupled_sender") == []  # the final flag alone: no message
    assert _stream(server, "raised", "decoupled_sender") == [  # decoupled: Triton's exact text
        "Unable to send response. Response sender has been closed."]


def test_a_request_the_model_released_unanswered_gets_an_error(server: ServerThread) -> None:
    status, body = _http(server, "released")
    assert status == 500
    assert "returned None for a request and released it without sending a response" in body["error"]
    assert "released it" in _grpc(server, "released")


def test_a_batch_answered_in_three_ways(server: ServerThread) -> None:
    from concurrent.futures import ThreadPoolExecutor

    modes = ["returned", "two_caught", "after_return"]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda m: _output(_http(server, m, "sender_batching")), modes))
    assert answers == ["returned", "r1", "late"]
