"""System shared memory: registration, status, in-place inputs and outputs, over HTTP and gRPC,
with tritonclient's own shared-memory helpers; and every bad offset, size and name refused."""

from __future__ import annotations

import base64
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from pyserve import InferRequest, InferResponse, InstanceContext
from pyserve.api.backend import Backend
from pyserve.dataplane.shared_memory import cuda_available
from pyserve.server.core import ServerThread

ADDSUB = """
name: "addsub"
backend: "shmtest"
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""

STRINGS = """
name: "strings"
backend: "shmtest"
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ 2 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 2 ] } ]
"""


class AddSub(Backend):
    """``OUTPUT0 = INPUT0 + INPUT1``, ``OUTPUT1 = INPUT0 - INPUT1``; echoes BYTES; keeps the
    last INPUT0 array it saw; sleeps ``delay_ms`` when asked; with parameter ``hold``, waits
    until ``release`` is set."""

    def __init__(self) -> None:
        self.last_input: np.ndarray | None = None
        self.started = threading.Event()
        self.release = threading.Event()

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        responses = []
        for request in requests:
            self.last_input = request.inputs["INPUT0"]
            self.started.set()
            delay = float(request.parameters.get("delay_ms", 0))
            if delay:
                time.sleep(delay / 1000)
            if request.parameters.get("hold"):
                self.release.wait(60)
            if instance.model.name == "strings":
                responses.append(InferResponse({"OUTPUT0": request.inputs["INPUT0"]}))
                continue
            a, b = request.inputs["INPUT0"], request.inputs["INPUT1"]
            responses.append(InferResponse({"OUTPUT0": a + b, "OUTPUT1": a - b}))
        return responses


@pytest.fixture
def backend() -> AddSub:
    return AddSub()


@pytest.fixture
def server(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path], backend: AddSub) -> ServerThread:
    return start_server(make_repo({"addsub": ADDSUB, "strings": STRINGS}), backends={"shmtest": backend})


@pytest.fixture
def regions() -> Iterator[Callable[[int], tuple[Any, str]]]:
    """``make(size)`` → (tritonclient handle, key); every region is destroyed afterwards."""
    made: list[Any] = []

    def make(size: int) -> tuple[Any, str]:
        key = f"/pyserve_test_{uuid.uuid4().hex[:12]}"
        handle = shm.create_shared_memory_region(key[1:], key, size)
        made.append(handle)
        return handle, key

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def _data() -> tuple[np.ndarray, np.ndarray]:
    return np.arange(16, dtype=np.int32), np.full(16, 3, dtype=np.int32)


def test_http_round_trip_in_place(server: ServerThread, regions: Any, backend: AddSub) -> None:
    a, b = _data()
    in_handle, in_key = regions(128)
    out_handle, out_key = regions(128)
    shm.set_shared_memory_region(in_handle, [a, b])
    client = httpclient.InferenceServerClient(server.url)
    try:
        client.register_system_shared_memory("in", in_key, 128)
        client.register_system_shared_memory("out", out_key, 128)
        status = {r["name"]: r for r in client.get_system_shared_memory_status()}
        assert status["in"] == {"name": "in", "key": in_key, "offset": 0, "byte_size": 128}
        assert client.get_system_shared_memory_status("out")[0]["key"] == out_key

        inputs = [httpclient.InferInput("INPUT0", [16], "INT32"), httpclient.InferInput("INPUT1", [16], "INT32")]
        inputs[0].set_shared_memory("in", 64)
        inputs[1].set_shared_memory("in", 64, offset=64)
        outputs = [httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("out", 64)
        outputs[1].set_shared_memory("out", 64, offset=64)
        result = client.infer("addsub", inputs, outputs=outputs)

        out0 = result.get_output("OUTPUT0")
        # as Triton 2.51: no data and no parameters (NVIDIA's C++ client reads output
        # parameters as binary data and fails on shared-memory ones)
        assert out0 == {"name": "OUTPUT0", "datatype": "INT32", "shape": [16]}
        assert result.get_output("OUTPUT1") == {"name": "OUTPUT1", "datatype": "INT32", "shape": [16]}
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.int32, [16]), a + b)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.int32, [16], offset=64), a - b)

        # the backend got a view of the region, not a copy: a later write shows through it
        assert backend.last_input is not None and not backend.last_input.flags.writeable
        shm.set_shared_memory_region(in_handle, [np.full(16, 99, dtype=np.int32)])
        np.testing.assert_array_equal(backend.last_input, np.full(16, 99))

        client.unregister_system_shared_memory("in")
        assert [r["name"] for r in client.get_system_shared_memory_status()] == ["out"]
        client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status() == []
    finally:
        client.close()


def test_grpc_round_trip(server: ServerThread, regions: Any) -> None:
    a, b = _data()
    in_handle, in_key = regions(128)
    out_handle, out_key = regions(64)
    shm.set_shared_memory_region(in_handle, [a, b])
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.register_system_shared_memory("in", in_key, 128)
        client.register_system_shared_memory("out", out_key, 64)
        status = client.get_system_shared_memory_status(as_json=True)["regions"]
        assert status["in"]["key"] == in_key and int(status["in"]["byte_size"]) == 128

        inputs = [grpcclient.InferInput("INPUT0", [16], "INT32"), grpcclient.InferInput("INPUT1", [16], "INT32")]
        inputs[0].set_shared_memory("in", 64)
        inputs[1].set_data_from_numpy(b)  # mixed: one input in shm, one raw
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("out", 64)
        result = client.infer("addsub", inputs, outputs=outputs)
        out0 = result.get_output("OUTPUT0")
        assert not out0.parameters  # as Triton 2.51
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.int32, [16]), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)

        client.unregister_system_shared_memory("in")
        assert list(client.get_system_shared_memory_status(as_json=True).get("regions", {})) == ["out"]
        client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
    finally:
        client.close()


def test_bytes_tensor_through_shared_memory(server: ServerThread, regions: Any) -> None:
    values = np.array([b"hello", b"shared memory"], dtype=object)
    serialized = serialize_byte_tensor(values)
    size = len(serialized.item())
    handle, key = regions(256)
    shm.set_shared_memory_region(handle, [serialized])
    out_handle, out_key = regions(256)
    client = httpclient.InferenceServerClient(server.url)
    try:
        client.register_system_shared_memory("s_in", key, 256)
        client.register_system_shared_memory("s_out", out_key, 256)
        tensor = httpclient.InferInput("INPUT0", [2], "BYTES")
        tensor.set_shared_memory("s_in", size)
        output = httpclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("s_out", 256)
        client.infer("strings", [tensor], outputs=[output])
        got = shm.get_contents_as_numpy(out_handle, np.object_, [2])
        assert list(got) == list(values)
    finally:
        client.close()


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{server.url}", timeout=30) as c:
        yield c


def _infer_body(in_params: dict[str, Any], out_params: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [16], "parameters": in_params},
            {"name": "INPUT1", "datatype": "INT32", "shape": [16], "data": list(range(16))},
        ]
    }
    if out_params is not None:
        body["outputs"] = [{"name": "OUTPUT0", "parameters": out_params}]
    return body


def test_bad_requests_are_clear_400s(http: httpx.Client, regions: Any) -> None:
    handle, key = regions(128)
    shm.set_shared_memory_region(handle, [np.arange(32, dtype=np.int32)])
    assert http.post("/v2/systemsharedmemory/region/r/register", json={"key": key, "byte_size": 128}).status_code == 200

    def error(body: dict[str, Any]) -> str:
        response = http.post("/v2/models/addsub/infer", json=body)
        assert response.status_code == 400, response.text
        return str(response.json()["error"])

    region = {"shared_memory_region": "r", "shared_memory_byte_size": 64}
    unknown = http.post("/v2/models/addsub/infer", json=_infer_body({**region, "shared_memory_region": "nope"}))
    assert unknown.status_code == 404  # as Triton 2.51
    assert "Unable to find shared memory region: 'nope'" in unknown.json()["error"]
    # Triton's words first (its scripts match them), then the numbers
    assert ("Invalid offset + byte size for shared memory region: 'r' (input 'INPUT0': offset 100 and byte size "
            "64; the region holds 128 byte(s))") in error(_infer_body({**region, "shared_memory_offset": 100}))
    assert "Invalid offset for shared memory region: 'r'" in error(_infer_body({**region, "shared_memory_offset": 128}))
    assert "Invalid offset + byte size for shared memory region: 'r'" in error(
        _infer_body({**region, "shared_memory_byte_size": 1024}))
    assert "input byte size mismatch for input 'INPUT0' for model 'addsub'. Expected 64, got 32" in error(
        _infer_body({**region, "shared_memory_byte_size": 32}))
    assert "non-negative integer" in error(_infer_body({**region, "shared_memory_offset": -4}))
    assert "'shared_memory_byte_size' is required" in error(_infer_body({"shared_memory_region": "r"}))
    assert "exactly one of" in error({"inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [16], "parameters": region, "data": list(range(16))},
        {"name": "INPUT1", "datatype": "INT32", "shape": [16], "data": list(range(16))},
    ]})
    # outputs: classification with shm, region too small for the result, window outside the region
    assert "classification cannot be combined" in error(
        _infer_body(region, {**region, "classification": 2})
    )
    assert "Output can't set both 'shared_memory_region' and 'binary_data'" in error(  # Triton 2.51's words
        _infer_body(region, {**region, "binary_data": True}))
    assert "should be at least 64 bytes" in error(_infer_body(region, {**region, "shared_memory_byte_size": 16}))
    assert "Invalid offset + byte size for shared memory region: 'r' (output 'OUTPUT0'" in error(
        _infer_body(region, {**region, "shared_memory_offset": 96}))

    ok = http.post("/v2/models/addsub/infer", json=_infer_body(region, {**region, "shared_memory_offset": 64}))
    assert ok.status_code == 200, ok.text
    written = shm.get_contents_as_numpy(handle, np.int32, [16], offset=64)
    np.testing.assert_array_equal(written, np.arange(16) + np.arange(16))


def test_registration_errors(http: httpx.Client, regions: Any) -> None:
    _, key = regions(64)

    def register(name: str, body: dict[str, Any]) -> httpx.Response:
        return http.post(f"/v2/systemsharedmemory/region/{name}/register", json=body)

    assert register("a", {"key": key, "byte_size": 64}).status_code == 200
    again = register("a", {"key": key, "byte_size": 64})
    assert again.status_code == 400 and "already in manager" in again.json()["error"]
    too_big = register("b", {"key": key, "offset": 32, "byte_size": 64})
    assert too_big.status_code == 400
    assert "failed to register shared memory region 'b': invalid args (offset 32 plus byte size 64 exceeds the 64 " \
           "byte(s)" in too_big.json()["error"]
    for bad_key in ("../etc/passwd", "/a/b", "", "/"):
        response = register("c", {"key": bad_key, "byte_size": 8})
        assert response.status_code == 400, bad_key
    missing = register("d", {"key": f"/pyserve_missing_{uuid.uuid4().hex}", "byte_size": 8})
    assert missing.status_code == 400 and "Unable to open shared memory region" in missing.json()["error"]
    assert register("e", {"key": key, "byte_size": -1}).status_code == 400
    assert register("e", {"key": key}).status_code == 400
    assert http.post("/v2/systemsharedmemory/region/e/register", content=b"not json").status_code == 400

    unknown = http.get("/v2/systemsharedmemory/region/zzz/status")
    assert unknown.status_code == 404
    assert http.post("/v2/systemsharedmemory/region/zzz/unregister").status_code == 200
    assert [r["name"] for r in http.get("/v2/systemsharedmemory/status").json()] == ["a"]
    for name in ("f2", "f18", "f4"):
        assert register(name, {"key": key, "byte_size": 8}).status_code == 200
    # listed by name, as Triton 2.51 lists them (checked side by side), not in registration order
    assert [r["name"] for r in http.get("/v2/systemsharedmemory/status").json()] == ["a", "f18", "f2", "f4"]
    assert http.post("/v2/systemsharedmemory/unregister").status_code == 200
    assert http.get("/v2/systemsharedmemory/status").json() == []


def test_grpc_errors(server: ServerThread, regions: Any) -> None:
    _, key = regions(64)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.register_system_shared_memory("g", key, 128)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        client.register_system_shared_memory("g", key, 64)
        tensor = grpcclient.InferInput("INPUT0", [16], "INT32")
        tensor.set_shared_memory("g", 64, offset=8)
        other = grpcclient.InferInput("INPUT1", [16], "INT32")
        other.set_data_from_numpy(np.zeros(16, dtype=np.int32))
        with pytest.raises(InferenceServerException) as info:
            client.infer("addsub", [tensor, other])
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "Invalid offset + byte size for shared memory region: 'g'" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            client.get_system_shared_memory_status("nope")
        assert info.value.status() == "StatusCode.NOT_FOUND"
        # a CUDA registration with no name or handle, in Triton's words (its L0_grpc aio test
        # matches them), with or without a GPU
        with pytest.raises(InferenceServerException, match="failed to register shared memory region.*invalid args"):
            client.register_cuda_shared_memory("", b"", 0, 0)
    finally:
        client.close()


def test_unregister_while_in_use(server: ServerThread, regions: Any, backend: AddSub) -> None:
    """As Triton 2.51: a region a request is using cannot be unregistered (500, Triton's words),
    neither by name nor with the others; once the request is done it can."""
    a, b = _data()
    in_handle, in_key = regions(128)
    out_handle, out_key = regions(64)
    spare_handle, spare_key = regions(64)
    shm.set_shared_memory_region(in_handle, [a, b])
    client = httpclient.InferenceServerClient(server.url)
    try:
        client.register_system_shared_memory("in", in_key, 128)
        client.register_system_shared_memory("out", out_key, 64)
        client.register_system_shared_memory("spare", spare_key, 64)
        inputs = [httpclient.InferInput("INPUT0", [16], "INT32"), httpclient.InferInput("INPUT1", [16], "INT32")]
        inputs[0].set_shared_memory("in", 64)
        inputs[1].set_shared_memory("in", 64, offset=64)
        output = httpclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("out", 64)
        outcome: dict[str, Any] = {}
        backend.release.clear()

        def run() -> None:
            try:  # tritonclient.http clients are bound to the thread that made them
                with httpclient.InferenceServerClient(server.url) as own:
                    outcome["result"] = own.infer("addsub", inputs, outputs=[output], parameters={"hold": True})
            except Exception as exc:  # asserted below
                outcome["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        try:
            assert backend.started.wait(30)
            with pytest.raises(InferenceServerException) as every:
                client.unregister_system_shared_memory()
            assert every.value.status() == "500"
            assert every.value.message() == (
                "Failed to unregister the following system shared memory regions: in ,out ,")
            with pytest.raises(InferenceServerException) as one:
                client.unregister_system_shared_memory("out")
            assert one.value.message() == "Cannot unregister shared memory region 'out', it is currently in use."
            assert sorted(r["name"] for r in client.get_system_shared_memory_status()) == ["in", "out"]
        finally:
            backend.release.set()
        thread.join(60)
        assert "error" not in outcome, outcome
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.int32, [16]), a + b)
        client.unregister_system_shared_memory()  # the request is done: nothing holds them now
        assert client.get_system_shared_memory_status() == []
        with pytest.raises(InferenceServerException, match="Unable to find shared memory region"):
            client.infer("addsub", inputs, outputs=[output])
        assert client.is_server_live()
    finally:
        client.close()


def test_cuda_shared_memory_without_a_gpu(http: httpx.Client) -> None:
    if cuda_available():
        pytest.skip("cupy and a GPU are present; tests/gpu/test_gpu.py covers CUDA shared memory")
    body = {"raw_handle": {"b64": base64.b64encode(b"\0" * 64).decode()}, "device_id": 0, "byte_size": 64}
    response = http.post("/v2/cudasharedmemory/region/c/register", json=body)
    assert response.status_code == 501
    assert "CUDA shared memory is not available" in response.json()["error"]
    assert http.get("/v2/cudasharedmemory/status").json() == []
    assert http.post("/v2/cudasharedmemory/unregister").status_code == 200
    assert "cuda_shared_memory" not in http.get("/v2").json()["extensions"]
    assert "system_shared_memory" in http.get("/v2").json()["extensions"]


def test_client_shared_memory_can_be_turned_off(
    start_server: Callable[..., ServerThread], make_repo: Callable[..., Path], backend: AddSub
) -> None:
    """``--allow-client-shm false`` (Triton 2.69's default): registering and unregistering
    system and CUDA regions is UNSUPPORTED with Triton's words, over HTTP and gRPC; status
    still answers; nothing is mapped."""
    server = start_server(make_repo({"addsub": ADDSUB}), backends={"shmtest": backend}, allow_client_shm=False)
    message = "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable."
    key = f"/pyserve_test_off_{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region("off", key, 64)
    http = httpclient.InferenceServerClient(server.url)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        calls: list[Callable[[], object]] = [
            lambda: http.register_system_shared_memory("off", key, 64),
            lambda: grpc.register_system_shared_memory("off", key, 64),
            lambda: http.unregister_system_shared_memory("off"),
            lambda: grpc.unregister_system_shared_memory(),
            lambda: http.register_cuda_shared_memory("off", b"\0" * 64, 0, 64),
            lambda: grpc.register_cuda_shared_memory("off", b"\0" * 64, 0, 64),
            lambda: http.unregister_cuda_shared_memory(),
        ]
        for call in calls:
            with pytest.raises(InferenceServerException) as caught:
                call()
            assert message in caught.value.message()
            assert caught.value.status() in ("501", "StatusCode.UNIMPLEMENTED"), caught.value.status()
        assert http.get_system_shared_memory_status() == []
        assert list(grpc.get_system_shared_memory_status().regions) == []
    finally:
        http.close()
        grpc.close()
        shm.destroy_shared_memory_region(handle)
