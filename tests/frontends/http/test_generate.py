"""Triton's generate extension over HTTP: ``/generate`` (one JSON object) and
``/generate_stream`` (server-sent events), read with plain httpx against a real server."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from suite_support import SQUARE_CONFIG, write_model

from pyserve import (
    Backend,
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from pyserve.host.plugins import PluginHost
from pyserve.server.core import Server, ServerOptions, ServerThread

ONE_RESPONSE = (
    "generate expects model to produce exactly 1 response, use generate stream for model that "
    "generates various number of responses"
)


class ParamsBackend(Backend):
    """``OUT`` = ``IN``; ``PARAMS`` = the request parameters as JSON; ``mode: raise`` raises."""

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        if any(r.parameters.get("mode") == "raise" for r in requests):
            raise RuntimeError("params backend raised on purpose")
        return [
            InferResponse({
                "OUT": r.inputs["IN"],
                "PARAMS": np.array([json.dumps(r.parameters, sort_keys=True).encode()], dtype=object),
            })
            for r in requests
        ]


class StepsBackend(Backend):
    """Decoupled: ``N`` → responses ``OUT`` = 0..N-1, ``delay_ms`` apart (request parameter),
    stopping when cancelled; request parameter ``fail_at`` = i sends an error instead of
    response i. ``sent[id]`` counts the responses sent; ``done[id]`` is set at the end."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.done: dict[str, threading.Event] = {}

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> None:
        for request in requests:
            self.sent[request.id] = 0
            self.done[request.id] = threading.Event()
            threading.Thread(target=self._send, args=(request,), daemon=True).start()

    def _send(self, request: InferRequest) -> None:
        sender = request.response_sender()
        fail_at = request.parameters.get("fail_at", -1)
        delay = float(request.parameters.get("delay_ms", 0)) / 1000
        try:
            for i in range(int(request.inputs["N"].reshape(-1)[0])):
                time.sleep(delay)
                if sender.is_cancelled():
                    break
                if i == fail_at:
                    sender.send(InferError.invalid(f"steps failed at {i}"))
                else:
                    sender.send(InferResponse({"OUT": np.array([i], dtype=np.int32)}))
                self.sent[request.id] += 1
            sender.send(final=True)
        finally:
            self.done[request.id].set()


MODELS = {
    "params": """
        backend: "params"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] },
                 { name: "PARAMS" data_type: TYPE_STRING dims: [ 1 ] } ]
    """,
    "text": """
        backend: "identity"
        max_batch_size: 4
        input [ { name: "text_input" data_type: TYPE_STRING dims: [ -1 ] } ]
        output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
    """,
    "fixed": """
        backend: "identity"
        max_batch_size: 8
        input [ { name: "PROMPT" data_type: TYPE_STRING dims: [ 1 ] },
                { name: "IDS" data_type: TYPE_INT32 dims: [ 2, -1 ] optional: true } ]
        output [ { name: "PROMPT" data_type: TYPE_STRING dims: [ 1 ] } ]
    """,
    "floats": """
        backend: "identity"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
    """,
    "square": SQUARE_CONFIG,
    "repeat": """
        backend: "repeat"
        max_batch_size: 0
        model_transaction_policy { decoupled: true }
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
                { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] optional: true } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
                 { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]
    """,
    "steps": """
        backend: "steps"
        max_batch_size: 0
        model_transaction_policy { decoupled: true }
        input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
    """,
}


@pytest.fixture(scope="module")
def steps() -> StepsBackend:
    return StepsBackend()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, steps: StepsBackend) -> Iterator[ServerThread]:
    repo = tmp_path_factory.mktemp("generate")
    for name, config in MODELS.items():
        write_model(repo, name, config)
    host = PluginHost(extra_backends={"params": ParamsBackend(), "steps": steps})
    options = ServerOptions(model_repositories=[repo], host="127.0.0.1", http_port=0, grpc_port=0)
    thread = ServerThread(Server(options, host))
    thread.start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{server.url}", timeout=30) as c:
        yield c


