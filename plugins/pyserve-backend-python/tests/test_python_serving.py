"""Triton model.py files served by pyserve over HTTP and gRPC (default, non-decoupled mode)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import numpy as np
import pytest
import triton_python_backend_utils as pb_utils
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from pyserve.server.core import ServerThread


def http_inputs(arrays: dict[str, np.ndarray], datatypes: dict[str, str]) -> list[httpclient.InferInput]:
    inputs = []
    for name, array in arrays.items():
        item = httpclient.InferInput(name, list(array.shape), datatypes[name])
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs


def grpc_inputs(arrays: dict[str, np.ndarray], datatypes: dict[str, str]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in arrays.items():
        item = grpcclient.InferInput(name, list(array.shape), datatypes[name])
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs


@pytest.mark.parametrize(("model", "dtype", "datatype"), [("add_sub", np.float32, "FP32"), ("add_sub_int32", np.int32, "INT32")])
def test_add_sub_http_and_grpc(python_server: ServerThread, model: str, dtype: Any, datatype: str) -> None:
    a = np.arange(8, dtype=dtype).reshape(2, 4)
    b = np.full((2, 4), 3, dtype=dtype)
    types = {"INPUT0": datatype, "INPUT1": datatype}
    http = httpclient.InferenceServerClient(python_server.url)
    result = http.infer(model, http_inputs({"INPUT0": a, "INPUT1": b}, types))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.as_numpy("OUTPUT0").dtype == dtype
    with grpcclient.InferenceServerClient(python_server.grpc_url) as grpc:
        result = grpc.infer(model, grpc_inputs({"INPUT0": a, "INPUT1": b}, types),
                            outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        assert result.as_numpy("OUTPUT0") is None


def test_add_sub_dynamic_batching_answers_each_request(python_server: ServerThread) -> None:
    http = httpclient.InferenceServerClient(python_server.url, concurrency=8)
    types = {"INPUT0": "FP32", "INPUT1": "FP32"}
    pending = []
    for i in range(16):
        a = np.full((1, 4), i, dtype=np.float32)
        pending.append((i, http.async_infer("add_sub", http_inputs({"INPUT0": a, "INPUT1": a}, types))))
    for i, request in pending:
        np.testing.assert_array_equal(request.get_result().as_numpy("OUTPUT0"), np.full((1, 4), 2 * i, dtype=np.float32))
    http.close()


def test_auto_complete_config_is_served(python_server: ServerThread) -> None:
    config = httpx.get(f"http://{python_server.url}/v2/models/auto_add/config").json()
    assert config["max_batch_size"] == 4
    assert config["backend"] == "python"
    assert "dynamic_batching" in config
    assert [(i["name"], i["data_type"], i["dims"], i["optional"]) for i in config["input"]] == [
        ("A", "TYPE_INT64", [2], False), ("B", "TYPE_INT64", [2], True)]
    assert [(o["name"], o["data_type"], o["dims"]) for o in config["output"]] == [("SUM", "TYPE_INT64", [2])]
    a = np.array([[1, 2], [3, 4]], dtype=np.int64)
    http = httpclient.InferenceServerClient(python_server.url)
    result = http.infer("auto_add", http_inputs({"A": a}, {"A": "INT64"}))
    np.testing.assert_array_equal(result.as_numpy("SUM"), a)


def test_initialize_args_have_every_triton_key(python_server: ServerThread) -> None:
    http = httpclient.InferenceServerClient(python_server.url)
    text = np.array([b"abc"], dtype=np.object_)
    result = http.infer("init_args", http_inputs({"IN": text}, {"IN": "BYTES"}))
    assert result.as_numpy("ECHO").tolist() == [b"ABC"]
    args = json.loads(result.as_numpy("ARGS")[0])
    assert set(args) == {"model_config", "model_instance_kind", "model_instance_name", "model_instance_device_id",
                         "model_repository", "model_version", "model_name"}
    assert args["model_name"] == "init_args"
    assert args["model_version"] == "1"
    assert args["model_instance_kind"] == "CPU"
    assert args["model_instance_name"] == "init_args_0"  # Triton 2.51: group "init_args", instance 0
    assert args["model_instance_device_id"] == "0"
    assert args["model_repository"].endswith("init_args")  # the model directory, not the repository
    config = json.loads(args["model_config"])
    assert config["name"] == "init_args"
    assert config["parameters"] == {"greeting": {"string_value": "hello"}}
    assert pb_utils.get_input_config_by_name(config, "IN")["data_type"] == "TYPE_STRING"


def test_request_parameters_response_parameters_and_metrics(python_server: ServerThread) -> None:
    labels = {"model": "params_metrics", "version": "1"}
    before = pb_utils.REGISTRY.get_sample_value("pyserve_test_requests", labels) or 0.0
    http = httpclient.InferenceServerClient(python_server.url)
    values = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    result = http.infer("params_metrics", http_inputs({"IN": values}, {"IN": "FP32"}),
                        parameters={"temperature": 0.5, "mode": "fast", "flag": True})
    assert json.loads(result.as_numpy("PARAMS")[0]) == {"flag": True, "mode": "fast", "temperature": 0.5}
    assert result.get_response()["parameters"] == {"seen": 3, "request_count": int(before) + 1}
    with grpcclient.InferenceServerClient(python_server.grpc_url) as grpc:
        result = grpc.infer("params_metrics", grpc_inputs({"IN": values[:1]}, {"IN": "FP32"}), parameters={"n": 7})
        assert json.loads(result.as_numpy("PARAMS")[0]) == {"n": 7}
    registry = pb_utils.REGISTRY
    assert registry.get_sample_value("pyserve_test_requests", labels) == before + 2
    assert registry.get_sample_value("pyserve_test_last_sum", labels) == 1.0
    assert registry.get_sample_value("pyserve_test_input_size_bucket", {**labels, "le": "1"}) >= 1
    assert registry.get_sample_value("pyserve_test_input_size_bucket", {**labels, "le": "4"}) >= 2
    assert registry.get_sample_value("pyserve_test_input_size_count", labels) >= 2


def test_dlpack_model(python_server: ServerThread) -> None:
    values = np.array([0.5, -1.0, 2.0], dtype=np.float32)
    http = httpclient.InferenceServerClient(python_server.url)
    result = http.infer("dlpack", http_inputs({"IN": values}, {"IN": "FP32"}))
    np.testing.assert_array_equal(result.as_numpy("DOUBLED"), values * 2)
    np.testing.assert_array_equal(result.as_numpy("SAME"), values)


def test_stateful_model_under_the_sequence_batcher(python_server: ServerThread) -> None:
    http = httpclient.InferenceServerClient(python_server.url)

    def step(corrid: int, value: int, start: bool = False, end: bool = False) -> tuple[int, int]:
        result = http.infer("accumulate", http_inputs({"IN": np.array([[value]], dtype=np.int32)}, {"IN": "INT32"}),
                            sequence_id=corrid, sequence_start=start, sequence_end=end)
        return int(result.as_numpy("TOTAL")[0, 0]), int(result.as_numpy("CALLS")[0, 0])

    assert step(11, 5, start=True) == (5, 1)
    assert step(22, 100, start=True) == (100, 1)
    assert step(11, 2) == (7, 2)
    assert step(22, 1) == (101, 2)
    assert step(11, 3, end=True) == (10, 3)
    assert step(11, 1, start=True, end=True) == (1, 1)  # state restarts with a new sequence
    with grpcclient.InferenceServerClient(python_server.grpc_url) as grpc:
        result = grpc.infer("accumulate", grpc_inputs({"IN": np.array([[4]], dtype=np.int32)}, {"IN": "INT32"}),
                            sequence_id=22, sequence_end=True)
        assert int(result.as_numpy("TOTAL")[0, 0]) == 105


TORCH_MODEL = """
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            values = torch.from_dlpack(pb_utils.get_input_tensor_by_name(request, "IN"))
            out = pb_utils.Tensor.from_dlpack("OUT", torch.cumsum(values, dim=0))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
