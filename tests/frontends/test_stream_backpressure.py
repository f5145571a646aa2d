"""A decoupled model streaming to a client that does not read is paused, not buffered: over a
gRPC stream and over SSE (``generate_stream``) its sender waits once ``RESPONSE_BACKLOG``
responses wait for the writer, and every response still arrives, in order, once the client
reads. The ``square`` backend (one response per unit of its input) on a real server."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from suite_support import SQUARE_CONFIG, wait_for, write_model
from test_grpc_http2 import RawClient, framed

from pyserve import protocol as pb
from pyserve.frontends.grpc import http2 as h2
from pyserve.server.core import ServerThread
from pyserve.testing import serve

COUNT = 3000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    path: Path = tmp_path_factory.mktemp("backpressure")
    write_model(path, "square", SQUARE_CONFIG)
    with serve(path) as thread:
        yield thread


def a_sender_waits() -> bool:
    """Some thread of this process (the server's) waits in ``ResponseBacklog.put``."""
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name == "put" and frame.f_code.co_filename.endswith("backlog.py"):
                return True
            frame = frame.f_back  # type: ignore[assignment]
    return False


def test_a_grpc_stream_that_is_not_read_pauses_the_model(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port, {h2.INITIAL_WINDOW_SIZE: 1024})
    request = pb.ModelInferRequest(model_name="square", id="many")
    request.inputs.add(name="IN", datatype="INT32", shape=[1])
    request.raw_input_contents.append(np.array([COUNT], dtype=np.int32).tobytes())
    try:
        client.headers(1, path="/inference.GRPCInferenceService/ModelStreamInfer")
        client.data(1, framed(request.SerializeToString()), end_stream=False)
        wait_for(a_sender_waits, timeout=60, what="the model to wait for the client")
        client.send(h2.window_update(0, 1 << 30) + h2.window_update(1, 1 << 30))
        client.data(1, b"", end_stream=True)
        _, body, trailers = client.reply(1)
        assert dict(trailers)["grpc-status"] == "0"
        values, position = [], 0
        while position < len(body):
            length = int.from_bytes(body[position + 1:position + 5], "big")
            message = pb.ModelStreamInferResponse.FromString(body[position + 5:position + 5 + length])
            if message.infer_response.raw_output_contents:
                values.append(int(np.frombuffer(message.infer_response.raw_output_contents[0], np.int32)[0]))
            position += 5 + length
        assert values == [COUNT] * COUNT  # square answers its input, COUNT times
    finally:
        client.close()


def test_an_sse_stream_that_is_not_read_pauses_the_model(server: ServerThread) -> None:
    sock = socket.create_connection(("127.0.0.1", server.server.http_port), timeout=60)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = b'{"IN": %d}' % COUNT
    try:
        sock.sendall(b"POST /v2/models/square/generate_stream HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        wait_for(a_sender_waits, timeout=60, what="the model to wait for the client")
        answer = b""
        while not answer.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(1 << 20)
            assert chunk, answer[-200:]
            answer += chunk
        assert answer.count(b"data: ") == COUNT
        assert answer.count(b'"OUT":%d' % COUNT) == COUNT and b"error" not in answer
    finally:
        sock.close()
