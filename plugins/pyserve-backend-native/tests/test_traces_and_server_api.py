"""Traces and the server API through the shim, with the C test backend ``tracing``: a request's
trace and its custom activities in pyserve's trace files and OpenTelemetry spans, child traces
and backend-made traces for BLS calls, and what the hosting server answers about itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from pyserve.testing import ServerFactory, write_model
from pyserve.tracing import TraceConfig, parse_trace_config

TRACED = """
    backend: "c_tracing"
    max_batch_size: 0
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""
IDENT = TRACED.replace("c_tracing", "c_identity")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def _repo(tmp_path: Path, backend_libraries: dict[str, Path]) -> Path:
    import shutil

    repo = tmp_path / "repo"
    shutil.copy(backend_libraries["tracing"], write_model(repo, "traced", TRACED) / "libtriton_c_tracing.so")
    shutil.copy(backend_libraries["identity"], write_model(repo, "ident", IDENT) / "libtriton_c_identity.so")
    return repo


def _ask(server: Any, headers: dict[str, str] | None = None) -> dict[str, Any]:
    with httpclient.InferenceServerClient(server.url) as client:
        inp = httpclient.InferInput("INPUT0", [2], "FP32")
        inp.set_data_from_numpy(np.array([1.5, -2.0], dtype=np.float32))
        result = client.infer("traced", [inp], request_id="r1", headers=headers)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [1.5, -2.0])
        report: dict[str, Any] = json.loads(result.get_response()["parameters"]["report"])
        report["server_name"] = client.get_server_metadata()["name"]
        return report


def _check_server_api(report: dict[str, Any], bls_calls: int) -> None:
    assert report["live"] == 1 and report["ready"] == 1
    assert report["metadata"]["name"] == report["server_name"] and "statistics" in report["metadata"]["extensions"]
    assert {(e["name"], e["state"]) for e in report["index"]} == {("ident", "READY"), ("traced", "READY")}
    (stats,) = report["stats"]["model_stats"]
    assert stats["name"] == "ident" and stats["inference_stats"]["success"]["count"] == bls_calls
    assert report["metrics_count"] == 1
    assert report["api"] == "1.34"
    assert report["server_new"] == report["server_stop"] == "Unsupported"


def _check_own_trace(report: dict[str, Any]) -> None:
    """The BLS call with the backend's own trace: every stamp went to its activity callback
    (the custom activity it reported first, then pyserve's stamps in order), then the trace
    came back through its release callback."""
    activities = report["own_activities"]
    assert activities[0] == "CUSTOM_ACTIVITY"
    stamps = activities[1:]
    assert stamps[0] == "REQUEST_START" and stamps[-1] == "REQUEST_END"
    for name in ("QUEUE_START", "COMPUTE_START", "COMPUTE_END"):
        assert name in stamps
    assert stamps.index("COMPUTE_START") < stamps.index("COMPUTE_END")
    assert report["own_released"] == 1 and report["own_id"] > 0


def test_trace_file_holds_custom_activities_and_the_child_bls_call(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory
) -> None:
    path = tmp_path / "trace.json"
    server = pyserve_server_factory(
        _repo(tmp_path, backend_libraries), trace_config=TraceConfig(level=["TIMESTAMPS"], rate=1, file=str(path))
    )
    report = _ask(server)
    assert report["traced"] == 1
    assert (report["model"], report["version"], report["request_id"]) == ("traced", 1, "r1")
    assert report["parent_id"] == 0 and report["context"] is None  # Triton mode has no context
    assert report["child_parent"] == report["id"] and report["child_id"] not in (0, report["id"])
    assert report["delete_request_trace"] == "Invalid argument"
    _check_own_trace(report)
    _check_server_api(report, bls_calls=2)  # the call with its own trace, and the child
    server.stop()
    entries = {e["id"]: e for e in json.loads(path.read_text())}
    # the request and its child BLS call; the call with the backend's own trace is not written
    assert set(entries) == {report["id"], report["child_id"]}
    traced = entries[report["id"]]
    assert traced["model_name"] == "traced" and traced["request_id"] == "r1"
    names = [t["name"] for t in traced["timestamps"]]
    assert [n for n in names if n in ("WORK_START", "MARK", "WORK_END")] == ["WORK_START", "MARK", "WORK_END"]
    assert names.index("COMPUTE_START") < names.index("WORK_START") < names.index("WORK_END") < names.index("COMPUTE_END")
    child = entries[report["child_id"]]
    assert (child["model_name"], child["model_version"], child["parent_id"]) == ("ident", 1, report["id"])
    assert "COMPUTE_START" in [t["name"] for t in child["timestamps"]]


