"""``POST /v2/models/<m>/infer`` of a decoupled model answers as a stream (JSON lines, or
Server-Sent Events with ``Accept: text/event-stream``), read the way curl reads it: raw HTTP with
httpx and a plain socket. Non-decoupled models answer as before."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from suite_support import (
    SQUARE_CONFIG,
    WORDS_MODEL_PY,
    identity_config,
    wait_for_file,
    words_config,
    write_model,
)

from pyserve.server.core import ServerThread
from pyserve.testing import serve

FINAL = "triton_final_response"


def square(n: int, **extra: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [n]}], **extra}


def text(prompt: str) -> dict[str, Any]:
    return {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [prompt]}]}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stream")
    (root / "marks").mkdir()
    repo = root / "models"
    write_model(repo, "square", SQUARE_CONFIG)
    write_model(repo, "words", words_config(root / "marks"), {"1/model.py": WORDS_MODEL_PY})
    write_model(repo, "ident", identity_config("ident", "INT32"))
    return root


@pytest.fixture(scope="module", params=["pyserve", "uvicorn"])
def server(root: Path, request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    with serve(root / "models", http_server=request.param) as thread:
        yield thread


def lines(server: ServerThread, model: str, body: dict[str, Any], **headers: str) -> tuple[httpx.Response, list[Any]]:
    with httpx.stream("POST", f"http://{server.url}/v2/models/{model}/infer", json=body, headers=headers,
                      timeout=30) as answer:
        objects = [json.loads(line) for line in answer.iter_lines() if line]
    return answer, objects


def test_json_lines_by_default_with_a_final_marker(server: ServerThread) -> None:
    answer, objects = lines(server, "square", square(3, id="r1"))

    assert answer.status_code == 200 and answer.headers["content-type"] == "application/x-ndjson"
    response = {"id": "r1", "model_name": "square", "model_version": "1",
                "outputs": [{"name": "OUT", "datatype": "INT32", "shape": [1], "data": [3]}]}
    assert objects == [{**response, "parameters": {FINAL: False}}] * 3 + [
        {"id": "r1", "model_name": "square", "model_version": "1", "outputs": [], "parameters": {FINAL: True}}]


def test_server_sent_events_when_asked(server: ServerThread) -> None:
    with httpx.stream("POST", f"http://{server.url}/v2/models/words/infer", json=text("one two three"),
                      headers={"accept": "text/event-stream"}, timeout=30) as answer:
        raw = answer.read()

    assert answer.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(e[len(b"data: "):]) for e in raw.split(b"\n\n") if e]
    assert [e["outputs"][0]["data"] for e in events[:3]] == [["one "], ["two "], ["three"]]
    assert [e["parameters"][FINAL] for e in events] == [False, False, False, True]


def test_the_wire_is_chunked_and_each_response_arrives_alone(server: ServerThread) -> None:
    body = json.dumps(text("forever wire")).encode()
    with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=30) as sock:
        sock.sendall(b"POST /v2/models/words/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while received.count(b'"data":["x"]') < 3:
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk

    head = received.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 200") and b"transfer-encoding: chunked" in head


def test_a_client_leaving_the_stream_cancels_the_model(server: ServerThread, root: Path) -> None:
    tag = f"kserve-{server.server.options.http_server}"
    with httpx.stream("POST", f"http://{server.url}/v2/models/words/infer", json=text(f"forever {tag}"),
                      timeout=30) as answer:
        for _, line in zip(range(3), answer.iter_lines()):
            assert json.loads(line)["outputs"][0]["data"] == ["x"]

    assert wait_for_file(root / "marks" / tag)


def test_model_errors_before_and_during_the_stream(server: ServerThread) -> None:
    answer, objects = lines(server, "square", square(-1))
    assert answer.status_code == 400
    assert objects == [{"error": "IN must hold exactly one non-negative integer"}]

    answer, objects = lines(server, "words", text("fail"))
    assert answer.status_code == 200
    assert [o["outputs"][0]["data"] for o in objects[:2]] == [["one "], ["two "]]
    assert objects[2]["error"].endswith("failed after two words")
    assert objects[2]["parameters"] == {FINAL: True} and len(objects) == 3


@pytest.mark.parametrize(("model", "body", "status", "message"), [
    ("square", {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1], "data": [1.0]}]}, 400, "data-type"),
    ("square", square(1, parameters={"binary_data_output": True}), 400, "binary outputs cannot be requested"),
    ("nope", square(1), 404, "unknown model"),
])
def test_bad_requests_get_errors(server: ServerThread, model: str, body: dict[str, Any], status: int,
                                 message: str) -> None:
    answer = httpx.post(f"http://{server.url}/v2/models/{model}/infer", json=body, timeout=30)

    assert answer.status_code == status and message in answer.json()["error"]


def test_streams_run_concurrently_and_non_decoupled_models_are_unchanged(server: ServerThread) -> None:
    results: list[Any] = []

    def stream(n: int) -> None:
        results.append(lines(server, "square", square(n))[1])

    threads = [threading.Thread(target=stream, args=(n,)) for n in (5, 6)]
    for thread in threads:
        thread.start()
    plain = httpx.post(f"http://{server.url}/v2/models/ident/infer", timeout=30, json={
        "inputs": [{"name": "IN", "datatype": "INT32", "shape": [1, 2], "data": [1, 2]}]})
    for thread in threads:
        thread.join(30)

    assert sorted(len(r) for r in results) == [6, 7]
    assert plain.headers["content-type"] == "application/json"
    assert plain.json()["outputs"][0]["data"] == [1, 2] and "parameters" not in plain.json()


def test_restricted_inference_covers_the_stream(root: Path) -> None:
    from pyserve.frontends.restricted import Restriction

    with serve(root / "models", http_restricted_api={"inference": Restriction("infer-key", "yes")}) as thread:
        url = f"http://{thread.url}/v2/models/square/infer"
        refused = httpx.post(url, json=square(1), timeout=30)
        allowed = httpx.post(url, json=square(1), headers={"infer-key": "yes"}, timeout=30)

    assert refused.status_code == 403
    assert allowed.status_code == 200 and len(allowed.text.splitlines()) == 2
