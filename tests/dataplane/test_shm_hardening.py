"""System shared memory is not a confused deputy: a client cannot register the server's own
segments (by name, or by a link to them) nor other programs' reserved objects, the process-mode
input arena never stays in ``/dev/shm`` for anyone to find, and each registered region holds one
descriptor (the one opened to map it is closed). Real servers, the HTTP API, real objects."""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from suite_support import ECHO_MODEL_PY, python_echo_config, write_model

from pyserve.dataplane import shared_memory
from pyserve.server.core import ServerThread
from pyserve.testing import serve

SHM = Path("/dev/shm")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    repo = tmp_path / "repo"
    extra = 'parameters { key: "execution_mode" value { string_value: "process" } }'
    write_model(repo, "echo_proc", python_echo_config("echo_proc", extra), files={"1/model.py": ECHO_MODEL_PY})
    with serve(repo) as thread:
        yield thread


def register(thread: ServerThread, name: str, key: str, byte_size: int = 64) -> requests.Response:
    return requests.post(f"http://{thread.url}/v2/systemsharedmemory/region/{name}/register",
                         json={"key": key, "offset": 0, "byte_size": byte_size}, timeout=60)


def make_object(key: str, size: int = 4096) -> Path:
    path = SHM / key
    with open(path, "wb") as handle:
        handle.truncate(size)
    return path


def descriptors_of(path: Path) -> int:
    """Descriptors of this process (the server runs in it) open on ``path``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:
            continue
    return count


def infer(thread: ServerThread) -> None:
    client = httpclient.InferenceServerClient(thread.url)
    try:
        tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
        assert client.infer("echo_proc", [tensor]).as_numpy("OUTPUT0").tolist() == [[0, 1, 2, 3]]
    finally:
        client.close()


def test_the_process_mode_arena_is_never_left_in_dev_shm(server: ServerThread) -> None:
    infer(server)
    leftovers = [name for name in os.listdir(SHM) if name.startswith(f"pyserve_py_{os.getpid()}_")]
    assert leftovers == []


@pytest.mark.parametrize("key", ["pyserve_py_1_2_i0", "/pyserve_py_9_o3", "sem.lock", "psm_0a1b2c", "torch_1_2"])
def test_reserved_names_are_refused(server: ServerThread, key: str) -> None:
    path = make_object(key.removeprefix("/"))
    try:
        answer = register(server, "r", key)
    finally:
        path.unlink()
    assert answer.status_code == 400
    assert "is reserved" in answer.json()["error"]


def test_a_link_to_a_segment_of_the_server_is_refused(server: ServerThread) -> None:
    own = f"pyserve_test_own_{uuid.uuid4().hex}"
    fd = os.open(SHM / own, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    noted = shared_memory.note_server_segment(fd)  # as the Python backend notes its arenas
    link = f"innocent_{uuid.uuid4().hex}"
    try:
        os.ftruncate(fd, 4096)
        os.link(SHM / own, SHM / link)
        answer = register(server, "r", link)
        assert answer.status_code == 400
        assert "memory of the server itself" in answer.json()["error"]
    finally:
        shared_memory.forget_server_segment(noted)
        os.close(fd)
        for name in (own, link):
            (SHM / name).unlink(missing_ok=True)


def test_each_region_holds_one_descriptor_and_still_sees_a_shrink(server: ServerThread) -> None:
    key = f"client_{uuid.uuid4().hex}"
    path = make_object(key, 1 << 16)
    try:
        for index in range(50):
            assert register(server, f"r{index}", key).status_code == 200
        assert descriptors_of(path) == 50  # one per region: the mapping's own
        os.truncate(path, 16)  # the client shrinks its object below a region's window
        request = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "parameters": {
            "shared_memory_region": "r0", "shared_memory_byte_size": 16, "shared_memory_offset": 32}}]}
        answer = requests.post(f"http://{server.url}/v2/models/echo_proc/infer", json=request, timeout=60)
        assert answer.status_code == 400 and "it was shrunk after registration" in answer.json()["error"]
    finally:
        requests.post(f"http://{server.url}/v2/systemsharedmemory/unregister", timeout=60)
        path.unlink()


def test_registrations_are_capped(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_memory, "MAX_REGIONS", 3)
    key = f"client_{uuid.uuid4().hex}"
    path = make_object(key)
    try:
        assert [register(server, f"c{i}", key).status_code for i in range(4)] == [200, 200, 200, 400]
        assert "unregister some first" in register(server, "c9", key).json()["error"]
    finally:
        requests.post(f"http://{server.url}/v2/systemsharedmemory/unregister", timeout=60)
        path.unlink()


def test_a_mapping_outlives_its_closed_descriptor() -> None:
    """What the region relies on: Python's mmap keeps its own descriptor for ``size()``."""
    key = f"client_{uuid.uuid4().hex}"
    path = make_object(key, 8192)
    try:
        fd = os.open(path, os.O_RDWR)
        mapping = mmap.mmap(fd, 8192)
        os.close(fd)
        os.truncate(path, 100)
        assert mapping.size() == 100
        mapping.close()
    finally:
        path.unlink()
