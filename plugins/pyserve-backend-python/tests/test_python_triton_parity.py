"""Behaviours where a differential probe found pyserve's Python backend differing from Triton 2.51.

Served through real servers (thread and process mode) where the difference shows only end to
end: writeable input arrays, BYTES conversion of model outputs and BLS inputs, ``async_exec``
futures, error messages and ``auto_complete_config`` that catches a refused ``add_input``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import numpy as np
import pytest
import triton_python_backend_utils as pb_utils
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from python_backend_helpers import PROCESS_MODE
from tritonclient.utils import InferenceServerException

from pyserve import InferRequest
from pyserve.server.core import ServerThread

Serve = Callable[[Mapping[str, tuple[str | None, str]]], ServerThread]

CONFIG = """
backend: "python"
max_batch_size: 0
input [
  { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] optional: true }
]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "TEXT_OUT" data_type: TYPE_STRING dims: [ -1 ] }
]
"""

SOURCE = """
import asyncio
import json
import numpy as np
import triton_python_backend_utils as pb_utils

CALLEE = "writer"


def bls(values, mode, text=None, callee=CALLEE, outputs=("OUT",)):
    inputs = [pb_utils.Tensor("IN", values)]
    if text is not None:
        inputs.append(pb_utils.Tensor("TEXT", text))
    return pb_utils.InferenceRequest(model_name=callee, inputs=inputs, requested_output_names=list(outputs),
                                     parameters={"mode": mode})


def out(name, array):
    return pb_utils.InferenceResponse([pb_utils.Tensor(name, array)])


class TritonPythonModel:
    def initialize(self, args):
        self.const = np.array([5, 6], dtype=np.int32)

    async def execute(self, requests):
        return [await self.one(request) for request in requests]

    async def one(self, request):
        mode = json.loads(request.parameters()).get("mode", "inplace")
        tensor = pb_utils.get_input_tensor_by_name(request, "IN")
        if mode == "inplace":  # model code that normalises its input in place
            x = tensor.as_numpy()
            x += 1
            x[0] = 100
            return out("OUT", np.append(x, [int(tensor.as_numpy() is x)]).astype(np.int32))
        if mode == "const":  # an array the model keeps, returned as its output
            return out("OUT", self.const)
        if mode == "bls_inplace":  # the callee writes into its input: the caller's array stays
            x = tensor.as_numpy()
            before = x.copy()
            answer = bls(x, "inplace").exec()
            got = pb_utils.get_output_tensor_by_name(answer, "OUT").as_numpy()
            return out("OUT", np.append(got, [int(np.array_equal(x, before))]).astype(np.int32))
        if mode == "bls_const":  # writing into a BLS output leaves the callee's array alone
            first = pb_utils.get_output_tensor_by_name(bls(tensor.as_numpy(), "const").exec(), "OUT").as_numpy()
            first += 100
            second = pb_utils.get_output_tensor_by_name(bls(tensor.as_numpy(), "const").exec(), "OUT").as_numpy()
            return out("OUT", np.concatenate([first, second]).astype(np.int32))
        if mode == "ints":  # a BYTES output made of ints
            return out("TEXT_OUT", np.array([1, 22], dtype=object))
        if mode == "types":  # which TEXT elements arrived as bytes
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            return pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.array([int(type(e) is bytes) for e in text], dtype=np.int32)),
                pb_utils.Tensor("TEXT_OUT", text)])
        if mode == "bls_bytes":  # str elements in a BLS BYTES input; ints in the callee's output
            answer = bls(tensor.as_numpy(), "types", np.array(["a", b"b"], dtype=object),
                         outputs=("OUT", "TEXT_OUT")).exec()
            seen = pb_utils.get_output_tensor_by_name(answer, "OUT").as_numpy()
            ints = pb_utils.get_output_tensor_by_name(bls(tensor.as_numpy(), "ints", outputs=("TEXT_OUT",)).exec(),
                                                      "TEXT_OUT").as_numpy()
            return out("OUT", np.append(seen, [int(ints.tolist() == [b"1", b"22"])]).astype(np.int32))
        if mode == "names":
            names = request.requested_output_names()
            return out("OUT", np.array([int(type(names) is set), int(names == {"OUT"})], dtype=np.int32))
        if mode == "async":
            future = bls(tensor.as_numpy(), "const").async_exec()
            called = []
            future.add_done_callback(lambda f: called.append(f.done()))
            done, _ = await asyncio.wait([future])
            await asyncio.sleep(0)  # done callbacks run soon after
            answer = future.result()
            got = pb_utils.get_output_tensor_by_name(answer, "OUT").as_numpy()

            def outside_loop():
                try:
                    bls(tensor.as_numpy(), "const").async_exec()
                except RuntimeError as exc:
                    return int("no running event loop" in str(exc))
                return 0

            refused = await asyncio.to_thread(outside_loop)
            flags = [int(isinstance(future, asyncio.Future)), int(done == {future}), int(called == [True]), refused]
            return out("OUT", np.append(got, flags).astype(np.int32))
        if mode == "fractions":  # FP32 values for the INT32 output: Triton sends them as FP32
            return out("OUT", np.array([1.5, 2.5], dtype=np.float32))
        if mode == "bls_fractions":  # a BLS caller sees the callee's FP32 as it was produced
            got = pb_utils.get_output_tensor_by_name(bls(tensor.as_numpy(), "fractions").exec(), "OUT").as_numpy()
            return out("OUT", np.append(got, [float(got.dtype == np.float32)]).astype(np.float32))
        if mode == "tme":
            raise pb_utils.TritonModelException("tme boom")
        raise ValueError(f"unknown mode {mode}")
