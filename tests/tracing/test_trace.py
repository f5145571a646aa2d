"""The trace extension: settings (global, per model, HTTP and gRPC), sampling by rate and
count, Triton trace files, and OpenTelemetry spans (in-memory exporter, W3C traceparent)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tritonclient.utils import InferenceServerException

from pyserve import InferRequest, InferResponse, InstanceContext
from pyserve.api.backend import Backend
from pyserve.server.core import ServerThread
from pyserve.tracing import (
    TRACING,
    TraceConfig,
    TraceConfigError,
    parse_trace_config,
)

IDENTITY = """
name: "{name}"
backend: "traced"
max_batch_size: 4
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
"""

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class Identity(Backend):
    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        return [InferResponse({"OUTPUT0": r.inputs["INPUT0"]}) for r in requests]


@pytest.fixture
def serve(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> Callable[..., ServerThread]:
    def start(**options: Any) -> ServerThread:
        repo = make_repo({"ident": IDENTITY.format(name="ident"), "other": IDENTITY.format(name="other")})
        return start_server(repo, backends={"traced": Identity()}, **options)

    return start


def infer(http: httpx.Client, model: str = "ident", headers: dict[str, str] | None = None) -> None:
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}
    response = http.post(f"/v2/models/{model}/infer", json=body, headers=headers)
    assert response.status_code == 200, response.text


@pytest.fixture
def client_for() -> Iterator[Callable[[ServerThread], httpx.Client]]:
    clients: list[httpx.Client] = []

    def make(server: ServerThread) -> httpx.Client:
        clients.append(httpx.Client(base_url=f"http://{server.url}", timeout=30))
        return clients[-1]

    yield make
    for c in clients:
        c.close()


def test_settings_over_http(serve: Callable[..., ServerThread], client_for: Any) -> None:
    server = serve()
    http = client_for(server)
    assert http.get("/v2/trace/setting").json() == {
        "trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1", "log_frequency": "0",
        "trace_file": "", "trace_mode": "triton",
    }
    assert not server.server.dataplane.tracing.active
    updated = http.post("/v2/trace/setting", json={"trace_level": ["TIMESTAMPS"], "trace_rate": "10"}).json()
    assert updated["trace_level"] == ["TIMESTAMPS"] and updated["trace_rate"] == "10"
    assert server.server.dataplane.tracing.active and TRACING.on

    model = http.post("/v2/models/ident/trace/setting", json={"trace_rate": "3", "trace_count": "5"}).json()
    assert model["trace_rate"] == "3" and model["trace_count"] == "5" and model["trace_level"] == ["TIMESTAMPS"]
    assert http.get("/v2/trace/setting").json()["trace_rate"] == "10"
    assert http.get("/v2/models/other/trace/setting").json()["trace_rate"] == "10"
    cleared = http.post("/v2/models/ident/trace/setting", json={"trace_rate": None}).json()
    assert cleared["trace_rate"] == "10" and cleared["trace_count"] == "5"

    for body, message in (
        ({"trace_rate": "0"}, "'trace_rate' must be >= 1"),
        ({"trace_rate": "fast"}, "must be an integer"),
        ({"trace_level": ["LOUD"]}, "unknown trace level"),
        ({"trace_file": "/tmp/x"}, "can not be updated"),
        ({"trace_count": "-2"}, "'trace_count'"),
    ):
        response = http.post("/v2/trace/setting", json=body)
        assert response.status_code == 400, body
        assert message in response.json()["error"]
    before = http.get("/v2/trace/setting").json()
    ignored = http.post("/v2/trace/setting", json={"bogus": "1"})  # Triton 2.51 ignores unknown keys
    assert ignored.status_code == 200 and ignored.json() == before
    missing = http.get("/v2/models/missing/trace/setting")  # 400, as Triton 2.51 answers
    assert missing.status_code == 400 and "Request for unknown model" in missing.json()["error"]
    server.server.models.unload_model("other")  # unloaded: unknown too, as in Triton 2.51
    gone = http.post("/v2/models/other/trace/setting", json={"trace_rate": "7"})
    assert gone.status_code == 400 and gone.json()["error"] == "Request for unknown model : other"
    assert http.get("/v2/models/ident/versions/1/trace/setting").status_code == 404

    off = http.post("/v2/trace/setting", json={"trace_level": ["OFF"]}).json()
    assert off["trace_level"] == ["OFF"]
    assert not server.server.dataplane.tracing.active  # 'ident' overrides only the count: OFF too
    on = http.post("/v2/models/ident/trace/setting", json={"trace_level": ["TIMESTAMPS"]}).json()
    assert on["trace_level"] == ["TIMESTAMPS"] and server.server.dataplane.tracing.active
    http.post("/v2/models/ident/trace/setting", json={"trace_level": None, "trace_count": None})
    assert not server.server.dataplane.tracing.active


def test_settings_over_grpc(serve: Callable[..., ServerThread]) -> None:
    server = serve()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        settings = client.get_trace_settings(as_json=True)["settings"]
        assert settings["trace_level"]["value"] == ["OFF"]
        assert settings["trace_mode"]["value"] == ["triton"]
        updated = client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "2"}, as_json=True)
        assert updated["settings"]["trace_rate"]["value"] == ["2"]
        per_model = client.update_trace_settings("ident", {"trace_count": "7"}, as_json=True)["settings"]
        assert per_model["trace_count"]["value"] == ["7"] and per_model["trace_rate"]["value"] == ["2"]
        back = client.update_trace_settings("ident", {"trace_count": None}, as_json=True)["settings"]
        assert back["trace_count"]["value"] == ["-1"]
        with pytest.raises(InferenceServerException) as info:
            client.update_trace_settings(settings={"trace_rate": "0"})
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException) as info:
            client.get_trace_settings("missing")
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"  # as Triton 2.51 answers


def test_triton_trace_files(serve: Callable[..., ServerThread], client_for: Any, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    config = TraceConfig(level=["TIMESTAMPS"], rate=1, file=str(path), log_frequency=2)
    server = serve(trace_config=config)
    http = client_for(server)
    for _ in range(3):
        infer(http)
    first = json.loads((tmp_path / "trace.json.0").read_text())
    assert len(first) == 2
    entry = first[0]
    assert entry["model_name"] == "ident" and entry["model_version"] == 1
    names = [t["name"] for t in entry["timestamps"]]
    for expected in ("REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
                     "COMPUTE_OUTPUT_START", "COMPUTE_END", "REQUEST_END"):
        assert expected in names
    stamps = [t["ns"] for t in entry["timestamps"]]
    assert stamps == sorted(stamps)
    server.stop()
    assert len(json.loads((tmp_path / "trace.json.1").read_text())) == 1


def test_rate_and_count(serve: Callable[..., ServerThread], client_for: Any, tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    server = serve(trace_config=TraceConfig(level=["TIMESTAMPS"], rate=2, count=2, file=str(path)))
    http = client_for(server)
    for _ in range(8):
        infer(http)
    settings = http.get("/v2/trace/setting").json()
    assert settings["trace_count"] == "0"
    assert not server.server.dataplane.tracing.active
    server.stop()
    traces = json.loads(path.read_text())
    assert len(traces) == 2



@pytest.mark.parametrize("log_frequency", [0, 2])
def test_settings_updates_keep_the_traces_collected_so_far(serve: Callable[..., ServerThread], client_for: Any,
                                                           tmp_path: Path, log_frequency: int) -> None:
    """Every update makes new effective settings; the traces collected under the old ones are
    written all the same (one file at the stop, or numbered files that go on counting), also
    those of a model with settings of its own writing to the same file."""
    path = tmp_path / "t.json"
    server = serve(trace_config=TraceConfig(level=["TIMESTAMPS"], rate=1, log_frequency=log_frequency, file=str(path)))
    http = client_for(server)
    for _ in range(3):
        infer(http)
    assert http.post("/v2/trace/setting", json={"trace_rate": "1", "trace_count": "-1"}).status_code == 200
    infer(http, "other")
    assert http.post("/v2/models/ident/trace/setting", json={"trace_count": "10"}).status_code == 200
    for _ in range(2):
        infer(http)
    assert http.post("/v2/models/ident/trace/setting", json={"trace_count": None}).status_code == 200
    infer(http)
    server.stop()
    files = [path] if not log_frequency else sorted(tmp_path.glob("t.json.*"), key=lambda f: int(f.suffix[1:]))
    traces = [trace for file in files for trace in json.loads(file.read_text())]
    assert [t["model_name"] for t in traces] == ["ident"] * 3 + ["other"] + ["ident"] * 3
    assert [t["id"] for t in traces] == sorted(t["id"] for t in traces)
    if log_frequency:
        assert [f.name for f in files] == ["t.json.0", "t.json.1", "t.json.2", "t.json.3"]

def test_opentelemetry_spans(serve: Callable[..., ServerThread], client_for: Any) -> None:
    server = serve(trace_config=parse_trace_config(
        ["mode=opentelemetry", "level=TIMESTAMPS", "rate=1", "opentelemetry,resource=service.name=test-svc"]
    ))
    exporter = InMemorySpanExporter()
    server.server.dataplane.tracing.use_span_exporter(exporter)
    http = client_for(server)
    assert http.get("/v2/trace/setting").json()["trace_mode"] == "opentelemetry"
    infer(http, headers={"traceparent": PARENT})

    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"InferRequest", "queue", "compute", "compute_input", "compute_infer", "compute_output"}
    root = spans["InferRequest"]
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert root.parent is not None and format(root.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert root.attributes["triton.model_name"] == "ident"
    assert root.resource.attributes["service.name"] == "test-svc"
    assert spans["queue"].parent.span_id == root.context.span_id
    assert spans["compute"].parent.span_id == root.context.span_id
    for child in ("compute_input", "compute_infer", "compute_output"):
        assert spans[child].parent.span_id == spans["compute"].context.span_id
        assert spans["compute"].start_time <= spans[child].start_time <= spans[child].end_time
    assert root.start_time <= spans["queue"].start_time and spans["compute"].end_time <= root.end_time
    assert {e.name for e in root.events} >= {"REQUEST_START", "COMPUTE_START", "REQUEST_END"}

    exporter.clear()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        tensor = grpcclient.InferInput("INPUT0", [1, 2], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 2), dtype=np.float32))
        client.infer("ident", [tensor], headers={"traceparent": PARENT})
        client.infer("ident", [tensor])
    roots = [s for s in exporter.get_finished_spans() if s.name == "InferRequest"]
    assert len(roots) == 2
    assert format(roots[0].context.trace_id, "032x") == TRACE_ID
    assert format(roots[1].context.trace_id, "032x") != TRACE_ID and roots[1].parent is None


def test_tracing_off_leaves_requests_alone(serve: Callable[..., ServerThread], client_for: Any) -> None:
    server = serve()
    seen: list[Any] = []
    original = server.server.dataplane.tracing.begin
    server.server.dataplane.tracing.begin = lambda request: (seen.append(request), original(request))  # type: ignore[method-assign]
    infer(client_for(server))
    assert seen == []


def test_trace_config_parsing() -> None:
    config = parse_trace_config([
        "level=TIMESTAMPS", "level=TENSORS", "rate=5", "count=3", "triton,file=/tmp/t.json",
        "triton,log-frequency=10", "mode=opentelemetry", "opentelemetry,url=http://collector:4318/v1/traces",
        "opentelemetry,resource=a=b", "opentelemetry,bsp_max_queue_size=10",
    ])
    assert config.level == ["TIMESTAMPS", "TENSORS"] and config.rate == 5 and config.count == 3
    assert config.file == "/tmp/t.json" and config.log_frequency == 10 and config.mode == "opentelemetry"
    assert config.url == "http://collector:4318/v1/traces" and config.resource == {"a": "b"}
    assert config.bsp == {"bsp_max_queue_size": 10}
    for bad in ("level=LOUD", "rate=0", "rate=x", "count=-5", "mode=jaeger", "jaeger,url=x", "nokey",
                "triton,url=x", "opentelemetry,resource=novalue"):
        with pytest.raises(TraceConfigError):
            parse_trace_config([bad])