def events(http: httpx.Client, path: str, body: Any) -> tuple[httpx.Response, list[dict[str, Any]]]:
    """POST to a ``/generate_stream`` route and parse its ``data:`` events as they arrive."""
    parsed: list[dict[str, Any]] = []
    with http.stream("POST", path, json=body) as response:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            buffer = ""
            for chunk in response.iter_text():
                buffer += chunk
                while "\n\n" in buffer:
                    event, buffer = buffer.split("\n\n", 1)
                    assert event.startswith("data: "), event
                    parsed.append(orjson.loads(event[len("data: "):]))
            assert buffer == ""
        else:
            response.read()
    return response, parsed


def assert_error(response: httpx.Response, status: int, message: str | None = None) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["error"]
    if message is not None:
        assert body["error"] == message
    return str(body["error"])


# -- /generate -----------------------------------------------------------------------------------


def test_generate_non_decoupled(http: httpx.Client) -> None:
    response = http.post("/v2/models/params/generate", json={"id": "g1", "IN": [4, 5, 6]})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    payload = response.json()
    assert json.loads(payload.pop("PARAMS")) == {"id": "g1"}  # Triton passes the id on as a parameter too
    assert payload == {"OUT": [4, 5, 6], "model_name": "params", "model_version": "1", "id": "g1"}
    # a scalar input becomes one element; a single-element output a scalar; no id → no "id"
    response = http.post("/v2/models/params/versions/1/generate", json={"IN": 7})
    assert response.json() == {"OUT": 7, "PARAMS": "{}", "model_name": "params", "model_version": "1"}
    response = http.post("/v2/models/floats/generate", json={"IN": [0.5, -1.25]})
    assert response.json()["OUT"] == [0.5, -1.25]


def test_generate_extra_keys_become_parameters(http: httpx.Client) -> None:
    body = {"IN": [1], "temperature": 0.5, "stream": False, "prompt_id": "p", "parameters": {"max_tokens": 3}}
    response = http.post("/v2/models/params/generate", json=body)
    assert response.status_code == 200, response.text
    assert json.loads(response.json()["PARAMS"]) == {
        "temperature": 0.5, "stream": False, "prompt_id": "p", "max_tokens": 3,
    }
    # keys that /infer reads as scheduling controls are the model's parameters here, as in
    # Triton 2.51 (checked side by side): an LLM's 'timeout' or 'priority' reaches it
    body = {"IN": [1], "sequence_id": 5, "sequence_start": True, "priority": "high", "timeout": -5}
    response = http.post("/v2/models/params/generate", json=body)
    assert response.status_code == 200, response.text
    assert json.loads(response.json()["PARAMS"]) == {
        "sequence_id": 5, "sequence_start": True, "priority": "high", "timeout": -5}
    # a nested parameter naming an input feeds that input, as Triton reads vLLM-style bodies
    response = http.post("/v2/models/params/generate", json={"parameters": {"IN": [8, 9], "top_k": 2}})
    assert response.status_code == 200, response.text
    assert response.json()["OUT"] == [8, 9] and json.loads(response.json()["PARAMS"]) == {"top_k": 2}
    # an input given at the top and in 'parameters' is given twice (Triton 2.51's words)
    assert_error(http.post("/v2/models/params/generate", json={"IN": [1], "parameters": {"IN": 5}}), 400,
                 "Converting keyword: 'parameters': input 'IN' already exists in request")
    assert_error(http.post("/v2/models/params/generate", json={"IN": [1], "triton_x": True}), 400,
                 "parameter keys starting with 'triton_' are reserved for Triton usage and should not be "
                 "specified (got 'triton_x')")
    assert_error(http.post("/v2/models/params/generate", json={"IN": [1], "parameters": [1]}), 400,
                 "Expected JSON object for keyword: 'parameters'")
    assert_error(http.post("/v2/models/params/generate", json={"IN": [1], "bad": [1, 2]}), 400)


