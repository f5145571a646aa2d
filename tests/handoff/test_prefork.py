"""``pyserve run`` loads the models its frontends replicate once and forks the frontends from
that state (``pyserve.handoff.prefork``): every process serves them from one copy of the
weights.

Real ``pyserve run`` processes with ``--frontend-processes 1``; the Python model writes the
pid of each ``initialize`` into a file beside it and answers with the pid that executed, so the
tests see which process loaded what and which one answered.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from suite_support import RunningServer, wait_for, write_model

WEIGHTS_MIB = 192

PID_MODEL = """
import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

HERE = os.path.dirname(__file__)


class TritonPythonModel:
    def initialize(self, args):
        with open(os.path.join(HERE, "initialized.txt"), "a") as log:
            log.write(f"{os.getpid()}\\n")
        self.weights = np.ones(WEIGHTS_MIB * 1024 * 1024 // 8, dtype=np.float64)
        self.thread = None
        if STARTS_THREAD:
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self.stop.wait)
            self.thread.start()

    def execute(self, requests):
        pid = np.array([os.getpid()], dtype=np.int64)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", pid)]) for _ in requests]

    def finalize(self):
        with open(os.path.join(HERE, "finalized.txt"), "a") as log:
            log.write(f"{os.getpid()}\\n")
        if self.thread is not None:
            self.stop.set()
            self.thread.join()
"""


def _repository(root: Path, starts_thread: bool = False) -> Path:
    repo = root / "repo"
    source = PID_MODEL.replace("WEIGHTS_MIB", str(WEIGHTS_MIB)).replace("STARTS_THREAD", str(starts_thread))
    write_model(repo, "pid", """
        backend: "python"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
    """, {"1/model.py": source})
    return repo


def _initialized(repo: Path, what: str = "initialized") -> list[int]:
    path = repo / "pid" / "1" / f"{what}.txt"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def _pid_of_answer(client: httpclient.InferenceServerClient) -> int:
    tensor = httpclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
    return int(client.infer("pid", [tensor]).as_numpy("PID")[0])


def _frontend_pid(server: RunningServer) -> int:
    match = re.search(r"Started 1 frontend process\(es\): pids (\d+)", server.stderr)
    assert match, server.stderr
    return int(match.group(1))


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _private_kib(pid: int) -> int:
    """The memory only this process holds (its private pages, resident), in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0])
    return fields["Private_Clean"] + fields["Private_Dirty"]


@pytest.fixture
def start() -> Iterator[object]:
    servers: list[RunningServer] = []

    def run(*args: str) -> RunningServer:
        server = RunningServer(["--frontend-processes", "1", "--exit-timeout-secs", "10", *args])
        servers.append(server)
        return server

    yield run
    for server in servers:
        server.close()


def _clients(url: str, count: int) -> list[httpclient.InferenceServerClient]:
    return [httpclient.InferenceServerClient(url, network_timeout=60) for _ in range(count)]


def test_the_replica_is_the_model_loaded_before_the_fork(start: object, tmp_path: Path) -> None:
    repo = _repository(tmp_path)
    server = start("--model-repository", str(repo))  # type: ignore[operator]
    url = server.wait_started(timeout=120)
    frontend = _frontend_pid(server)
    owner = server.server_pid
    assert _parent(frontend) == owner
    clients = _clients(url, 2)  # the balancer places the second connection on the frontend
    try:
        answered = {_pid_of_answer(client) for client in clients}
    finally:
        for client in clients:
            client.close()
    assert answered == {owner, frontend}
    assert _initialized(repo) == [owner], "initialize ran again after the fork"
    assert "model 'pid': loaded once, its replicas share the weights" in server.stderr
    # the weights are the owner's pages: the frontend holds far less than them of its own
    assert _private_kib(frontend) < WEIGHTS_MIB * 1024 / 2, _private_kib(frontend)
    assert server.stop(timeout=60) == 0, server.stderr
    # finalize() runs where initialize() ran, once: the frontend drops its forked copy without it
    assert _initialized(repo, "finalized") == [owner]


