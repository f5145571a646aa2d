"""``pyserve run --frontend-processes N``: frontend processes sharing the HTTP and gRPC ports,
handing requests to the model owner or answering them with their own replicas.

A real server with one frontend process (a separate ``python -m pyserve.handoff.frontend``)
and installed backends only, driven with tritonclient over many fresh connections, which
are spread over both processes (``test_frontend_balance`` checks how), so every check holds
whichever process took the connection. Sequences, shared memory, streams, model control, statistics and metrics
must behave as in a single process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from suite_support import (
    ACCUMULATE_PY,
    ECHO_MODEL_PY,
    OWN_GRPC_CONNECTION,
    accumulate_config,
    echo_config,
    python_echo_config,
    wait_for,
)
from tritonclient.utils import InferenceServerException

from pyserve.handoff.supervisor import FrontendSupervisor
from pyserve.server.core import Server, ServerThread, StartupError
from pyserve.testing import serve, write_model

CONNECTIONS = 16
"""Fresh connections per check: all landing on one of two processes has odds 2**-15."""

ECHO = echo_config()

PYECHO = python_echo_config("pyecho")

BLS = """
name: "bls"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1, -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1, -1 ] } ]
"""

BLS_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="pyecho", requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0")],
            )
            answer = call.exec()
            out = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy() * 2
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
        return responses
"""

ACCUMULATE = accumulate_config()

