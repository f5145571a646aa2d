"""The HTTP/REST frontend against a real server, driven by the official ``tritonclient.http``:
the KServe v2 routes as Triton serves them (health, metadata, config, repository index,
versioned routes, 404/405 bodies) and inference round trips for every datatype in both
JSON and binary form. Raw HTTP (httpx) is used where the wire form itself is under test.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import ml_dtypes
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from http_protocol_support import (
    JSON_INPUT_UNSUPPORTED,
    MODELS,
    assert_error,
    make_input,
    split_binary,
)
from suite_support import DATATYPES, StartServer, identity_config, sample

# -- health and metadata ---------------------------------------------------------------------


def test_health_live_and_ready(client: httpclient.InferenceServerClient, http: httpx.Client) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    for path in ("/v2/health/live", "/v2/health/ready"):
        response = http.get(path)
        assert response.status_code == 200
        assert response.content == b""


def test_not_ready_when_a_model_failed_while_others_serve(start_server: StartServer, make_repo: Any) -> None:
    repo = make_repo(
        {
            "good": identity_config("good", "INT32"),
            "broken": """
                name: "broken"
                backend: "no_such_backend"
                max_batch_size: 0
                input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
                output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
            """,
        }
    )
    server = start_server(repo)
    with httpx.Client(base_url=f"http://{server.url}") as http:
        assert http.get("/v2/health/live").status_code == 200
        assert_error(http.get("/v2/health/ready"), 400, "Server is not ready")
        assert http.get("/v2/models/good/ready").status_code == 200
        assert_error(http.get("/v2/models/broken/ready"), 400, "Model version not ready")
        response = http.get("/v2/models/broken")
        assert response.status_code == 404
        assert response.json()["error"].startswith(
            "Request for unknown model: 'broken' has no available versions"
        )
        assert "no_such_backend" in response.json()["error"]
        index = http.post("/v2/repository/index").json()
        assert [e["name"] for e in index] == ["broken", "good"]
        assert index[0]["state"] == "UNAVAILABLE" and "no_such_backend" in index[0]["reason"]
        assert index[1] == {"name": "good", "version": "1", "state": "READY"}
        assert http.post("/v2/repository/index", json={"ready": True}).json() == [index[1]]
    client = httpclient.InferenceServerClient(server.url)
    try:
        assert client.is_server_live()
        assert not client.is_server_ready()
        data = np.arange(3, dtype=np.int32).reshape(1, 3)
        result = client.infer("good", [make_input("IN", data, "INT32", True)])
        np.testing.assert_array_equal(result.as_numpy("OUT"), data)
    finally:
        client.close()


def test_server_metadata(client: httpclient.InferenceServerClient) -> None:
    metadata = client.get_server_metadata()
    assert metadata["name"] == "pyserve"
    assert isinstance(metadata["version"], str) and metadata["version"]
    assert {"classification", "binary_tensor_data", "parameters", "model_configuration"} <= set(
        metadata["extensions"]
    )
    # Triton 2.51's list and order (CUDA shared memory only where it can be used)
    assert [e for e in metadata["extensions"] if e != "cuda_shared_memory"] == [
        "classification", "sequence", "model_repository", "model_repository(unload_dependents)",
        "schedule_policy", "model_configuration", "system_shared_memory", "binary_tensor_data",
        "parameters", "statistics", "trace", "logging",
    ]


def test_model_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.get_model_metadata("two") == {
        "name": "two",
        "versions": ["1"],
        "platform": "identity",
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]},
            {"name": "INPUT1", "datatype": "INT32", "shape": [-1, 16]},
        ],
        "outputs": [
            {"name": "OUTPUT0", "datatype": "INT32", "shape": [-1, 16]},
            {"name": "OUTPUT1", "datatype": "INT32", "shape": [-1, 16]},
        ],
    }
    fixed = client.get_model_metadata("fixed_nb")
    assert fixed["inputs"] == [{"name": "IN", "datatype": "FP32", "shape": [2, 3]}]
    assert client.get_model_metadata("id_bytes")["inputs"] == [
        {"name": "IN", "datatype": "BYTES", "shape": [-1, -1]}
    ]
    assert client.get_model_metadata("inspect")["platform"] == "inspect"


def test_versions(client: httpclient.InferenceServerClient, http: httpx.Client) -> None:
    assert client.get_model_metadata("multi")["versions"] == ["1", "2", "3"]
    assert client.get_model_metadata("multi", "2")["versions"] == ["2"]
    assert http.get("/v2/models/multi/versions/2").json()["versions"] == ["2"]
    assert http.get("/v2/models/multi/versions/1/ready").status_code == 200
    assert http.get("/v2/models/multi/versions/3/config").json()["name"] == "multi"
    data = np.array([7, 8], dtype=np.int32)
    for version in ("1", "2", "3"):
        result = client.infer("multi", [make_input("IN", data, "INT32", False)], model_version=version)
        assert result.get_response()["model_version"] == version
    # unversioned requests go to the latest version
    assert (
        client.infer("multi", [make_input("IN", data, "INT32", False)]).get_response()["model_version"] == "3"
    )
    body = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [2], "data": [7, 8]}]}
    assert http.post("/v2/models/multi/versions/2/infer", json=body).json()["model_version"] == "2"


def test_unknown_model_and_version(http: httpx.Client) -> None:
    assert_error(http.get("/v2/models/nope"), 404, "Request for unknown model: 'nope' is not found")
    assert_error(http.get("/v2/models/nope/config"), 404, "Request for unknown model: 'nope' is not found")
    assert_error(http.get("/v2/models/nope/ready"), 400, "Model version not ready")
    assert_error(http.get("/v2/models/multi/versions/9/ready"), 400, "Model version not ready")
    assert_error(
        http.get("/v2/models/multi/versions/9"),
        404,
        "Request for unknown model: 'multi' version 9 is not found",
    )
    assert_error(
        http.post("/v2/models/multi/versions/9/infer", json={}),
        404,
        "Request for unknown model: 'multi' version 9 is not found",
    )


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/multi/versions/abc",
        "/v2/models/multi/versions/-1/ready",
        "/v2/models/multi/versions/1.0/config",
        "/v2/nothing",
        "/v2/models/multi/extra",
        "/",
    ],
)
def test_unmatched_route_is_404(http: httpx.Client, path: str) -> None:
    assert_error(http.get(path), 404, "Not Found")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v2/health/live"),
        ("PUT", "/v2"),
        ("DELETE", "/v2/models/two"),
        ("GET", "/v2/models/two/infer"),
        ("GET", "/v2/repository/index"),
        ("POST", "/v2/models/multi/versions/1/config"),
    ],
)
def test_wrong_method_is_405(http: httpx.Client, method: str, path: str) -> None:
    assert_error(http.request(method, path), 405, "Method Not Allowed")


def test_model_config_json(client: httpclient.InferenceServerClient, http: httpx.Client) -> None:
    response = http.get("/v2/models/cls/config")
    assert response.headers["content-type"] == "application/json"
    config = response.json()
    assert config == client.get_model_config("cls")
    assert config["name"] == "cls"
    assert config["backend"] == "identity"
    assert config["platform"] == ""
    assert config["max_batch_size"] == 4
    assert config["input"][0] == {
        "name": "IN",
        "data_type": "TYPE_FP32",
        "format": "FORMAT_NONE",
        "dims": [4],
        "is_shape_tensor": False,
        "allow_ragged_batch": False,
        "optional": False,
        "is_non_linear_format_io": False,
    }
    assert config["output"][0]["label_filename"] == "labels.txt"
    assert config["output"][0]["dims"] == [4]
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    assert config["instance_group"][0]["count"] == 1
    assert config["version_policy"] == {"latest": {"num_versions": 1}}
    reshaped = http.get("/v2/models/reshaped/config").json()
    assert reshaped["input"][0]["reshape"] == {"shape": [6]}
    assert http.get("/v2/models/multi/config").json()["version_policy"] == {"all": {}}


def test_repository_index(client: httpclient.InferenceServerClient, http: httpx.Client) -> None:
    index = http.post("/v2/repository/index").json()
    names = sorted(MODELS)
    expected = [
        {"name": n, "version": str(v), "state": "READY"}
        for n in names
        for v in ((1, 2, 3) if n == "multi" else (1,))
    ]
    assert index == expected
    assert http.post("/v2/repository/index", json={"ready": True}).json() == expected
    assert http.post("/v2/repository/index", json={"ready": False}).json() == expected
    assert client.get_model_repository_index() == expected
    assert http.post("/v2/repository/myrepo/index").json() == expected  # a repository name, as Triton 2.51
    assert_error(http.post("/v2/repository/index", json={"ready": "yes"}), 400, "'ready' must be a boolean")
    assert_error(
        http.post("/v2/repository/index", json=[1]), 400, "the repository index body must be a JSON object"
    )


def test_model_ready_routes(client: httpclient.InferenceServerClient, http: httpx.Client) -> None:
    assert client.is_model_ready("two")
    assert client.is_model_ready("multi", "2")
    assert not client.is_model_ready("nope")
    response = http.get("/v2/models/two/ready")
    assert response.status_code == 200 and response.content == b""


# -- inference: datatypes ------------------------------------------------------------------


ROUND_TRIPS = [
    pytest.param(
        dt,
        input_binary,
        output_binary,
        id=f"{dt}-in-{'binary' if input_binary else 'json'}-out-{'binary' if output_binary else 'json'}",
    )
    for dt in DATATYPES
    for input_binary in (True, False)
    for output_binary in (True, False)
    if input_binary or dt not in JSON_INPUT_UNSUPPORTED  # refused as JSON: see test_http_bad_inputs
]


@pytest.mark.parametrize(("datatype", "input_binary", "output_binary"), ROUND_TRIPS)
def test_round_trip_every_datatype(
    client: httpclient.InferenceServerClient, datatype: str, input_binary: bool, output_binary: bool
) -> None:
    data = sample(datatype)
    model = f"id_{datatype.lower()}"
    result = client.infer(
        model,
        [make_input("IN", data, datatype, input_binary)],
        outputs=[httpclient.InferRequestedOutput("OUT", binary_data=output_binary)],
    )
    response = result.get_response()
    out = response["outputs"][0]
    assert out["name"] == "OUT"
    assert out["datatype"] == datatype
    assert out["shape"] == [2, 3]
    assert ("data" in out) is not output_binary
    got = result.as_numpy("OUT")
    assert got.shape == (2, 3)
    if datatype == "BYTES":
        # tritonclient returns JSON BYTES data as str, binary BYTES data as bytes
        expected = data if output_binary else np.vectorize(bytes.decode, otypes=[object])(data)
        assert got.tolist() == expected.tolist()
    else:
        assert got.dtype == data.dtype
        np.testing.assert_array_equal(got, data)


def test_bf16_raw_bytes_over_http(http: httpx.Client) -> None:
    values = np.array([1.0, -2.5, 0.15625, 3e38], dtype=ml_dtypes.bfloat16)
    raw = values.tobytes()
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "IN", "datatype": "BF16", "shape": [1, 4], "parameters": {"binary_data_size": 8}}
            ],
            "outputs": [{"name": "OUT", "parameters": {"binary_data": True}}],
        }
    )
    response = http.post(
        "/v2/models/id_bf16/infer",
        content=header + raw,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    meta, tail = split_binary(response)
    assert meta["outputs"] == [
        {"name": "OUT", "datatype": "BF16", "shape": [1, 4], "parameters": {"binary_data_size": 8}}
    ]
    assert tail == raw
    # the same output as JSON: BF16 values as numbers
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "IN", "datatype": "BF16", "shape": [1, 4], "parameters": {"binary_data_size": 8}}
            ]
        }
    )
    response = http.post(
        "/v2/models/id_bf16/infer",
        content=header + raw,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert response.headers["content-type"] == "application/json"
    data = np.array(response.json()["outputs"][0]["data"], dtype=np.float32)
    np.testing.assert_array_equal(data, values.astype(np.float32))


def test_json_wire_form(http: httpx.Client) -> None:
    """The exact JSON Triton returns, nested input data accepted, BOOL as true/false."""
    body = {
        "id": "req-7",
        "inputs": [{"name": "IN", "datatype": "BOOL", "shape": [1, 3], "data": [[True, False, True]]}],
    }
    response = http.post("/v2/models/id_bool/infer", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {
        "id": "req-7",
        "model_name": "id_bool",
        "model_version": "1",
        "outputs": [{"name": "OUT", "datatype": "BOOL", "shape": [1, 3], "data": [True, False, True]}],
    }
    body = {"inputs": [{"name": "IN", "datatype": "BYTES", "shape": [1, 2], "data": ["a", "\u00e9\u2603"]}]}
    assert http.post("/v2/models/id_bytes/infer", json=body).json() == {
        "model_name": "id_bytes",
        "model_version": "1",
        "outputs": [{"name": "OUT", "datatype": "BYTES", "shape": [1, 2], "data": ["a", "\u00e9\u2603"]}],
    }
    body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [2, 3], "data": [[1, 2, 3], [4.5, 5, 6]]}]}
    assert http.post("/v2/models/fixed_nb/infer", json=body).json()["outputs"] == [
        {"name": "OUT", "datatype": "FP32", "shape": [2, 3], "data": [1.0, 2.0, 3.0, 4.5, 5.0, 6.0]}
    ]


def test_json_data_nesting_is_free_as_in_triton(http: httpx.Client) -> None:
    """Triton reads JSON ``data`` elements in order whatever their nesting (even ragged); only
    their number must match the shape."""
    for data in ([[1, 2, 3, 4, 5, 6]], [[1, 2], [3, 4], [5, 6]], [[1, 2, 3, 4], [5], [[6]]], [1, 2, 3, 4, 5, 6]):
        body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [2, 3], "data": data}]}
        response = http.post("/v2/models/fixed_nb/infer", json=body)
        assert response.status_code == 200, (data, response.text)
        assert response.json()["outputs"][0]["data"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    body = {"inputs": [{"name": "IN", "datatype": "BYTES", "shape": [1, 3], "data": [["a"], ["b", ["c"]]]}]}
    assert http.post("/v2/models/id_bytes/infer", json=body).json()["outputs"][0]["data"] == ["a", "b", "c"]
    body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [2, 3], "data": [[1, 2, 3], [4, 5]]}]}
    response = http.post("/v2/models/fixed_nb/infer", json=body)
    assert response.status_code == 400
    assert response.json()["error"] == "Unable to parse 'data': Shape does not match true shape of 'data' field"


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64", "BF16"])
def test_non_finite_floats_in_json(http: httpx.Client, client: httpclient.InferenceServerClient, datatype: str) -> None:
    """NaN and the infinities are written as Triton writes them (``NaN``, ``Infinity``,
    ``-Infinity``: not strict JSON, but what Python's json and tritonclient read), and read
    back from a request the same way."""
    dtype = ml_dtypes.bfloat16 if datatype == "BF16" else np.dtype(datatype.replace("FP", "float").lower())
    values = np.array([[np.nan, np.inf, -np.inf, 1.5]], dtype=dtype)
    model = f"id_{datatype.lower()}"
    result = client.infer(model, [make_input("IN", values, datatype, True)],
                          outputs=[httpclient.InferRequestedOutput("OUT", binary_data=False)])
    np.testing.assert_array_equal(result.as_numpy("OUT").astype(np.float64), values.astype(np.float64))
    header = json.dumps({"inputs": [{"name": "IN", "datatype": datatype, "shape": [1, 4],
                                     "parameters": {"binary_data_size": values.nbytes}}],
                         "outputs": [{"name": "OUT", "parameters": {"binary_data": False}}]}).encode()
    response = http.post(f"/v2/models/{model}/infer", content=header + values.tobytes(),
                         headers={"Inference-Header-Content-Length": str(len(header))})
    assert b'"data":[NaN,Infinity,-Infinity,1.5]' in response.content
    if datatype in JSON_INPUT_UNSUPPORTED:
        return
    body = b'{"inputs":[{"name":"IN","datatype":"%s","shape":[1,4],"data":[NaN,Infinity,-Infinity,1.5]}]}' % (
        datatype.encode())
    response = http.post(f"/v2/models/{model}/infer", content=body)
    assert response.status_code == 200, response.text
    np.testing.assert_array_equal(np.array(json.loads(response.content)["outputs"][0]["data"]),
                                  [np.nan, np.inf, -np.inf, 1.5])


def test_json_requests_keep_refusing_what_cannot_be_written_back(http: httpx.Client) -> None:
    """Only the non-finite literals are read beyond strict JSON: a lone surrogate is still a
    parse error (the standard library would take it)."""
    body = b'{"inputs":[{"name":"IN","datatype":"BYTES","shape":[1,1],"data":["\\ud800"]}]}'
    response = http.post("/v2/models/id_bytes/infer", content=body)
    assert response.status_code == 400
    assert "failed to parse the request JSON buffer" in response.json()["error"]


