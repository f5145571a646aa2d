"""The HTTP/REST frontend against a real server, driven by the official ``tritonclient.http``:
request ids and parameters, output selection, classification, compression, raw binary
requests, config reshape, optional inputs, backend failures, and a 16 MB tensor. Raw HTTP
(httpx) is used where the wire form itself is under test.
"""

from __future__ import annotations

import gzip
import json
import struct
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from http_protocol_support import (
    assert_error,
    make_input,
    split_binary,
)
from suite_support import StartServer, write_model
from tritonclient.utils import InferenceServerException

from pyserve import (
    Backend,
    InferRequest,
    InferResponse,
    InstanceContext,
)

# -- inference: id, parameters, outputs ------------------------------------------------------


def test_request_id_echoed_only_when_sent(
    client: httpclient.InferenceServerClient, http: httpx.Client
) -> None:
    data = np.arange(32, dtype=np.int32).reshape(2, 16)
    inputs = [make_input("INPUT0", data, "INT32", True), make_input("INPUT1", data + 1, "INT32", True)]
    assert client.infer("two", inputs, request_id="abc-123").get_response()["id"] == "abc-123"
    assert "id" not in client.infer("two", inputs).get_response()
    body = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [1]}]}
    assert "id" not in http.post("/v2/models/multi/infer", json=body).json()
    assert "id" not in http.post("/v2/models/multi/infer", json={**body, "id": ""}).json()


def test_request_parameters_reach_the_backend(client: httpclient.InferenceServerClient) -> None:
    params = {"temperature": 0.5, "top_k": 3, "greedy": True, "prompt": "héllo"}
    data = np.array([1, 2, 3], dtype=np.int32)
    result = client.infer(
        "inspect",
        [make_input("A", data, "INT32", True)],
        request_id="r1",
        parameters=params,
        priority=0,
    )
    info = json.loads(result.as_numpy("INFO")[0])
    assert info["parameters"] == params  # reserved keys are not passed on
    assert info["id"] == "r1"
    assert result.get_response()["parameters"] == params


def test_sequence_and_schedule_parameters_are_not_custom(http: httpx.Client) -> None:
    body = {
        "parameters": {
            "sequence_id": 42,
            "sequence_start": True,
            "priority": 1,
            "timeout": 0,
            "headers": {"a": 1},
            "custom": "x",
        },
        "inputs": [{"name": "A", "datatype": "INT32", "shape": [1], "data": [1]}],
    }
    response = http.post("/v2/models/inspect/infer", json=body)
    assert response.status_code == 200, response.text
    payload = response.json()
    assert payload["parameters"] == {"custom": "x"}
    assert json.loads(payload["outputs"][0]["data"][0])["parameters"] == {"custom": "x"}