"""

CALLER_MODES = ("bls_inplace", "bls_const", "bls_bytes", "async")


def _models(process: bool) -> dict[str, tuple[str | None, str]]:
    extra = PROCESS_MODE if process else ""
    return {"probe": (CONFIG + extra, SOURCE), "writer": (CONFIG + extra, SOURCE)}


@pytest.fixture(scope="module", params=["thread", "process"])
def probe_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ServerThread:
    from python_backend_helpers import start, write_python_model

    repo = tmp_path_factory.mktemp(f"parity_{request.param}")
    for name, (config, source) in _models(request.param == "process").items():
        write_python_model(repo, name, config, source)
    thread = start(repo)
    request.addfinalizer(thread.stop)
    return thread


def _http(server: ServerThread, mode: str, values: np.ndarray, binary: bool = True, output: str = "OUT") -> np.ndarray:
    client = httpclient.InferenceServerClient(server.url)
    item = httpclient.InferInput("IN", list(values.shape), "INT32")
    item.set_data_from_numpy(values, binary_data=binary)
    result = client.infer("probe", [item], parameters={"mode": mode},
                          outputs=[httpclient.InferRequestedOutput(output, binary_data=binary)])
    array = result.as_numpy(output)
    assert array is not None
    return array


def _grpc(server: ServerThread, mode: str, values: np.ndarray) -> np.ndarray:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        item = grpcclient.InferInput("IN", list(values.shape), "INT32")
        item.set_data_from_numpy(values)
        result = client.infer("probe", [item], parameters={"mode": mode},
                              outputs=[grpcclient.InferRequestedOutput("OUT")])
        array = result.as_numpy("OUT")
        assert array is not None
        return array


def test_inputs_are_writeable_over_every_protocol(probe_server: ServerThread) -> None:
    values = np.array([1, 2, 3], dtype=np.int32)
    expected = [100, 3, 4, 1]  # the last element: as_numpy() returned the same array twice
    assert _http(probe_server, "inplace", values).tolist() == expected  # binary extension
    assert _http(probe_server, "inplace", values, binary=False).tolist() == expected  # JSON
    assert _grpc(probe_server, "inplace", values).tolist() == expected  # raw_input_contents


def test_writes_into_arrays_never_reach_another_model(probe_server: ServerThread) -> None:
    values = np.array([1, 2], dtype=np.int32)
    # the callee's in-place writes do not change the caller's array (last element 1)
    assert _grpc(probe_server, "bls_inplace", values).tolist() == [100, 3, 1, 1]
    # the caller's writes into a BLS output do not change the array the callee keeps
    assert _grpc(probe_server, "bls_const", values).tolist() == [105, 106, 5, 6]


def test_bytes_outputs_and_bls_inputs_are_serialised_as_triton_does(probe_server: ServerThread) -> None:
    one = np.array([1], dtype=np.int32)
    assert _http(probe_server, "ints", one, binary=False, output="TEXT_OUT").tolist() == ["1", "22"]  # JSON
    assert _http(probe_server, "ints", one, output="TEXT_OUT").tolist() == [b"1", b"22"]
    # the callee sees bytes for the str element; the caller sees the callee's ints as b"1", b"22"
    assert _grpc(probe_server, "bls_bytes", one).tolist() == [1, 1, 1]


def test_an_output_of_another_datatype_is_sent_as_the_model_produced_it(probe_server: ServerThread) -> None:
    values = np.array([1], dtype=np.int32)
    for answer in (_http(probe_server, "fractions", values), _http(probe_server, "fractions", values, binary=False),
                   _grpc(probe_server, "fractions", values)):
        assert answer.dtype == np.float32
        assert answer.tolist() == [1.5, 2.5]
    assert _http(probe_server, "bls_fractions", values).tolist() == [1.5, 2.5, 1.0]


def test_requested_output_names_is_a_set(probe_server: ServerThread) -> None:
    assert _grpc(probe_server, "names", np.array([1], dtype=np.int32)).tolist() == [1, 1]


def test_async_exec_returns_a_future_on_the_running_loop(probe_server: ServerThread) -> None:
    assert _grpc(probe_server, "async", np.array([1], dtype=np.int32)).tolist() == [5, 6, 1, 1, 1, 1]


def test_triton_model_exception_message_names_its_class(probe_server: ServerThread) -> None:
    with pytest.raises(InferenceServerException, match="message: TritonModelException: tme boom"):
        _http(probe_server, "tme", np.array([1], dtype=np.int32))


AUTO_COMPLETE_SOURCE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        try:
            config.add_input({"name": "BAD", "data_type": "TYPE_FP32", "dims": [1], "foo": 1})
        except ValueError:
            pass
        try:
            config.add_output({"name": "BAD_OUT", "data_type": "TYPE_FP32", "dims": [1], "label_filename": "x"})
        except ValueError:
            pass
        config.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [1]})
        config.add_output({"name": "OUT", "data_type": "TYPE_INT32", "dims": [1]})
        return config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
                for r in requests]
"""