"""


def test_torch_model_through_dlpack(serve: Any) -> None:
    pytest.importorskip("torch")
    config = """
        backend: "python"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
    """
    server = serve({"torch_cumsum": (config, TORCH_MODEL)})
    values = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    result = httpclient.InferenceServerClient(server.url).infer(
        "torch_cumsum", http_inputs({"IN": values}, {"IN": "FP32"}))
    np.testing.assert_array_equal(result.as_numpy("OUT"), [1.0, 3.0, 6.0])


NO_TENSORS_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for _ in requests]
'''


def test_a_model_without_tensors_loads_and_answers(serve: Any) -> None:
    """Triton 2.51 serves a config.pbtxt of only ``backend: "python"`` (model.py without
    auto_complete_config): READY, and a request without inputs gets an answer without outputs."""
    server = serve({"bare": ('backend: "python"\n', NO_TENSORS_MODEL)})
    config = httpx.get(f"http://{server.url}/v2/models/bare/config").json()
    assert config["input"] == [] and config["output"] == []
    assert config["instance_group"][0]["name"] == "bare"
    response = httpx.post(f"http://{server.url}/v2/models/bare/infer", json={"inputs": []})
    assert response.status_code == 200, response.text
    assert response.json()["outputs"] == []
    with grpcclient.InferenceServerClient(server.grpc_url) as grpc:
        answer = grpc.infer("bare", []).get_response()
        assert answer.model_name == "bare" and not answer.outputs
