"""``--frontend-balance``: how new connections are spread over the owner and its frontends.

A real server with one frontend process. With ``connections`` (the default) the owner accepts
every connection and passes it to the process that holds the fewest, so keep-alive clients
split evenly whatever their addresses hash to; with ``kernel`` both processes listen
(``SO_REUSEPORT``) and the kernel picks.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from suite_support import ECHO_MODEL_PY, OWN_GRPC_CONNECTION, echo_config, python_echo_config, wait_for

from pyserve.frontends.balancer import ConnectionBalancer
from pyserve.server.core import ServerThread, StartupError
from pyserve.testing import BatchRecorder, serve, write_model
from pyserve.testing.helpers import LOOP_THREAD

ECHO = echo_config()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repo = tmp_path_factory.mktemp("balance") / "repo"
    write_model(repo, "echo", ECHO)
    with serve(repo, frontend_processes=1, frontend_balance="connections") as thread:
        yield thread


def _balancer(server: ServerThread) -> ConnectionBalancer:
    balancer = server.server.balancer
    assert balancer is not None
    return balancer


def _open(server: ServerThread) -> socket.socket:
    """A keep-alive HTTP connection that has been answered once (so it is being served)."""
    sock = socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10)
    sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(4096)
        assert chunk, "the connection closed before it was answered"
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer
    return sock


def _owner_ports(server: ServerThread) -> set[int]:
    """Client ports of the HTTP connections the owner serves itself."""
    http = server.server._http
    assert http is not None
    return {c.client[1] for c in list(http.connections) if c.client is not None}


def _frontend_load(server: ServerThread) -> int:
    [peer] = _balancer(server).peers
    return peer.load


def _idle(server: ServerThread) -> None:
    """Wait until the frontend is connected and no process holds a client connection."""
    balancer = _balancer(server)
    grpc_server = server.server._grpc

    def idle() -> bool:
        return (len(balancer.peers) == 1 and _frontend_load(server) == 0 and not _owner_ports(server)
                and grpc_server.tcp_connection_count() == 0)

    wait_for(idle, what="every earlier connection closed")


def test_keep_alive_connections_split_evenly(server: ServerThread) -> None:
    balancer = _balancer(server)
    _idle(server)
    passed = balancer.passed
    sockets = [_open(server) for _ in range(8)]
    try:
        owner = _owner_ports(server)
        assert len(owner) == 4, owner
        assert balancer.passed == passed + 4
        wait_for(lambda: _frontend_load(server) == 4 and balancer.peers[0].open == 4, what="the frontend reports 4")
        on_owner = [s for s in sockets if s.getsockname()[1] in owner]
        on_frontend = [s for s in sockets if s not in on_owner]

        for sock in on_owner:  # the owner now holds none: the next four are its own
            sock.close()
        wait_for(lambda: not _owner_ports(server), what="the owner's connections closed")
        sockets = on_frontend + [_open(server) for _ in range(4)]
        assert len(_owner_ports(server)) == 4 and balancer.passed == passed + 4

        for sock in on_frontend:  # the frontend reports its closed connections: the next go there
            sock.close()
        wait_for(lambda: _frontend_load(server) == 0, what="the frontend reports its connections closed")
        sockets = sockets[4:] + [_open(server) for _ in range(2)]
        assert len(_owner_ports(server)) == 4 and balancer.passed == passed + 6
    finally:
        for sock in sockets:
            sock.close()


def test_connections_passed_to_the_frontend_are_served_there(server: ServerThread) -> None:
    """Infer requests over HTTP and gRPC answer on every connection, half of them the frontend's."""
    balancer = _balancer(server)
    _idle(server)
    passed = balancer.passed
    values = np.arange(4, dtype=np.float32).reshape(1, 4)
    http_clients = [httpclient.InferenceServerClient(server.url) for _ in range(4)]
    # each client its own connection (grpc shares them by default)
    grpc_clients = [grpcclient.InferenceServerClient(server.grpc_url, channel_args=OWN_GRPC_CONNECTION)
                    for _ in range(4)]
    try:
        for client in http_clients:
            tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
            tensor.set_data_from_numpy(values)
            assert np.array_equal(client.infer("echo", [tensor]).as_numpy("OUTPUT0"), values)
        for client in grpc_clients:
            tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
            tensor.set_data_from_numpy(values)
            assert np.array_equal(client.infer("echo", [tensor]).as_numpy("OUTPUT0"), values)
        grpc_server = server.server._grpc
        assert grpc_server.tcp_connection_count() == 2  # two of the four gRPC connections are the owner's
        assert balancer.passed == passed + 4  # and two of each kind went to the frontend
    finally:
        for client in http_clients:
            client.close()
        for grpc_client in grpc_clients:
            grpc_client.close()


def test_a_dead_frontend_leaves_its_connections_to_the_owner(server: ServerThread) -> None:
    balancer = _balancer(server)
    supervisor = server.server.frontends
    assert supervisor is not None
    wait_for(lambda: len(balancer.peers) == 1 and bool(supervisor.pids), what="the frontend runs")
    [old] = supervisor.pids
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: not balancer.peers, what="the owner drops the dead frontend's channel")
    passed = balancer.passed
    sockets = [_open(server) for _ in range(3)]  # meanwhile the owner serves every connection
    try:
        assert len(_owner_ports(server)) == 3 and balancer.passed == passed
        wait_for(lambda: len(balancer.peers) == 1, timeout=30, what="the restarted frontend's channel is open")
        sockets += [_open(server) for _ in range(3)]  # the new frontend holds none: it takes these
        assert len(_owner_ports(server)) == 3 and balancer.passed == passed + 3
    finally:
        for sock in sockets:
            sock.close()