def test_auto_complete_that_catches_a_refused_add_input_still_loads(serve: Serve) -> None:
    server = serve({"ac_badkey": ('backend: "python"\n', AUTO_COMPLETE_SOURCE)})
    base = f"http://{server.url}/v2/models/ac_badkey"
    assert httpx.get(f"{base}/ready").status_code == 200
    config = httpx.get(f"{base}/config").json()
    assert [i["name"] for i in config["input"]] == ["IN"]
    assert [o["name"] for o in config["output"]] == ["OUT"]


# -- unit tests (no server) -------------------------------------------------------------------------
def test_triton_to_numpy_type_matches_tritons_table() -> None:
    triton = [np.bool_, np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32, np.int64,
              np.float16, np.float32, np.float64, np.object_]
    assert [pb_utils.triton_to_numpy_type(n) for n in range(1, 14)] == triton
    assert pb_utils.TRITON_STRING_TO_NUMPY["TYPE_BOOL"] is bool  # Triton's dict says bool too


def test_model_config_refuses_unknown_keys_with_tritons_message() -> None:
    config = pb_utils.ModelConfig({"name": "m", "input": [{"name": "A", "data_type": "TYPE_FP32", "dims": []}]})
    before = json.dumps(config.as_dict())
    with pytest.raises(ValueError, match=r"input 'BAD' in auto-complete-config function for model 'm' contains "
                                         r"property other than 'name', 'data_type', 'dims' and 'optional'\."):
        config.add_input({"name": "BAD", "data_type": "TYPE_FP32", "dims": [1], "foo": 1})
    with pytest.raises(ValueError, match=r"output 'O' in auto-complete-config function for model 'm' contains "
                                         r"property other than 'name', 'data_type' and 'dims'\."):
        config.add_output({"name": "O", "data_type": "TYPE_FP32", "dims": [1], "label_filename": "l.txt"})
    with pytest.raises(ValueError, match="data_type"):  # dims [] may be filled in, but not with this
        config.add_input({"name": "A", "dims": [4], "data_type": "TYPE_INT8"})
    assert json.dumps(config.as_dict()) == before  # nothing was changed by the refused calls
    config.to_message()  # still a valid config


def test_received_read_only_input_is_copied_once_when_asked_for() -> None:
    from pyserve_backend_python.request import InferenceRequest

    received = np.frombuffer(b"\x01\x00\x00\x00\x02\x00\x00\x00", dtype=np.int32)  # as binary requests give
    writeable = np.arange(2, dtype=np.int32)
    server_request = InferRequest("m", 1, {"R": received, "W": writeable}, ("OUT",))
    request = InferenceRequest._from_server(server_request)
    first = pb_utils.get_input_tensor_by_name(request, "R").as_numpy()
    assert first.flags.writeable and first is pb_utils.get_input_tensor_by_name(request, "R").as_numpy()
    first += 1
    assert received.tolist() == [1, 2] and first.tolist() == [2, 3]
    assert pb_utils.get_input_tensor_by_name(request, "W").as_numpy() is writeable  # no copy needed


