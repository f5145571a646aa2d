"""Ensemble steps are traced as children of the ensemble's trace, as Triton traces composing
models: in OpenTelemetry mode their ``InferRequest`` spans hang under the ensemble's (read here
from a real OTLP/HTTP receiver on a loopback port, fed by the server's own exporter), in Triton
mode their trace-file entries carry the ensemble's id as ``parent_id``."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from pyserve import InferRequest, InferResponse, InstanceContext
from pyserve.api.backend import Backend
from pyserve.server.core import ServerThread
from pyserve.tracing import parse_trace_config

trace_service = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2", reason="opentelemetry-proto is not installed")

STEP = """
name: "{name}"
backend: "traced"
max_batch_size: 4
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
"""

PIPELINE = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
ensemble_scheduling { step [
  { model_name: "first" model_version: -1 input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "MID" } },
  { model_name: "second" model_version: -1 input_map { key: "INPUT0" value: "MID" } output_map { key: "OUTPUT0" value: "OUT" } }
] }
"""

OUTER = """
name: "outer"
platform: "ensemble"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
ensemble_scheduling { step [
  { model_name: "pipeline" model_version: -1 input_map { key: "IN" value: "X" } output_map { key: "OUT" value: "Y" } }
] }
"""

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Identity(Backend):
    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        return [InferResponse({"OUTPUT0": r.inputs["INPUT0"]}) for r in requests]


class Receiver:
    """An OTLP/HTTP trace receiver (protobuf bodies on ``/v1/traces``) on a loopback port."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                request = trace_service.ExportTraceServiceRequest.FromString(body)
                with receiver._lock:
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            receiver.spans.extend(scope.spans)
                answer = trace_service.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    yield found
    found.close()


@pytest.fixture
def serve(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> Callable[..., ServerThread]:
    def start(trace: list[str]) -> ServerThread:
        repo = make_repo({"first": STEP.format(name="first"), "second": STEP.format(name="second"),
                          "pipeline": PIPELINE, "outer": OUTER})
        return start_server(repo, backends={"traced": Identity()}, trace_config=parse_trace_config(trace))

    return start


def infer(server: ServerThread, model: str, name: str, headers: dict[str, str] | None = None) -> None:
    body = {"inputs": [{"name": name, "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}
    response = httpx.post(f"http://{server.url}/v2/models/{model}/infer", json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [1.0, 2.0]


def _attribute(span: Any, key: str) -> Any:
    for attribute in span.attributes:
        if attribute.key == key:
            value = attribute.value
            return value.string_value if value.HasField("string_value") else value.int_value
    return None


def test_ensemble_steps_are_child_spans_in_opentelemetry(serve: Callable[..., ServerThread], receiver: Receiver) -> None:
    server = serve(["mode=opentelemetry", "level=TIMESTAMPS", "rate=1", f"opentelemetry,url={receiver.url}",
                    "opentelemetry,bsp_schedule_delay=50"])
    infer(server, "outer", "X", headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    server.stop()  # flushes the exporter

    spans = receiver.spans
    requests = {_attribute(s, "triton.model_name"): s for s in spans if s.name == "InferRequest"}
    assert sorted(requests) == ["first", "outer", "pipeline", "second"], [s.name for s in spans]
    assert {s.trace_id.hex() for s in spans} == {CLIENT_TRACE}  # one trace: the client's
    outer, pipeline = requests["outer"], requests["pipeline"]
    assert outer.parent_span_id.hex() == CLIENT_SPAN
    assert pipeline.parent_span_id == outer.span_id  # a step under its ensemble
    assert requests["first"].parent_span_id == requests["second"].parent_span_id == pipeline.span_id
    assert _attribute(pipeline, "triton.trace_parent_id") == _attribute(outer, "triton.trace_id")
    assert _attribute(requests["first"], "triton.trace_parent_id") == _attribute(pipeline, "triton.trace_id")
    assert _attribute(outer, "triton.trace_parent_id") == 0
    by_id = {s.span_id: s for s in spans}
    for step in ("first", "second"):  # each step has its own queue and compute spans
        below = {s.name for s in spans if s.parent_span_id == requests[step].span_id}
        assert {"queue", "compute"} <= below, below
        compute = next(s for s in spans if s.name == "compute" and s.parent_span_id == requests[step].span_id)
        assert {s.name for s in spans if s.parent_span_id == compute.span_id} == {
            "compute_input", "compute_infer", "compute_output"}
    for span in spans:  # every span but the root hangs under a span of this trace
        if span is not outer:
            assert span.parent_span_id in by_id, span.name
            parent = by_id[span.parent_span_id]
            assert parent.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano
            assert span.end_time_unix_nano <= parent.end_time_unix_nano


def test_ensemble_steps_name_their_parent_in_triton_trace_files(serve: Callable[..., ServerThread],
                                                                 tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    server = serve(["level=TIMESTAMPS", "rate=1", "count=1", f"triton,file={path}"])
    infer(server, "outer", "X")  # the one request the count lets through, with all its steps
    infer(server, "outer", "X")  # not traced, nor are its steps
    server.stop()
    entries = {e["model_name"]: e for e in json.loads(path.read_text())}
    assert sorted(entries) == ["first", "outer", "pipeline", "second"]
    assert "parent_id" not in entries["outer"]
    assert entries["pipeline"]["parent_id"] == entries["outer"]["id"]
    assert entries["first"]["parent_id"] == entries["second"]["parent_id"] == entries["pipeline"]["id"]
    assert len({e["id"] for e in entries.values()}) == 4
    for name in ("first", "second"):  # stamped although the count ran out when the request began
        stamps = [t["name"] for t in entries[name]["timestamps"]]
        assert stamps == ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
                          "COMPUTE_OUTPUT_START", "COMPUTE_END", "REQUEST_END"], stamps
    for name in ("outer", "pipeline"):  # an ensemble computes from its first step to its answer
        stamps = {t["name"]: t["ns"] for t in entries[name]["timestamps"]}
        assert stamps["COMPUTE_START"] <= stamps["COMPUTE_END"] <= stamps["REQUEST_END"]
    first = {t["name"]: t["ns"] for t in entries["first"]["timestamps"]}
    pipeline = {t["name"]: t["ns"] for t in entries["pipeline"]["timestamps"]}
    assert pipeline["COMPUTE_START"] <= first["REQUEST_START"] and first["REQUEST_END"] <= pipeline["REQUEST_END"]