SQUARE = """
name: "square"
backend: "square"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def _repository(root: Path) -> Path:
    repo = root / "repo"
    write_model(repo, "echo", ECHO)
    write_model(repo, "pyecho", PYECHO, {"1/model.py": ECHO_MODEL_PY})
    write_model(repo, "bls", BLS, {"1/model.py": BLS_PY})
    write_model(repo, "accumulate", ACCUMULATE, {"1/model.py": ACCUMULATE_PY})
    write_model(repo, "square", SQUARE)
    return repo


def _wait_for_replicas(server: ServerThread, count: int, timeout: float = 60.0) -> None:
    handoff = server.server._handoff
    assert handoff is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(len(g) >= count for g in handoff.replicas.values()):
            return
        time.sleep(0.05)
    raise AssertionError(f"frontend replicas did not become ready: {handoff.replicas}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repo = _repository(tmp_path_factory.mktemp("frontends"))
    with serve(
        repo, frontend_processes=1, replicate_models="auto", model_control_mode="explicit", load_models=["*"],
        allow_metrics=True,
    ) as thread:  # ready: echo and pyecho are replicated (their default and numbered entries share one)
        yield thread


def _http(server: ServerThread) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url)


def _grpc(server: ServerThread) -> grpcclient.InferenceServerClient:
    """A gRPC client on a connection of its own (which the balancer places as any new one)."""
    return grpcclient.InferenceServerClient(server.grpc_url, channel_args=OWN_GRPC_CONNECTION)


def _fp32(values: np.ndarray, module: object = httpclient) -> object:
    tensor = module.InferInput("INPUT0", list(values.shape), "FP32")  # type: ignore[attr-defined]
    tensor.set_data_from_numpy(values)
    return tensor


@contextlib.contextmanager
def _http_pair(server: ServerThread) -> Iterator[list[httpclient.InferenceServerClient]]:
    """Two HTTP clients used in turn, the first one first: the balancer gives the first
    connection to the owner (the owner wins ties) and the second, opened while the first is
    open, to the frontend."""
    clients = [_http(server), _http(server)]
    try:
        yield clients
    finally:
        for client in clients:
            client.close()


@contextlib.contextmanager
def _grpc_pair(server: ServerThread) -> Iterator[list[grpcclient.InferenceServerClient]]:
    """``_http_pair`` for gRPC connections."""
    clients = [_grpc(server), _grpc(server)]
    try:
        yield clients
    finally:
        for client in clients:
            client.close()


def _pids(server: ServerThread) -> list[int]:
    assert server.server.frontends is not None
    return server.server.frontends.pids


# -- answers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["echo", "pyecho"])
def test_replicated_models_answer_on_every_connection(server: ServerThread, model: str) -> None:
    for i in range(CONNECTIONS // 2):
        values = np.arange(8, dtype=np.float32).reshape(1, 8) + i
        with _http_pair(server) as clients:
            for client in clients:
                assert np.array_equal(client.infer(model, [_fp32(values)]).as_numpy("OUTPUT0"), values)
        with _grpc_pair(server) as grpc_clients:
            for grpc in grpc_clients:
                answer = grpc.infer(model, [_fp32(values, grpcclient)])
                assert np.array_equal(answer.as_numpy("OUTPUT0"), values)


def test_models_left_with_the_owner_answer_on_every_connection(server: ServerThread) -> None:
    """``bls`` calls another model (not replicated by ``auto``): handed to the owner."""
    handoff = server.server._handoff
    assert handoff is not None
    before = handoff.requests
    values = np.ones((1, 4), dtype=np.float32)
    for _ in range(CONNECTIONS // 2):
        with _http_pair(server) as clients:
            for client in clients:
                assert np.array_equal(client.infer("bls", [_fp32(values)]).as_numpy("OUTPUT0"), values * 2)
    assert handoff.requests > before, "no request came through a frontend process"


def test_statistics_and_metrics_count_every_replica(server: ServerThread) -> None:
    handoff = server.server._handoff
    assert handoff is not None
    with _http(server) as client:
        before = client.get_inference_statistics("echo")["model_stats"][0]["inference_count"]
    absorbed_before = handoff.absorbed
    values = np.ones((1, 3), dtype=np.float32)
    for _ in range(CONNECTIONS // 2):
        with _http_pair(server) as clients:  # the owner's replica answers one, the frontend's the other
            for client in clients:
                client.infer("echo", [_fp32(values)])
    with _http(server) as client:
        stats = client.get_inference_statistics("echo")["model_stats"][0]
    assert stats["inference_count"] == before + CONNECTIONS
    assert stats["inference_stats"]["success"]["count"] == before + CONNECTIONS
    grpc = _grpc(server)
    try:
        grpc_stats = grpc.get_inference_statistics("echo", as_json=True)["model_stats"][0]
    finally:
        grpc.close()
    assert int(grpc_stats["inference_count"]) == before + CONNECTIONS
    page = httpx.get(f"http://127.0.0.1:{server.server.metrics_port}/metrics").text
    line = next(x for x in page.splitlines() if x.startswith('nv_inference_request_success{model="echo"'))
    assert float(line.split()[-1]) == before + CONNECTIONS
    assert handoff.absorbed > absorbed_before, "no replica in a frontend answered a request"


def test_bad_requests_get_the_owners_error_texts(server: ServerThread) -> None:
    messages = set()
    unknown = set()
    for _ in range(CONNECTIONS):
        with _http(server) as client:
            with pytest.raises(InferenceServerException) as bad:
                client.infer("echo", [_fp32(np.ones((9, 2), dtype=np.float32))])  # batch 9 > 8
            messages.add(str(bad.value))
            with pytest.raises(InferenceServerException) as missing:
                client.infer("nope", [_fp32(np.ones((1, 2), dtype=np.float32))])
            unknown.add(str(missing.value))
    assert messages == {"[400] inference request batch-size must be <= 8 for 'echo' (input 'INPUT0' has batch size 9)"}
    assert unknown == {"[404] Request for unknown model: 'nope' is not found"}


def test_decoupled_model_streamed_over_http_and_grpc(server: ServerThread) -> None:
    for _ in range(4):  # HTTP: JSON lines relayed from the owner (test_infer_stream has the format)
        reply = httpx.post(
            f"http://{server.url}/v2/models/square/infer",
            json={"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [3]}]},
        )
        assert reply.status_code == 200 and len(reply.text.splitlines()) == 4
    for _ in range(4):
        results: list[object] = []
        client = _grpc(server)
        try:
            client.start_stream(callback=lambda result, error, sink=results: sink.append(error or result))
            tensor = grpcclient.InferInput("IN", [1], "INT32")
            tensor.set_data_from_numpy(np.array([3], dtype=np.int32))
            client.async_stream_infer("square", [tensor])
            deadline = time.monotonic() + 60
            while len(results) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            client.stop_stream()
        finally:
            client.close()
        assert [r.as_numpy("OUT")[0] for r in results] == [3, 3, 3]  # type: ignore[union-attr]


def test_large_messages_of_relayed_grpc_calls(server: ServerThread) -> None:
    """A gRPC message too large for one read (several DATA frames) on a method the frontend
    relays to the owner: a streamed inference and a model load with a file's contents. Each
    pair of connections has one in the frontend, so the relay carries one of each pair."""
    values = np.random.default_rng(1).standard_normal((1, 500_000)).astype(np.float32)  # 2 MB
    balancer = server.server.balancer
    assert balancer is not None
    passed = balancer.passed
    for _ in range(3):
        with _grpc_pair(server) as clients:
            for client in clients:
                answers: queue.Queue[object] = queue.Queue()
                client.start_stream(callback=lambda result, error, sink=answers: sink.put(error or result))
                try:
                    client.async_stream_infer("echo", [_fp32(values, grpcclient)])
                    answer = answers.get(timeout=60)
                finally:
                    client.stop_stream()
                assert not isinstance(answer, InferenceServerException), answer
                assert np.array_equal(answer.as_numpy("OUTPUT0"), values)  # type: ignore[attr-defined]
    assert balancer.passed > passed, "no connection went to the frontend"
    config = json.dumps({"name": "pybig", "backend": "python", "max_batch_size": 8,
                         "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
                         "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}]})
    padded = (ECHO_MODEL_PY + "#" + "x" * 2_000_000 + "\n").encode()  # 2 MB of model.py
    with _grpc_pair(server) as clients:
        try:
            for client in clients:
                client.load_model("pybig", config=config, files={"file:1/model.py": padded})
                answer = client.infer("pybig", [_fp32(values, grpcclient)])
                assert np.array_equal(answer.as_numpy("OUTPUT0"), values)
        finally:
            clients[0].unload_model("pybig")


# -- state that must stay in one process -----------------------------------------------------


def test_a_sequence_keeps_its_state_across_connections(server: ServerThread) -> None:
    sums = []
    for step in range(8):
        tensor_values = np.array([step + 1], dtype=np.int32)
        if step % 2:
            client = _grpc(server)
            tensor = grpcclient.InferInput("INPUT0", [1], "INT32")
            tensor.set_data_from_numpy(tensor_values)
            try:
                answer = client.infer("accumulate", [tensor], sequence_id=4242, sequence_start=step == 0,
                                      sequence_end=step == 7)
            finally:
                client.close()
        else:
            with _http(server) as http:
                tensor = httpclient.InferInput("INPUT0", [1], "INT32")
                tensor.set_data_from_numpy(tensor_values)
                answer = http.infer("accumulate", [tensor], sequence_id=4242, sequence_start=step == 0,
                                    sequence_end=step == 7)
        sums.append(int(answer.as_numpy("OUTPUT0")[0]))
    assert sums == [1, 3, 6, 10, 15, 21, 28, 36]


def test_shared_memory_requests_are_served_on_every_connection(server: ServerThread) -> None:
    key = f"/pyserve-fp-{uuid.uuid4().hex[:8]}"
    values = np.arange(6, dtype=np.float32).reshape(1, 6)
    handle = shm.create_shared_memory_region("fp_region", key, 2 * values.nbytes)
    try:
        shm.set_shared_memory_region(handle, [values])
        with _http(server) as client:
            client.register_system_shared_memory("fp_region", key, 2 * values.nbytes)
        try:
            for _ in range(CONNECTIONS):
                with _http(server) as client:
                    tensor = httpclient.InferInput("INPUT0", [1, 6], "FP32")
                    tensor.set_shared_memory("fp_region", values.nbytes)
                    output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
                    output.set_shared_memory("fp_region", values.nbytes, offset=values.nbytes)
                    client.infer("echo", [tensor], outputs=[output])
                    got = shm.get_contents_as_numpy(handle, np.float32, [1, 6], offset=values.nbytes)
                    assert np.array_equal(got, values)
                    shm.set_shared_memory_region(handle, [np.zeros_like(values)], offset=values.nbytes)
        finally:
            with _http(server) as client:
                client.unregister_system_shared_memory("fp_region")
    finally:
        shm.destroy_shared_memory_region(handle)


# -- model control ---------------------------------------------------------------------------


def test_unload_and_load_reach_every_process(server: ServerThread) -> None:
    values = np.ones((1, 2), dtype=np.float32)
    with _http(server) as client:
        client.unload_model("pyecho")
    for _ in range(CONNECTIONS):
        with _http(server) as client:
            with pytest.raises(InferenceServerException) as gone:
                client.infer("pyecho", [_fp32(values)])
            assert "pyecho" in str(gone.value)
            assert not client.is_model_ready("pyecho")
    with _http(server) as client:
        client.load_model("pyecho")
    for _ in range(CONNECTIONS):
        with _http(server) as client:
            assert np.array_equal(client.infer("pyecho", [_fp32(values)]).as_numpy("OUTPUT0"), values)
    _wait_for_replicas(server, 2)


SCALED_PY = ECHO_MODEL_PY.replace("as_numpy())", "as_numpy() * FACTOR)") + "\nFACTOR = {factor}\n"


@pytest.mark.parametrize("mode", ["explicit", "poll"])
def test_a_replica_follows_its_model_py_edited_and_reloaded(tmp_path: Path, mode: str) -> None:
    """Only model.py changes (the config stays): the frontend's replica is loaded again, so no
    answer comes from the code it was first loaded with. Every connection goes to the frontend."""
    repo = tmp_path / "repo"
    write_model(repo, "scaled", python_echo_config("scaled"), {"1/model.py": SCALED_PY.format(factor=1)})
    control = {"model_control_mode": "explicit", "load_models": ["*"]} if mode == "explicit" else {
        "model_control_mode": "poll", "repository_poll_secs": 0.2}
    values = np.ones((1, 2), dtype=np.float32)
    with serve(repo, frontend_processes=1, replicate_models="auto", frontend_balance="frontends",
               **control) as server:  # type: ignore[arg-type]
        _wait_for_replicas(server, 1)
        for factor in (2, 3):
            (repo / "scaled" / "1" / "model.py").write_text(SCALED_PY.format(factor=factor))
            if mode == "explicit":
                with _http(server) as client:
                    client.load_model("scaled")
            else:  # the poll picks the change up: wait for the owner's new code
                def reloaded(factor: int = factor) -> bool:
                    with _http(server) as client:
                        return bool(client.infer("scaled", [_fp32(values)]).as_numpy("OUTPUT0")[0, 0] == factor)
                wait_for(reloaded, timeout=60, what=f"the owner to serve factor {factor}")
            for _ in range(CONNECTIONS):  # before and after the replica is loaded again
                with _http(server) as client:
                    answer = client.infer("scaled", [_fp32(values)]).as_numpy("OUTPUT0")
                assert answer.tolist() == [[factor, factor]], (factor, answer)
            _wait_for_replicas(server, 1)
        with _http(server) as client:
            assert client.infer("scaled", [_fp32(values)]).as_numpy("OUTPUT0").tolist() == [[3.0, 3.0]]


HELD_PY = """
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marks = args["model_repository"]

    def execute(self, requests):
        out = []
        for r in requests:
            value = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            if value.flat[0] == 1:  # held until the test releases it
                open(os.path.join(self.marks, "holding"), "w").close()
                deadline = time.monotonic() + 300
                while not os.path.exists(os.path.join(self.marks, "release")) and time.monotonic() < deadline:
                    time.sleep(0.01)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", value)]))
        return out