def test_opentelemetry_spans_for_custom_activities_and_the_child_call(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory
) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    server = pyserve_server_factory(
        _repo(tmp_path, backend_libraries), trace_config=parse_trace_config(["mode=opentelemetry", "level=TIMESTAMPS", "rate=1"])
    )
    exporter = InMemorySpanExporter()
    server.server.dataplane.tracing.use_span_exporter(exporter)
    report = _ask(server, headers={"traceparent": PARENT})
    assert json.loads(json.dumps(report["context"]))["traceparent"].split("-")[1] == TRACE_ID
    spans = exporter.get_finished_spans()
    roots = {s.attributes["triton.model_name"]: s for s in spans if s.name == "InferRequest"}
    assert set(roots) == {"traced", "ident"}  # the backend's own-trace call is not exported
    traced, child = roots["traced"], roots["ident"]
    assert format(traced.context.trace_id, "032x") == TRACE_ID
    # the child BLS call is a span under the calling request's span, naming its parent trace
    assert child.parent is not None and child.parent.span_id == traced.context.span_id
    assert child.attributes["triton.trace_parent_id"] == report["id"]
    (compute,) = [s for s in spans if s.name == "compute" and s.parent.span_id == traced.context.span_id]
    (work,) = [s for s in spans if s.name == "WORK"]
    assert work.parent.span_id == compute.context.span_id
    assert [e.name for e in work.events] == ["WORK_START", "MARK", "WORK_END"]
    assert compute.start_time <= work.start_time <= work.end_time <= compute.end_time


def test_untraced_requests_and_backend_traces_with_tracing_off(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory
) -> None:
    server = pyserve_server_factory(_repo(tmp_path, backend_libraries), allow_metrics=True, metrics_port=0)
    report = _ask(server)
    assert report["traced"] == 0  # TRITONBACKEND_RequestTrace gives NULL
    _check_own_trace(report)  # a backend's own trace is reported whatever the server's settings
    _check_server_api(report, bls_calls=1)  # no child: the request has no trace
    from pyserve.tracing import TRACING

    assert not TRACING.on  # the own trace's hold on stamping ended with its request


def test_custom_counter_keeps_the_name_it_was_created_with(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory
) -> None:
    """A counter created without "_total" (Triton's identity backend names its counter so) is
    shown under that name, as Triton shows it; one created with it keeps it (``bls_calls_total``)."""
    import urllib.request

    server = pyserve_server_factory(_repo(tmp_path, backend_libraries), allow_metrics=True, metrics_port=0)
    _ask(server)
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        page = response.read().decode()
    assert "# TYPE traced_requests counter" in page
    assert 'traced_requests{backend="tracing"} 1' in page
    assert "traced_requests_total" not in page


def _control(server: Any, request_id: str) -> str:
    with httpclient.InferenceServerClient(server.url) as client:
        inp = httpclient.InferInput("INPUT0", [1], "FP32")
        inp.set_data_from_numpy(np.array([1.0], dtype=np.float32))
        result = client.infer("traced", [inp], request_id=request_id)
        return str(json.loads(result.get_response()["parameters"]["report"])["control"])


def test_model_load_and_unload_from_a_backend(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    repo = _repo(tmp_path, backend_libraries)
    server = pyserve_server_factory(repo, model_control_mode="explicit", load_models=["traced"])
    with httpclient.InferenceServerClient(server.url) as client:
        assert not client.is_model_ready("ident")
        assert _control(server, "load:ident") == "ok"
        assert client.is_model_ready("ident")
        assert _control(server, "unload:ident") == "ok"
        assert not client.is_model_ready("ident")
        assert _control(server, "load:nonexistent") != "ok"  # the load's error comes back to the backend
        assert "failed to load 'nonexistent'" in caplog.text  # (which logs its message)
        assert client.is_model_ready("traced")


def test_model_control_outside_explicit_mode_is_refused(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory
) -> None:
    server = pyserve_server_factory(_repo(tmp_path, backend_libraries))
    assert _control(server, "unload:ident") == "Unavailable"
    with httpclient.InferenceServerClient(server.url) as client:
        assert client.is_model_ready("ident")
