"""pyserve's own HTTP/1.1 server (``pyserve.frontends.http.server``, ``.connection``, ``.native_infer``) at the protocol level, over raw sockets.

Keep-alive reuse, pipelining (answers in order), HTTP/1.0, ``Connection: close``,
``Expect: 100-continue``, chunked request bodies, malformed requests, a declared body over
the cap refused without being read, a client disconnect cancelling its queued request, and
server-sent events arriving as they are produced. The tests of ordering and closing run both on
a lone connection and beside another open one, where answers are queued and written together.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from suite_support import wait_for, write_model

from pyserve import (
    Backend,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from pyserve.frontends.http.server import HttpServer
from pyserve.server.core import ServerThread
from pyserve.testing import serve

MODELS = {
    "ident": """
        backend: "gate"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
        instance_group [ { count: 1 kind: KIND_CPU } ]
    """,
    "ticks": """
        backend: "ticks"
        max_batch_size: 0
        model_transaction_policy { decoupled: true }
        input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
    """,
}
MAX_INPUT = 4096


class GateBackend(Backend):
    """Echoes ``IN`` → ``OUT``; while ``open`` is clear, execute waits on it. Counts executions."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.executing = threading.Event()
        self.executed: list[str] = []

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        self.executing.set()
        assert self.open.wait(30)
        self.executed += [r.id for r in requests]
        return [InferResponse({"OUT": r.inputs["IN"]}) for r in requests]


class TicksBackend(Backend):
    """Decoupled: ``N`` responses 0..N-1, 200 ms apart; ``sent`` counts those sent so far."""

    def __init__(self) -> None:
        self.sent = 0

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> None:
        for request in requests:
            threading.Thread(target=self._run, args=(request,), daemon=True).start()

    def _run(self, request: InferRequest) -> None:
        sender = request.response_sender()
        for i in range(int(request.inputs["N"].reshape(-1)[0])):
            if i:
                time.sleep(0.2)
            sender.send(InferResponse({"OUT": np.array([i], dtype=np.int32)}))
            self.sent = i + 1
        sender.send(final=True)


@pytest.fixture(scope="module")
def backends() -> tuple[GateBackend, TicksBackend]:
    return GateBackend(), TicksBackend()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, backends: tuple[GateBackend, TicksBackend]) -> Iterator[ServerThread]:
    repo: Path = tmp_path_factory.mktemp("httpserver")
    for name, config in MODELS.items():
        write_model(repo, name, config)
    gate, ticks = backends
    # one process: the tests watch this process's HTTP server (queued replies, its connections)
    with serve(repo, backends={"gate": gate, "ticks": ticks}, http_max_input_size=MAX_INPUT,
               allow_grpc=False, use_entry_points=False, frontend_processes=0) as thread:
        yield thread


def _body(request_id: str = "", values: Sequence[float] = (1.0, 2.0)) -> bytes:
    payload: dict[str, object] = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [len(values)],
                                              "data": list(values)}]}
    if request_id:
        payload["id"] = request_id
    return orjson.dumps(payload)


