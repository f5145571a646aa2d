"""What the statistics' durations cover (issue 30, item 3) and ``response_stats`` (item 7).

Every path must keep queue + compute input + compute infer + compute output within the
request's duration (the invariant perf_analyzer's "overhead" relies on): HTTP and gRPC unary,
gRPC streaming, ensembles and their steps, BLS calls, and per-batch statistics. Nothing here
compares a duration with a wall-clock threshold: the sums hold by construction, whatever the load.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from suite_support import QueuedStream, StartServer, wait_for

from pyserve import (
    Backend,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from pyserve.server.core import ServerThread

BIG = 200_000  # FP32 elements: decoding and encoding them as JSON takes far longer than the rest
PARTS = ("queue", "compute_input", "compute_infer", "compute_output")

IDENTITY = """
    backend: "identity"
    max_batch_size: 0
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

CHAIN = """
    platform: "ensemble"
    max_batch_size: 0
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
    ensemble_scheduling { step [
      { model_name: "ident" model_version: -1 input_map { key: "INPUT0" value: "INPUT0" }
        output_map { key: "OUTPUT0" value: "mid" } },
      { model_name: "ident" model_version: -1 input_map { key: "INPUT0" value: "mid" }
        output_map { key: "OUTPUT0" value: "OUTPUT0" } }
    ] }
"""

PYADD_CONFIG = """
    backend: "python"
    max_batch_size: 4
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
    output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

PYADD_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() + 1)])
            for r in requests]
"""

BLS_CONFIG = """
    backend: "python"
    max_batch_size: 0
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

BLS_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(model_name="ident", requested_output_names=["OUTPUT0"],
                                             inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0")])
            answer = call.exec()
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.get_output_tensor_by_name(answer, "OUTPUT0")]))
        return responses
"""

CHATTY = """
    backend: "chatty"
    max_batch_size: 0
    model_transaction_policy { decoupled: true }
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

GATED = """
    backend: "gated"
    max_batch_size: 0
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


class ChattyBackend(Backend):
    """Decoupled: two responses through the response sender, then the final flag alone; a
    negative first element answers an error instead."""

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> None:
        for request in requests:
            sender = request.response_sender()
            data = request.inputs["INPUT0"]
            if data.reshape(-1)[0] < 0:
                sender.send(RuntimeError("negative input"), final=True)
                continue
            sender.send(InferResponse({"OUTPUT0": data}))
            sender.send(InferResponse({"OUTPUT0": data * 2}))
            sender.send(None, final=True)


class GatedBackend(Backend):
    """Echoes INPUT0; ``open`` holds executes."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.executing = threading.Event()

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[Any]:
        self.executing.set()
        assert self.open.wait(30)
        return [InferResponse({"OUTPUT0": r.inputs["INPUT0"]}) for r in requests]


@pytest.fixture
def gated() -> GatedBackend:
    return GatedBackend()


@pytest.fixture
def server(make_repo: Callable[..., Path], start_server: StartServer, gated: GatedBackend) -> ServerThread:
    repo = make_repo({"ident": IDENTITY, "chain": CHAIN, "pyadd": PYADD_CONFIG, "bls": BLS_CONFIG,
                      "chatty": CHATTY, "gated": GATED})
    (repo / "pyadd" / "1" / "model.py").write_text(PYADD_PY)
    (repo / "bls" / "1" / "model.py").write_text(BLS_PY)
    return start_server(repo, backends={"chatty": ChattyBackend(), "gated": gated})


def stats(server: ServerThread, model: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{server.url}/v2/models/{model}/stats", timeout=30) as response:
        entry: dict[str, Any] = json.loads(response.read())["model_stats"][0]
    return entry


def post(server: ServerThread, model: str, values: Sequence[float], shape: Sequence[int] | None = None) -> int:
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": list(shape or [len(values)]),
                        "data": list(values)}]}
    request = urllib.request.Request(f"http://{server.url}/v2/models/{model}/infer", json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)


def assert_adds_up(entry: dict[str, Any], requests: int) -> dict[str, Any]:
    """The model's requests: counted ``requests`` times, queue and compute within the request."""
    inference = entry["inference_stats"]
    assert inference["success"]["count"] == requests
    for key in PARTS:
        assert inference[key]["count"] == requests, key
    parts = sum(inference[key]["ns"] for key in PARTS)
    assert 0 < parts <= inference["success"]["ns"], inference
    return dict(inference)


