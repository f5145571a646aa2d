"""What a model returns that its config did not promise. As Triton 2.51 answers it: a missing
output is left out (200), and an output of another datatype is answered (200). pyserve converts
it to the declared datatype when numpy casts it within its kind without wrapping; any other is
sent as the model produced it, with its own datatype, as Triton sends it. Only an array with no
tensor datatype (complex) fails the request (500 / INTERNAL). Each leniency is logged once per
model and output."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from suite_support import StartServer, write_model
from tritonclient.utils import InferenceServerException

from pyserve import (
    Backend,
    InferRequest,
    InferResponse,
    InstanceContext,
)

CONFIG = """
    backend: "sloppy"
    max_batch_size: 0
    input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
    output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] },
             { name: "COUNT" data_type: TYPE_INT32 dims: [ 2 ] } ]
"""


class SloppyBackend(Backend):
    """Answers by the request parameter ``mode``: ``float64`` / ``int`` (OUT of another
    datatype), ``missing`` (no OUT), ``text`` (OUT as strings), ``wide`` (COUNT as int64 values
    beyond INT32), ``fraction`` (COUNT as float32), ``objects`` (COUNT as Python ints in an object
    array), ``complex`` (OUT as complex64), else exactly what the config declares."""

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        answers = []
        for request in requests:
            values = np.asarray(request.inputs["IN"])
            mode = request.parameters.get("mode", "")
            outputs: dict[str, np.ndarray] = {"COUNT": np.array([1, 2], np.int32)}
            if mode == "float64":
                outputs["OUT"] = values.astype(np.float64) * 2
            elif mode == "int":
                outputs["OUT"] = np.array([7, 8], np.int32)
            elif mode == "text":
                outputs["OUT"] = np.array(["a", "b"], dtype=object)
            elif mode == "wide":
                outputs["OUT"] = values
                outputs["COUNT"] = np.array([1, 2**40], np.int64)
            elif mode == "fraction":
                outputs["OUT"] = values
                outputs["COUNT"] = np.array([1.5, 2.5], np.float32)
            elif mode == "objects":
                outputs["OUT"] = values
                outputs["COUNT"] = np.array([3, 44], dtype=object)
            elif mode == "complex":
                outputs["OUT"] = values.astype(np.complex64)
            elif mode != "missing":
                outputs["OUT"] = values
            answers.append(InferResponse(outputs))
        return answers


@pytest.fixture
def server(start_server: StartServer, tmp_path: Path) -> object:
    repo = tmp_path / "repo"
    write_model(repo, "sloppy", CONFIG)
    return start_server(repo, backends={"sloppy": SloppyBackend()})


def infer(server: object, mode: str, binary: bool = True) -> httpclient.InferResult:
    client = httpclient.InferenceServerClient(server.url)  # type: ignore[attr-defined]
    try:
        tensor = httpclient.InferInput("IN", [2], "FP32")
        tensor.set_data_from_numpy(np.array([1.5, 2.5], np.float32))
        outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUT", "COUNT")]
        return client.infer("sloppy", [tensor], parameters={"mode": mode}, outputs=outputs)
    finally:
        client.close()


def infer_grpc(server: object, mode: str) -> grpcclient.InferResult:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:  # type: ignore[attr-defined]
        tensor = grpcclient.InferInput("IN", [2], "FP32")
        tensor.set_data_from_numpy(np.array([1.5, 2.5], np.float32))
        return client.infer("sloppy", [tensor], parameters={"mode": mode})


@pytest.mark.parametrize(("mode", "expected"), [("float64", [3.0, 5.0]), ("int", [7.0, 8.0])])
def test_other_numeric_datatypes_become_the_declared_one(
    server: object, mode: str, expected: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    for _ in range(2):
        result = infer(server, mode)
        assert result.get_output("OUT")["datatype"] == "FP32"
        assert result.as_numpy("OUT").dtype == np.float32
        assert result.as_numpy("OUT").tolist() == expected
    warnings = [r.getMessage() for r in caplog.records if "converted to FP32" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per model and output
    assert "model 'sloppy' produced output 'OUT' as" in warnings[0]


def test_a_missing_output_is_left_out(server: object) -> None:
    result = infer(server, "missing")
    assert result.as_numpy("OUT") is None
    assert result.as_numpy("COUNT").tolist() == [1, 2]
    with grpcclient.InferenceServerClient(server.grpc_url) as client:  # type: ignore[attr-defined]
        tensor = grpcclient.InferInput("IN", [2], "FP32")
        tensor.set_data_from_numpy(np.array([1, 2], np.float32))
        answer = client.infer("sloppy", [tensor], parameters={"mode": "missing"},
                              outputs=[grpcclient.InferRequestedOutput("OUT")]).get_response()
        assert not answer.outputs


def plain(array: np.ndarray) -> list[object]:
    """The values, BYTES elements as text (tritonclient gives ``bytes`` from binary data and
    ``str`` from JSON)."""
    return [v.decode() if isinstance(v, bytes) else v for v in array.tolist()]


@pytest.mark.parametrize(("mode", "name", "datatype", "expected"), [
    ("text", "OUT", "BYTES", ["a", "b"]),
    ("wide", "COUNT", "INT64", [1, 2**40]),
    ("fraction", "COUNT", "FP32", [1.5, 2.5]),
    ("objects", "COUNT", "BYTES", ["3", "44"]),  # an object array goes as BYTES, each element's text
])
def test_what_cannot_be_converted_is_sent_as_the_model_produced_it(
    server: object, mode: str, name: str, datatype: str, expected: list[object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    for binary in (True, False):
        result = infer(server, mode, binary)
        assert result.get_output(name)["datatype"] == datatype
        assert plain(result.as_numpy(name)) == expected
    answer = infer_grpc(server, mode)
    assert answer.get_output(name).datatype == datatype
    assert plain(answer.as_numpy(name)) == expected
    warnings = [r.getMessage() for r in caplog.records if "sent as it is" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per model and output
    assert f"model 'sloppy' produced output '{name}' as {datatype}; sent as it is" in warnings[0]


def test_an_array_with_no_tensor_datatype_fails_the_request(server: object) -> None:
    with pytest.raises(InferenceServerException) as caught:
        infer(server, "complex")
    assert caught.value.status() == "500"
    assert "model 'sloppy' produced output 'OUT' of numpy dtype complex64, which is no tensor datatype" in str(
        caught.value.message())
    assert infer(server, "").as_numpy("OUT").tolist() == [1.5, 2.5]  # the model still answers