"""


def test_an_unload_stops_the_replicas_while_the_owner_still_drains(tmp_path: Path) -> None:
    """As in Triton (checked side by side): once an unload began, no new request is answered,
    also by a frontend's replica while the owner waits for an execute to end."""
    from pyserve import InferRequest

    repo = tmp_path / "repo"
    write_model(repo, "held", python_echo_config("held"), {"1/model.py": HELD_PY})
    values = np.zeros((1, 2), dtype=np.float32)
    with serve(repo, frontend_processes=1, replicate_models="auto", frontend_balance="frontends",
               model_control_mode="explicit", load_models=["*"], exit_timeout_secs=600) as server:
        _wait_for_replicas(server, 1)  # an unload waits for executes up to 600 s: past every wait here
        handoff = server.server._handoff
        assert handoff is not None and server._loop is not None
        owner_version = server.server.models.records["held"].versions[1]
        held = InferRequest("held", 1, {"INPUT0": np.ones((1, 2), dtype=np.float32)}, ("OUTPUT0",))
        in_owner = asyncio.run_coroutine_threadsafe(server.server.dataplane.infer(owner_version, held), server._loop)
        unloading = threading.Thread(target=lambda: _http(server).unload_model("held"))
        try:
            wait_for(lambda: (repo / "held" / "holding").exists(), timeout=60, what="the owner's execute to hold")
            unloading.start()
            wait_for(lambda: owner_version.state.name == "UNLOADING", timeout=60, what="the unload to begin")
            wait_for(lambda: not any(handoff.replicas.values()), timeout=60,
                     what="the frontend to stop answering from its replica while the owner drains")
            for _ in range(CONNECTIONS):  # every connection is a frontend's: none is answered
                with _http(server) as client, pytest.raises(InferenceServerException) as refused:
                    client.infer("held", [_fp32(values)])
                assert "held" in str(refused.value)
        finally:
            (repo / "held" / "release").touch()
        assert in_owner.result(60).outputs["OUTPUT0"].tolist() == [[1.0, 1.0]]
        unloading.join(60)
        with _http(server) as client:
            assert not client.is_model_ready("held")


