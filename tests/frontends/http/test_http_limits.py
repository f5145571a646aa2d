"""pyserve's own HTTP/1.1 server refuses an overlong request head (431, or 414 for the URL)
with a JSON error and closes, without holding up other clients; a closed connection is freed
at once (no reference cycle waiting for the garbage collector); and a version in an infer URL
must be ASCII digits."""

from __future__ import annotations

import gc
import select
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from suite_support import write_model

from pyserve import (
    Backend,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from pyserve.frontends.http.connection import MAX_HEAD_SIZE, HttpProtocol
from pyserve.server.core import ServerThread
from pyserve.testing import serve

IDENT = """
    backend: "echo"
    max_batch_size: 0
    input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


class Echo(Backend):
    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        return [InferResponse({"OUT": r.inputs["IN"]}) for r in requests]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repo: Path = tmp_path_factory.mktemp("limits")
    write_model(repo, "ident", IDENT)
    # one process: some tests watch this process's HTTP connections
    with serve(repo, backends={"echo": Echo()}, allow_grpc=False, use_entry_points=False,
               frontend_processes=0) as thread:
        yield thread


BODY = orjson.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}]})


def _connect(server: ServerThread) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.server.http_port), timeout=60)


class Reader:
    """Reads Content-Length framed answers off a socket, keeping bytes of the next answer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self, what: str) -> None:
        piece = self.sock.recv(65536)
        if not piece:
            raise ConnectionError(f"closed {what} (had {self.buffer!r})")
        self.buffer += piece

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            self._fill("before a full head")
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        while len(self.buffer) < length:
            self._fill("mid-body")
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(lines[0].split()[1]), headers, body


