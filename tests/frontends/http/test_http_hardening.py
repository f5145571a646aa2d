"""pyserve's HTTP server against clients that trickle, idle or crowd it: total deadlines for a
request's head and body (a byte now and then no longer keeps a request alive), leading CRLFs that
do not hold an idle connection, a connection cap answered with 503 and a warning, and the soft
descriptor limit raised at start. Real servers on loopback ports, raw sockets as clients."""

from __future__ import annotations

import logging
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from suite_support import wait_for, write_model

from pyserve.frontends import limits
from pyserve.frontends.http import connection as http_server
from pyserve.server.core import ServerThread
from pyserve.testing import serve

ECHO = ('backend: "identity" max_batch_size: 0 input [ { name: "I" data_type: TYPE_FP32 dims: [ 2 ] } ] '
        'output [ { name: "O" data_type: TYPE_FP32 dims: [ 2 ] } ]')
BODY = b'{"inputs":[{"name":"I","shape":[2],"datatype":"FP32","data":[1,2]}]}'
REQUEST = b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write_model(tmp_path / "repo", "echo", ECHO)
    return tmp_path / "repo"


def read_all(sock: socket.socket) -> bytes:
    answer = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return answer
        if not chunk:
            return answer
        answer += chunk


def trickle(sock: socket.socket, data: bytes, step: int = 4, pause: float = 0.05) -> bool:
    """Send ``data`` a few bytes at a time; False once the server closed the connection."""
    for offset in range(0, len(data), step):
        try:
            sock.sendall(data[offset:offset + step])
        except OSError:
            return False
        time.sleep(pause)
    return True


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_trickled_request_is_answered_408_once_its_total_time_is_up(repo: Path, part: str) -> None:
    """One byte-group every 50 ms never leaves the connection idle for the 60 s read timeout,
    yet the request ends at its total limit (0.3 s for the head or the body)."""
    options = {"http_header_timeout_secs": 0.3} if part == "headers" else {"http_body_timeout_secs": 0.3}
    with serve(repo, **options) as thread:
        with socket.create_connection(("127.0.0.1", thread.server.http_port), timeout=30) as sock:
            head, _, body = REQUEST.partition(b"\r\n\r\n")
            if part == "headers":
                trickle(sock, head * 200)  # a head that would take minutes
            else:
                sock.sendall(head.replace(b"content-length: %d" % len(BODY), b"content-length: 100000") + b"\r\n\r\n")
                trickle(sock, b"x" * 100_000)
            answer = read_all(sock)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert f"the request {part} did not arrive in time (0.3 s in all".encode() in answer
        assert b"connection: close" in answer


def test_leading_crlfs_do_not_keep_an_idle_connection_open(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_server, "KEEP_ALIVE_TIMEOUT", 0.3)
    with serve(repo) as thread:
        with socket.create_connection(("127.0.0.1", thread.server.http_port), timeout=30) as sock:
            still_open = trickle(sock, b"\r\n" * 2000, step=2, pause=0.01)  # 20 s of CRLFs if never closed
            assert not still_open or read_all(sock) == b""
        with socket.create_connection(("127.0.0.1", thread.server.http_port), timeout=30) as sock:
            sock.sendall(b"\r\n\r\n" + REQUEST)  # CRLFs before a request are still allowed (RFC 9112 §2.2)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


@pytest.fixture
def capped(repo: Path) -> Iterator[ServerThread]:
    with serve(repo, http_max_connections=2, frontend_processes=0) as thread:
        yield thread


def test_connections_past_the_cap_get_503_and_a_warning(capped: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    """Idle keep-alive connections stay open (as in Triton) until the cap needs their room: a
    connection past it closes the longest idle one; only while none is idle is it answered 503."""
    caplog.set_level(logging.WARNING, "pyserve.frontends.http")
    port = capped.server.http_port
    first = socket.create_connection(("127.0.0.1", port), timeout=30)
    second = socket.create_connection(("127.0.0.1", port), timeout=30)
    third = None
    try:
        for sock in (first, second):
            sock.sendall(REQUEST)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        wait_for(lambda: len(capped.server._http.connections) == 2
                 and all(c.idle for c in capped.server._http.connections), what="both to fall idle")
        third = socket.create_connection(("127.0.0.1", port), timeout=30)
        third.sendall(REQUEST)  # past the cap: the longest idle one (first) made room for it
        assert third.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert read_all(first) == b""
        wait_for(lambda: len(capped.server._http.connections) == 2, what="the idle connection to close")
        for sock in (second, third):  # both busy now: a request has begun on each
            sock.sendall(REQUEST[:20])
        wait_for(lambda: not any(c.idle for c in capped.server._http.connections), what="both to be busy")
        with socket.create_connection(("127.0.0.1", port), timeout=30) as fourth:
            answer = read_all(fourth)
        assert answer.startswith(b"HTTP/1.1 503 "), answer
        assert b"limit of 2 connections (--http-max-connections)" in answer
        assert "--http-max-connections" in caplog.text
        second.sendall(REQUEST[20:])  # the busy ones go on as if nothing happened
        assert second.recv(65536).startswith(b"HTTP/1.1 200 ")
    finally:
        for sock in (first, second, third):
            if sock is not None:
                sock.close()


def test_idle_keep_alive_connections_stay_open(repo: Path) -> None:
    """As Triton's HTTP server: no idle timeout closes a keep-alive connection under a client
    that pauses between requests (a pooled connection a client reuses after a while)."""
    with serve(repo, frontend_processes=0) as thread:
        with socket.create_connection(("127.0.0.1", thread.server.http_port), timeout=30) as sock:
            sock.sendall(REQUEST)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
            port = sock.getsockname()[1]
            (connection,) = [c for c in thread.server._http.connections if c.client and c.client[1] == port]
            # idle once the server has finished with the answer the client already read
            wait_for(lambda: connection.idle, what="the connection to fall idle")
            assert connection.deadline is None  # nothing will close it
            sock.sendall(REQUEST)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one_at_start(repo: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, hard, 512)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        with serve(repo) as thread:
            assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
            expected = limits.connection_limit(0)
            assert thread.server._http.max_connections == expected
            assert thread.server._grpc.max_connections == expected
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_default_cap_leaves_descriptors_in_reserve() -> None:
    assert limits.connection_limit(7) == 7
    current = limits.descriptor_limit()
    expected = max(limits.MIN_DEFAULT_CONNECTIONS,
                   min(limits.MAX_DEFAULT_CONNECTIONS, (current - limits.RESERVED_DESCRIPTORS) // 2))
    assert limits.connection_limit(0) == expected
    assert 2 * expected + limits.RESERVED_DESCRIPTORS <= max(current, 2 * limits.MIN_DEFAULT_CONNECTIONS + 256)