# -- processes -------------------------------------------------------------------------------


def test_a_killed_frontend_is_started_again(server: ServerThread) -> None:
    supervisor = server.server.frontends
    assert supervisor is not None
    [old] = supervisor.pids
    restarts = supervisor.restarts
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (supervisor.restarts == restarts or not supervisor.pids
                                             or old in supervisor.pids):
        time.sleep(0.05)
    assert supervisor.restarts == restarts + 1 and supervisor.pids and old not in supervisor.pids
    handoff = server.server._handoff
    assert handoff is not None
    while time.monotonic() < deadline and supervisor.pids[0] not in handoff.ready_pids:
        time.sleep(0.05)
    values = np.ones((1, 2), dtype=np.float32)
    for _ in range(CONNECTIONS):  # the owner kept serving meanwhile; now both processes do again
        with _http(server) as client:
            assert np.array_equal(client.infer("echo", [_fp32(values)]).as_numpy("OUTPUT0"), values)


def test_not_ready_until_the_frontends_listen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner's ports listen before its frontends start; until they do, the server says not
    ready, so a client that waits for ready does not pin its connections to the owner."""
    answers: list[tuple[int, int]] = []
    start_frontends = Server._start_frontends

    async def asking_around(self: Server) -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.http_port}") as client:
            before = (await client.get("/v2/health/ready")).status_code
            await start_frontends(self)
            after = (await client.get("/v2/health/ready")).status_code
        answers.append((before, after))

    monkeypatch.setattr(Server, "_start_frontends", asking_around)
    with serve(_repository(tmp_path), frontend_processes=1) as thread:
        assert answers == [(400, 400)]  # still starting while the frontends come up
        assert thread.server.dataplane.is_ready()
        with _http(thread) as client:
            assert client.is_server_ready()


SLOW_START_PY = """
import json
import os
import time
from pathlib import Path
from typing import Any


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        marker = Path(args["model_repository"]) / "owner.pid"
        if not marker.exists():  # the owner loads first; frontends load their replicas later
            marker.write_text(str(os.getpid()))
            time.sleep(float(parameters["owner_sleep_s"]["string_value"]))
        elif marker.read_text() != str(os.getpid()):
            start = time.monotonic()
            time.sleep(float(parameters["replica_sleep_s"]["string_value"]))
            with open(marker.parent.parent / "replica_loads.txt", "a") as loads:
                loads.write(f"{start} {time.monotonic()}\\n")

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]) for r in requests]
"""
"""An echo whose ``initialize`` sleeps: ``owner_sleep_s`` in the owner, ``replica_sleep_s`` in a frontend."""


def _slow_start_repository(root: Path, owner_sleep_s: float, replica_sleep_s: float, names: tuple[str, ...] = ("slow",),
                           ) -> Path:
    repo = root / "repo"
    parameters = (f'parameters {{ key: "owner_sleep_s" value {{ string_value: "{owner_sleep_s}" }} }}\n'
                  f'parameters {{ key: "replica_sleep_s" value {{ string_value: "{replica_sleep_s}" }} }}')
    for name in names:
        write_model(repo, name, python_echo_config(name, parameters), {"1/model.py": SLOW_START_PY})
    write_model(repo, "echo", ECHO)
    return repo


def test_ready_only_once_the_frontends_answer_with_their_replicas(tmp_path: Path) -> None:
    """READY (and the start's return) comes after each frontend loaded its replicas: a client
    that waits for ready finds every process answering with its own copies, and the owner files
    each frontend's replicas under its pid (the report sent before HELLO included). A frontend
    loads its replicas several at once, as the owner loads its models."""
    repo = _slow_start_repository(tmp_path, 0.0, 1.5, names=("slow", "slow2"))
    with serve(repo, frontend_processes=1, replicate_models="auto") as thread:
        handoff = thread.server._handoff
        assert handoff is not None
        pids = _pids(thread)
        assert sorted(handoff.replicas) == pids  # no entry filed before the frontend said who it is
        assert len(handoff.replicas[pids[0]]) == 3  # slow, slow2 and echo, already at READY
        values = np.ones((1, 3), dtype=np.float32)
        before = handoff.requests
        for _ in range(CONNECTIONS // 2):
            with _http_pair(thread) as clients:
                for client in clients:
                    assert np.array_equal(client.infer("slow", [_fp32(values)]).as_numpy("OUTPUT0"), values)
        assert handoff.requests == before, "a replicated model's request was handed to the owner"
    loads = [tuple(map(float, line.split())) for line in (repo / "replica_loads.txt").read_text().splitlines()]
    assert len(loads) == 2
    assert max(start for start, _ in loads) < min(end for _, end in loads), f"replicas loaded one by one: {loads}"


def test_replicas_that_load_too_long_do_not_hold_up_the_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Past the replicas' wait the server serves anyway (a warning says so): the frontend hands
    the model's requests to the owner until its replica is ready, then answers them itself."""
    start = FrontendSupervisor.start

    async def short_wait(self: FrontendSupervisor, timeout: float = 60.0, replicas_timeout: float = 60.0) -> None:
        await start(self, timeout, replicas_timeout=1.0)

    monkeypatch.setattr(FrontendSupervisor, "start", short_wait)
    caplog.set_level("WARNING", logger="pyserve.handoff")
    with serve(_slow_start_repository(tmp_path, 0.0, 8.0), frontend_processes=1, replicate_models="auto") as thread:
        handoff = thread.server._handoff
        assert handoff is not None
        assert "still load model replicas after 1 s" in caplog.text
        pid = _pids(thread)[0]
        assert len(handoff.replicas.get(pid, ())) < 2
        values = np.ones((1, 3), dtype=np.float32)
        for _ in range(CONNECTIONS // 2):  # whichever process takes it, the owner's copy answers
            with _http_pair(thread) as clients:
                for client in clients:
                    assert np.array_equal(client.infer("slow", [_fp32(values)]).as_numpy("OUTPUT0"), values)
        _wait_for_replicas(thread, 2)
        assert sorted(handoff.replicas) == [pid]


def test_a_long_queue_delay_batches_every_connection_in_one_process(tmp_path: Path) -> None:
    """A batcher that waits up to a minute for a preferred batch of 8 is left with the owner by
    ``auto``: four requests of 2, on connections spread over both processes, execute as one
    batch of 8 at once (split, each process would wait out the delay with half of them)."""
    write_model(tmp_path / "repo", "patient", echo_config().replace('name: "echo"', 'name: "patient"').replace(
        "dynamic_batching { }", "dynamic_batching { preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 60000000 }"))
    with serve(tmp_path / "repo", frontend_processes=1, replicate_models="auto") as thread:
        values = np.arange(6, dtype=np.float32).reshape(2, 3)
        clients = [httpclient.InferenceServerClient(thread.url, network_timeout=120) for _ in range(4)]
        try:
            for client in clients:  # open the four connections first, so the balancer spreads them
                assert client.is_server_live()
            pending = [client.async_infer("patient", [_fp32(values)]) for client in clients]
            answers = [request.get_result() for request in pending]
            assert all(np.array_equal(answer.as_numpy("OUTPUT0"), values) for answer in answers)
            stats = clients[0].get_inference_statistics("patient")["model_stats"][0]
        finally:
            for client in clients:
                client.close()
        assert stats["execution_count"] == 1 and stats["inference_count"] == 8
        handoff = thread.server._handoff
        assert handoff is not None and handoff.requests > 0, "no request came through the frontend"


BLOCKING_PY = """
import os
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.folder = args["model_repository"]

    def execute(self, requests):
        open(os.path.join(self.folder, "started"), "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(os.path.join(self.folder, "release")) and time.monotonic() < deadline:
            time.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(
            r, "INPUT0").as_numpy())]) for r in requests]
"""


def test_a_bounded_queue_bounds_the_requests_of_every_connection(tmp_path: Path) -> None:
    """``max_queue_size`` holds for the model, not per process: ``auto`` keeps a batcher with a
    queue policy in the owner. While one request executes (held until the test releases it),
    the requests of every other connection, spread over both processes, find one queue: one
    waits, every other one is refused with Triton's 'Exceeds maximum queue size'."""
    model_dir = write_model(tmp_path / "repo", "bounded", python_echo_config(
        "bounded", "dynamic_batching { default_queue_policy { max_queue_size: 1 } }"), {"1/model.py": BLOCKING_PY})
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": [0.0, 1.0, 2.0]}]}
    with serve(tmp_path / "repo", frontend_processes=1, replicate_models="auto") as thread:
        balancer = thread.server.balancer
        assert balancer is not None
        deadline = time.monotonic() + 120
        while not balancer.peers:  # on a busy machine the frontend may join the balancer late
            assert time.monotonic() < deadline, "the frontend never joined the connection balancer"
            time.sleep(0.05)
        clients = [httpx.Client(base_url=f"http://{thread.url}", timeout=300) for _ in range(CONNECTIONS)]
        try:
            for client in clients:  # open every connection first, so the balancer spreads them
                assert client.get("/v2/health/live").status_code == 200
            with ThreadPoolExecutor(len(clients)) as pool:
                first = pool.submit(clients[0].post, "/v2/models/bounded/infer", json=body)
                deadline = time.monotonic() + 120
                while not (model_dir / "started").exists():
                    assert time.monotonic() < deadline and not first.done(), "the first request never executed"
                    time.sleep(0.02)
                others = [pool.submit(c.post, "/v2/models/bounded/infer", json=body) for c in clients[1:]]
                deadline = time.monotonic() + 120
                while sum(f.done() for f in others) < len(others) - 1:
                    assert time.monotonic() < deadline, f"{sum(f.done() for f in others)} answered while one executes"
                    time.sleep(0.02)
                refused = [f.result() for f in others if f.done()]
                waiting = [f for f in others if not f.done()]
                assert all(r.status_code == 503 for r in refused), [(r.status_code, r.text) for r in refused]
                assert all("Exceeds maximum queue size" in r.json()["error"] for r in refused)
                (model_dir / "release").touch()
                for future in [first, *waiting]:
                    assert future.result(timeout=120).json()["outputs"][0]["data"] == [0.0, 1.0, 2.0]
        finally:
            for client in clients:
                client.close()
        # the one-queue answer above holds wherever the balancer placed the connections (on a
        # busy machine it may keep them all in the owner): no assertion on the placement


def test_handoff_without_replicas(tmp_path: Path) -> None:
    repo = _repository(tmp_path)
    with serve(repo, frontend_processes=1) as thread:
        handoff = thread.server._handoff
        assert handoff is not None
        values = np.arange(4, dtype=np.float32).reshape(1, 4)
        for _ in range(CONNECTIONS // 2):
            with _http_pair(thread) as clients:
                for client in clients:
                    assert np.array_equal(client.infer("echo", [_fp32(values)]).as_numpy("OUTPUT0"), values)
                    assert client.get_model_metadata("echo")["name"] == "echo"
            with _grpc_pair(thread) as grpc_clients:
                for grpc in grpc_clients:
                    answer = grpc.infer("pyecho", [_fp32(values, grpcclient)])
                    assert np.array_equal(answer.as_numpy("OUTPUT0"), values)
                    assert grpc.is_server_ready()
        assert handoff.requests > 0
        assert handoff.replicas == {}
        folder = thread.server._handoff_dir
        assert folder is not None and Path(folder).is_dir()
    assert not Path(folder).exists()  # the sockets' folder is removed at shutdown


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"frontend_processes": 1, "http_server": "uvicorn"}, "needs --http-server pyserve"),
        ({"frontend_processes": -1}, "--frontend-processes must be between"),
        ({"frontend_processes": 1, "replicate_models": "echo,,pyecho"}, "--replicate-models"),
        ({"frontend_processes": 1, "allow_http": False, "allow_grpc": False}, "needs the HTTP or the gRPC service"),
    ],
)
def test_bad_settings_are_refused(tmp_path: Path, options: dict[str, object], message: str) -> None:
    write_model(tmp_path / "repo", "echo", ECHO)
    with pytest.raises(StartupError, match=message):
        with serve(tmp_path / "repo", **options):
            pass


