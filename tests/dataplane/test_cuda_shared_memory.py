"""CUDA shared memory on a machine without a GPU: argument checks against the real server, and
the region logic (offsets, copies, errors, closing handles) over HTTP and gRPC with a host-memory
stand-in for the four cupy runtime calls ``pyserve.dataplane.shared_memory.CudaRegion`` makes.

The stand-in replaces only what cannot run here (CUDA); ``tests/gpu/test_gpu.py`` runs the same
paths with tritonclient's ``cuda_shared_memory`` utilities on a real GPU.
"""

from __future__ import annotations

import base64
import ctypes
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from gpu_support import IDENTITY_CONFIG, carries_no_data
from suite_support import StartServer, wait_for
from tritonclient.utils import InferenceServerException

from pyserve.dataplane.shared_memory import CUDA_IPC_HANDLE_SIZE, cuda_available
from pyserve.server.core import ServerThread
from pyserve.testing import serve, write_model


class CUDARuntimeError(RuntimeError):
    """What cupy raises for a failed CUDA runtime call."""


class _Device:
    """``cupy.cuda.Device(id)``: one device, 0."""

    def __init__(self, device_id: int) -> None:
        if device_id != 0:
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class HostRuntime:
    """``cupy.cuda.runtime`` for the calls CudaRegion makes, over ctypes buffers standing for
    another process's device allocations (``allocate`` gives the IPC handle of a new one)."""

    memcpyHostToDevice = 1
    memcpyDeviceToHost = 2

    def __init__(self) -> None:
        self.buffers: dict[bytes, Any] = {}
        self.opened: list[int] = []
        self.closed: list[int] = []

    def allocate(self, size: int) -> tuple[bytes, Any]:
        handle = os.urandom(CUDA_IPC_HANDLE_SIZE)
        self.buffers[handle] = ctypes.create_string_buffer(size)
        return handle, self.buffers[handle]

    def getDeviceCount(self) -> int:  # noqa: N802 - cupy's name
        return 1

    def ipcOpenMemHandle(self, handle: bytes, flags: int = 1) -> int:  # noqa: N802
        if not isinstance(handle, bytes) or handle not in self.buffers:
            raise CUDARuntimeError("cudaErrorInvalidValue: invalid argument")
        pointer = ctypes.addressof(self.buffers[handle])
        self.opened.append(pointer)
        return pointer

    def ipcCloseMemHandle(self, pointer: int) -> None:  # noqa: N802
        self.closed.append(pointer)

    def _inside(self, pointer: int, size: int) -> bool:
        return any(ctypes.addressof(b) <= pointer and pointer + size <= ctypes.addressof(b) + ctypes.sizeof(b)
                   for b in self.buffers.values())

    def memcpy(self, destination: int, source: int, size: int, kind: int) -> None:
        device = destination if kind == self.memcpyHostToDevice else source
        if not self._inside(device, size):
            raise CUDARuntimeError("cudaErrorInvalidValue: invalid argument")
        ctypes.memmove(destination, source, size)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cuda-shm") / "repo"
    write_model(root, "ident", IDENTITY_CONFIG)
    return root


@pytest.fixture(scope="module")
def standin(repo: Path) -> Iterator[tuple[HostRuntime, ServerThread]]:
    """One server for the module, with the stand-in installed as ``cupy`` while it runs."""
    host = HostRuntime()
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=host, Device=_Device))
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "cupy", cupy)
        with serve(repo) as server:
            yield host, server


@pytest.fixture
def runtime(standin: tuple[HostRuntime, ServerThread]) -> HostRuntime:
    return standin[0]


def _clients(server: ServerThread, protocol: str) -> tuple[Any, Any]:
    if protocol == "http":
        return httpclient.InferenceServerClient(server.url.removeprefix("http://")), httpclient
    return grpcclient.InferenceServerClient(server.grpc_url), grpcclient


def _b64(handle: bytes) -> bytes:
    return base64.b64encode(handle)


def _regions(client: Any, protocol: str) -> dict[str, tuple[int, int]]:
    if protocol == "http":
        entries = client.get_cuda_shared_memory_status()
    else:
        entries = list(client.get_cuda_shared_memory_status(as_json=True).get("regions", {}).values())
    return {e["name"]: (int(e.get("device_id", 0)), int(e["byte_size"])) for e in entries}


