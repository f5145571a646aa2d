"""``pb_utils`` arguments as Triton's pybind11 bindings take them: ``bytes`` for text (Triton's
BLS example passes ``model_name=b"add_sub"``), ``TypeError`` for an argument of the wrong type
(what Triton's own ``argument_validation`` test model checks), ``TritonModelException`` for a
list element that is not a tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import triton_python_backend_utils as pb_utils
import tritonclient.http as httpclient
from python_backend_helpers import start, write_python_model

ADD_CONFIG = """
    backend: "python"
    max_batch_size: 0
    input [ { name: "IN" data_type: TYPE_INT32 dims: [ 2 ] } ]
    output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 2 ] } ]
"""

ADD_ONE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + 1)]) for r in requests]
"""

CALLER_CONFIG = ADD_CONFIG.replace('name: "IN" data_type: TYPE_INT32 dims: [ 2 ] }', (
    'name: "IN" data_type: TYPE_INT32 dims: [ 2 ] }, { name: "MODEL_NAME" data_type: TYPE_STRING dims: [ 1 ] }'))

CALLER = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy()[0]  # bytes
            answer = pb_utils.InferenceRequest(
                model_name=name, inputs=[pb_utils.get_input_tensor_by_name(request, "IN")],
                requested_output_names=[b"OUT"]).exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(answer, "OUT")]))
        return responses
"""


def test_bls_takes_the_model_name_as_bytes(tmp_path: Path) -> None:
    write_python_model(tmp_path, "add_one", ADD_CONFIG, ADD_ONE)
    write_python_model(tmp_path, "caller", CALLER_CONFIG, CALLER)
    server = start(tmp_path)
    try:
        values = httpclient.InferInput("IN", [2], "INT32")
        values.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
        name = httpclient.InferInput("MODEL_NAME", [1], "BYTES")
        name.set_data_from_numpy(np.array([b"add_one"], dtype=np.object_))
        with httpclient.InferenceServerClient(server.url) as client:
            result = client.infer("caller", [values, name]).as_numpy("OUT")
        np.testing.assert_array_equal(result, [2, 3])
    finally:
        server.stop()


TENSOR = pb_utils.Tensor("INPUT0", np.asarray([1, 2], dtype=np.int32))


@pytest.mark.parametrize("change", [
    {"inputs": None}, {"model_name": None}, {"requested_output_names": None},
    {"requested_output_names": [None]}, {"correlation_id": None}, {"request_id": None},
    {"model_version": None}, {"flags": None}, {"timeout": "soon"},
])
def test_inference_request_arguments_of_the_wrong_type(change: dict[str, Any]) -> None:
    arguments: dict[str, Any] = {"model_name": "m", "inputs": [TENSOR], "requested_output_names": ["OUT"]}
    arguments.update(change)
    with pytest.raises(TypeError):
        pb_utils.InferenceRequest(**arguments)


def test_inference_request_and_response_elements_that_are_not_tensors() -> None:
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.InferenceRequest(model_name="m", inputs=[None], requested_output_names=[])
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.InferenceResponse(output_tensors=[None])
    with pytest.raises(TypeError):
        pb_utils.InferenceResponse(output_tensors=None)
    assert pb_utils.InferenceResponse().output_tensors() == []
    request = pb_utils.InferenceRequest(model_name=b"m", inputs=[], requested_output_names=[], request_id=b"r",
                                        correlation_id="c", model_version=np.int64(2))
    assert (request.model_name(), request.request_id(), request.correlation_id()) == ("m", "r", "c")


def test_tensor_and_logger_arguments_of_the_wrong_type() -> None:
    with pytest.raises(TypeError):
        pb_utils.Tensor(None, np.ones(1))
    with pytest.raises(TypeError):
        pb_utils.Tensor("OUTPUT0", None)
    for call in (pb_utils.Logger.log_info, pb_utils.Logger.log_warn, pb_utils.Logger.log_error,
                 pb_utils.Logger.log_verbose):
        with pytest.raises(TypeError):
            call(None)
    with pytest.raises(TypeError):
        pb_utils.Logger.log("message", 1)  # a plain int is no LogLevel, as in Triton
    with pytest.raises(TypeError):
        pb_utils.Logger.log("message", None)
    pb_utils.Logger.log("level unspecified")