def test_generate_bytes_input_from_a_json_string(http: httpx.Client) -> None:
    response = http.post("/v2/models/text/generate", json={"text_input": "héllo ☃", "id": "t"})
    assert response.status_code == 200, response.text
    assert response.json() == {"text_output": "héllo ☃", "model_name": "text", "model_version": "1", "id": "t"}
    response = http.post("/v2/models/text/generate", json={"text_input": ["a", "bc"]})
    assert response.json()["text_output"] == ["a", "bc"]
    assert_error(http.post("/v2/models/text/generate", json={"text_input": 3}), 400)


def test_generate_on_decoupled_model_with_one_response(http: httpx.Client) -> None:
    response = http.post("/v2/models/square/generate", json={"IN": 1, "id": "one"})
    assert response.status_code == 200, response.text
    assert response.json() == {"OUT": 1, "model_name": "square", "model_version": "1", "id": "one"}


@pytest.mark.parametrize("count", [0, 2])
def test_generate_needs_exactly_one_response(http: httpx.Client, count: int) -> None:
    message = assert_error(http.post("/v2/models/square/generate", json={"IN": count}), 400)
    assert message.startswith(ONE_RESPONSE)


def test_generate_shapes_values_as_triton(http: httpx.Client) -> None:
    """Triton 2.51's shapes: the metadata shape (``-1`` first for a batching model) takes the
    elements, fixed dims first, the innermost variable dim the rest, other variable dims 1."""
    response = http.post("/v2/models/fixed/generate", json={"PROMPT": "hello"})  # dims [1], batching: [1, 1]
    assert response.status_code == 200, response.text
    assert response.json()["PROMPT"] == "hello"
    assert http.post("/v2/models/fixed/generate", json={"PROMPT": ["hi"], "IDS": [1, 2, 3, 4]}).status_code == 200
    two = http.post("/v2/models/fixed/generate", json={"PROMPT": ["a", "b"]})  # [2, 1]: a batch of two
    assert two.status_code == 200 and two.json()["PROMPT"] == ["a", "b"]
    assert "The schema can not convert input 'IDS' to tensor with proper shape" in assert_error(
        http.post("/v2/models/fixed/generate", json={"PROMPT": "a", "IDS": [1, 2, 3]}), 400)


def test_generate_type_errors_in_tritons_words(http: httpx.Client) -> None:
    cases = [
        ({"PROMPT": "a", "PARAMS": {"P": 1}},
         "parameter 'PARAMS' has invalid type. It should be either 'int', 'bool', or 'string'."),
        ({"PROMPT": "a", "parameters": {"nested": [1]}},
         "Converting keyword: 'parameters': parameter 'nested' has invalid type."),
        ({"PROMPT": {"USER": "a"}}, "attempt to access JSON non-string as string"),
    ]
    for body, message in cases:
        for route in ("generate", "generate_stream"):  # refused before inference: plain JSON errors
            assert message in assert_error(http.post(f"/v2/models/fixed/{route}", json=body), 400)
    assert "input 'PROMPT' already exists in request" in assert_error(
        http.post("/v2/models/fixed/generate", content=b'{"PROMPT": "a", "PROMPT": "b"}'), 400)


def test_generate_errors(http: httpx.Client) -> None:
    assert_error(http.post("/v2/models/nope/generate", json={"IN": 1}), 404,
                 "Request for unknown model: 'nope' is not found")
    assert_error(http.post("/v2/models/params/generate", json={"IN": "x"}), 400)
    assert_error(http.post("/v2/models/params/generate", json={"id": "x"}), 400)  # missing input
    assert_error(http.post("/v2/models/params/generate", content=b"{nope"), 400)
    assert_error(http.post("/v2/models/params/generate", json=[1]), 400,
                 "the generate request body must be a JSON object")
    assert_error(http.post("/v2/models/params/generate", json={"IN": 1, "id": 5}), 400,
                 "request 'id' must be a string")
    # Triton 2.51 answers a failed generate with 400, whatever the error
    message = assert_error(http.post("/v2/models/params/generate", json={"IN": 1, "mode": "raise"}), 400)
    assert "params backend raised on purpose" in message
    assert_error(http.post("/v2/models/steps/generate", json={"N": 3, "fail_at": 1}), 400, "steps failed at 1")
    # the server keeps serving
    assert http.post("/v2/models/params/generate", json={"IN": 1}).status_code == 200