def test_outputs_reach_the_server_as_the_models_values_at_hand_over_and_as_bytes() -> None:
    """The server takes what the outputs hold when the response is handed over (see
    test_python_output_ownership.py for when that needs no copy); BYTES elements become
    ``bytes`` in a new array, the model's own arrays untouched. (Whoever passes an output on
    to another model hands over a read-only view.)"""
    kept = np.array([1, 2], dtype=np.int32)
    objects = np.array([1, "é", b"\xff"], dtype=object)
    response = pb_utils.InferenceResponse([pb_utils.Tensor("A", kept), pb_utils.Tensor("B", objects)])
    outputs = response.to_server().outputs  # type: ignore[union-attr]
    kept[0] = 9  # the model writes its array again: the answer keeps the values it was given
    assert outputs["A"].tolist() == [1, 2] and outputs["A"].dtype == np.int32
    assert kept.flags.writeable  # the model's own array is untouched
    answer = pb_utils.InferenceResponse.from_server(response.to_server())  # type: ignore[arg-type]
    assert not answer.output_tensors()[0]._array.flags.writeable  # what a BLS caller receives
    assert outputs["B"].tolist() == [b"1", "é".encode(), b"\xff"]
    assert objects.tolist() == [1, "é", b"\xff"]
    all_bytes = np.array([b"x"], dtype=object)
    assert pb_utils.InferenceResponse([pb_utils.Tensor("C", all_bytes)]).to_server().outputs[  # type: ignore[union-attr]
        "C"].tolist() == [b"x"]


def test_bls_request_converts_str_elements_and_shares_read_only() -> None:
    values = np.array([1, 2], dtype=np.int32)
    text = np.array(["a", b"b"], dtype=object)
    request = pb_utils.InferenceRequest(model_name="other", requested_output_names=["OUT", "X"],
                                        inputs=[pb_utils.Tensor("IN", values), pb_utils.Tensor("TEXT", text)])
    assert request.requested_output_names() == {"OUT", "X"}
    call = request._to_server()
    assert call.requested_outputs == ("OUT", "X")
    assert call.inputs["TEXT"].tolist() == [b"a", b"b"] and text.tolist() == ["a", b"b"]
    assert not call.inputs["IN"].flags.writeable and np.shares_memory(call.inputs["IN"], values)
    assert values.flags.writeable


def test_async_exec_outside_an_event_loop_raises() -> None:
    request = pb_utils.InferenceRequest(model_name="other", inputs=[], requested_output_names=[])
    with pytest.raises(RuntimeError, match="no running event loop"):
        request.async_exec()


def test_execute_failure_names_the_exception_class() -> None:
    from pyserve_backend_python.results import execute_failure

    error = execute_failure("m", "m_0", pb_utils.TritonModelException("tme boom"))
    assert error.message.endswith("message: TritonModelException: tme boom")
    assert execute_failure("m", "m_0", ValueError("v")).message.endswith("message: ValueError: v")


def test_async_exec_future_runs_without_being_awaited() -> None:
    """The future is a task: it runs even if nothing awaits it at once (as Triton's)."""
    import pyserve_backend_python.bls as bls_module

    calls: list[str] = []

    async def fake(request: pb_utils.InferenceRequest, decoupled: bool) -> str:
        calls.append(request.model_name())
        return "answer"

    async def main() -> tuple[bool, object]:
        saved = bls_module.async_exec_request
        bls_module.async_exec_request = fake  # type: ignore[assignment]
        try:
            future = pb_utils.InferenceRequest(model_name="other", inputs=[], requested_output_names=[]).async_exec()
            await asyncio.sleep(0)
            return future.done(), await future
        finally:
            bls_module.async_exec_request = saved

    assert asyncio.run(main()) == (True, "answer") and calls == ["other"]


def test_triton_error_codes_are_enum_members_that_equal_their_numbers() -> None:
    code = pb_utils.TritonError("gone", pb_utils.TritonError.NOT_FOUND).code()
    assert code == pb_utils.TritonError.NOT_FOUND and code == 2 and code.name == "NOT_FOUND"
    assert pb_utils.TritonError("x").code().name == "INTERNAL"
    assert pb_utils.TritonError("odd", 42).code() == 42


BF16_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_BF16 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_BF16 dims: [ -1 ] } ]
"""
BF16_SOURCE = """
import torch
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "IN")
            try:
                tensor.as_numpy()
            except pb_utils.TritonModelException:
                pass
            else:
                raise RuntimeError("as_numpy() of a BF16 tensor should have failed")
            doubled = torch.utils.dlpack.from_dlpack(tensor.to_dlpack()) * 2
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor.from_dlpack("OUT", torch.utils.dlpack.to_dlpack(doubled))]))
        return out
"""


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_bf16_through_dlpack_and_torch(serve: Any, mode: str) -> None:
    """A model in the manner of Triton's identity_bf16: BF16 in, through torch by DLPack, out."""
    pytest.importorskip("torch")
    import ml_dtypes

    config = BF16_CONFIG + (PROCESS_MODE if mode == "process" else "")
    server = serve({"bf16_torch": (config, BF16_SOURCE)})
    values = np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16)
    item = httpclient.InferInput("IN", [3], "BF16")
    item.set_data_from_numpy(values, binary_data=True)
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        result = client.infer("bf16_torch", [item])
    finally:
        client.close()
    assert result.as_numpy("OUT").astype(np.float32).tolist() == [3.0, -4.0, 6.5]