def test_http_decoding_and_encoding_are_in_the_request_not_in_compute(server: ServerThread) -> None:
    """Before: a big JSON request's decode and encode times were counted as compute input /
    output while falling outside the request duration, so the parts exceeded the whole."""
    for _ in range(2):
        assert post(server, "ident", [0.5] * BIG) == 200
    inference = assert_adds_up(stats(server, "ident"), 2)
    assert inference["compute_input"]["ns"] == 0  # the identity backend reports no phases
    assert inference["compute_output"]["ns"] > 0  # checking its responses
    batches = stats(server, "ident")["batch_stats"]
    assert [b["batch_size"] for b in batches] == [1]
    assert batches[0]["compute_output"]["count"] == 2 and batches[0]["compute_output"]["ns"] > 0


def test_grpc_unary_and_streaming_add_up(server: ServerThread) -> None:
    data = np.full(BIG, 0.25, dtype=np.float32)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        tensor = grpcclient.InferInput("INPUT0", [BIG], "FP32")
        tensor.set_data_from_numpy(data)
        client.infer("ident", [tensor])
    finally:
        client.close()
    stream = QueuedStream(server.grpc_url)
    try:
        stream.client.async_stream_infer("ident", [tensor])
        result, error = stream.next()
        assert error is None and result.as_numpy("OUTPUT0").shape == (BIG,)
    finally:
        stream.close()
    # the streamed request is counted once its final response is encoded: wait for it
    wait_for(lambda: stats(server, "ident")["inference_stats"]["success"]["count"] == 2)
    inference = assert_adds_up(stats(server, "ident"), 2)
    assert inference["compute_output"]["ns"] > 0  # streamed requests too (it was always 0)


def test_python_backend_reports_its_phases(server: ServerThread) -> None:
    """The Python backend splits its execute: wrapping the requests is compute input,
    ``execute()`` compute infer, converting the responses compute output (per request and per
    batch; batch_stats compute input/output stayed 0 before)."""
    for _ in range(3):
        assert post(server, "pyadd", [1.0, 2.0, 3.0, 4.0], shape=[1, 4]) == 200
    entry = stats(server, "pyadd")
    inference = assert_adds_up(entry, 3)
    assert inference["compute_input"]["ns"] > 0 and inference["compute_output"]["ns"] > 0
    (batch,) = entry["batch_stats"]
    assert batch["batch_size"] == 1 and batch["compute_input"]["count"] == 3
    assert batch["compute_input"]["ns"] > 0 and batch["compute_output"]["ns"] > 0
    batch_total = sum(batch[k]["ns"] for k in ("compute_input", "compute_infer", "compute_output"))
    assert batch_total <= inference["success"]["ns"]


def test_ensemble_and_its_steps_add_up(server: ServerThread) -> None:
    for _ in range(2):
        assert post(server, "chain", [1.0] * 1000) == 200
    chain = stats(server, "chain")
    step = stats(server, "ident")
    inference = assert_adds_up(chain, 2)
    step_inference = assert_adds_up(step, 4)  # two steps per request
    for key in ("compute_input", "compute_infer", "compute_output"):  # the sums of its steps'
        assert inference[key]["ns"] == step_inference[key]["ns"], key
    assert chain["execution_count"] == 2 and chain["batch_stats"][0]["compute_output"]["count"] == 2
    # a step's queue includes the hand-off from the step before it: the steps' queue and
    # compute together stay within the ensemble's request
    steps_total = sum(step_inference[key]["ns"] for key in PARTS)
    assert steps_total <= inference["success"]["ns"]


def test_bls_calls_add_up(server: ServerThread) -> None:
    assert post(server, "bls", [3.0, 4.0]) == 200
    assert_adds_up(stats(server, "bls"), 1)
    inner = assert_adds_up(stats(server, "ident"), 1)
    assert inner["compute_output"]["ns"] > 0


# -- response_stats ----------------------------------------------------------------------------------


