"""A large JSON infer body is decoded on a decode thread (``pyserve.frontends.http.offload``): meanwhile
the event loop goes on serving other clients. A small body is decoded inline, on the loop.

Order is what the tests check, never time: the server's JSON decoder is wrapped so that, for
the large body only, it waits until the test lets it go. Decoding on the loop would then hold
the loop, and the small request on another connection could not be answered until the large
one is; decoded on a decode thread, the small request is answered first. Real servers on
loopback ports (pyserve's HTTP server and uvicorn), ``tritonclient`` and raw sockets as clients.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from suite_support import identity_config, wait_for, write_model

from pyserve.frontends.http import fast_infer, offload
from pyserve.server.core import ServerThread
from pyserve.testing import serve

LARGE_ELEMENTS = 2_000_000
"""FP32 elements of the large request: about 20 MB of JSON, far over ``OFFLOAD_JSON_BYTES``."""
GATE_SECONDS = 60.0
"""The most the wrapped decoder waits to be let go (a test that fails does not hang)."""


@dataclass
class GatedDecoder:
    """Wraps the HTTP JSON decoder: records on which thread each body is decoded, and holds
    the decoding of a body over ``OFFLOAD_JSON_BYTES`` until ``release`` is set."""

    real: Any
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    threads: list[tuple[int, str]] = field(default_factory=list)  # (body bytes, thread name)
    large_decoded: int = 0  # large bodies decoded (or refused) so far

    def __call__(self, body: Any, *args: Any, **kwargs: Any) -> Any:
        self.threads.append((len(body), threading.current_thread().name))
        if len(body) <= offload.OFFLOAD_JSON_BYTES:
            return self.real(body, *args, **kwargs)
        self.entered.set()
        self.release.wait(GATE_SECONDS)
        try:
            return self.real(body, *args, **kwargs)
        finally:
            self.large_decoded += 1


@pytest.fixture
def decoder(monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedDecoder]:
    gated = GatedDecoder(fast_infer.decode_infer)
    monkeypatch.setattr(fast_infer, "decode_infer", gated)
    yield gated
    gated.release.set()


@pytest.fixture(params=["pyserve", "uvicorn"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServerThread]:
    repo = tmp_path / "repo"
    write_model(repo, "echo", identity_config("echo", "FP32", max_batch_size=0))
    # in this process: the tests wrap this process's decoder
    with serve(repo, frontend_processes=0, http_server=request.param) as thread:
        yield thread


def large_body(values: np.ndarray) -> bytes:
    """A JSON infer body for ``values``, asking for the output as binary data (a small header)."""
    return orjson.dumps({
        "inputs": [{"name": "IN", "datatype": "FP32", "shape": [values.size], "data": values.tolist()}],
        "outputs": [{"name": "OUT", "parameters": {"binary_data": True}}],
    })


def post(port: int, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=GATE_SECONDS * 2)
    sock.sendall(b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    return sock


def answer(sock: socket.socket) -> tuple[int, bytes]:
    """Status and body of one answer (read to its content-length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1 << 16)
        assert chunk, "the connection closed before an answer"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        chunk = sock.recv(1 << 20)
        assert chunk, "the connection closed within an answer"
        rest += chunk
    return int(lines[0].split()[1]), rest[:length]


def small_infer(url: str) -> np.ndarray:
    with httpclient.InferenceServerClient(url, network_timeout=GATE_SECONDS * 2) as client:
        tensor = httpclient.InferInput("IN", [2], "FP32")
        tensor.set_data_from_numpy(np.array([1.5, -2.0], dtype=np.float32), binary_data=False)
        return client.infer("echo", [tensor]).as_numpy("OUT")