# -- large tensors, disconnects and the owner going away --------------------------------------


def test_large_tensors_cross_the_handoff(tmp_path: Path) -> None:
    """8 MB tensors over HTTP binary and gRPC, handed to the owner (no replicas), on every
    connection: a frame that large is collected into one buffer of its own size."""
    repo = _repository(tmp_path)
    values = np.random.default_rng(0).standard_normal((1, 2_000_000)).astype(np.float32)
    with serve(repo, frontend_processes=1) as thread:
        for _ in range(3):
            with _http_pair(thread) as clients:
                for client in clients:
                    output = httpclient.InferRequestedOutput("OUTPUT0")
                    answer = client.infer("echo", [_fp32(values)], outputs=[output])
                    assert np.array_equal(answer.as_numpy("OUTPUT0"), values)
            with _grpc_pair(thread) as grpc_clients:
                for grpc in grpc_clients:
                    assert np.array_equal(grpc.infer("echo", [_fp32(values, grpcclient)]).as_numpy("OUTPUT0"), values)
        assert thread.server._handoff is not None and thread.server._handoff.requests > 0
        # output to shared memory: the frontend hands the gRPC request over undecoded (its
        # tensor stays a view of the received bytes in the owner) on every connection
        key = f"/pyserve-fp-big-{uuid.uuid4().hex[:8]}"
        handle = shm.create_shared_memory_region("big_out", key, values.nbytes)
        try:
            grpc = _grpc(thread)
            try:
                grpc.register_system_shared_memory("big_out", key, values.nbytes)
                for _ in range(6):
                    output = grpcclient.InferRequestedOutput("OUTPUT0")
                    output.set_shared_memory("big_out", values.nbytes)
                    grpc.infer("echo", [_fp32(values, grpcclient)], outputs=[output])
                    got = shm.get_contents_as_numpy(handle, np.float32, list(values.shape))
                    assert np.array_equal(got, values)
                    shm.set_shared_memory_region(handle, [np.zeros_like(values)])
                grpc.unregister_system_shared_memory("big_out")
            finally:
                grpc.close()
        finally:
            shm.destroy_shared_memory_region(handle)