def test_the_recorder_reaches_the_owner_past_a_connection_it_holds(tmp_path: Path) -> None:
    """``BatchRecorder.until_on_the_loop`` sees the owner's executes only: with a connection held
    open on the owner, its first connection goes to the frontend (whose replica, asked for by
    name, answers unseen), so it opens another, which the balancer gives to the owner."""
    write_model(tmp_path / "repo", "pyecho", python_echo_config("pyecho"), {"1/model.py": ECHO_MODEL_PY})
    recorder = BatchRecorder()
    values = np.arange(2, dtype=np.float32).reshape(1, 2)

    def call(client: grpcclient.InferenceServerClient) -> None:
        tensor = grpcclient.InferInput("INPUT0", [1, 2], "FP32")
        tensor.set_data_from_numpy(values)
        assert np.array_equal(client.infer("pyecho", [tensor]).as_numpy("OUTPUT0"), values)

    with serve(tmp_path / "repo", frontend_processes=1, replicate_models="pyecho", server_plugins=[recorder],
               frontend_balance="connections") as server:
        handoff = server.server._handoff
        assert handoff is not None
        wait_for(lambda: len(_balancer(server).peers) == 1 and any(handoff.replicas.values()),
                 what="the frontend's replica is ready")
        held = _open(server)  # the owner's: the next connection goes to the frontend
        try:
            passed = _balancer(server).passed
            calls = recorder.until_on_the_loop(
                "pyecho", lambda: grpcclient.InferenceServerClient(server.grpc_url, channel_args=OWN_GRPC_CONNECTION),
                call)
        finally:
            held.close()
        assert _balancer(server).passed == passed + 1  # the first went to the frontend, the second stayed
        assert calls >= 2 and recorder.threads["pyecho"][-1] == LOOP_THREAD


def test_frontends_balance_passes_every_connection_to_a_frontend(tmp_path: Path) -> None:
    """``--frontend-balance frontends``: the owner serves no connection while a frontend is
    connected, whatever it holds; with the frontend gone it serves them itself."""
    write_model(tmp_path / "repo", "echo", ECHO)
    with serve(tmp_path / "repo", frontend_processes=1, frontend_balance="frontends") as server:
        balancer = _balancer(server)
        assert not balancer.owner_serves
        supervisor = server.server.frontends
        assert supervisor is not None
        wait_for(lambda: len(balancer.peers) == 1 and bool(supervisor.pids), what="the frontend runs")
        passed = balancer.passed
        sockets = [_open(server) for _ in range(4)]
        try:
            assert not _owner_ports(server) and balancer.passed == passed + 4
            values = np.arange(4, dtype=np.float32).reshape(1, 4)
            client = grpcclient.InferenceServerClient(server.grpc_url, channel_args=OWN_GRPC_CONNECTION)
            try:
                tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
                tensor.set_data_from_numpy(values)
                assert np.array_equal(client.infer("echo", [tensor]).as_numpy("OUTPUT0"), values)
                assert server.server._grpc.tcp_connection_count() == 0 and balancer.passed == passed + 5
            finally:
                client.close()
            [pid] = supervisor.pids
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not balancer.peers, what="the owner drops the dead frontend's channel")
            sockets.append(_open(server))
            assert len(_owner_ports(server)) == 1 and balancer.passed == passed + 5
        finally:
            for sock in sockets:
                sock.close()


def test_kernel_balance_lets_every_process_listen(tmp_path: Path) -> None:
    write_model(tmp_path / "repo", "echo", ECHO)
    with serve(tmp_path / "repo", frontend_processes=1, frontend_balance="kernel") as thread:
        assert thread.server.balancer is None
        http = thread.server._http
        assert http is not None
        values = np.ones((1, 2), dtype=np.float32)
        for _ in range(200):  # fresh connections until the kernel gives one to the frontend
            with httpclient.InferenceServerClient(thread.url) as client:
                tensor = httpclient.InferInput("INPUT0", [1, 2], "FP32")
                tensor.set_data_from_numpy(values)
                assert np.array_equal(client.infer("echo", [tensor]).as_numpy("OUTPUT0"), values)
            handoff = thread.server._handoff
            assert handoff is not None
            if handoff.requests:  # an infer request came through the frontend's own listener
                break
        else:
            raise AssertionError("no connection reached the frontend process")


def test_an_unknown_balance_is_refused(tmp_path: Path) -> None:
    write_model(tmp_path / "repo", "echo", ECHO)
    with pytest.raises(StartupError, match="--frontend-balance must be one of connections, frontends, kernel, got 'random'"):
        with serve(tmp_path / "repo", frontend_processes=1, frontend_balance="random"):
            pass


def test_the_flag_takes_its_choices(capsys: pytest.CaptureFixture[str]) -> None:
    from pyserve.cli.main import build_parser

    parser = build_parser()
    base = ["run", "--model-repository", "repo"]
    assert parser.parse_args(base).frontend_balance == "connections"
    assert parser.parse_args([*base, "--frontend-balance", "kernel"]).frontend_balance == "kernel"
    assert parser.parse_args([*base, "--frontend-balance", "frontends"]).frontend_balance == "frontends"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--frontend-balance", "random"])
    assert "--frontend-balance: invalid choice: 'random'" in capsys.readouterr().err