def _infer_request(body: bytes, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return (b"POST /v2/models/ident/infer HTTP/" + version + b"\r\nHost: x\r\nContent-Type: application/json\r\n"
            + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body)


class Reader:
    """Reads HTTP/1.1 responses off a socket (Content-Length or chunked framing)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buffer += data
        return bool(data)

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            if not self._fill():
                raise ConnectionError("closed")
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    def _exact(self, n: int) -> bytes:
        while len(self.buffer) < n:
            if not self._fill():
                raise ConnectionError("closed")
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def head(self) -> tuple[int, dict[str, str]]:
        status = int(self._line().split()[1])
        headers: dict[str, str] = {}
        while line := self._line():
            name, _, value = line.partition(b":")
            headers[name.decode().lower()] = value.decode().strip()
        return status, headers

    def response(self) -> tuple[int, dict[str, str], bytes]:
        status, headers = self.head()
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(self._line(), 16):
                body += self._exact(size)
                self._line()
            self._line()
            return status, headers, body
        return status, headers, self._exact(int(headers.get("content-length", "0")))

    def closed(self) -> bool:
        """True once the peer has closed (nothing more to read)."""
        return not self.buffer and not self._fill()


def _connect(server: ServerThread) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.server.http_port), timeout=60)


@pytest.fixture(params=["alone", "beside another connection"])
def company(request: pytest.FixtureRequest, server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Runs a test on a lone connection (answers written at once) and beside another open
    connection (answers queued and written together a loop turn later), checking that the
    second variant really took the queued path."""
    if request.param == "alone":
        yield
        return
    queued: list[int] = []
    original = HttpServer.queue_reply

    def counting(self: HttpServer, connection: Any, data: bytes) -> None:
        queued.append(len(data))
        original(self, connection, data)

    monkeypatch.setattr(HttpServer, "queue_reply", counting)
    with _connect(server) as other:
        other.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert Reader(other).response()[0] == 200  # the server has accepted it
        yield
    assert queued, "no answer took the queued path"


def test_keep_alive_reuses_the_connection(server: ServerThread, company: None) -> None:
    with _connect(server) as sock:
        reader = Reader(sock)
        for i in range(5):
            sock.sendall(_infer_request(_body(f"k{i}")))
            status, headers, body = reader.response()
            assert status == 200, body
            assert "connection" not in headers
            assert orjson.loads(body)["id"] == f"k{i}"
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")  # the ASGI route, same socket
        assert reader.response()[0] == 200


def test_pipelined_requests_are_answered_in_order(server: ServerThread, company: None) -> None:
    with _connect(server) as sock:
        reader = Reader(sock)
        batch = b"".join(
            _infer_request(_body(f"p{i}")) if i % 3 else b"GET /v2/models/ident/ready HTTP/1.1\r\nHost: x\r\n\r\n"
            for i in range(12)
        )
        sock.sendall(batch)
        for i in range(12):
            status, _, body = reader.response()
            assert status == 200
            if i % 3:
                assert orjson.loads(body)["id"] == f"p{i}"
            else:
                assert body == b""


def test_http_10_closes_unless_keep_alive(server: ServerThread, company: None) -> None:
    with _connect(server) as sock:
        reader = Reader(sock)
        sock.sendall(_infer_request(_body("old"), version=b"1.0"))
        status, headers, body = reader.response()
        assert status == 200 and orjson.loads(body)["id"] == "old"
        assert headers["connection"] == "close"
        assert reader.closed()
    with _connect(server) as sock:
        reader = Reader(sock)
        for _ in range(2):
            sock.sendall(_infer_request(_body("ka"), b"Connection: keep-alive\r\n", version=b"1.0"))
            status, headers, _ = reader.response()
            assert status == 200 and headers["connection"] == "keep-alive"


def test_connection_close_is_honoured(server: ServerThread, company: None) -> None:
    for request in (_infer_request(_body(), b"Connection: close\r\n"),
                    b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"):
        with _connect(server) as sock:
            reader = Reader(sock)
            sock.sendall(request)
            status, headers, _ = reader.response()
            assert status == 200 and headers["connection"] == "close"
            assert reader.closed()


@pytest.mark.parametrize("path", [b"/v2/models/ident/infer", b"/v2/repository/index"])
def test_expect_100_continue(server: ServerThread, path: bytes, company: None) -> None:
    body = _body("c") if path.endswith(b"infer") else b"{}"
    with _connect(server) as sock:
        reader = Reader(sock)
        # an answered request first, pipelined: its answer must precede the 100 Continue
        sock.sendall(_infer_request(_body("before")) + b"POST " + path + b" HTTP/1.1\r\nHost: x\r\n"
                     b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        status, _, answer = reader.response()
        assert status == 200 and orjson.loads(answer)["id"] == "before"
        assert reader.head() == (100, {})
        sock.sendall(body)
        status, _, answer = reader.response()
        assert status == 200, answer


def test_chunked_request_body(server: ServerThread) -> None:
    body = _body("chunky", [float(i) for i in range(20)])
    framed = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    with _connect(server) as sock:
        reader = Reader(sock)
        sock.sendall(b"POST /v2/models/ident/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(framed), 50):  # in several packets
            sock.sendall(framed[i:i + 50])
            time.sleep(0.005)
        sock.sendall(b"0\r\n\r\n")
        status, _, answer = reader.response()
        assert status == 200, answer
        result = orjson.loads(answer)
        assert result["id"] == "chunky" and result["outputs"][0]["data"] == [float(i) for i in range(20)]


def test_content_length_with_chunked_is_read_as_chunked_then_closed(server: ServerThread) -> None:
    """RFC 9112 §6.3, as Triton reads it: Transfer-Encoding wins over Content-Length (here a
    wrong one), and the connection closes after the answer, so nothing can be smuggled behind."""
    body = _body("both", [1.0, 2.0])
    framed = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    smuggled = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    with _connect(server) as sock:
        reader = Reader(sock)
        sock.sendall(b"POST /v2/models/ident/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + framed + smuggled)
        status, headers, answer = reader.response()
        assert status == 200, answer
        assert orjson.loads(answer)["outputs"][0]["data"] == [1.0, 2.0]
        assert headers["connection"] == "close"
        assert reader.closed()  # the request after it was not answered


def test_chunked_body_over_the_cap_is_refused(server: ServerThread) -> None:
    with _connect(server) as sock:
        reader = Reader(sock)
        sock.sendall(b"POST /v2/models/ident/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 1000
        for _ in range(6):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, headers, answer = reader.response()
        assert status == 400 and b"--http-max-input-size" in answer
        assert headers["connection"] == "close"


@pytest.mark.parametrize("garbage", [b"BLAH\r\n\r\n", b"GET / HTTP/9.x\r\n\r\n", b"\x00\x01\x02 junk\r\n\r\n"])
def test_malformed_request_gets_400_and_close(server: ServerThread, garbage: bytes) -> None:
    with _connect(server) as sock:
        reader = Reader(sock)
        sock.sendall(garbage)
        status, headers, _ = reader.response()
        assert status == 400 and headers["connection"] == "close"
        assert reader.closed()


def test_malformed_request_after_a_good_one(server: ServerThread, company: None) -> None:
    with _connect(server) as sock:
        reader = Reader(sock)
        sock.sendall(_infer_request(_body("good")) + b"NONSENSE\r\n\r\n")
        status, _, body = reader.response()
        assert status == 200 and orjson.loads(body)["id"] == "good"
        assert reader.response()[0] == 400
        assert reader.closed()


def test_oversized_declared_body_is_refused_unread(server: ServerThread) -> None:
    with _connect(server) as sock:
        reader = Reader(sock)
        sock.sendall(b"POST /v2/models/ident/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_INPUT + 1))
        status, headers, answer = reader.response()  # answered before any body byte is sent
        assert status == 400 and b"exceeds the maximum allowed input size of 4096 bytes" in answer
        assert headers["connection"] == "close"
        assert reader.closed()


def test_unknown_model_keeps_the_connection(server: ServerThread, company: None) -> None:
    with _connect(server) as sock:
        reader = Reader(sock)
        body = _body()
        sock.sendall(b"POST /v2/models/nope/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        status, _, answer = reader.response()
        assert status == 404 and orjson.loads(answer)["error"].startswith("Request for unknown model")
        sock.sendall(_infer_request(_body("after")))
        assert reader.response()[0] == 200


def test_disconnect_cancels_a_queued_request(server: ServerThread, backends: tuple[GateBackend, TicksBackend]) -> None:
    gate = backends[0]
    gate.open.clear()
    gate.executing.clear()
    try:
        running = _connect(server)
        running.sendall(_infer_request(_body("running")))
        assert gate.executing.wait(60)
        queued = _connect(server)
        queued.sendall(_infer_request(_body("queued")))
        dataplane = server.server.dataplane
        wait_for(lambda: dataplane.in_flight == 2, timeout=60, what="the second request to be queued")
        native = server.server._http
        open_before = len(native.connections)
        queued.close()  # the client goes away while its request waits in the queue
        wait_for(lambda: len(native.connections) < open_before, timeout=60, what="the server to see the close")
    finally:
        gate.open.set()
    status, _, body = Reader(running).response()
    running.close()
    assert status == 200 and orjson.loads(body)["id"] == "running"
    wait_for(lambda: server.server.dataplane.in_flight == 0, timeout=60, what="no request in flight")
    assert "queued" not in gate.executed


def test_sse_events_arrive_as_they_are_sent(server: ServerThread, backends: tuple[GateBackend, TicksBackend]) -> None:
    ticks = backends[1]
    body = orjson.dumps({"N": 4})
    with _connect(server) as sock:
        reader = Reader(sock)
        sock.sendall(b"POST /v2/models/ticks/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        status, headers = reader.head()
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert headers["content-type"].startswith("text/event-stream")
        size = int(reader._line(), 16)
        first = reader._exact(size)
        assert first.startswith(b"data: ") and orjson.loads(first[6:].strip())["OUT"] == 0
        assert ticks.sent < 4  # the first event came before the backend produced the last one
        rest = b""
        reader._line()  # the CRLF after the first chunk
        while size := int(reader._line(), 16):
            rest += reader._exact(size)
            reader._line()
        reader._line()
        events = [orjson.loads(line[6:]) for line in rest.split(b"\n") if line.startswith(b"data: ")]
        assert [e["OUT"] for e in events] == [1, 2, 3]
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")  # still usable after the stream
        assert reader.response()[0] == 200


def test_uvicorn_remains_available(tmp_path: Path) -> None:
    write_model(tmp_path, "ident", MODELS["ident"])
    with serve(tmp_path, backends={"gate": GateBackend()}, http_server="uvicorn", allow_grpc=False,
               use_entry_points=False) as thread:
        with _connect(thread) as sock:
            sock.sendall(_infer_request(_body("uv")))
            status, _, body = Reader(sock).response()
            assert status == 200 and orjson.loads(body)["id"] == "uv"


def test_a_request_that_stops_arriving_gets_408(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A client that sends part of a request and stalls is answered 408 and disconnected; one
    that sends slowly but steadily is not."""
    import socket as socket_module

    from pyserve.frontends.http import connection as http_server
    from pyserve.testing import serve, write_model

    monkeypatch.setattr(http_server, "READ_TIMEOUT", 0.4)  # this process's: the owner serves a lone connection
    write_model(tmp_path / "repo", "echo", 'backend: "identity" max_batch_size: 0 '
                'input [ { name: "I" data_type: TYPE_FP32 dims: [ 2 ] } ] output [ { name: "O" data_type: TYPE_FP32 dims: [ 2 ] } ]')
    with serve(tmp_path / "repo", frontend_balance="connections") as thread:
        port = thread.server.http_port
        for partial in (b"GET /v2/hea", b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 200\r\n\r\n{\"in"):
            with socket_module.create_connection(("127.0.0.1", port)) as sock:
                sock.settimeout(5)
                sock.sendall(partial)
                answer = b""
                while True:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            assert b"did not arrive in time" in answer and b"at most 0.4 s between bytes" in answer
        body = b'{"inputs":[{"name":"I","shape":[2],"datatype":"FP32","data":[1,2]}]}'
        request = b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body
        with socket_module.create_connection(("127.0.0.1", port)) as sock:
            sock.settimeout(5)
            for i in range(0, len(request), 8):  # 8 bytes every 0.1 s: ~1.2 s in all, never 0.4 s idle
                sock.sendall(request[i:i + 8])
                time.sleep(0.1)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")


def test_keep_alive_timeout_closes_only_idle_connections(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The keep-alive deadline moves with every request (one lazy timer per connection): a
    connection used every 0.1 s for 1.2 s stays open under a 0.4 s timeout; once idle, it is
    closed about 0.4 s later."""
    import socket as socket_module

    from pyserve.frontends.http import connection as http_server
    from pyserve.testing import serve, write_model

    monkeypatch.setattr(http_server, "KEEP_ALIVE_TIMEOUT", 0.4)
    write_model(tmp_path / "repo", "echo", 'backend: "identity" max_batch_size: 0 '
                'input [ { name: "I" data_type: TYPE_FP32 dims: [ 2 ] } ] output [ { name: "O" data_type: TYPE_FP32 dims: [ 2 ] } ]')
    body = b'{"inputs":[{"name":"I","shape":[2],"datatype":"FP32","data":[1,2]}]}'
    request = b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    with serve(tmp_path / "repo") as thread:
        with socket_module.create_connection(("127.0.0.1", thread.server.http_port)) as sock:
            sock.settimeout(60)
            reader = Reader(sock)
            for _ in range(12):
                sock.sendall(request)
                status, _, _ = reader.response()
                assert status == 200
                time.sleep(0.1)
            idle_from = time.monotonic()
            assert sock.recv(4096) == b""  # closed by the server, not by the 60 s socket timeout
            waited = time.monotonic() - idle_from
            assert waited > 0.2, waited  # after the keep-alive timeout, not at once


def test_infer_urls_are_remembered_within_bounds(server: ServerThread) -> None:
    """The per-URL infer routing memo answers like the uncached rule (percent-encoded paths and
    non-infer URLs take the ASGI route) and never grows past its bound or keeps long URLs."""
    from pyserve.frontends.http import native_infer as http_server

    native = server.server._http
    assert native.infer_target(b"/v2/models/echo/infer") == ("echo", None)
    assert native.infer_target(b"/v2/models/echo/versions/3/infer?x=1") == ("echo", "3")
    assert native.infer_target(b"/v2/models/ec%68o/infer") is None
    assert native.infer_target(b"/v2/models/echo/ready") is None
    long_url = b"/v2/models/" + b"m" * 300 + b"/infer"
    assert native.infer_target(long_url) == ("m" * 300, None)
    assert long_url not in native.infer_targets
    for i in range(http_server._TARGET_CACHE + 10):
        native.infer_target(b"/v2/models/m%d/infer" % i)
    assert len(native.infer_targets) <= http_server._TARGET_CACHE
    assert native.infer_target(b"/v2/models/m%d/infer" % (http_server._TARGET_CACHE + 5)) == (
        f"m{http_server._TARGET_CACHE + 5}", None)


@pytest.mark.parametrize("path", [b"/v2/repository/index", b"/v2/models/echo/generate"])
def test_a_client_gone_mid_body_is_not_a_server_error(
    server: ServerThread, caplog: pytest.LogCaptureFixture, path: bytes
) -> None:
    """Routes served through the ASGI app: the client sends half a body and leaves."""
    caplog.set_level("ERROR")
    for _ in range(3):
        with _connect(server) as sock:
            sock.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"half")
            time.sleep(0.05)
        time.sleep(0.1)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text
    with _connect(server) as sock:  # still serving
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 200")


def _binary_request(values: np.ndarray, extra: bytes = b"") -> bytes:
    header = orjson.dumps({
        "inputs": [{"name": "IN", "datatype": "FP32", "shape": [values.size],
                    "parameters": {"binary_data_size": values.nbytes}}],
        "outputs": [{"name": "OUT", "parameters": {"binary_data": True}}],
    })
    return (b"POST /v2/models/ident/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            + extra + b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n"
            % (len(header), len(header) + values.nbytes) + header + values.tobytes())


def _binary_output(headers: dict[str, str], body: bytes) -> np.ndarray:
    json_length = int(headers["inference-header-content-length"])
    size = orjson.loads(body[:json_length])["outputs"][0]["parameters"]["binary_data_size"]
    assert len(body) == json_length + size
    return np.frombuffer(body[json_length:], dtype=np.float32)


def test_large_binary_answers_reach_a_slow_reader_whole_and_in_order(server: ServerThread) -> None:
    """Answers larger than the socket buffers go out piece by piece as the client reads them
    (not copied into the transport first): each whole and in order, also when the answers of
    pipelined requests wait behind them, and a ``Connection: close`` one before the close."""
    first = np.arange(3 << 20, dtype=np.float32)  # 12 MiB
    last = -np.arange(5 << 19, dtype=np.float32)  # 10 MiB
    with _connect(server) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        data = (_binary_request(first) + _infer_request(_body("small", (4.0, 5.0)))
                + _binary_request(last, extra=b"Connection: close\r\n"))
        # sent from a thread: the server stops reading while it cannot write (backpressure)
        sender = threading.Thread(target=sock.sendall, args=(data,), daemon=True)
        sender.start()
        time.sleep(0.5)  # nothing read yet: the server's writes to this connection pause
        reader = Reader(sock)
        status, headers, body = reader.response()
        assert status == 200
        assert np.array_equal(_binary_output(headers, body), first)
        status, _, body = reader.response()
        assert status == 200
        assert orjson.loads(body)["id"] == "small"
        assert orjson.loads(body)["outputs"][0]["data"] == [4.0, 5.0]
        status, headers, body = reader.response()
        assert status == 200 and headers.get("connection") == "close"
        assert np.array_equal(_binary_output(headers, body), last)
        assert reader.closed()
        sender.join(60)
