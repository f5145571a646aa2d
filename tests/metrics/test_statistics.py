"""The statistics extension: ``GET /v2/models[/{m}[/versions/{v}]]/stats`` and gRPC
``ModelStatistics`` (through ``tritonclient``), with Triton's JSON shape and counting rules."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from suite_support import StartServer
from tritonclient.utils import InferenceServerException

from pyserve import (
    Backend,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from pyserve.server.core import ServerThread

CONFIG = """
    backend: "hold"
    max_batch_size: 8
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
    output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""

DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")


class HoldBackend(Backend):
    """Echoes INPUT0 after ``delay`` seconds; a negative first element fails, 1000 or more makes
    the execute raise; ``gate`` holds executes."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.executing = threading.Event()
        self.delay = 0.002

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[Any]:
        self.executing.set()
        assert self.gate.wait(30)
        time.sleep(self.delay)
        if any(r.inputs["INPUT0"].reshape(-1)[0] >= 1000 for r in requests):
            raise RuntimeError("execute raised on purpose")
        results: list[Any] = []
        for request in requests:
            data = request.inputs["INPUT0"]
            results.append(ValueError("negative") if data.reshape(-1)[0] < 0 else InferResponse({"OUTPUT0": data}))
        return results


@pytest.fixture
def hold() -> HoldBackend:
    return HoldBackend()


@pytest.fixture
def server(make_repo: Callable[..., Path], start_server: StartServer, hold: HoldBackend) -> ServerThread:
    repo = make_repo({
        "alpha": CONFIG,
        "batched": CONFIG + "dynamic_batching { max_queue_delay_microseconds: 100 }\n",
    }, versions=(1, 2))
    for name in ("alpha", "batched"):
        (repo / name / "config.pbtxt").write_text(
            (repo / name / "config.pbtxt").read_text() + "version_policy { all { } }\n"
        )
    return start_server(repo, backends={"hold": hold}, use_entry_points=False)


def infer(server: ServerThread, model: str, value: float = 1.0, batch: int = 1, version: str = "") -> int:
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    data = [[value, value]] * batch
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [batch, 2], "data": data}]})
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://{server.url}{path}", body.encode())) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)


def get(server: ServerThread, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://{server.url}{path}") as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), json.loads(exc.read())


def test_an_execute_that_raises_is_still_an_execution(server: ServerThread) -> None:
    """As Triton 2.51 counts it: the failed requests, and the execution with its batch, but no
    inferences (its ``nv_inference_count`` stays 0)."""
    assert infer(server, "alpha", value=1000.0) == 500
    assert infer(server, "alpha", value=1000.0, batch=2) == 500
    entry = get(server, "/v2/models/alpha/versions/2/stats")[1]["model_stats"][0]
    assert entry["inference_stats"]["fail"]["count"] == 2
    assert entry["execution_count"] == 2 and entry["inference_count"] == 0
    assert sorted(b["batch_size"] for b in entry["batch_stats"]) == [1, 2]
    assert entry["last_inference"] > 0  # set although every request failed, as Triton sets it


def test_statistics_is_a_reported_extension(server: ServerThread) -> None:
    assert "statistics" in get(server, "/v2")[1]["extensions"]


def test_json_shape_before_any_request(server: ServerThread) -> None:
    status, body = get(server, "/v2/models/stats")
    assert status == 200
    assert [(m["name"], m["version"]) for m in body["model_stats"]] == [
        ("alpha", "1"), ("alpha", "2"), ("batched", "1"), ("batched", "2")
    ]
    entry = body["model_stats"][0]
    assert set(entry) == {
        "name", "version", "last_inference", "inference_count", "execution_count", "inference_stats",
        "response_stats", "batch_stats", "memory_usage",
    }
    assert entry["last_inference"] == 0 and entry["inference_count"] == 0 and entry["execution_count"] == 0
    assert entry["inference_stats"] == {key: {"count": 0, "ns": 0} for key in DURATIONS}
    assert entry["response_stats"] == {} and entry["batch_stats"] == [] and entry["memory_usage"] == []


def test_counts_follow_triton_rules(server: ServerThread) -> None:
    before_ms = time.time() * 1000
    for _ in range(3):
        assert infer(server, "alpha") == 200
    assert infer(server, "alpha", batch=3) == 200
    assert infer(server, "alpha", value=-1.0) == 500
    assert infer(server, "alpha", version="1") == 200
    status, body = get(server, "/v2/models/alpha/stats")  # every version of the model
    assert status == 200
    v1, v2 = body["model_stats"]
    assert (v1["version"], v2["version"]) == ("1", "2")
    assert v1["inference_count"] == 1 and v1["inference_stats"]["success"]["count"] == 1
    stats = v2["inference_stats"]
    assert stats["success"]["count"] == 4
    assert stats["fail"]["count"] == 1 and stats["fail"]["ns"] > 0
    assert stats["queue"]["count"] == 4
    for key in ("compute_input", "compute_infer", "compute_output"):
        assert stats[key]["count"] == 4
    assert stats["compute_infer"]["ns"] >= 4 * 2_000_000  # the backend sleeps 2 ms per execute
    # the backend reports no compute of its own: the execute call is compute infer, the checking
    # of its responses compute output; decoding and encoding are in the request, not in compute
    assert stats["compute_input"]["ns"] == 0 and stats["compute_output"]["ns"] > 0
    parts = sum(stats[key]["ns"] for key in ("queue", "compute_input", "compute_infer", "compute_output"))
    assert parts <= stats["success"]["ns"]
    assert stats["cache_hit"] == {"count": 0, "ns": 0}
    assert v2["execution_count"] == 5  # the failed request executed too
    assert v2["inference_count"] == 3 + 3 + 1
    assert before_ms - 1000 <= v2["last_inference"] <= time.time() * 1000 + 1000
    sizes = {entry["batch_size"]: entry for entry in v2["batch_stats"]}
    assert sorted(sizes) == [1, 3]
    assert sizes[1]["compute_infer"]["count"] == 4 and sizes[3]["compute_infer"]["count"] == 1
    assert set(sizes[1]) == {"batch_size", "compute_input", "compute_infer", "compute_output"}
    # one version only
    status, body = get(server, "/v2/models/alpha/versions/1/stats")
    assert status == 200 and [m["version"] for m in body["model_stats"]] == ["1"]


def test_dynamic_batcher_execution_and_queue(server: ServerThread, hold: HoldBackend) -> None:
    hold.gate.clear()
    hold.executing.clear()
    with ThreadPoolExecutor(6) as pool:
        first = pool.submit(infer, server, "batched")
        assert hold.executing.wait(10)
        rest = [pool.submit(infer, server, "batched") for _ in range(4)]
        time.sleep(0.3)  # the four wait in the queue while the first executes
        hold.gate.set()
        assert first.result() == 200 and all(f.result() == 200 for f in rest)
    entry = get(server, "/v2/models/batched/versions/2/stats")[1]["model_stats"][0]
    assert entry["inference_count"] == 5
    assert entry["execution_count"] == 2
    assert {b["batch_size"]: b["compute_infer"]["count"] for b in entry["batch_stats"]} == {1: 1, 4: 1}
    queue = entry["inference_stats"]["queue"]
    assert queue["count"] == 5 and queue["ns"] >= 4 * 250_000_000  # the four queued ≥ 0.3 s each


def test_unknown_model_or_version(server: ServerThread) -> None:
    status, body = get(server, "/v2/models/nope/stats")
    assert status == 400 and body == {"error": "requested model 'nope' is not available"}
    status, body = get(server, "/v2/models/alpha/versions/9/stats")
    assert status == 400 and "not available for model 'alpha'" in body["error"]


def test_grpc_model_statistics_matches_http(server: ServerThread) -> None:
    for _ in range(2):
        assert infer(server, "alpha") == 200
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        message = client.get_inference_statistics("alpha", "2")
        assert len(message.model_stats) == 1
        stats = message.model_stats[0]
        assert (stats.name, stats.version) == ("alpha", "2")
        assert stats.inference_count == 2 and stats.execution_count == 2
        assert stats.inference_stats.success.count == 2
        http_entry = get(server, "/v2/models/alpha/versions/2/stats")[1]["model_stats"][0]
        assert stats.inference_stats.success.ns == http_entry["inference_stats"]["success"]["ns"]
        assert stats.last_inference == http_entry["last_inference"]
        assert [b.batch_size for b in stats.batch_stats] == [1]
        everything = client.get_inference_statistics(as_json=True)
        assert [(m["name"], m["version"]) for m in everything["model_stats"]] == [
            ("alpha", "1"), ("alpha", "2"), ("batched", "1"), ("batched", "2")
        ]
        with pytest.raises(InferenceServerException) as unknown:
            client.get_inference_statistics("nope")
        assert unknown.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
        assert "requested model 'nope' is not available" in unknown.value.message()
    finally:
        client.close()


def test_http_tritonclient_statistics(server: ServerThread) -> None:
    assert infer(server, "batched", batch=2) == 200
    client = httpclient.InferenceServerClient(server.url)
    try:
        stats = client.get_inference_statistics("batched")
        assert [m["version"] for m in stats["model_stats"]] == ["1", "2"]
        assert stats["model_stats"][1]["inference_count"] == 2
        assert stats["model_stats"][1]["execution_count"] == 1
        with pytest.raises(InferenceServerException, match="not available"):
            client.get_inference_statistics("nope")
    finally:
        client.close()


def test_grpc_infer_durations_add_up(server: ServerThread) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        tensor = grpcclient.InferInput("INPUT0", [1, 2], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 2), np.float32))
        client.infer("alpha", [tensor])
        stats = client.get_inference_statistics("alpha", "2", as_json=True)["model_stats"][0]["inference_stats"]
    finally:
        client.close()
    assert int(stats["success"]["count"]) == 1
    assert int(stats["compute_output"]["ns"]) > 0
    parts = sum(int(stats[key].get("ns", 0)) for key in ("queue", "compute_input", "compute_infer", "compute_output"))
    assert parts <= int(stats["success"]["ns"])