def _read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The one answer expected on ``sock`` (nothing is pipelined behind it)."""
    return Reader(sock).answer()


def _good_request(sock: socket.socket, path: bytes = b"/v2/models/ident/infer") -> tuple[int, dict[str, Any]]:
    sock.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY)
    status, _, body = _read_answer(sock)
    return status, orjson.loads(body)


def _stream_until_answered(sock: socket.socket, start: bytes, piece: bytes, limit: int) -> tuple[int, int]:
    """Send ``start`` then ``piece`` repeatedly until the server answers (or ``limit`` bytes
    went out); returns (bytes sent, status). A reset after the answer is fine."""
    sent = 0
    for chunk in [start] + [piece] * (limit // len(piece)):
        readable, _, _ = select.select([sock], [], [], 0.005)
        if readable:
            break
        try:
            sock.sendall(chunk)
        except OSError:  # the server closed after answering
            break
        sent += len(chunk)
    status, headers, body = _read_answer(sock)
    assert headers["connection"] == "close"
    assert headers["content-type"] == "application/json"
    assert "exceed" in orjson.loads(body)["error"] and "the limit of 65536 bytes" in orjson.loads(body)["error"]
    return sent, status


@pytest.mark.parametrize(
    ("start", "piece", "status"),
    [
        (b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: ", b"v" * 4096, 431),
        (b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n", b"X-H: v\r\n" * 512, 431),
        (b"GET /v2/health/live?q=", b"a" * 4096, 414),
    ],
    ids=["one endless header", "many small headers", "endless url"],
)
def test_streamed_head_is_refused_past_the_limit(server: ServerThread, start: bytes, piece: bytes, status: int) -> None:
    # a second client is answered while the overlong head streams in
    with _connect(server) as other, _connect(server) as sock:
        assert _good_request(other)[0] == 200
        sent, got = _stream_until_answered(sock, start, piece, 16 * MAX_HEAD_SIZE)
        assert got == status
        assert sent < 16 * MAX_HEAD_SIZE  # refused once the limit was passed, not at the end
        assert _good_request(other)[0] == 200
        try:  # the refused connection is closed by the server
            assert sock.recv(65536) == b""
        except ConnectionResetError:
            pass


def test_one_megabyte_header_gets_431(server: ServerThread) -> None:
    request = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * (1 << 20) + b"\r\n\r\n"
    with _connect(server) as sock:
        sender = threading.Thread(target=_send_ignoring_errors, args=(sock, request), daemon=True)
        sender.start()
        status, headers, body = _read_answer(sock)  # 431, not the 408 of a header deadline
        assert status == 431 and headers["connection"] == "close"
        assert "request line and headers exceed the limit of 65536 bytes" in orjson.loads(body)["error"]
        sender.join(60)
    with _connect(server) as sock:
        status, answer = _good_request(sock)
        assert status == 200 and answer["outputs"][0]["data"] == [1.0, 2.0]


def _send_ignoring_errors(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass


def test_head_just_under_the_limit_is_served(server: ServerThread) -> None:
    padding = b"X-Pad: " + b"p" * (MAX_HEAD_SIZE - 1024) + b"\r\n"
    with _connect(server) as sock:
        sock.sendall(b"POST /v2/models/ident/infer HTTP/1.1\r\nHost: x\r\n" + padding
                     + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY)
        assert _read_answer(sock)[0] == 200
        # pipelined requests on the same connection each get their own allowance
        many = b"".join(b"POST /v2/models/ident/infer HTTP/1.1\r\nHost: x\r\n" + padding
                        + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY for _ in range(4))
        sock.sendall(many)
        reader = Reader(sock)
        assert [reader.answer()[0] for _ in range(4)] == [200] * 4


def test_closed_connection_is_freed_without_a_collection(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    protocols: list[weakref.ref[HttpProtocol]] = []
    original = HttpProtocol.connection_made

    def recording(self: HttpProtocol, transport: Any) -> None:
        protocols.append(weakref.ref(self))
        original(self, transport)

    monkeypatch.setattr(HttpProtocol, "connection_made", recording)
    gc.disable()
    try:
        with _connect(server) as sock:  # headers sent half-way, then the client leaves
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + b"X-H: v\r\n" * 100)
            deadline = time.monotonic() + 60
            while not protocols and time.monotonic() < deadline:
                time.sleep(0.01)
        with _connect(server) as sock:  # a complete request, then close
            assert _good_request(sock)[0] == 200
        deadline = time.monotonic() + 60
        while any(ref() is not None for ref in protocols) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(protocols) == 2
        assert all(ref() is None for ref in protocols), "a closed connection waits for the garbage collector"
    finally:
        gc.enable()


def _post(server: ServerThread, path: bytes) -> tuple[int, dict[str, str], bytes]:
    with _connect(server) as sock:
        sock.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY)
        return _read_answer(sock)


@pytest.mark.parametrize(
    "version",
    [b"%C2%B2", b"%D9%A1", b"%EF%BC%91"],
    ids=["superscript two", "arabic-indic one", "fullwidth one"],
)
def test_non_ascii_version_is_answered_like_any_non_numeric_version(server: ServerThread, version: bytes) -> None:
    status, headers, body = _post(server, b"/v2/models/ident/versions/" + version + b"/infer")
    expected = _post(server, b"/v2/models/ident/versions/abc/infer")
    assert expected[0] == 404 and "error" in orjson.loads(expected[2])
    assert (status, headers["content-type"], body) == (expected[0], expected[1]["content-type"], expected[2])
    # an ASCII version still works
    assert _post(server, b"/v2/models/ident/versions/1/infer")[0] == 200


@pytest.mark.parametrize("path", [b"/v2/models/ident/infer", b"/v2/repository/index"])
@pytest.mark.parametrize("coding", [b"gzip, chunked", b"deflate,chunked", b"x-custom , chunked"])
def test_unsupported_transfer_coding_is_501(server: ServerThread, path: bytes, coding: bytes) -> None:
    with _connect(server) as sock:
        # a good request first: it is still answered, in order
        sock.sendall(b"POST /v2/models/ident/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
                     + b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + coding + b"\r\n\r\n"
                     + b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY))
        reader = Reader(sock)
        assert reader.answer()[0] == 200
        status, headers, body = reader.answer()
        assert status == 501 and headers["connection"] == "close"
        assert "unsupported transfer coding" in orjson.loads(body)["error"]
        assert sock.recv(100) == b""


def test_trailing_slash_is_an_unknown_route_not_a_redirect(server: ServerThread) -> None:
    status, headers, body = _post(server, b"/v2/models/ident/infer/")
    assert status == 404 and headers["content-type"] == "application/json"
    assert orjson.loads(body) == {"error": "Not Found"}
    with _connect(server) as sock:
        sock.sendall(b"GET /v2/health/live/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _read_answer(sock)[0] == 404