@pytest.fixture(params=["http", "grpc"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def client(standin: tuple[HostRuntime, ServerThread], protocol: str) -> Iterator[tuple[Any, Any]]:
    client, module = _clients(standin[1], protocol)
    yield client, module
    client.unregister_cuda_shared_memory()
    client.close()


def test_regions_carry_inputs_and_outputs(runtime: HostRuntime, client: tuple[Any, Any], protocol: str) -> None:
    connection, module = client
    x = np.arange(6, dtype=np.float32)
    in_handle, in_buffer = runtime.allocate(64)
    out_handle, out_buffer = runtime.allocate(64)
    ctypes.memmove(ctypes.addressof(in_buffer) + 8, x.ctypes.data, x.nbytes)
    connection.register_cuda_shared_memory("cin", _b64(in_handle), 0, 64)
    connection.register_cuda_shared_memory("cout", _b64(out_handle), 0, 64)
    assert _regions(connection, protocol) == {"cin": (0, 64), "cout": (0, 64)}

    tensor = module.InferInput("IN", [6], "FP32")
    tensor.set_shared_memory("cin", x.nbytes, offset=8)
    output = module.InferRequestedOutput("OUT")
    output.set_shared_memory("cout", x.nbytes, offset=16)
    result = connection.infer("ident", [tensor], outputs=[output])
    assert carries_no_data(result, "OUT"), result.get_response()
    np.testing.assert_array_equal(np.frombuffer(out_buffer.raw[16:16 + x.nbytes], dtype=np.float32), x)

    pointer = ctypes.addressof(in_buffer)
    connection.unregister_cuda_shared_memory("cin")
    assert _regions(connection, protocol) == {"cout": (0, 64)}
    wait_for(lambda: pointer in runtime.closed, 30, "the unregistered region's IPC handle to be closed")
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region: 'cin'"):
        connection.infer("ident", [tensor], outputs=[output])
    connection.unregister_cuda_shared_memory()
    assert _regions(connection, protocol) == {}


def test_a_window_past_the_allocation_is_refused(runtime: HostRuntime, client: tuple[Any, Any]) -> None:
    """A client registering more bytes than it allocated gets the CUDA copy's error as
    INVALID_ARG for that request; the server goes on serving."""
    connection, module = client
    handle, _ = runtime.allocate(16)
    connection.register_cuda_shared_memory("small", _b64(handle), 0, 1024)
    tensor = module.InferInput("IN", [64], "FP32")
    tensor.set_shared_memory("small", 256)
    with pytest.raises(InferenceServerException, match="CUDA shared memory region 'small': copying 256 byte"):
        connection.infer("ident", [tensor])
    x = np.ones(4, dtype=np.float32)
    tensor = module.InferInput("IN", [4], "FP32")
    tensor.set_data_from_numpy(x)
    output = module.InferRequestedOutput("OUT")
    output.set_shared_memory("small", 16, offset=512)
    with pytest.raises(InferenceServerException, match="copying 16 byte"):
        connection.infer("ident", [tensor], outputs=[output])
    assert connection.is_server_live()
    np.testing.assert_array_equal(connection.infer("ident", [tensor]).as_numpy("OUT"), x)


@pytest.mark.parametrize(("handle", "device_id", "message"), [
    (b"\0" * 10, 0, "'raw_handle' must be a 64-byte cudaIpcMemHandle_t (got 10)"),
    (b"\1" * CUDA_IPC_HANDLE_SIZE, 0, "failed to open CUDA IPC handle for region 'r'"),
    (None, 3, "failed to open CUDA IPC handle for region 'r': cudaErrorInvalidDevice"),
], ids=["short-handle", "unknown-handle", "bad-device"])
def test_bad_registrations(runtime: HostRuntime, client: tuple[Any, Any], protocol: str,
                           handle: bytes | None, device_id: int, message: str) -> None:
    connection, _ = client
    if handle is None:
        handle, _ = runtime.allocate(16)
    with pytest.raises(InferenceServerException, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        connection.register_cuda_shared_memory("r", _b64(handle), device_id, 16)
    status = caught.value.status()
    assert status in ("400", "StatusCode.INVALID_ARGUMENT"), status
    assert _regions(connection, protocol) == {}


def test_handle_size_is_checked_before_cuda(repo: Path, start_server: StartServer,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Without cupy or a GPU: a malformed handle is INVALID_ARG, a well-formed one UNSUPPORTED."""
    monkeypatch.delitem(sys.modules, "cupy", raising=False)  # the module's stand-in, if it is installed
    if cuda_available():
        pytest.skip("cupy and a GPU are present")
    client = httpclient.InferenceServerClient(start_server(repo).url.removeprefix("http://"))
    try:
        with pytest.raises(InferenceServerException, match="must be a 64-byte") as caught:
            client.register_cuda_shared_memory("r", _b64(b"\0" * 63), 0, 16)
        assert caught.value.status() == "400"
        with pytest.raises(InferenceServerException, match="CUDA shared memory is not available") as caught:
            client.register_cuda_shared_memory("r", _b64(b"\0" * CUDA_IPC_HANDLE_SIZE), 0, 16)
        assert caught.value.status() == "501"
    finally:
        client.close()

