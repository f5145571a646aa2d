"""The HTTP/REST frontend against a real server, driven by the official ``tritonclient.http``.

Covers the KServe v2 routes as Triton serves them (health, metadata, config, repository
index, versioned routes, 404/405 bodies), inference round trips for every datatype in both
JSON and binary form, request ids and parameters, output selection, classification,
compression, raw binary requests, config reshape, optional inputs, backend failures, and a
16 MB tensor. Raw HTTP (httpx) is used where the wire form itself is under test.
"""

from __future__ import annotations

import gzip
import json
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import ml_dtypes
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from suite_support import DATATYPES, StartServer, identity_config, sample, write_model
from tritonclient.utils import InferenceServerException

from pyserve import (
    Backend,
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from pyserve.host.plugins import PluginHost
from pyserve.server.core import Server, ServerOptions, ServerThread

# -- datatypes -------------------------------------------------------------------------------

JSON_INPUT_UNSUPPORTED = {"FP16", "BF16"}
"""Triton refuses these datatypes as JSON input data (they must be sent binary)."""


# -- inline backends -------------------------------------------------------------------------


def _info_output(instance: InstanceContext, request: InferRequest, info: dict[str, Any]) -> np.ndarray:
    text = json.dumps(info, sort_keys=True).encode()
    batched = instance.model.config.max_batch_size > 0
    return np.full((request.batch_size, 1) if batched else (1,), text, dtype=object)


class InspectBackend(Backend):
    """Reports what it received: output ``INFO`` is a JSON document of the request's id,
    parameters, input shapes and batch size; the request parameters come back as response
    parameters."""

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        out = []
        for r in requests:
            info = {
                "id": r.id,
                "parameters": r.parameters,
                "shapes": {name: list(a.shape) for name, a in r.inputs.items()},
                "dtypes": {name: a.dtype.name for name, a in r.inputs.items()},
                "batch_size": r.batch_size,
            }
            out.append(InferResponse({"INFO": _info_output(instance, r, info)}, dict(r.parameters)))
        return out


class FlakyBackend(Backend):
    """Echoes ``IN`` to ``OUT`` unless the request parameter ``mode`` says otherwise:
    ``raise`` raises from execute (failing the call), ``error`` returns an ``InferError`` and
    ``exception`` returns an exception instance for that request alone."""

    def execute(
        self, instance: InstanceContext, requests: Sequence[InferRequest]
    ) -> list[InferResponse | InferError | BaseException]:
        if any(r.parameters.get("mode") == "raise" for r in requests):
            raise RuntimeError("flaky backend raised on purpose")
        out: list[InferResponse | InferError | BaseException] = []
        for r in requests:
            mode = r.parameters.get("mode")
            if mode == "error":
                out.append(InferError.invalid(f"request {r.id} rejected by the backend"))
            elif mode == "exception":
                out.append(ValueError(f"request {r.id} failed in the backend"))
            elif mode == "bytes_parameter":  # response parameters must be bool/int/float/str
                out.append(InferResponse({"OUT": r.inputs["IN"]}, {"p": b"raw"}))  # type: ignore[dict-item]
            else:
                out.append(InferResponse({"OUT": r.inputs["IN"]}))
        return out


# -- the shared server -----------------------------------------------------------------------

LABELS = ["cat", "dog", "bird", "fish"]

MODELS: dict[str, str] = {
    **{f"id_{dt.lower()}": identity_config(f"id_{dt.lower()}", dt) for dt in DATATYPES},
    "two": """
        name: "two"
        backend: "identity"
        max_batch_size: 8
        input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
                { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
                 { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
    """,
    "one_bytes": """
        name: "one_bytes"
        backend: "identity"
        max_batch_size: 8
        input [ { name: "IN" data_type: TYPE_STRING dims: [ 1 ] } ]
        output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
    """,
    "two_var": """
        name: "two_var"
        backend: "identity"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP16 dims: [ -1, -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP16 dims: [ -1, -1 ] } ]
    """,
    "fixed_nb": """
        name: "fixed_nb"
        backend: "identity"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2, 3 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2, 3 ] } ]
    """,
    "cls": """
        name: "cls"
        backend: "identity"
        max_batch_size: 4
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "labels.txt" } ]
    """,
    "cls_nb": """
        name: "cls_nb"
        backend: "identity"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
    """,
    "cls_int": """
        name: "cls_int"
        backend: "identity"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ 4 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 4 ] label_filename: "labels.txt" } ]
    """,
    "multi": """
        name: "multi"
        backend: "identity"
        max_batch_size: 0
        version_policy: { all { } }
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
    """,
    "inspect": """
        name: "inspect"
        backend: "inspect"
        max_batch_size: 0
        input [ { name: "A" data_type: TYPE_INT32 dims: [ -1 ] },
                { name: "B" data_type: TYPE_FP32 dims: [ -1 ] optional: true } ]
        output [ { name: "INFO" data_type: TYPE_STRING dims: [ 1 ] } ]
    """,
    "reshaped": """
        name: "reshaped"
        backend: "inspect"
        max_batch_size: 4
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape: { shape: [ 6 ] } } ]
        output [ { name: "INFO" data_type: TYPE_STRING dims: [ 1 ] } ]
    """,
    "flaky": """
        name: "flaky"
        backend: "flaky"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
    """,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repo = tmp_path_factory.mktemp("http_protocol")
    for name, config in MODELS.items():
        write_model(repo, name, config, versions=(1, 2, 3) if name == "multi" else (1,))
    (repo / "cls" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    (repo / "cls_int" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    host = PluginHost(extra_backends={"inspect": InspectBackend(), "flaky": FlakyBackend()})
    thread = ServerThread(
        Server(ServerOptions(model_repositories=[repo], host="127.0.0.1", http_port=0, grpc_port=0,
                             exit_on_error=False), host)  # a model fails on purpose
    )
    thread.start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(server.url, concurrency=8)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{server.url}", timeout=30) as c:
        yield c


def assert_error(response: httpx.Response, status: int, message: str) -> None:
    """Triton's error form: the status, a JSON content type and exactly ``{"error": ...}``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"error": message}


def make_input(name: str, array: np.ndarray, datatype: str, binary: bool) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def split_binary(response: httpx.Response) -> tuple[dict[str, Any], bytes]:
    """A binary response: the JSON header and the binary tail."""
    assert response.headers["content-type"] == "application/octet-stream"
    length = int(response.headers["inference-header-content-length"])
    return orjson.loads(response.content[:length]), response.content[length:]


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
    assert "it holds 5 element(s) but the input shape [2, 3] needs 6" in response.json()["error"]


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
