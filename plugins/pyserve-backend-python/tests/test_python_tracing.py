"""``request.trace().get_context()`` and BLS calls under OpenTelemetry tracing, as in Triton."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from python_backend_helpers import PROCESS_MODE as PROCESS
from python_backend_helpers import start, write_python_model

from pyserve.server.core import ServerThread
from pyserve.tracing import parse_trace_config

TRACE_ID = "0af7651916cd43dd8448eb211c126601"
PARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"

CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "CONTEXT" data_type: TYPE_STRING dims: [ 2 ] } ]
"""

# CONTEXT[0]: this request's trace context ("none" when not traced); CONTEXT[1]: what the
# BLS call to "inner" answered (IN 1: with trace=request.trace(), 2: without), or "".
SOURCE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            how = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            mine = request.trace().get_context() or "none"
            theirs = ""
            if how:
                extra = {"trace": request.trace()} if how == 1 else {}
                call = pb_utils.InferenceRequest(
                    model_name="inner", requested_output_names=["CONTEXT"],
                    inputs=[pb_utils.Tensor("IN", np.array([0], dtype=np.int32))], **extra)
                answer = call.exec()
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
                theirs = pb_utils.get_output_tensor_by_name(answer, "CONTEXT").as_numpy()[0].decode()
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("CONTEXT", np.array([mine.encode(), theirs.encode()], dtype=object))]))
        return out
"""


def _ask(server: ServerThread, model: str, how: int, headers: dict[str, str] | None = None) -> tuple[str, str]:
    item = httpclient.InferInput("IN", [1], "INT32")
    item.set_data_from_numpy(np.array([how], dtype=np.int32))
    result = httpclient.InferenceServerClient(server.url).infer(model, [item], headers=headers)
    mine, theirs = (v.decode() for v in result.as_numpy("CONTEXT"))
    return mine, theirs


def _ids(context: str) -> tuple[str, str]:
    parts = json.loads(context)["traceparent"].split("-")
    assert parts[0] == "00" and parts[3] == "01"
    return parts[1], parts[2]


def _roots(exporter: InMemorySpanExporter) -> dict[str, object]:
    spans = [s for s in exporter.get_finished_spans() if s.name == "InferRequest"]
    return {s.attributes["triton.model_name"]: s for s in spans}  # type: ignore[index,union-attr]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_get_context_names_the_request_span_and_bls_calls_become_its_children(tmp_path: Path, mode: str) -> None:
    extra = PROCESS if mode == "process" else ""
    write_python_model(tmp_path, "outer", CONFIG + extra, SOURCE)
    write_python_model(tmp_path, "inner", CONFIG + extra, SOURCE)
    server = start(tmp_path, trace_config=parse_trace_config(["mode=opentelemetry", "level=TIMESTAMPS", "rate=1"]))
    try:
        exporter = InMemorySpanExporter()
        server.server.dataplane.tracing.use_span_exporter(exporter)

        mine, theirs = _ask(server, "outer", 1, headers={"traceparent": PARENT})
        trace_id, span_id = _ids(mine)
        assert trace_id == TRACE_ID  # the client's trace goes on
        inner_trace, inner_span = _ids(theirs)
        roots = _roots(exporter)
        outer, inner = roots["outer"], roots["inner"]
        assert format(outer.context.trace_id, "032x") == trace_id  # type: ignore[attr-defined]
        assert format(outer.context.span_id, "016x") == span_id  # type: ignore[attr-defined]
        assert format(outer.parent.span_id, "016x") == "b7ad6b7169203331"  # type: ignore[attr-defined]
        assert format(inner.context.span_id, "016x") == inner_span and inner_trace == trace_id  # type: ignore[attr-defined]
        assert inner.parent.span_id == outer.context.span_id  # type: ignore[attr-defined]

        exporter.clear()
        mine, theirs = _ask(server, "outer", 2)  # no client parent; BLS without trace=
        roots = _roots(exporter)
        assert _ids(mine)[0] != TRACE_ID and roots["outer"].parent is None  # type: ignore[attr-defined]
        assert _ids(theirs)[0] != _ids(mine)[0] and roots["inner"].parent is None  # type: ignore[attr-defined]
    finally:
        server.stop()


def test_get_context_is_none_without_opentelemetry_tracing(tmp_path: Path) -> None:
    write_python_model(tmp_path, "outer", CONFIG, SOURCE)
    write_python_model(tmp_path, "inner", CONFIG, SOURCE)
    server = start(tmp_path)
    try:
        assert _ask(server, "outer", 1) == ("none", "none")
    finally:
        server.stop()
    server = start(tmp_path, trace_config=parse_trace_config(["level=TIMESTAMPS", "rate=1", f"triton,file={tmp_path / 't.json'}"]))
    try:
        assert _ask(server, "outer", 1) == ("none", "none")  # Triton mode: traced, but no OpenTelemetry context
    finally:
        server.stop()


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_bls_calls_with_the_request_trace_are_its_children_in_triton_trace_files(tmp_path: Path, mode: str) -> None:
    """In Triton mode too (no OpenTelemetry context), a BLS call given ``trace=request.trace()``
    is traced as the request's child: its entry names the request's trace id as ``parent_id``,
    whatever the sampling (rate 1000: only the first request is sampled). A call without it is
    a request of its own, sampled as any other."""
    extra = PROCESS if mode == "process" else ""
    repo = tmp_path / "repo"
    write_python_model(repo, "outer", CONFIG + extra, SOURCE)
    write_python_model(repo, "inner", CONFIG + extra, SOURCE)
    path = tmp_path / "trace.json"
    server = start(repo, trace_config=parse_trace_config(["level=TIMESTAMPS", "rate=1000", f"triton,file={path}"]))
    try:
        assert _ask(server, "outer", 1) == ("none", "none")  # sampled, with its BLS call
        _ask(server, "outer", 1)  # not sampled: neither is its call
    finally:
        server.stop()
    entries = json.loads(path.read_text())
    assert [e["model_name"] for e in entries] == ["inner", "outer"], entries
    inner, outer = entries
    assert inner["parent_id"] == outer["id"] and "parent_id" not in outer
    assert "COMPUTE_START" in [t["name"] for t in inner["timestamps"]]