# -- /generate_stream -----------------------------------------------------------------------------------


def test_generate_stream_square(http: httpx.Client) -> None:
    response, parsed = events(http, "/v2/models/square/generate_stream", {"IN": 3, "id": "s"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert parsed == [{"OUT": 3, "model_name": "square", "model_version": "1", "id": "s"}] * 3
    response, parsed = events(http, "/v2/models/square/generate_stream", {"IN": 0})
    assert response.status_code == 200 and parsed == []


def test_generate_stream_repeat_in_order(http: httpx.Client) -> None:
    values = [9, 8, 7, 6]
    response, parsed = events(
        http, "/v2/models/repeat/generate_stream", {"IN": values, "DELAY": [20, 0, 10, 5]}
    )
    assert response.status_code == 200
    assert [(e["IDX"], e["OUT"]) for e in parsed] == list(enumerate(values))


def test_generate_stream_non_decoupled(http: httpx.Client) -> None:
    response, parsed = events(http, "/v2/models/params/generate_stream", {"IN": [1, 2], "k": 1})
    assert response.status_code == 200
    assert parsed == [{"OUT": [1, 2], "PARAMS": '{"k": 1}', "model_name": "params", "model_version": "1"}]


def test_generate_stream_errors_before_inference_are_plain(http: httpx.Client) -> None:
    response, _ = events(http, "/v2/models/nope/generate_stream", {"IN": 1})
    assert_error(response, 404, "Request for unknown model: 'nope' is not found")
    response, _ = events(http, "/v2/models/square/generate_stream", {"IN": "x"})
    assert_error(response, 400)
    response, _ = events(http, "/v2/models/square/generate_stream", {"IN": 1, "triton_x": 1})
    assert_error(response, 400)


def test_generate_stream_errors_after_start_are_events(http: httpx.Client) -> None:
    response, parsed = events(http, "/v2/models/steps/generate_stream", {"N": 3, "fail_at": 1})
    assert response.status_code == 200
    base = {"model_name": "steps", "model_version": "1"}
    assert parsed == [{"OUT": 0, **base}, {"error": "steps failed at 1"}, {"OUT": 2, **base}]
    # as Triton 2.51: the status waits for the first response; a first error answers 400
    response, parsed = events(http, "/v2/models/repeat/generate_stream", {"IN": [1, 2], "DELAY": [1]})
    assert response.status_code == 400
    assert parsed == [{"error": "DELAY has 1 element(s) but IN has 2; give one delay per element"}]
    response, parsed = events(http, "/v2/models/params/generate_stream", {"IN": [1], "mode": "raise"})
    assert response.status_code == 400
    assert len(parsed) == 1 and "params backend raised on purpose" in parsed[0]["error"]


def test_generate_stream_many_at_once(server: ServerThread) -> None:
    results: dict[int, list[dict[str, Any]]] = {}

    def one(i: int) -> None:
        with httpx.Client(base_url=f"http://{server.url}", timeout=30) as c:
            _, results[i] = events(c, "/v2/models/repeat/generate_stream", {"IN": list(range(i + 1)), "id": str(i)})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(8):
        assert [(e["id"], e["IDX"], e["OUT"]) for e in results[i]] == [(str(i), k, k) for k in range(i + 1)]


def test_generate_stream_client_disconnect_cancels(server: ServerThread, http: httpx.Client, steps: StepsBackend) -> None:
    body = {"N": 100, "delay_ms": 20, "id": "gone"}
    with http.stream("POST", "/v2/models/steps/generate_stream", json=body) as response:
        assert response.status_code == 200
        first = next(response.iter_lines())
        assert first.startswith("data: ")
    assert steps.done["gone"].wait(10)
    assert steps.sent["gone"] < 30
    deadline = time.monotonic() + 60
    while server.server.dataplane.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.server.dataplane.in_flight == 0