def test_frontends_exit_when_the_owner_dies(tmp_path: Path) -> None:
    """A frontend whose owner is killed (no graceful shutdown) exits by itself: no orphans. (On
    Linux ``pyserve run``'s keeper then starts a new owner; this test stops it afterwards.)"""
    import subprocess
    import sys

    repo = _repository(tmp_path)
    owner = subprocess.Popen(
        [sys.executable, "-m", "pyserve", "run", "--model-repository", str(repo), "--http-port", "0",
         "--grpc-port", "0", "--allow-metrics", "false", "--frontend-processes", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        frontend = server = None
        while time.monotonic() < deadline and frontend is None:
            line = owner.stderr.readline() if owner.stderr else ""
            if "Started 1 frontend process(es): pids" in line:
                frontend = int(line.rsplit("pids", 1)[1].strip())
                server = int(line.split()[2])  # the pid of the process that wrote the line
            elif not line and owner.poll() is not None:
                break
        assert frontend is not None and server is not None, "the owner did not report its frontend"
        os.kill(server, signal.SIGKILL)
        if server == owner.pid:
            owner.wait(10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _running(frontend):
            time.sleep(0.1)
        if _running(frontend):
            os.kill(frontend, signal.SIGKILL)
            raise AssertionError("the frontend outlived its owner")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        if owner.stderr is not None:
            owner.stderr.close()


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (an exited process left unreaped by its new parent does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


SLOW = """
name: "slow"
backend: "identity"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "execute_delay_ms" value { string_value: "600" } }
"""


def _connect_to_frontend(server: ServerThread) -> socket.socket:
    """A connection the kernel gave to the frontend process (not one of the owner's)."""
    http = server.server._http
    assert http is not None
    for _ in range(200):
        sock = socket.create_connection(("127.0.0.1", server.server.http_port))
        port = sock.getsockname()[1]
        time.sleep(0.02)
        if not any(c.client is not None and c.client[1] == port for c in list(http.connections)):
            return sock
        sock.close()
    raise AssertionError("no connection reached the frontend process")


def test_a_client_that_goes_away_cancels_the_handed_off_request(tmp_path: Path) -> None:
    write_model(tmp_path / "repo", "slow", SLOW)
    with serve(tmp_path / "repo", frontend_processes=1) as thread:
        values = np.ones((2,), dtype=np.float32)
        busy = threading.Thread(target=lambda: _http(thread).infer("slow", [_fp32(values)]))
        busy.start()
        time.sleep(0.15)  # the one instance is busy for 600 ms: what comes next waits in the owner's queue
        sock = _connect_to_frontend(thread)
        body = b'{"inputs":[{"name":"INPUT0","shape":[2],"datatype":"FP32","data":[1,2]}]}'
        sock.sendall(b"POST /v2/models/slow/infer HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.15)
        sock.close()  # gone before its turn: the frontend tells the owner, which drops it
        busy.join(60)
        time.sleep(0.3)
        with _http(thread) as client:
            stats = client.get_inference_statistics("slow")["model_stats"][0]
        assert stats["execution_count"] == 1, stats  # the abandoned request never executed
        assert stats["inference_stats"]["fail"]["count"] == 1, stats
        assert thread.server.dataplane.in_flight == 0


def _answer_of(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole HTTP/1.1 answer with a Content-Length: status, headers, body."""
    sock.settimeout(60)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed mid-answer"
        body += chunk
    return int(status_line.split()[1]), headers, body


def test_a_relayed_body_over_the_limit_gets_the_json_refusal(tmp_path: Path) -> None:
    """A repository call with a body over --http-max-input-size, sent to the frontend (which
    relays every route but infer to the owner), is refused there in Triton's words with a
    JSON 400, whether its length is declared or it streams in chunks, many times over."""
    write_model(tmp_path / "repo", "echo", ECHO)
    limit = 4096
    with serve(tmp_path / "repo", frontend_processes=1, http_max_input_size=limit) as thread:
        path = b"/v2/repository/models/echo/load"
        body = b'{"parameters": {"config": "' + b"x" * (2 * limit) + b'"}}'
        for attempt in range(6):
            sock = _connect_to_frontend(thread)
            with sock:
                if attempt % 2 == 0:
                    sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
                                 % (path, len(body), body))
                    expected = f"request JSON size of {len(body)} bytes exceeds the maximum allowed input size"
                else:
                    chunks = b"".join(b"%x\r\n%s\r\n" % (512, body[i:i + 512]) for i in range(0, 4 * 512 * 4, 512))
                    sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n%s"
                                 % (path, chunks))
                    expected = f"request JSON size of more than {limit} bytes exceeds the maximum allowed input size"
                status, headers, answer = _answer_of(sock)
            assert status == 400, answer
            assert headers["content-type"] == "application/json"
            assert expected in json.loads(answer)["error"]
        with _http(thread) as client:  # the owner and the frontend still serve
            assert client.is_model_ready("echo")


def test_an_owner_that_closes_before_answering_is_a_json_502(tmp_path: Path) -> None:
    """The proxy's owner side goes away mid-body without an answer: the client gets a JSON 502
    naming that, not a bare 500."""
    from pyserve.handoff.http_proxy import OwnerHttpProxy

    path = str(tmp_path / "owner.sock")

    async def scenario() -> tuple[int, bytes]:
        async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(100)  # takes a little of the request, then hangs up
            writer.transport.abort()

        listener = await asyncio.start_unix_server(owner, path)
        proxy = OwnerHttpProxy(path, max_input_size=1 << 30)
        pieces = [b"x" * 65536] * 64
        sent: list[dict[str, object]] = []

        async def receive() -> dict[str, object]:
            await asyncio.sleep(0)
            piece = pieces.pop() if pieces else b""
            return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "raw_path": b"/v2/repository/index", "query_string": b"",
                 "headers": [(b"host", b"x"), (b"transfer-encoding", b"chunked")]}
        await asyncio.wait_for(proxy(scope, receive, send), 60)
        listener.close()
        start, *bodies = sent
        return int(start["status"]), b"".join(m["body"] for m in bodies)  # type: ignore[misc]

    status, body = asyncio.run(scenario())
    assert status == 502
    assert json.loads(body) == {"error": "the model owner closed the connection before it answered"}


def test_the_proxy_caps_a_body_as_the_owner_does(tmp_path: Path) -> None:
    """An infer body whose binary data after its JSON header passes --http-max-input-size is
    relayed (the owner takes binary data up to the machine's memory); a body of that length
    without a JSON header, or with one over the cap, is refused before anything is relayed."""
    from pyserve.handoff.http_proxy import OwnerHttpProxy

    path = str(tmp_path / "owner.sock")
    relayed: list[int] = []

    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.startswith(b"content-length")))
        relayed.append(len(await reader.readexactly(length)))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    async def call(proxy: OwnerHttpProxy, headers: list[tuple[bytes, bytes]], body: bytes) -> int:
        sent: list[dict[str, Any]] = []
        given = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if given:
                return given.pop()
            await asyncio.Event().wait()  # the client stays: no disconnect
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "raw_path": b"/v2/models/m/infer", "query_string": b"",
                 "headers": [(b"content-length", b"%d" % len(body)), *headers]}
        await asyncio.wait_for(proxy(scope, receive, send), 60)
        return int(sent[0]["status"])

    async def scenario() -> list[int]:
        listener = await asyncio.start_unix_server(owner, path)
        proxy = OwnerHttpProxy(path, max_input_size=4096)
        body = b"{}" + bytes(10_000)
        statuses = [
            await call(proxy, [(b"inference-header-content-length", b"2")], body),  # binary data: relayed
            await call(proxy, [], body),  # all JSON: over the cap
            await call(proxy, [(b"inference-header-content-length", b"0")], body),  # raw: over the cap
        ]
        listener.close()
        return statuses

    assert asyncio.run(scenario()) == [200, 400, 400]
    assert relayed == [10_002]


def test_generate_stream_is_relayed_as_it_streams(server: ServerThread) -> None:
    """Server-sent events of a decoupled model, on every connection (relayed by frontends)."""
    for _ in range(CONNECTIONS):
        with httpx.Client(base_url=f"http://{server.url}") as http:
            with http.stream("POST", "/v2/models/square/generate_stream", json={"IN": 3, "id": "s"}) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                text = "".join(response.iter_text())
        events = [e for e in text.split("\n\n") if e]
        assert len(events) == 3 and all(e.startswith("data: ") and '"OUT":3' in e for e in events), text


def test_restricted_apis_hold_on_every_process(tmp_path: Path) -> None:
    from pyserve.frontends.restricted import parse_restrictions

    write_model(tmp_path / "repo", "echo", ECHO)
    rules = parse_restrictions(["inference,metadata:api-key=s3cret"])
    with serve(tmp_path / "repo", frontend_processes=1, http_restricted_api=rules) as thread:
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
        for _ in range(CONNECTIONS):
            with httpx.Client(base_url=f"http://{thread.url}") as http:
                refused = http.post("/v2/models/echo/infer", json=body)
                assert refused.status_code == 403
                assert refused.json() == {"error": "This API is restricted, expecting header 'api-key'"}
                assert http.get("/v2/models/echo").status_code == 403  # relayed: the owner refuses
                allowed = http.post("/v2/models/echo/infer", json=body, headers={"api-key": "s3cret"})
                assert allowed.status_code == 200 and allowed.json()["outputs"][0]["data"] == [1, 2]
                assert http.get("/v2/models/echo", headers={"api-key": "s3cret"}).status_code == 200
                assert http.get("/v2/health/ready").status_code == 200  # not restricted


def test_classification_labels_reach_the_frontends(tmp_path: Path) -> None:
    """Top-k classification is encoded by whichever process answers, with the model's labels
    (the owner sends them with each snapshot); the same over gRPC."""
    import shutil as shutil_module

    from suite_support import EXAMPLE_REPOSITORY

    repo = tmp_path / "repo"
    shutil_module.copytree(Path(EXAMPLE_REPOSITORY) / "classifier", repo / "classifier")
    labels = (repo / "classifier" / "labels.txt").read_text().split()
    scores = np.array([[0.1, 0.7, 0.05, 0.9, 0.2]], dtype=np.float32)
    expected = [f"{scores[0, i]:f}:{i}:{labels[i]}" for i in (3, 1)]
    for replicate in ("none", "auto"):
        with serve(repo, frontend_processes=1, replicate_models=replicate) as thread:
            for _ in range(CONNECTIONS):
                with _http(thread) as client:
                    tensor = httpclient.InferInput("INPUT0", [1, 5], "FP32")
                    tensor.set_data_from_numpy(scores)
                    output = httpclient.InferRequestedOutput("OUTPUT0", class_count=2)
                    got = client.infer("classifier", [tensor], outputs=[output]).as_numpy("OUTPUT0")
                    assert [v.decode() for v in got.reshape(-1)] == expected
                grpc = _grpc(thread)
                try:
                    tensor = grpcclient.InferInput("INPUT0", [1, 5], "FP32")
                    tensor.set_data_from_numpy(scores)
                    output = grpcclient.InferRequestedOutput("OUTPUT0", class_count=2)
                    got = grpc.infer("classifier", [tensor], outputs=[output]).as_numpy("OUTPUT0")
                    assert [v.decode() for v in got.reshape(-1)] == expected
                finally:
                    grpc.close()


def test_shutdown_lets_handed_off_requests_finish(tmp_path: Path) -> None:
    """SIGTERM-style shutdown: a request in flight through a frontend still gets its answer."""
    write_model(tmp_path / "repo", "slow", SLOW)
    with serve(tmp_path / "repo", frontend_processes=1) as thread:
        sock = _connect_to_frontend(thread)
        body = b'{"inputs":[{"name":"INPUT0","shape":[2],"datatype":"FP32","data":[1,2]}]}'
        sock.sendall(b"POST /v2/models/slow/infer HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.15)  # executing in the owner now (600 ms)
        stopper = threading.Thread(target=thread.stop)
        stopper.start()
        sock.settimeout(10)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
        sock.close()
        stopper.join(30)
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert b'"data":[1.0,2.0]' in answer
