"""The gRPC frontend against a real server, driven by ``tritonclient.grpc`` and the raw stub.

Covers every RPC of ``inference.GRPCInferenceService`` (health, metadata, config, repository,
the not-yet-available extensions), ``grpc.health.v1.Health/Check``, and ``ModelInfer``: every
datatype sent as ``raw_input_contents`` and as typed ``contents`` (replies always raw),
parameters, ids, requested outputs, classification, validation errors with the same texts
as HTTP and Triton's status codes, backend failures, a full queue, large tensors, and
decoupled models refused. Also: both ports served at once, and a clean shutdown.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from suite_support import DATATYPES, SQUARE_CONFIG, StartServer, identity_config, write_model
from suite_support import sample as _sample
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from pyserve import (
    Backend,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from pyserve import protocol as pb
from pyserve.frontends.grpc.server import GRPC_SERVERS, GrpcOptions
from pyserve.host.plugins import PluginHost
from pyserve.server.core import Server, ServerOptions, ServerThread

# -- datatypes -------------------------------------------------------------------------------

CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
"""The typed ``InferTensorContents`` field of each datatype (FP16/BF16 have none)."""

GRPC_CODE = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
"""HTTP status → gRPC status for the same Triton error code."""

MAX_MESSAGE = 2**31 - 1


def sample(datatype: str, shape: tuple[int, ...] = (2, 3)) -> np.ndarray:
    return _sample(datatype, shape, blank=b"\x00\xff")


# -- inline backend --------------------------------------------------------------------------


class EchoBackend(Backend):
    """``OUT`` = ``IN``; ``PARAMS`` = the request parameters as JSON; the parameters come back
    as response parameters. Request parameter ``mode``: ``raise`` raises from execute;
    ``sleep_ms`` (int) sleeps first."""

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        if any(r.parameters.get("mode") == "raise" for r in requests):
            raise RuntimeError("echo backend raised on purpose")
        delay = max(int(r.parameters.get("sleep_ms", 0)) for r in requests)
        if delay:
            time.sleep(delay / 1000)
        batched = instance.model.config.max_batch_size > 0
        out = []
        for r in requests:
            text = json.dumps(r.parameters, sort_keys=True).encode()
            params = np.full((r.batch_size, 1) if batched else (1,), text, dtype=object)
            out.append(InferResponse({"OUT": r.inputs["IN"], "PARAMS": params}, dict(r.parameters)))
        return out


MODELS: dict[str, str] = {
    **{f"id_{dt.lower()}": identity_config(f"id_{dt.lower()}", dt) for dt in DATATYPES},
    "two": """
        backend: "identity"
        max_batch_size: 8
        input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
                { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
                 { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
    """,
    "cls": """
        backend: "identity"
        max_batch_size: 4
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "labels.txt" } ]
    """,
    "echo": """
        backend: "echo"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] },
                 { name: "PARAMS" data_type: TYPE_STRING dims: [ 1 ] } ]
    """,
    "slow": """
        backend: "echo"
        max_batch_size: 1
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] },
                 { name: "PARAMS" data_type: TYPE_STRING dims: [ 1 ] } ]
        dynamic_batching { default_queue_policy { max_queue_size: 1 } }
    """,
    "square": SQUARE_CONFIG,
}

LABELS = ["cat", "dog", "bird", "fish"]


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repo = tmp_path_factory.mktemp("grpc")
    for name, config in MODELS.items():
        write_model(repo, name, config)
    (repo / "cls" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    host = PluginHost(extra_backends={"echo": EchoBackend()})
    options = ServerOptions(model_repositories=[repo], host="127.0.0.1", http_port=0, grpc_port=0,
                            grpc=GrpcOptions(implementation=request.param))  # both gRPC servers
    thread = ServerThread(Server(options, host))
    thread.start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    channel = grpc.insecure_channel(
        server.grpc_url,
        options=[("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)],
    )
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{server.url}", timeout=30) as c:
        yield c


def grpc_input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def rpc_error(call: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


def client_error(call: Any, *args: Any, **kwargs: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call(*args, **kwargs)
    return info.value


def typed_request(model: str, inputs: dict[str, tuple[np.ndarray, str]], **fields: Any) -> Any:
    """A ``ModelInferRequest`` carrying every input in typed ``contents``."""
    request = service_pb2.ModelInferRequest(model_name=model, **fields)
    for name, (array, datatype) in inputs.items():
        tensor = request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        getattr(tensor.contents, CONTENTS_FIELD[datatype]).extend(array.reshape(-1).tolist())
    return request


def raw_request(model: str, inputs: dict[str, tuple[np.ndarray, str]], **fields: Any) -> Any:
    """A ``ModelInferRequest`` carrying every input in ``raw_input_contents``."""
    request = service_pb2.ModelInferRequest(model_name=model, **fields)
    for name, (array, datatype) in inputs.items():
        request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    return request


# -- health, metadata, config ----------------------------------------------------------------


def test_server_live_ready_and_metadata(client: grpcclient.InferenceServerClient, http: httpx.Client) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata(as_json=True)
    assert meta == http.get("/v2").json()
    assert meta["name"] == "pyserve"
    assert "model_configuration" in meta["extensions"]


def test_model_ready(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_model_ready("id_fp32")
    assert client.is_model_ready("id_fp32", "1")
    assert not client.is_model_ready("id_fp32", "2")
    assert not client.is_model_ready("nope")  # an unknown model is not ready, not an error


def test_a_version_that_is_not_a_number_is_invalid(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """INVALID_ARGUMENT, as Triton 2.51 answers ModelReady, ModelMetadata and ModelInfer."""
    message = ("failed to get model version from specified version string 'x': "
               "version should be an integral value > 0")
    for call, request in (
        (stub.ModelReady, service_pb2.ModelReadyRequest(name="id_fp32", version="x")),
        (stub.ModelMetadata, service_pb2.ModelMetadataRequest(name="id_fp32", version="x")),
        (stub.ModelInfer, service_pb2.ModelInferRequest(model_name="id_fp32", model_version="x")),
    ):
        error = rpc_error(call, request)
        assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)


def test_model_metadata(client: grpcclient.InferenceServerClient, http: httpx.Client) -> None:
    meta = client.get_model_metadata("two", as_json=True)
    expected = http.get("/v2/models/two").json()
    # protobuf JSON writes int64 shape elements as strings
    for field in ("inputs", "outputs"):
        for tensor in meta[field]:
            tensor["shape"] = [int(d) for d in tensor["shape"]]
    assert meta == expected
    assert meta["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]}
    assert client.get_model_metadata("two", "1", as_json=True)["versions"] == ["1"]
    error = client_error(client.get_model_metadata, "nope")
    assert error.status() == "StatusCode.NOT_FOUND"
    assert error.message() == http.get("/v2/models/nope").json()["error"]
    error = client_error(client.get_model_metadata, "two", "7")
    assert error.status() == "StatusCode.NOT_FOUND"
    assert error.message() == http.get("/v2/models/two/versions/7").json()["error"]


@pytest.mark.parametrize("model", ["two", "cls", "echo", "slow", "square", "id_bytes"])
def test_model_config_matches_http(client: grpcclient.InferenceServerClient, http: httpx.Client, model: str) -> None:
    config = client.get_model_config(model).config
    from_http = json_format.ParseDict(http.get(f"/v2/models/{model}/config").json(), model_config_pb2.ModelConfig())
    assert config == from_http
    assert config.name == model
    if model == "square":
        assert config.model_transaction_policy.decoupled
    error = client_error(client.get_model_config, "nope")
    assert error.status() == "StatusCode.NOT_FOUND"


def test_repository_index(
    client: grpcclient.InferenceServerClient, stub: service_pb2_grpc.GRPCInferenceServiceStub
) -> None:
    index = client.get_model_repository_index(as_json=True)["models"]
    assert {m["name"] for m in index} == set(MODELS)
    assert all(m["state"] == "READY" and m["version"] == "1" for m in index)
    assert stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True)).models == (
        client.get_model_repository_index().models
    )
    error = rpc_error(stub.RepositoryIndex, service_pb2.RepositoryIndexRequest(repository_name="other"))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "repository_name" in error.details()


def test_not_ready_server_and_ready_filter(start_server: StartServer, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "good", identity_config("good", "FP32"))
    write_model(repo, "broken", """
        backend: "square"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
    """)
    server = start_server(repo)
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        assert c.is_server_live()
        assert not c.is_server_ready()  # a model is UNAVAILABLE
        assert c.is_model_ready("good")
        assert not c.is_model_ready("broken")
        index = {m.name: m for m in c.get_model_repository_index().models}
        assert index["good"].state == "READY"
        assert index["broken"].state == "UNAVAILABLE"
        assert "decoupled" in index["broken"].reason
        assert len(index) == 2
        with grpc.insecure_channel(server.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            ready = stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True))
        assert [m.name for m in ready.models] == ["good"]
        error = client_error(c.infer, "broken", [grpc_input("IN", np.array([1], dtype=np.int32), "INT32")])
    body = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [1]}]}
    response = httpx.post(f"http://{server.url}/v2/models/broken/infer", json=body)
    assert error.status() == str(GRPC_CODE[response.status_code])
    assert error.message() == response.json()["error"]


def test_health_check(server: ServerThread) -> None:
    request_class = pb.message_class("grpc.health.v1.HealthCheckRequest")
    response_class = pb.message_class("grpc.health.v1.HealthCheckResponse")
    with grpc.insecure_channel(server.grpc_url) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        response = check(request_class(), timeout=10)
    status = response.DESCRIPTOR.fields_by_name["status"].enum_type.values_by_number[response.status].name
    assert status == "SERVING"


def test_unavailable_extensions_say_so(client: grpcclient.InferenceServerClient) -> None:
    calls: list[tuple[Any, tuple[Any, ...]]] = [
        # statistics, shared memory, trace and log settings: tests/metrics/test_statistics.py,
        # test_shared_memory.py, test_trace.py, test_logging_settings.py
    ]
    for call, args in calls:
        error = client_error(call, *args)
        assert error.status() == "StatusCode.UNIMPLEMENTED", call.__name__
        assert error.message(), call.__name__
    for call in (client.load_model, client.unload_model):
        error = client_error(call, "echo")
        assert error.status() == "StatusCode.UNAVAILABLE"
        assert error.message() == "explicit model load / unload is not allowed if polling is enabled"


# -- ModelInfer: datatypes ---------------------------------------------------------------------


@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_round_trip_raw(client: grpcclient.InferenceServerClient, datatype: str) -> None:
    data = sample(datatype)
    result = client.infer(f"id_{datatype.lower()}", [grpc_input("IN", data, datatype)])
    response = result.get_response()
    assert not response.outputs[0].HasField("contents")
    assert len(response.raw_output_contents) == 1
    assert response.outputs[0].datatype == datatype
    out = result.as_numpy("OUT")
    assert out.shape == data.shape
    if datatype == "BF16":  # tritonclient reads BF16 back as float32
        np.testing.assert_array_equal(out, data.astype(np.float32))
    else:
        assert out.dtype == data.dtype
        np.testing.assert_array_equal(out, data)


@pytest.mark.parametrize("datatype", list(CONTENTS_FIELD))
def test_round_trip_typed_contents_replies_raw(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, datatype: str
) -> None:
    data = sample(datatype)
    response = stub.ModelInfer(typed_request(f"id_{datatype.lower()}", {"IN": (data, datatype)}, id="t1"))
    assert response.id == "t1"
    assert not response.outputs[0].HasField("contents")
    assert len(response.raw_output_contents) == 1
    out = grpcclient.InferResult(response).as_numpy("OUT")
    assert out.dtype == data.dtype
    np.testing.assert_array_equal(out, data)


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_half_precision_typed_contents_refused(stub: service_pb2_grpc.GRPCInferenceServiceStub, datatype: str) -> None:
    request = service_pb2.ModelInferRequest(model_name=f"id_{datatype.lower()}")
    tensor = request.inputs.add(name="IN", datatype=datatype, shape=[1, 2])
    tensor.contents.fp32_contents.extend([1.0, 2.0])
    error = rpc_error(stub.ModelInfer, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == f"input 'IN': {datatype} data must be sent in raw_input_contents"


def test_typed_contents_count_and_range_checked(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = service_pb2.ModelInferRequest(model_name="id_int32")
    tensor = request.inputs.add(name="IN", datatype="INT32", shape=[1, 3])
    tensor.contents.int_contents.extend([1, 2])
    error = rpc_error(stub.ModelInfer, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "3 element(s)" in error.details() and "2 element(s)" in error.details()
    request = typed_request("id_int8", {"IN": (np.array([[1, 300]], dtype=np.int32), "INT8")})
    error = rpc_error(stub.ModelInfer, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "contents of input 'IN' have values out of range for INT8"


def test_two_inputs_mixed_forms_refused(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    request = raw_request("two", {"INPUT0": (a, "INT32"), "INPUT1": (a, "INT32")})
    request.inputs[1].contents.int_contents.extend(a.reshape(-1).tolist())
    error = rpc_error(stub.ModelInfer, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "input 'INPUT1': contents must be empty when raw_input_contents is used"

    request = raw_request("two", {"INPUT0": (a, "INT32"), "INPUT1": (a, "INT32")})
    del request.raw_input_contents[1]
    error = rpc_error(stub.ModelInfer, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "expected 2 raw_input_contents (one per input) but got 1 for model 'two'"

    request = raw_request("two", {"INPUT0": (a, "INT32"), "INPUT1": (a, "INT32")})
    request.raw_input_contents.append(b"ignored")  # one more than the inputs: Triton 2.51 ignores it
    response = stub.ModelInfer(request)
    assert [o.name for o in response.outputs] == ["OUTPUT0", "OUTPUT1"]

    request = raw_request("two", {"INPUT0": (a, "INT32"), "INPUT1": (a, "INT32")})
    request.raw_input_contents[0] = request.raw_input_contents[0][:-4]
    error = rpc_error(stub.ModelInfer, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input byte size mismatch for input 'INPUT0' for model 'two'. Expected 64, got 60" in error.details()


# -- ModelInfer: ids, parameters, outputs, classification ------------------------------------------


def test_request_id_and_parameters(client: grpcclient.InferenceServerClient) -> None:
    data = np.array([3, 4], dtype=np.int32)
    params = {"text": "hé", "count": 7, "flag": True, "ratio": 0.5}
    result = client.infer("echo", [grpc_input("IN", data, "INT32")], request_id="r-1", parameters=params)
    response = result.get_response()
    assert response.id == "r-1"
    assert response.model_name == "echo" and response.model_version == "1"
    assert json.loads(result.as_numpy("PARAMS")[0]) == params
    got = {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in response.parameters.items()}
    assert got == params
    # no id given → empty id; reserved parameters are not passed on
    result = client.infer("echo", [grpc_input("IN", data, "INT32")], priority=1, timeout=1_000_000)
    assert result.get_response().id == ""
    assert json.loads(result.as_numpy("PARAMS")[0]) == {}


def test_reserved_parameters_refused(stub: service_pb2_grpc.GRPCInferenceServiceStub, http: httpx.Client) -> None:
    # tritonclient refuses reserved keys itself, so the raw stub sends them
    data = np.array([1], dtype=np.int32)
    for key in ("triton_x", "triton_final_response"):
        request = raw_request("echo", {"IN": (data, "INT32")})
        request.parameters[key].bool_param = True
        error = rpc_error(stub.ModelInfer, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == (  # Triton 2.51's text, then the key
            "parameter keys starting with 'triton_' are reserved for Triton usage. Only the following keys "
            f"starting with 'triton_' are allowed: triton_enable_empty_final_response (got '{key}')")
    for key in ("triton_x", "triton_enable_empty_final_response"):  # HTTP accepts no triton_ key (as Triton)
        body = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [1]}], "parameters": {key: True}}
        response = http.post("/v2/models/echo/infer", json=body)
        assert response.status_code == 400
        assert response.json()["error"] == f"parameter keys starting with 'triton_' are reserved for Triton usage and should not be specified (got '{key}')"


@pytest.mark.parametrize("value", [True, False])
def test_unary_call_accepts_and_ignores_enable_empty_final_response(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, value: bool
) -> None:
    """perf_analyzer (and model-analyzer through it) sets the parameter on every gRPC request:
    Triton accepts it on ModelInfer too, does not pass it to the model and answers as usual."""
    request = raw_request("echo", {"IN": (np.array([5, 6], dtype=np.int32), "INT32")}, id="e")
    request.parameters["triton_enable_empty_final_response"].bool_param = value
    request.parameters["mine"].string_param = "kept"
    response = stub.ModelInfer(request)
    assert response.id == "e"
    assert np.frombuffer(response.raw_output_contents[0], dtype=np.int32).tolist() == [5, 6]
    assert json.loads(_bytes_element(response.raw_output_contents[1])) == {"mine": "kept"}


def test_enable_empty_final_response_must_be_a_bool(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = raw_request("echo", {"IN": (np.array([1], dtype=np.int32), "INT32")})
    request.parameters["triton_enable_empty_final_response"].int64_param = 1
    error = rpc_error(stub.ModelInfer, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        "invalid value type for 'triton_enable_empty_final_response' parameter, expected bool_param.")


def _bytes_element(raw: bytes) -> bytes:
    """The first element of a serialized BYTES tensor (4-byte length, then the bytes)."""
    size = int.from_bytes(raw[:4], "little")
    return raw[4 : 4 + size]


def test_requested_outputs(client: grpcclient.InferenceServerClient) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = a * 2
    inputs = [grpc_input("INPUT0", a, "INT32"), grpc_input("INPUT1", b, "INT32")]
    result = client.infer("two", inputs, outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    response = result.get_response()
    assert [o.name for o in response.outputs] == ["OUTPUT1"]
    assert len(response.raw_output_contents) == 1
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), b)
    result = client.infer("two", inputs)
    assert [o.name for o in result.get_response().outputs] == ["OUTPUT0", "OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a)
    twice = [grpcclient.InferRequestedOutput(n) for n in ("OUTPUT1", "OUTPUT0", "OUTPUT1")]
    response = client.infer("two", inputs, outputs=twice).get_response()  # answered once, as in Triton
    assert [o.name for o in response.outputs] == ["OUTPUT1", "OUTPUT0"] and len(response.raw_output_contents) == 2
    error = client_error(client.infer, "two", inputs, outputs=[grpcclient.InferRequestedOutput("NOPE")])
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert error.message() == "unexpected inference output 'NOPE' for model 'two'"


def test_classification(client: grpcclient.InferenceServerClient) -> None:
    data = np.array([[0.5, 3.0, 2.0, 0.25]], dtype=np.float32)
    result = client.infer(
        "cls", [grpc_input("IN", data, "FP32")], outputs=[grpcclient.InferRequestedOutput("OUT", class_count=2)]
    )
    out = result.get_response().outputs[0]
    assert out.datatype == "BYTES" and list(out.shape) == [1, 2]
    assert result.as_numpy("OUT").tolist() == [[b"3.000000:1:dog", b"2.000000:2:bird"]]


# -- ModelInfer: errors ------------------------------------------------------------------------------

BAD_REQUESTS: list[tuple[str, str, str, list[tuple[str, str, list[int], list[Any]]], list[str]]] = [
    # (case, model, version, inputs (name, datatype, shape, values), requested outputs)
    ("wrong datatype", "id_fp32", "", [("IN", "INT32", [1, 2], [1, 2])], []),
    ("wrong shape", "two", "", [("INPUT0", "INT32", [1, 3], [1, 2, 3]), ("INPUT1", "INT32", [1, 3], [1, 2, 3])], []),
    ("unknown input", "id_fp32", "", [("NOPE", "FP32", [1, 1], [1.0])], []),
    ("missing input", "two", "", [("INPUT0", "INT32", [1, 16], list(range(16)))], []),
    ("batch too large", "id_fp32", "", [("IN", "FP32", [5, 1], [1.0] * 5)], []),
    ("unknown output", "id_fp32", "", [("IN", "FP32", [1, 1], [1.0])], ["NOPE"]),
    ("unknown model", "nope", "", [("IN", "FP32", [1, 1], [1.0])], []),
    ("unknown version", "id_fp32", "9", [("IN", "FP32", [1, 1], [1.0])], []),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_errors_match_http(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, http: httpx.Client, case: tuple[Any, ...]
) -> None:
    _, model, version, inputs, outputs = case
    np_types = {"INT32": np.int32, "FP32": np.float32}
    request = raw_request(
        model,
        {name: (np.array(values, dtype=np_types[dt]).reshape(shape), dt) for name, dt, shape, values in inputs},
        model_version=version,
    )
    for name in outputs:
        request.outputs.add(name=name)
    error = rpc_error(stub.ModelInfer, request)
    body = {
        "inputs": [{"name": n, "datatype": dt, "shape": s, "data": v} for n, dt, s, v in inputs],
        "outputs": [{"name": n} for n in outputs],
    }
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    response = http.post(path, json=body)
    assert response.status_code in (400, 404), response.text
    assert error.code() == GRPC_CODE[response.status_code]
    assert error.details() == response.json()["error"]


def test_no_inputs(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    error = rpc_error(stub.ModelInfer, service_pb2.ModelInferRequest(model_name="echo"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (  # Triton 2.51's text, which its scripts match
        "expected 1 inputs but got 0 inputs for model 'echo'. Got input(s) [], but missing required "
        "input(s) ['IN']. Please provide all required input(s).")


def test_backend_exception_is_internal_and_server_keeps_serving(
    client: grpcclient.InferenceServerClient, http: httpx.Client
) -> None:
    data = np.array([1], dtype=np.int32)
    error = client_error(client.infer, "echo", [grpc_input("IN", data, "INT32")], parameters={"mode": "raise"})
    assert error.status() == "StatusCode.INTERNAL"
    assert "echo backend raised on purpose" in error.message()
    body = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [1]}], "parameters": {"mode": "raise"}}
    response = http.post("/v2/models/echo/infer", json=body)
    assert response.status_code == 500
    assert response.json()["error"] == error.message()
    result = client.infer("echo", [grpc_input("IN", data, "INT32")])
    np.testing.assert_array_equal(result.as_numpy("OUT"), data)


def test_full_queue_is_unavailable(server: ServerThread) -> None:
    async def one(c: aioclient.InferenceServerClient, after: float, sleep_ms: int) -> Any:
        await asyncio.sleep(after)
        data = np.array([[1]], dtype=np.int32)
        try:
            return await c.infer("slow", [grpc_input("IN", data, "INT32")], parameters={"sleep_ms": sleep_ms})
        except InferenceServerException as exc:
            return exc

    async def main() -> list[Any]:
        async with aioclient.InferenceServerClient(server.grpc_url) as c:
            return await asyncio.gather(one(c, 0, 600), one(c, 0.2, 0), one(c, 0.3, 0))

    busy, queued, refused = asyncio.run(main())
    assert isinstance(busy, grpcclient.InferResult)
    assert isinstance(queued, grpcclient.InferResult)
    assert isinstance(refused, InferenceServerException)
    assert refused.status() == "StatusCode.UNAVAILABLE"
    assert "Exceeds maximum queue size" in refused.message()


def test_decoupled_model_refused_on_model_infer_and_streamed_over_http(client: grpcclient.InferenceServerClient, http: httpx.Client) -> None:
    error = client_error(client.infer, "square", [grpc_input("IN", np.array([1], dtype=np.int32), "INT32")])
    assert error.status() == "StatusCode.UNIMPLEMENTED"
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in error.message()
    assert "ModelStreamInfer" in error.message()
    body = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [1]}]}
    response = http.post("/v2/models/square/infer", json=body)  # HTTP streams it instead (test_infer_stream)
    assert response.status_code == 200 and response.headers["content-type"] == "application/x-ndjson"
    assert [json.loads(line)["parameters"] for line in response.text.splitlines()] == [
        {"triton_final_response": False}, {"triton_final_response": True}]


# -- large tensors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("megabytes", [16, 64])
def test_large_tensor_round_trip(client: grpcclient.InferenceServerClient, megabytes: int) -> None:
    data = np.random.default_rng(megabytes).standard_normal((1, megabytes * 256 * 1024), dtype=np.float32)
    result = client.infer("id_fp32", [grpc_input("IN", data, "FP32")])
    out = result.as_numpy("OUT")
    assert out.shape == data.shape
    np.testing.assert_array_equal(out, data)


# -- both ports, shutdown -----------------------------------------------------------------------------


def test_http_and_grpc_interleaved(server: ServerThread) -> None:
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            data = np.full((1, 3), i, dtype=np.int32)
            with grpcclient.InferenceServerClient(server.grpc_url) as g:
                h = httpclient.InferenceServerClient(server.url)
                try:
                    for _ in range(5):
                        r = g.infer("id_int32", [grpc_input("IN", data, "INT32")], request_id=f"g{i}")
                        assert r.get_response().id == f"g{i}"
                        np.testing.assert_array_equal(r.as_numpy("OUT"), data)
                        tensor = httpclient.InferInput("IN", [1, 3], "INT32")
                        tensor.set_data_from_numpy(data)
                        hr = h.infer("id_int32", [tensor], request_id=f"h{i}")
                        assert hr.get_response()["id"] == f"h{i}"
                        np.testing.assert_array_equal(hr.as_numpy("OUT"), data)
                finally:
                    h.close()
        except BaseException as exc:  # noqa: BLE001 — re-raised on the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_clean_shutdown_closes_both_ports(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "m", identity_config("m", "INT32"))
    options = ServerOptions(model_repositories=[repo], host="127.0.0.1", http_port=0, grpc_port=0)
    thread = ServerThread(Server(options))
    thread.start()
    http_port, grpc_port = thread.server.http_port, thread.server.grpc_port
    with grpcclient.InferenceServerClient(thread.grpc_url) as c:
        assert c.is_server_ready()
    assert httpx.get(f"http://{thread.url}/v2/health/ready").status_code == 200
    thread.stop()  # joins the server's thread for up to 60 s
    assert thread._thread is not None and not thread._thread.is_alive()
    assert not _port_open(http_port)
    assert not _port_open(grpc_port)