def test_requested_output_subset(client: httpclient.InferenceServerClient, http: httpx.Client) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [make_input("INPUT0", a, "INT32", True), make_input("INPUT1", a * 2, "INT32", True)]
    result = client.infer("two", inputs, outputs=[httpclient.InferRequestedOutput("OUTPUT1")])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a * 2)
    assert result.as_numpy("OUTPUT0") is None
    # outputs come back in the requested order, each in its own form
    result = client.infer(
        "two",
        inputs,
        outputs=[
            httpclient.InferRequestedOutput("OUTPUT1", binary_data=False),
            httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
        ],
    )
    outs = result.get_response()["outputs"]
    assert [o["name"] for o in outs] == ["OUTPUT1", "OUTPUT0"]
    assert outs[0]["data"] == (a * 2).reshape(-1).tolist()
    assert outs[1]["parameters"] == {"binary_data_size": 64}
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a)
    # no outputs listed → all outputs, in config order
    body = {
        "inputs": [
            {"name": n, "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}
            for n in ("INPUT1", "INPUT0")
        ]
    }
    assert [o["name"] for o in http.post("/v2/models/two/infer", json=body).json()["outputs"]] == [
        "OUTPUT0",
        "OUTPUT1",
    ]
    # an output listed twice is answered once (Triton 2.51 does the same)
    twice = {**body, "outputs": [{"name": "OUTPUT1"}, {"name": "OUTPUT0"}, {"name": "OUTPUT1"}]}
    assert [o["name"] for o in http.post("/v2/models/two/infer", json=twice).json()["outputs"]] == [
        "OUTPUT1",
        "OUTPUT0",
    ]
    # 'binary_data_output' is the default of the outputs not listed; a listed output without
    # 'binary_data' comes back as JSON (as in Triton 2.51)
    listed = {**body, "parameters": {"binary_data_output": True}, "outputs": [{"name": "OUTPUT0"}]}
    response = http.post("/v2/models/two/infer", json=listed)
    assert response.headers["content-type"] == "application/json"
    assert response.json()["outputs"][0]["data"] == list(range(16))
    unlisted = {**body, "parameters": {"binary_data_output": True}}
    response = http.post("/v2/models/two/infer", json=unlisted)
    assert response.headers["content-type"] == "application/octet-stream"


def test_binary_data_output_parameter(http: httpx.Client) -> None:
    data = list(range(16))
    inputs = [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": data} for n in ("INPUT0", "INPUT1")]
    response = http.post(
        "/v2/models/two/infer", json={"parameters": {"binary_data_output": True}, "inputs": inputs}
    )
    meta, tail = split_binary(response)
    assert [o["parameters"] for o in meta["outputs"]] == [{"binary_data_size": 64}] * 2
    assert "data" not in meta["outputs"][0]
    assert tail == np.array(data * 2, dtype="<i4").tobytes()
    # listed outputs take only their own 'binary_data' (default false), as in Triton 2.51, which
    # answers this request with JSON alone
    response = http.post(
        "/v2/models/two/infer",
        json={
            "parameters": {"binary_data_output": True},
            "inputs": inputs,
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}, {"name": "OUTPUT1"}],
        },
    )
    assert response.headers["content-type"] == "application/json"
    assert [o["data"] for o in response.json()["outputs"]] == [data, data]
    response = http.post(
        "/v2/models/two/infer",
        json={
            "parameters": {"binary_data_output": False},
            "inputs": inputs,
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}},
                        {"name": "OUTPUT1", "parameters": {"binary_data": True}}],
        },
    )
    meta, tail = split_binary(response)
    assert meta["outputs"][0] == {"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16], "data": data}
    assert meta["outputs"][1]["parameters"] == {"binary_data_size": 64}
    assert tail == np.array(data, dtype="<i4").tobytes()
    # default: JSON
    response = http.post("/v2/models/two/infer", json={"inputs": inputs})
    assert response.headers["content-type"] == "application/json"
    assert "inference-header-content-length" not in response.headers


# -- classification ------------------------------------------------------------------------


def test_classification_batched_with_labels(client: httpclient.InferenceServerClient) -> None:
    data = np.array([[0.1, 0.9, 0.5, 0.3], [4.0, 1.0, 2.0, 3.0]], dtype=np.float32)
    result = client.infer(
        "cls",
        [make_input("IN", data, "FP32", True)],
        outputs=[httpclient.InferRequestedOutput("OUT", class_count=2)],
    )
    out = result.get_response()["outputs"][0]
    assert out["datatype"] == "BYTES" and out["shape"] == [2, 2]
    assert result.as_numpy("OUT").tolist() == [
        [b"0.900000:1:dog", b"0.500000:2:bird"],
        [b"4.000000:0:cat", b"3.000000:3:fish"],
    ]
    # JSON form, k larger than the class count is clamped
    result = client.infer(
        "cls",
        [make_input("IN", data[:1], "FP32", False)],
        outputs=[httpclient.InferRequestedOutput("OUT", binary_data=False, class_count=9)],
    )
    assert result.get_response()["outputs"][0] == {
        "name": "OUT",
        "datatype": "BYTES",
        "shape": [1, 4],
        "data": ["0.900000:1:dog", "0.500000:2:bird", "0.300000:3:fish", "0.100000:0:cat"],
    }


def test_classification_non_batched_without_labels(client: httpclient.InferenceServerClient) -> None:
    data = np.array([-1.0, 2.5, 0.0, 2.25], dtype=np.float32)
    result = client.infer(
        "cls_nb",
        [make_input("IN", data, "FP32", True)],
        outputs=[httpclient.InferRequestedOutput("OUT", binary_data=False, class_count=3)],
    )
    assert result.get_response()["outputs"][0] == {
        "name": "OUT",
        "datatype": "BYTES",
        "shape": [3],
        "data": ["2.500000:1", "2.250000:3", "0.000000:2"],
    }


def test_classification_integer_output(client: httpclient.InferenceServerClient) -> None:
    data = np.array([5, -3, 9, 0], dtype=np.int32)
    result = client.infer(
        "cls_int",
        [make_input("IN", data, "INT32", True)],
        outputs=[httpclient.InferRequestedOutput("OUT", class_count=2)],
    )
    assert result.as_numpy("OUT").tolist() == [b"9:2:bird", b"5:0:cat"]


# -- compression ---------------------------------------------------------------------------


@pytest.mark.parametrize("request_algorithm", [None, "gzip", "deflate"])
@pytest.mark.parametrize("response_algorithm", [None, "gzip", "deflate"])
def test_compression(
    client: httpclient.InferenceServerClient, request_algorithm: str | None, response_algorithm: str | None
) -> None:
    data = np.linspace(0, 1, 600, dtype=np.float32).reshape(2, 300)
    result = client.infer(
        "id_fp32",
        [make_input("IN", data, "FP32", True)],
        request_compression_algorithm=request_algorithm,
        response_compression_algorithm=response_algorithm,
    )
    np.testing.assert_array_equal(result.as_numpy("OUT"), data)


def test_compressed_wire_form(http: httpx.Client) -> None:
    body = orjson.dumps({"inputs": [{"name": "IN", "datatype": "INT32", "shape": [3], "data": [1, 2, 3]}]})
    for encoding, packed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        response = http.post(
            "/v2/models/multi/infer",
            content=packed,
            headers={"Content-Encoding": encoding, "Accept-Encoding": "identity"},
        )
        assert response.status_code == 200, response.text
        assert "content-encoding" not in response.headers
        assert response.json()["outputs"][0]["data"] == [1, 2, 3]
    for accept, encoding, unpack in (
        ("gzip", "gzip", gzip.decompress),
        ("deflate", "deflate", zlib.decompress),
        ("br, gzip;q=0.5", "gzip", gzip.decompress),
    ):
        with httpx.stream(
            "POST",
            http.base_url.join("/v2/models/multi/infer"),
            content=body,
            headers={"Accept-Encoding": accept},
        ) as response:
            raw = b"".join(response.iter_raw())
        assert response.headers["content-encoding"] == encoding
        assert orjson.loads(unpack(raw))["outputs"][0]["data"] == [1, 2, 3]


# -- raw binary, reshape, optional inputs -----------------------------------------------------


def test_raw_binary_request(http: httpx.Client) -> None:
    data = np.arange(10, dtype="<f4")
    response = http.post(
        "/v2/models/id_fp32/infer", content=data.tobytes(), headers={"Inference-Header-Content-Length": "0"}
    )
    meta, tail = split_binary(response)
    assert meta == {
        "model_name": "id_fp32",
        "model_version": "1",
        "outputs": [
            {"name": "OUT", "datatype": "FP32", "shape": [1, 10], "parameters": {"binary_data_size": 40}}
        ],
    }
    assert tail == data.tobytes()
    # the same body chunk-encoded (httpx sends an iterator with Transfer-Encoding: chunked)
    chunked = http.post("/v2/models/id_fp32/infer", content=iter([data[:3].tobytes(), data[3:].tobytes()]),
                        headers={"Inference-Header-Content-Length": "0"})
    assert split_binary(chunked) == (meta, tail)
    response = http.post(
        "/v2/models/fixed_nb/infer",
        content=data[:6].tobytes(),
        headers={"Inference-Header-Content-Length": "0"},
    )
    meta, tail = split_binary(response)
    assert meta["outputs"][0]["shape"] == [2, 3]
    assert tail == data[:6].tobytes()
    response = http.post(
        "/v2/models/fixed_nb/infer",
        content=data[:5].tobytes(),
        headers={"Inference-Header-Content-Length": "0"},
    )
    assert_error(response, 400, "raw binary input has 5 element(s) but the input's dims need 6")
    # a BYTES input of dims [1] takes the whole body as its single element; other dims are refused
    # in Triton 2.51's words
    raw = {"Inference-Header-Content-Length": "0"}
    assert_error(http.post("/v2/models/id_bytes/infer", content=b"427", headers=raw), 400,
                 "For BYTE datatype raw input 'IN', the model must have input shape [1] (it has [-1])")
    assert_error(http.post("/v2/models/two_var/infer", content=np.ones(4, np.float16).tobytes(), headers=raw), 400,
                 "The shape of the raw input 'IN' can not be deduced because there are more than one "
                 "variable-sized dimension (dims [-1, -1])")
    assert_error(http.post("/v2/models/two/infer", content=np.ones(16, np.int32).tobytes(), headers=raw), 400,
                 "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'two' model "
                 "configuration (a raw binary request, Inference-Header-Content-Length: 0, is the one input's bytes)")
    response = http.post("/v2/models/one_bytes/infer", content=b"hello\x00world", headers=raw)
    meta, tail = split_binary(response)
    assert meta["outputs"] == [
        {"name": "OUT", "datatype": "BYTES", "shape": [1, 1], "parameters": {"binary_data_size": 15}}
    ]
    assert tail == struct.pack("<I", 11) + b"hello\x00world"


def test_empty_tensor_round_trip(http: httpx.Client) -> None:
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "IN", "datatype": "FP32", "shape": [1, 0], "parameters": {"binary_data_size": 0}}
            ],
            "outputs": [{"name": "OUT", "parameters": {"binary_data": True}}],
        }
    )
    response = http.post(
        "/v2/models/id_fp32/infer",
        content=header,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    meta, tail = split_binary(response)
    assert meta["outputs"][0] == {
        "name": "OUT",
        "datatype": "FP32",
        "shape": [1, 0],
        "parameters": {"binary_data_size": 0},
    }
    assert tail == b""
    body = {"inputs": [{"name": "IN", "datatype": "BYTES", "shape": [1, 0], "data": []}]}
    assert http.post("/v2/models/id_bytes/infer", json=body).json()["outputs"][0]["data"] == []


def test_reshape_is_applied_before_the_backend(client: httpclient.InferenceServerClient) -> None:
    data = np.arange(18, dtype=np.float32).reshape(3, 2, 3)
    result = client.infer("reshaped", [make_input("X", data, "FP32", True)])
    infos = result.as_numpy("INFO")
    assert infos.shape == (3, 1)
    info = json.loads(infos[0, 0])
    assert info["shapes"] == {"X": [3, 6]}
    assert info["batch_size"] == 3


def test_optional_input_may_be_omitted(client: httpclient.InferenceServerClient) -> None:
    a = np.array([1, 2], dtype=np.int32)
    info = json.loads(client.infer("inspect", [make_input("A", a, "INT32", True)]).as_numpy("INFO")[0])
    assert info["shapes"] == {"A": [2]}
    b = np.array([0.5], dtype=np.float32)
    result = client.infer("inspect", [make_input("A", a, "INT32", False), make_input("B", b, "FP32", True)])
    info = json.loads(result.as_numpy("INFO")[0])
    assert info["shapes"] == {"A": [2], "B": [1]}
    assert info["dtypes"] == {"A": "int32", "B": "float32"}


# -- backend failures ------------------------------------------------------------------------


def _flaky_body(mode: str | None, request_id: str, values: list[int]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": request_id,
        "inputs": [{"name": "IN", "datatype": "INT32", "shape": [len(values)], "data": values}],
    }
    if mode:
        body["parameters"] = {"mode": mode}
    return body


def test_backend_exception_is_500_and_server_keeps_serving(
    client: httpclient.InferenceServerClient, http: httpx.Client
) -> None:
    response = http.post("/v2/models/flaky/infer", json=_flaky_body("raise", "x", [1]))
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    message = response.json()["error"]
    assert list(response.json()) == ["error"]
    assert "flaky" in message and "flaky backend raised on purpose" in message
    with pytest.raises(InferenceServerException) as info:
        client.infer(
            "flaky",
            [make_input("IN", np.array([1], dtype=np.int32), "INT32", True)],
            parameters={"mode": "raise"},
        )
    assert info.value.status() == "500"
    # the next request is served
    response = http.post("/v2/models/flaky/infer", json=_flaky_body(None, "ok", [4, 5]))
    assert response.status_code == 200
    assert response.json()["outputs"][0]["data"] == [4, 5]
    assert http.get("/v2/health/ready").status_code == 200


def test_unserializable_response_parameter_is_a_clear_500(http: httpx.Client) -> None:
    response = http.post("/v2/models/flaky/infer", json=_flaky_body("bytes_parameter", "x", [1]))
    assert_error(
        response,
        500,
        "the response of model 'flaky' cannot be written as JSON: Type is not JSON serializable: bytes",
    )
    assert http.post("/v2/models/flaky/infer", json=_flaky_body(None, "ok", [2])).status_code == 200


def test_per_request_errors_are_isolated(http: httpx.Client) -> None:
    modes = [None, "error", None, "exception", None, "error", None, "exception"] * 3
    results: dict[int, httpx.Response] = {}

    def send(i: int) -> None:
        with httpx.Client(base_url=http.base_url, timeout=30) as c:
            results[i] = c.post("/v2/models/flaky/infer", json=_flaky_body(modes[i], f"r{i}", [i, i + 1]))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(modes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, mode in enumerate(modes):
        response = results[i]
        if mode is None:
            assert response.status_code == 200, response.text
            assert response.json()["id"] == f"r{i}"
            assert response.json()["outputs"][0]["data"] == [i, i + 1]
        elif mode == "error":
            assert_error(response, 400, f"request r{i} rejected by the backend")
        else:
            assert response.status_code == 500
            assert f"request r{i} failed in the backend" in response.json()["error"]


# -- large tensors -----------------------------------------------------------------------------


def test_large_binary_tensor_round_trip(client: httpclient.InferenceServerClient) -> None:
    data = np.random.default_rng(0).standard_normal((1, 4 * 1024 * 1024), dtype=np.float32)  # 16 MiB
    result = client.infer("id_fp32", [make_input("IN", data, "FP32", True)])
    out = result.as_numpy("OUT")
    assert out.shape == data.shape
    np.testing.assert_array_equal(out, data)


def test_large_tensor_gzip_round_trip(client: httpclient.InferenceServerClient) -> None:
    data = np.tile(np.arange(1024, dtype=np.int32), 1024).reshape(1, -1)  # 4 MiB, compresses well
    result = client.infer(
        "id_int32",
        [make_input("IN", data, "INT32", True)],
        request_compression_algorithm="gzip",
        response_compression_algorithm="gzip",
    )
    np.testing.assert_array_equal(result.as_numpy("OUT"), data)


class WriteableProbe(Backend):
    """Echoes ``IN``; records whether each request's input array was writeable."""

    def __init__(self) -> None:
        self.writeable: list[bool] = []

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        self.writeable += [bool(r.inputs["IN"].flags.writeable) for r in requests]
        return [InferResponse({"OUT": r.inputs["IN"]}) for r in requests]


@pytest.mark.parametrize("http_server", ["pyserve", "uvicorn"])
def test_a_large_binary_input_is_a_writeable_view(start_server: StartServer, tmp_path: Path, http_server: str) -> None:
    """A body that arrives in several chunks is joined into a bytearray: its tensors are
    writeable views (no copy), so a model may change its input in place, as in Triton."""
    repo = tmp_path / "repo"
    write_model(repo, "probe", """
        backend: "probe"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
    """)
    probe = WriteableProbe()
    server = start_server(repo, backends={"probe": probe}, use_entry_points=False, http_server=http_server)
    values = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: many reads
    client = httpclient.InferenceServerClient(server.url)
    try:
        result = client.infer("probe", [make_input("IN", values, "FP32", True)])
    finally:
        client.close()
    np.testing.assert_array_equal(result.as_numpy("OUT"), values)
    assert probe.writeable == [True]