def test_response_stats_of_a_plain_model(server: ServerThread) -> None:
    for _ in range(3):
        assert post(server, "ident", [1.0, 2.0]) == 200
    responses = stats(server, "ident")["response_stats"]
    assert list(responses) == ["0"]
    first = responses["0"]
    assert set(first) == {"compute_infer", "compute_output", "success", "fail", "empty_response", "cancel"}
    assert first["success"]["count"] == 3 and first["compute_infer"]["count"] == 3
    assert first["compute_output"]["count"] == 3
    assert first["fail"] == first["empty_response"] == first["cancel"] == {"count": 0, "ns": 0}
    assert first["compute_infer"]["ns"] + first["compute_output"]["ns"] == first["success"]["ns"]


def test_response_stats_by_index_for_a_decoupled_model(server: ServerThread) -> None:
    stream = QueuedStream(server.grpc_url)
    try:
        tensor = grpcclient.InferInput("INPUT0", [2], "FP32")
        tensor.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
        for _ in range(2):
            stream.client.async_stream_infer("chatty", [tensor], enable_empty_final_response=True)
        for _ in range(6):  # two responses and the empty final one, twice
            _, error = stream.next()
            assert error is None
        bad = grpcclient.InferInput("INPUT0", [1], "FP32")
        bad.set_data_from_numpy(np.array([-1.0], dtype=np.float32))
        stream.client.async_stream_infer("chatty", [bad])
        assert stream.error() is not None
    finally:
        stream.close()
    wait_for(lambda: stats(server, "chatty")["inference_stats"]["fail"]["count"] == 1)
    responses = stats(server, "chatty")["response_stats"]
    assert sorted(responses) == ["0", "1", "2"]
    assert responses["0"]["success"]["count"] == 2 and responses["0"]["fail"]["count"] == 1
    assert responses["1"]["success"]["count"] == 2
    assert responses["2"]["empty_response"]["count"] == 2 and responses["2"]["success"]["count"] == 0
    assert responses["2"]["compute_infer"]["count"] == 0  # a bare final flag computes nothing


def test_response_stats_count_a_cancelled_request(server: ServerThread, gated: GatedBackend) -> None:
    gated.open.clear()
    gated.executing.clear()
    holder = threading.Thread(target=post, args=(server, "gated", [1.0]))
    holder.start()
    try:
        assert gated.executing.wait(10)
        body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": [2.0]}]})
        client = socket.create_connection(("127.0.0.1", server.server.http_port))
        client.sendall(b"POST /v2/models/gated/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode()))
        wait_for(lambda: stats(server, "gated")["inference_stats"]["success"]["count"] == 0
                 and _pending(server) == 1, what="the second request queued")
        client.close()  # the client goes away while its request waits
        time.sleep(0.2)
    finally:
        gated.open.set()
        holder.join(30)
    wait_for(lambda: stats(server, "gated")["inference_stats"]["fail"]["count"] == 1)
    first = stats(server, "gated")["response_stats"]["0"]
    assert first["success"]["count"] == 1 and first["cancel"]["count"] == 1


def _pending(server: ServerThread) -> int:
    record = server.server.models.records["gated"]
    return int(record.versions[1].stats.pending)


def test_memory_usage_reported_by_a_backend(make_repo: Callable[..., Path], start_server: StartServer) -> None:
    class Holding(Backend):
        def create_model(self, model: Any) -> None:
            model.report_memory_usage([("CPU", 0, 4096), ("GPU", 1, 1 << 20)])
            with pytest.raises(ValueError, match="type must be one of"):
                model.report_memory_usage([("DISK", 0, 1)])

        def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[Any]:
            return [InferResponse({"OUTPUT0": r.inputs["INPUT0"]}) for r in requests]

    repo = make_repo({"held": GATED.replace('"gated"', '"holding"')})
    server = start_server(repo, backends={"holding": Holding()}, use_entry_points=False)
    assert stats(server, "held")["memory_usage"] == [
        {"type": "CPU", "id": 0, "byte_size": 4096}, {"type": "GPU", "id": 1, "byte_size": 1 << 20}
    ]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        message = client.get_inference_statistics("held")
    finally:
        client.close()
    usage = message.model_stats[0].memory_usage
    assert [(u.type, u.id, u.byte_size) for u in usage] == [("CPU", 0, 4096), ("GPU", 1, 1 << 20)]