def test_another_client_is_answered_while_a_large_json_body_is_decoded(
        server: ServerThread, decoder: GatedDecoder) -> None:
    values = np.arange(LARGE_ELEMENTS, dtype=np.float32) / 4
    body = large_body(values)
    assert len(body) > 10 * offload.OFFLOAD_JSON_BYTES
    order: list[str] = []
    results: dict[str, Any] = {}

    def send_large() -> None:
        with post(server.server.http_port, body) as sock:
            results["large"] = answer(sock)
            order.append("large")

    large = threading.Thread(target=send_large, daemon=True)
    large.start()
    assert decoder.entered.wait(GATE_SECONDS), "the large body was never decoded"
    small = small_infer(server.url)
    order.append("small")
    assert decoder.large_decoded == 0, "the small request waited for the large body to be decoded"
    decoder.release.set()
    large.join(GATE_SECONDS * 2)
    assert order == ["small", "large"]
    np.testing.assert_array_equal(small, np.array([1.5, -2.0], dtype=np.float32))
    status, content = results["large"]
    assert status == 200, content
    header_length = content.index(b"}]}") + 3
    header = orjson.loads(content[:header_length])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == values.nbytes
    np.testing.assert_array_equal(np.frombuffer(content[header_length:], dtype=np.float32), values)
    threads = dict(decoder.threads)
    assert threads[len(body)].startswith("pyserve-decode")  # the large body: on a decode thread
    small_threads = [name for size, name in decoder.threads if size != len(body)]
    assert small_threads and not any(name.startswith("pyserve-decode") for name in small_threads)


def test_a_bad_large_body_is_answered_400(server: ServerThread, decoder: GatedDecoder) -> None:
    """An error found while decoding on a decode thread is answered as inline: 400 and why."""
    decoder.release.set()
    data: list[Any] = [0.5] * LARGE_ELEMENTS
    data[-1] = True
    body = orjson.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [len(data)], "data": data}]})
    with post(server.server.http_port, body) as sock:
        status, content = answer(sock)
    assert status == 400
    assert "must hold numbers, not true/false" in orjson.loads(content)["error"]
    assert dict(decoder.threads)[len(body)].startswith("pyserve-decode")


def test_a_client_that_leaves_while_its_body_is_decoded(server: ServerThread, decoder: GatedDecoder) -> None:
    """The client closes its connection while its large body is decoded: the server goes on
    serving, and pyserve's server drops the decoded request (never executed): it saw the
    connection close while the body was still being decoded."""
    body = large_body(np.zeros(LARGE_ELEMENTS, dtype=np.float32))
    sock = post(server.server.http_port, body)
    assert decoder.entered.wait(GATE_SECONDS), "the large body was never decoded"
    sock.close()
    native = server.server._http
    if native is not None:
        wait_for(lambda: not native.connections, timeout=GATE_SECONDS, what="the server to see the close")
    decoder.release.set()
    wait_for(lambda: decoder.large_decoded == 1, timeout=GATE_SECONDS, what="the large body to be decoded")
    np.testing.assert_array_equal(small_infer(server.url), np.array([1.5, -2.0], dtype=np.float32))
    dataplane = server.server.dataplane
    wait_for(lambda: dataplane.in_flight == 0, timeout=GATE_SECONDS, what="no request in flight")
    if native is not None:
        with httpclient.InferenceServerClient(server.url) as client:
            [stats] = client.get_inference_statistics("echo")["model_stats"]
        assert stats["inference_count"] == 1  # the small request alone


def test_a_large_json_body_through_a_frontend_process(tmp_path: Path) -> None:
    """A frontend process decodes large bodies on its own decode threads, then hands the request
    to the owner (or its replica) as it does a small one."""
    repo = tmp_path / "repo"
    write_model(repo, "echo", identity_config("echo", "FP32", max_batch_size=0))
    values = np.arange(LARGE_ELEMENTS, dtype=np.float32) / 8
    with serve(repo, frontend_processes=1) as server:
        assert server.server.frontends is not None
        with post(server.server.http_port, large_body(values)) as sock:
            status, content = answer(sock)
        np.testing.assert_array_equal(small_infer(server.url), np.array([1.5, -2.0], dtype=np.float32))
    assert status == 200, content
    header_length = content.index(b"}]}") + 3
    np.testing.assert_array_equal(np.frombuffer(content[header_length:], dtype=np.float32), values)