def test_a_model_whose_load_starts_threads_loads_in_each_process(start: object, tmp_path: Path) -> None:
    repo = _repository(tmp_path, starts_thread=True)
    server = start("--model-repository", str(repo))  # type: ignore[operator]
    url = server.wait_started(timeout=120)
    frontend = _frontend_pid(server)
    owner = server.server_pid
    assert "model 'pid': each process loads its own replica: loading it started threads" in server.stderr
    wait_for(lambda: frontend in _initialized(repo), timeout=60, what="the frontend's own replica")
    # once before the fork (finalized at once), once in the owner, once in the frontend
    assert sorted(_initialized(repo)) == sorted([owner, owner, frontend])
    clients = _clients(url, 2)
    try:
        wait_for(lambda: {_pid_of_answer(c) for c in clients} == {owner, frontend}, timeout=60,
                 what="answers from both processes")
    finally:
        for client in clients:
            client.close()
    assert server.stop(timeout=60) == 0, server.stderr
    assert sorted(_initialized(repo, "finalized")) == sorted([owner, owner, frontend])  # one per initialize


def test_a_killed_frontend_comes_back_with_a_replica_of_its_own(start: object, tmp_path: Path) -> None:
    repo = _repository(tmp_path)
    server = start("--model-repository", str(repo))  # type: ignore[operator]
    url = server.wait_started(timeout=120)
    first = _frontend_pid(server)
    owner = server.server_pid
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: len(set(_initialized(repo))) == 2, timeout=90, what="the new frontend's replica")
    [new] = set(_initialized(repo)) - {owner}
    assert new != first and _parent(new) == owner
    assert f"pid {first}) exited with status -9" in server.stderr

    def both_answer() -> bool:
        clients = _clients(url, 2)
        try:
            return {_pid_of_answer(client) for client in clients} == {owner, new}
        finally:
            for client in clients:
                client.close()

    wait_for(both_answer, timeout=60, what="answers from the owner and the restarted frontend")
    assert server.stop(timeout=60) == 0, server.stderr


def test_one_process_forks_nothing(start: object, tmp_path: Path) -> None:
    repo = _repository(tmp_path)
    server = RunningServer(["--model-repository", str(repo), "--frontend-processes", "0"])
    try:
        url = server.wait_started(timeout=120)
        [client] = _clients(url, 1)
        try:
            assert _pid_of_answer(client) == server.server_pid
        finally:
            client.close()
        assert "loaded once" not in server.stderr
        assert _initialized(repo) == [server.server_pid]
        assert server.stop(timeout=60) == 0, server.stderr
    finally:
        server.close()


GC_MODEL = """
import gc
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        state = np.array([os.getpid(), int(gc.isenabled()), gc.get_freeze_count()], dtype=np.int64)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("STATE", state)]) for _ in requests]
"""


def test_every_process_collects_garbage_again_once_started(start: object, tmp_path: Path) -> None:
    """``pyserve run`` pauses the collector while it starts (``startup_gc``): the owner and the
    forked frontend both run with it on again, the start's objects frozen."""
    repo = tmp_path / "repo"
    write_model(repo, "gc_state", """
        backend: "python"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "STATE" data_type: TYPE_INT64 dims: [ 3 ] } ]
    """, {"1/model.py": GC_MODEL})
    server = start("--model-repository", str(repo))  # type: ignore[operator]
    url = server.wait_started(timeout=120)
    clients = _clients(url, 2)  # the balancer places the second connection on the frontend
    states = {}
    try:
        for client in clients:
            tensor = httpclient.InferInput("IN", [1], "INT32")
            tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
            pid, enabled, frozen = (int(v) for v in client.infer("gc_state", [tensor]).as_numpy("STATE"))
            states[pid] = (enabled, frozen > 0)
    finally:
        for client in clients:
            client.close()
    assert set(states) == {server.server_pid, _frontend_pid(server)}
    assert set(states.values()) == {(1, True)}, states
    assert server.stop(timeout=60) == 0, server.stderr
