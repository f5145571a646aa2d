"""pyserve's own gRPC server at the HTTP/2 level: flow control, limits, errors, pings, compression.

Most tests speak raw HTTP/2 over a socket (frames built here, headers with ``hpack``) so they can
check what a gRPC library would hide: window sizes honoured, a too-large message refused before
its body is sent, GOAWAY codes. The rest use tritonclient and grpcio as clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import hpack
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from suite_support import FP32_ECHO_CONFIG, grpc_handler_server, write_model
from tritonclient.utils import InferenceServerException

from pyserve import protocol as pb
from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.grpc.server import GrpcOptions
from pyserve.server.core import ServerThread
from pyserve.testing import serve

INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"

ECHO = FP32_ECHO_CONFIG
SLOW = ECHO + """
    parameters { key: "execute_delay_ms" value { string_value: "300" } }
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("http2")
    write_model(path, "echo", ECHO)
    write_model(path, "slow", SLOW)
    return path


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[ServerThread]:
    options = GrpcOptions(max_message_bytes=1 << 20, infer_compression="high")
    with serve(repo, grpc=options) as thread:
        yield thread


@pytest.fixture(scope="module")
def plain_server(repo: Path) -> Iterator[ServerThread]:
    """The defaults: no reply compression, no message cap below grpc's."""
    with serve(repo) as thread:
        yield thread


@pytest.fixture(params=["plain", "compressed"])
def infer_server(request: pytest.FixtureRequest) -> ServerThread:
    """A server with plain replies, or the module's server (compressed replies)."""
    return request.getfixturevalue("plain_server" if request.param == "plain" else "server")  # type: ignore[no-any-return]


def infer_message(model: str, values: np.ndarray) -> bytes:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[values.size])
    request.raw_input_contents.append(values.astype(np.float32).tobytes())
    return request.SerializeToString()


def framed(message: bytes, compressed: bool = False) -> bytes:
    return bytes((int(compressed),)) + len(message).to_bytes(4, "big") + message


class RawClient:
    """A minimal HTTP/2 client: frames in and out, nothing hidden. A context manager (closed on
    leaving); its socket is closed even when the handshake fails."""

    def __init__(self, port: int, settings: dict[int, int] | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.buffer = b""
        self.pending: list[tuple[int, int, int, bytes]] = []
        try:
            self.sock.sendall(h2.PREFACE + h2.settings(settings or {}))
        except BaseException:
            self.sock.close()
            raise

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def headers(self, stream_id: int, path: str = INFER_PATH, end_stream: bool = False,
                extra: tuple[tuple[str, str], ...] = (), content_type: str = "application/grpc") -> None:
        block = self.encoder.encode([
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "localhost"),
            ("content-type", content_type), ("te", "trailers"), *extra,
        ])
        flags = h2.END_HEADERS | (h2.END_STREAM if end_stream else 0)
        self.send(h2.frame(h2.HEADERS, flags, stream_id, block))

    def data(self, stream_id: int, payload: bytes, end_stream: bool = True) -> None:
        for offset in range(0, max(len(payload), 1), 16_384):
            last = offset + 16_384 >= len(payload)
            self.send(h2.frame(h2.DATA, h2.END_STREAM if (end_stream and last) else 0, stream_id,
                               payload[offset:offset + 16_384]))

    def call(self, stream_id: int, message: bytes, extra: tuple[tuple[str, str], ...] = ()) -> None:
        self.headers(stream_id, extra=extra)
        self.data(stream_id, framed(message))

    def frame(self) -> tuple[int, int, int, bytes]:
        """The next frame (SETTINGS and WINDOW_UPDATE from the server included)."""
        while not self.pending:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("closed by the server")
            frames, self.buffer = h2.split_frames(self.buffer + chunk)
            self.pending.extend(frames)
        kind, flags, stream_id, payload = self.pending.pop(0)
        if kind == h2.SETTINGS and not flags & h2.ACK:
            # the server may have closed already (a refused connection: SETTINGS, then GOAWAY):
            # the frames it sent are still read
            with contextlib.suppress(OSError):
                self.send(h2.frame(h2.SETTINGS, h2.ACK, 0))
        return kind, flags, stream_id, payload

    def reply(self, stream_id: int) -> tuple[list[tuple[str, str]], bytes, list[tuple[str, str]]]:
        """Headers, DATA bytes and trailers of one stream (other streams' frames are dropped)."""
        headers: list[tuple[str, str]] = []
        trailers: list[tuple[str, str]] = []
        body = b""
        while True:
            kind, flags, sid, payload = self.frame()
            if kind == h2.HEADERS:
                decoded = [tuple(pair) for pair in self.decoder.decode(payload)]
                if sid != stream_id:
                    continue
                if flags & h2.END_STREAM:
                    if not headers:
                        headers, trailers = decoded, decoded  # trailers-only reply
                    else:
                        trailers = decoded
                    return headers, body, trailers
                headers = decoded
            elif kind == h2.DATA and sid == stream_id:
                body += payload
            elif kind == h2.GOAWAY:
                raise ConnectionError(f"GOAWAY {int.from_bytes(payload[4:8], 'big')}: {payload[8:]!r}")

    def goaway(self) -> tuple[int, bytes]:
        """The error code and debug text of the GOAWAY the server sends next."""
        while True:
            kind, _, _, payload = self.frame()
            if kind == h2.GOAWAY:
                return int.from_bytes(payload[4:8], "big"), payload[8:]


def status(trailers: list[tuple[str, str]]) -> tuple[int, str]:
    values = dict(trailers)
    return int(values["grpc-status"]), values.get("grpc-message", "")


def response_tensor(body: bytes) -> np.ndarray:
    assert body[0] == 0
    length = int.from_bytes(body[1:5], "big")
    response = pb.ModelInferResponse.FromString(body[5:5 + length])
    return np.frombuffer(response.raw_output_contents[0], dtype=np.float32)


def test_flow_control_honours_a_small_client_window(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port, {h2.INITIAL_WINDOW_SIZE: 1000})
    try:
        values = np.arange(20_000, dtype=np.float32)  # an 80 KB answer
        client.call(1, infer_message("echo", values))
        received, frames = 0, []
        while received < 1000:  # the window's worth comes (the socket waits up to 60 s)
            kind, _, sid, payload = client.frame()
            if kind == h2.DATA and sid == 1:
                received += len(payload)
                frames.append(len(payload))
        assert received == 1000
        client.sock.settimeout(0.5)  # then nothing more: the server waits for the window
        with contextlib.suppress(TimeoutError):
            while True:
                kind, _, sid, payload = client.frame()
                assert not (kind == h2.DATA and sid == 1), "DATA past the client's window"
        client.sock.settimeout(60)
        client.send(h2.window_update(1, 1 << 20) + h2.window_update(0, 1 << 20))
        _, rest, trailers = client.reply(1)
        assert status(trailers) == (0, "")
        assert max(frames + [len(rest)]) <= 1 << 20
    finally:
        client.close()


def test_data_frames_respect_the_client_max_frame_size_and_the_answer_is_whole(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port, {h2.INITIAL_WINDOW_SIZE: 1 << 24})
    try:
        client.send(h2.window_update(0, 1 << 24))
        values = np.random.default_rng(0).random(200_000).astype(np.float32)  # 800 KB
        client.call(1, infer_message("echo", values))
        body, sizes = b"", []
        while True:
            kind, flags, sid, payload = client.frame()
            if kind == h2.DATA and sid == 1:
                sizes.append(len(payload))
                body += payload
            elif kind == h2.HEADERS and flags & h2.END_STREAM:
                break
        assert max(sizes) <= h2.DEFAULT_MAX_FRAME
        np.testing.assert_array_equal(response_tensor(body), values)
    finally:
        client.close()


def test_oversized_message_refused_from_its_prefix(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port)
    try:
        client.headers(1)
        client.send(h2.frame(h2.DATA, 0, 1, b"\x00" + (1 << 30).to_bytes(4, "big")))  # announces 1 GiB, sends none
        _, _, trailers = client.reply(1)
        code, message = status(trailers)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert message == f"Received message larger than max ({1 << 30} vs. {1 << 20})"
        client.call(3, infer_message("echo", np.ones(4, np.float32)))  # the connection still serves
        _, body, trailers = client.reply(3)
        assert status(trailers) == (0, "")
        np.testing.assert_array_equal(response_tensor(body), np.ones(4, np.float32))
    finally:
        client.close()


def test_oversized_message_through_tritonclient(server: ServerThread) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        big = grpcclient.InferInput("INPUT0", [400_000], "FP32")
        big.set_data_from_numpy(np.zeros(400_000, np.float32))
        with pytest.raises(InferenceServerException) as error:
            client.infer("echo", [big])
        assert error.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        small = grpcclient.InferInput("INPUT0", [3], "FP32")
        small.set_data_from_numpy(np.arange(3, dtype=np.float32))
        assert client.infer("echo", [small]).as_numpy("OUTPUT0").tolist() == [0, 1, 2]
    finally:
        client.close()


def test_unknown_method_is_unimplemented(server: ServerThread) -> None:
    with grpc.insecure_channel(server.grpc_url) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/NoSuchRpc")
        with pytest.raises(grpc.RpcError) as error:
            call(b"", timeout=5)
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "NoSuchRpc" in error.value.details()


def test_undecodable_request_is_internal(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port)
    try:
        client.call(1, b"\xff\xff\xff")
        _, _, trailers = client.reply(1)
        assert status(trailers) == (grpc.StatusCode.INTERNAL.value[0], "Exception deserializing request!")
    finally:
        client.close()


def test_not_grpc_content_type_gets_415(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port)
    try:
        client.headers(1, content_type="application/json", end_stream=True)
        headers, _, _ = client.reply(1)
        assert dict(headers)[":status"] == "415"
    finally:
        client.close()


def test_http1_request_on_the_grpc_port(server: ServerThread) -> None:
    with socket.create_connection(("127.0.0.1", server.server.grpc_port), timeout=5) as sock:
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 505 ")
    assert b'{"error":"this port serves gRPC (HTTP/2)' in answer


@pytest.mark.parametrize("violation, code", [
    (h2.frame_header(h2.DATA, 0, 1, (1 << 20) + 1), h2.FRAME_SIZE_ERROR),  # larger than advertised
    (h2.frame(h2.HEADERS, h2.END_HEADERS, 1, b"\xff\xff\xff\xff\xff"), h2.COMPRESSION_ERROR),  # bad HPACK
    (h2.frame(h2.HEADERS, h2.END_HEADERS, 2, b"\x82"), h2.PROTOCOL_ERROR),  # even stream id
    (h2.frame(h2.PING, 0, 0, b"short"), h2.PROTOCOL_ERROR),
    (h2.frame(h2.PUSH_PROMISE, h2.END_HEADERS, 1, b"\x00\x00\x00\x02"), h2.PROTOCOL_ERROR),
], ids=["frame-too-large", "bad-hpack", "even-stream-id", "short-ping", "push-promise"])
def test_protocol_violation_closes_only_that_connection(server: ServerThread, violation: bytes, code: int) -> None:
    bad = RawClient(server.server.grpc_port)
    good = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        bad.send(violation)
        assert bad.goaway()[0] == code
        tensor = grpcclient.InferInput("INPUT0", [2], "FP32")
        tensor.set_data_from_numpy(np.array([1.5, 2.5], np.float32))
        assert good.infer("echo", [tensor]).as_numpy("OUTPUT0").tolist() == [1.5, 2.5]
    finally:
        bad.close()
        good.close()


def test_ping_is_acknowledged_and_abuse_ends_the_connection(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port)
    try:
        client.send(h2.frame(h2.PING, 0, 0, b"12345678"))
        while True:
            kind, flags, _, payload = client.frame()
            if kind == h2.PING:
                assert flags & h2.ACK and payload == b"12345678"
                break
        for _ in range(4):  # no calls, no data: Triton's defaults allow 2 strikes
            client.send(h2.frame(h2.PING, 0, 0, b"abcdefgh"))
        code, debug = client.goaway()
        assert code == h2.ENHANCE_YOUR_CALM and debug == b"too_many_pings"
    finally:
        client.close()


def test_server_keepalive_pings_and_closes_a_silent_peer(repo: Path) -> None:
    options = GrpcOptions(keepalive_time_ms=100, keepalive_timeout_ms=200, keepalive_permit_without_calls=True)
    with serve(repo, grpc=options) as server:
        client = RawClient(server.server.grpc_port)
        try:
            while True:
                kind, flags, _, _ = client.frame()
                if kind == h2.PING and not flags & h2.ACK:
                    break
            # not answered: the server hangs up (within the socket's 60 s timeout, so for the
            # keepalive timeout, not the 300 s idle timeout)
            with pytest.raises(ConnectionError):
                while True:
                    client.frame()
        finally:
            client.close()


def test_gzip_request_and_response(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port)
    try:
        values = np.linspace(0, 1, 1000, dtype=np.float32)
        client.headers(1, extra=(("grpc-encoding", "gzip"), ("grpc-accept-encoding", "identity,gzip")))
        client.data(1, framed(gzip.compress(infer_message("echo", values)), compressed=True))
        headers, body, trailers = client.reply(1)
        assert status(trailers) == (0, "")
        assert dict(headers)["grpc-encoding"] == "gzip"  # --grpc-infer-response-compression-level high
        assert body[0] == 1
        response = pb.ModelInferResponse.FromString(gzip.decompress(body[5:]))
        np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], np.float32), values)
    finally:
        client.close()


def test_truncated_gzip_message_is_internal_and_the_connection_goes_on(server: ServerThread) -> None:
    """A gzip message cut short is refused (it is not inflated to whatever part decodes)."""
    client = RawClient(server.server.grpc_port)
    try:
        whole = gzip.compress(infer_message("echo", np.linspace(0, 1, 1000, dtype=np.float32)))
        client.headers(1, extra=(("grpc-encoding", "gzip"),))
        client.data(1, framed(whole[: len(whole) // 2], compressed=True))
        _, _, trailers = client.reply(1)
        code, message = status(trailers)
        assert code == grpc.StatusCode.INTERNAL.value[0]
        assert message == "cannot decompress the request message: truncated gzip data"
        client.call(3, infer_message("echo", np.ones(2, np.float32)))
        assert status(client.reply(3)[2]) == (0, "")
    finally:
        client.close()


def test_data_inside_a_header_block_ends_the_connection_even_when_it_arrives_in_pieces(
    server: ServerThread,
) -> None:
    """A DATA frame where a CONTINUATION must come is a connection error, also when only its
    first bytes have arrived (the path that takes a large DATA payload as it comes)."""
    client = RawClient(server.server.grpc_port)
    try:
        block = client.encoder.encode([(":method", "POST"), (":path", INFER_PATH), ("content-type", "application/grpc")])
        client.send(h2.frame(h2.HEADERS, 0, 1, block))  # no END_HEADERS: a CONTINUATION must follow
        client.send(h2.frame_header(h2.DATA, 0, 1, 10_000) + b"x" * 100)  # most of the payload still to come
        code, text = client.goaway()
        assert code == h2.PROTOCOL_ERROR and b"expected CONTINUATION" in text
    finally:
        client.close()


def test_unsupported_encoding_is_unimplemented(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port)
    try:
        client.headers(1, extra=(("grpc-encoding", "snappy"),))
        client.data(1, framed(b"x", compressed=True))
        _, _, trailers = client.reply(1)
        code, message = status(trailers)
        assert code == grpc.StatusCode.UNIMPLEMENTED.value[0] and "snappy" in message
    finally:
        client.close()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_compression(server: ServerThread, algorithm: str) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        values = np.random.default_rng(1).random(50_000).astype(np.float32)
        tensor = grpcclient.InferInput("INPUT0", [values.size], "FP32")
        tensor.set_data_from_numpy(values)
        result = client.infer("echo", [tensor], compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values)
    finally:
        client.close()


def test_deadline_exceeded_and_the_server_keeps_serving(infer_server: ServerThread) -> None:
    server = infer_server
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        tensor = grpcclient.InferInput("INPUT0", [1], "FP32")
        tensor.set_data_from_numpy(np.ones(1, np.float32))
        with pytest.raises(InferenceServerException) as error:
            client.infer("slow", [tensor], client_timeout=0.05)
        assert error.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert client.infer("echo", [tensor]).as_numpy("OUTPUT0").tolist() == [1.0]
    finally:
        client.close()


def test_server_deadline_from_grpc_timeout_header(infer_server: ServerThread) -> None:
    server = infer_server
    client = RawClient(server.server.grpc_port)
    try:
        client.headers(1, extra=(("grpc-timeout", "50m"),))
        client.data(1, framed(infer_message("slow", np.ones(1, np.float32))))
        _, _, trailers = client.reply(1)  # the server's deadline: a raw client keeps none
        assert status(trailers) == (grpc.StatusCode.DEADLINE_EXCEEDED.value[0], "Deadline Exceeded")
    finally:
        client.close()


def test_reset_stream_cancels_only_that_call(infer_server: ServerThread) -> None:
    server = infer_server
    client = RawClient(server.server.grpc_port)
    try:
        client.call(1, infer_message("slow", np.ones(1, np.float32)))
        client.send(h2.rst_stream(1, h2.CANCEL))
        client.call(3, infer_message("echo", np.full(2, 7, np.float32)))
        _, body, trailers = client.reply(3)
        assert status(trailers) == (0, "")
        assert response_tensor(body).tolist() == [7, 7]
    finally:
        client.close()


def test_a_reset_call_still_queued_never_executes(infer_server: ServerThread) -> None:
    """Two calls of a one-instance 300 ms model: the second, reset while queued behind the
    first, is never executed (the execution count grows by one)."""
    stats = grpcclient.InferenceServerClient(infer_server.grpc_url)
    client = RawClient(infer_server.server.grpc_port)

    def executions() -> int:
        counted = stats.get_inference_statistics("slow", as_json=True)["model_stats"][0]
        return int(counted.get("execution_count", 0))

    try:
        settle = grpcclient.InferInput("INPUT0", [1], "FP32")
        settle.set_data_from_numpy(np.ones(1, np.float32))
        stats.infer("slow", [settle])  # queued behind whatever earlier tests left executing
        before = executions()
        client.call(1, infer_message("slow", np.ones(1, np.float32)))
        client.call(3, infer_message("slow", np.full(1, 2, np.float32)))
        time.sleep(0.1)
        client.send(h2.rst_stream(3, h2.CANCEL))
        _, body, trailers = client.reply(1)
        assert status(trailers) == (0, "")
        assert response_tensor(body).tolist() == [1]
        time.sleep(0.5)  # the reset call would have executed by now
        assert executions() - before == 1
    finally:
        client.close()
        stats.close()


def test_header_block_in_continuation_frames(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port)
    try:
        block = client.encoder.encode([
            (":method", "POST"), (":scheme", "http"), (":path", INFER_PATH), (":authority", "localhost"),
            ("content-type", "application/grpc"), ("x-padding", "p" * 3000),
        ])
        client.send(h2.frame(h2.HEADERS, 0, 1, block[:1000]) + h2.frame(h2.CONTINUATION, 0, 1, block[1000:2000])
                    + h2.frame(h2.CONTINUATION, h2.END_HEADERS, 1, block[2000:]))
        client.data(1, framed(infer_message("echo", np.ones(3, np.float32))))
        _, body, trailers = client.reply(1)
        assert status(trailers) == (0, "")
        assert response_tensor(body).tolist() == [1, 1, 1]
    finally:
        client.close()


def test_message_split_across_many_data_frames(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port)
    try:
        values = np.arange(100, dtype=np.float32)
        payload = framed(infer_message("echo", values))
        client.headers(1)
        for offset in range(0, len(payload), 3):  # prefix and message cut at every third byte
            piece = payload[offset:offset + 3]
            client.send(h2.frame(h2.DATA, h2.END_STREAM if offset + 3 >= len(payload) else 0, 1, piece))
        _, body, trailers = client.reply(1)
        assert status(trailers) == (0, "")
        np.testing.assert_array_equal(response_tensor(body), values)
    finally:
        client.close()


def test_many_concurrent_calls_on_one_channel(server: ServerThread) -> None:
    import asyncio

    async def run() -> list[Any]:
        client = aioclient.InferenceServerClient(server.grpc_url)
        try:
            async def one(i: int) -> Any:
                tensor = aioclient.InferInput("INPUT0", [2], "FP32")
                tensor.set_data_from_numpy(np.array([i, -i], np.float32))
                return (await client.infer("echo", [tensor])).as_numpy("OUTPUT0").tolist()

            return await asyncio.gather(*(one(i) for i in range(300)))
        finally:
            await client.close()

    assert asyncio.run(run()) == [[i, -i] for i in range(300)]


def test_handlers_without_a_deserializer_get_bytes_also_for_large_messages() -> None:
    """As grpc's server: a 2 MB message (many DATA frames, several reads) reaches a unary and a
    streaming handler without a deserializer as ``bytes``, which they can pass on to grpc's
    client (the frontend's relay does)."""
    seen: list[type] = []
    message = bytes(range(256)) * 8192

    async def unary(request: bytes, context: Any) -> bytes:
        seen.append(type(request))
        return request[:4]

    async def streaming(requests: Any, context: Any) -> Any:
        async for request in requests:
            seen.append(type(request))
            yield request[:4]

    handler = grpc.method_handlers_generic_handler("t.S", {
        "U": grpc.unary_unary_rpc_method_handler(unary),
        "S": grpc.stream_stream_rpc_method_handler(streaming),
    })
    with grpc_handler_server(handler) as port, grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)]) as channel:
        assert channel.unary_unary("/t.S/U")(message, timeout=60) == message[:4]
        assert list(channel.stream_stream("/t.S/S")(iter([message, b"small"]), timeout=60)) == [message[:4], b"smal"]
    assert seen == [bytes, bytes, bytes]


def test_metadata_reaches_the_servicer_and_trailers_come_back(repo: Path) -> None:
    """A custom servicer on the same server class: -bin metadata decoded, abort trailers encoded."""
    seen: dict[str, Any] = {}

    async def behaviour(request: bytes, context: Any) -> bytes:
        seen.update(dict(context.invocation_metadata()))
        seen["peer"] = context.peer()
        seen["remaining"] = context.time_remaining()
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "nope: 100%", (("why-bin", b"\x00\x01"), ("who", "me")))

    handler = grpc.method_handlers_generic_handler("t.S", {"M": grpc.unary_unary_rpc_method_handler(behaviour)})
    with grpc_handler_server(handler) as port, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/t.S/M")
        with pytest.raises(grpc.RpcError) as error:
            call(b"hi", metadata=(("token-bin", b"\xff\x00"), ("user", "ann")), timeout=60)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.value.details() == "nope: 100%"
    assert dict(error.value.trailing_metadata()) == {"why-bin": b"\x00\x01", "who": "me"}
    assert seen["token-bin"] == b"\xff\x00" and seen["user"] == "ann"
    assert seen["peer"].startswith("ipv4:127.0.0.1:")
    # grpc writes grpc-timeout rounded up to a few significant digits: slightly more than 60 s can arrive
    assert 0 < seen["remaining"] <= 60.5


def test_a_streaming_call_whose_task_is_cancelled_is_reset_at_once() -> None:
    """A servicer that ends with ``CancelledError`` (a relay whose own call was cancelled): the
    client is told (RST_STREAM CANCEL, written without waiting for the client's next frame)."""
    got: list[bytes] = []

    async def behaviour(requests: Any, context: Any) -> Any:
        async for message in requests:
            got.append(message)
            raise asyncio.CancelledError
        yield b""  # an async generator, as streaming servicers are

    handler = grpc.method_handlers_generic_handler("t.S", {"M": grpc.stream_stream_rpc_method_handler(behaviour)})
    done = threading.Event()

    def requests() -> Iterator[bytes]:
        yield b"one"
        done.wait(120)  # the request stream stays open: nothing more comes from the client

    with grpc_handler_server(handler) as port, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream("/t.S/M")(requests(), timeout=120)
        try:
            with pytest.raises(grpc.RpcError) as error:
                next(call)
        finally:
            done.set()
    assert error.value.code() == grpc.StatusCode.CANCELLED
    assert got == [b"one"]


# -- large messages: tensors stay where they arrived ---------------------------------------------


def test_large_request_parse_keeps_tensors_as_views_and_matches_protobuf() -> None:
    from pyserve.frontends.grpc.codec import SPLIT_ABOVE, SplitInferRequest, parse_infer_request

    request = pb.ModelInferRequest(model_name="m", model_version="2", id="x")
    request.parameters["priority"].int64_param = 3
    for index, size in enumerate((SPLIT_ABOVE, 100, 7)):
        request.inputs.add(name=f"IN{index}", datatype="UINT8", shape=[size])
        request.raw_input_contents.append(bytes([index + 1]) * size)
    request.outputs.add(name="OUT")
    wire = bytearray(request.SerializeToString())

    parsed = parse_infer_request(wire)
    assert isinstance(parsed, SplitInferRequest)
    assert [bytes(raw) for raw in parsed.raw_input_contents] == list(request.raw_input_contents)
    assert all(raw.obj is wire for raw in parsed.raw_input_contents)  # views, no copies
    assert parsed.model_name == "m" and parsed.id == "x" and parsed.parameters["priority"].int64_param == 3
    assert [t.name for t in parsed.inputs] == ["IN0", "IN1", "IN2"] and parsed.outputs[0].name == "OUT"
    assert parsed.SerializeToString() == bytes(wire)
    with pytest.raises(ValueError):
        parse_infer_request(wire[:-3])  # truncated inside the last field
    small = pb.ModelInferRequest(model_name="m")
    assert type(parse_infer_request(small.SerializeToString())) is pb.ModelInferRequest


def test_large_tensors_both_ways_through_tritonclient(repo: Path) -> None:
    """No response compression here: the reply leaves as unjoined pieces (views of the output)."""
    with serve(repo) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            for size in (200_000, 4_000_000):  # 800 KB and 16 MB each way
                values = np.random.default_rng(size).random(size).astype(np.float32)
                tensor = grpcclient.InferInput("INPUT0", [values.size], "FP32")
                tensor.set_data_from_numpy(values)
                np.testing.assert_array_equal(client.infer("echo", [tensor]).as_numpy("OUTPUT0"), values)
        finally:
            client.close()


def test_reuse_grpc_port_lets_two_servers_share_it(repo: Path) -> None:
    from pyserve.server.core import StartupError

    with serve(repo, grpc=GrpcOptions(reuse_port=True), reuse_http_port=True) as first:
        port = first.server.grpc_port
        with serve(repo, grpc_port=port, grpc=GrpcOptions(reuse_port=True)) as second:
            assert second.server.grpc_port == port
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                assert client.is_server_ready()
            finally:
                client.close()
        with pytest.raises(StartupError, match=f"gRPC service could not bind 127.0.0.1:{port}"):
            with serve(repo, grpc_port=port):  # without --reuse-grpc-port the port is taken
                pass


def test_no_stream_state_left_after_mixed_traffic(repo: Path) -> None:
    """Finished, failed, timed-out, reset and streaming calls all leave no stream behind."""
    import asyncio

    with serve(repo) as server:
        grpc_server = server.server._grpc

        async def run() -> None:
            client = aioclient.InferenceServerClient(server.grpc_url)
            try:
                tensor = aioclient.InferInput("INPUT0", [2], "FP32")
                tensor.set_data_from_numpy(np.ones(2, np.float32))

                async def one(i: int) -> None:
                    with contextlib.suppress(InferenceServerException):
                        if i % 5 == 0:
                            await client.infer("slow", [tensor], client_timeout=0.02)  # deadline
                        elif i % 7 == 0:
                            await client.infer("no_such_model", [tensor])  # error status
                        else:
                            await client.infer("echo", [tensor])

                await asyncio.gather(*(one(i) for i in range(150)))

                async def requests() -> Any:
                    for i in range(5):
                        yield {"model_name": "echo", "inputs": [tensor], "request_id": str(i)}

                answers = [result async for result in client.stream_infer(requests())]
                assert len(answers) == 5
            finally:
                await client.close()

        asyncio.run(run())
        raw = RawClient(server.server.grpc_port)  # a call reset by the client half-way
        raw.headers(1)
        raw.send(h2.rst_stream(1, h2.CANCEL))
        raw.close()
        deadline = time.monotonic() + 60
        while any(c._streams for c in list(grpc_server.connections)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(c._streams for c in list(grpc_server.connections))
        assert server.server.dataplane.in_flight == 0


def test_empty_header_name_is_not_a_crash(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port)
    try:
        block = client.encoder.encode([(":method", "POST"), (":path", INFER_PATH),
                                       ("content-type", "application/grpc"), ("", "x")])
        client.send(h2.frame(h2.HEADERS, h2.END_HEADERS, 1, block))
        client.data(1, framed(infer_message("echo", np.ones(2, np.float32))))
        _, body, trailers = client.reply(1)
        assert status(trailers) == (0, "")
    finally:
        client.close()


def test_random_frames_never_disturb_the_server(server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    """A fixed-seed fuzz: random frames (valid HPACK blocks, gRPC prefixes, bad lengths, odd flags)
    cut at random points; afterwards no error was logged and a normal client is served."""
    import random

    rng = random.Random(7)
    encoder_headers = [(":method", "POST"), (":path", INFER_PATH), ("content-type", "application/grpc")]

    def random_frame() -> bytes:
        kind = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 255])
        flags = rng.choice([0, 1, 4, 5, 8, 0x20, 0x25, 0x2D, 255])
        stream_id = rng.choice([0, 1, 1, 1, 3, 5, 2**31 - 1, rng.randrange(2**31)])
        payload = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 4, 5, 8, 9, 20, 100])))
        if kind == h2.HEADERS and rng.random() < 0.5:
            extra = [("grpc-timeout", rng.choice(["1S", "xx", "0n"])), ("grpc-encoding", rng.choice(["gzip", "zz"]))]
            payload = hpack.Encoder().encode(encoder_headers + extra)
        elif kind == h2.DATA and rng.random() < 0.5:
            message = bytes(rng.randrange(256) for _ in range(rng.choice([0, 3, 10])))
            payload = bytes((rng.choice([0, 1, 2]),)) + rng.choice([len(message), 5, 2**31]).to_bytes(4, "big") + message
        return h2.frame(kind, flags, stream_id, payload)

    caplog.set_level("ERROR")
    for _ in range(120):
        data = h2.PREFACE + b"".join(random_frame() for _ in range(rng.randrange(1, 12)))
        with socket.create_connection(("127.0.0.1", server.server.grpc_port), timeout=2) as sock:
            position = 0
            while position < len(data):
                step = rng.randrange(1, 64)
                with contextlib.suppress(OSError):
                    sock.sendall(data[position:position + step])
                position += step
            sock.settimeout(0.01)
            with contextlib.suppress(OSError):
                while sock.recv(65536):
                    pass
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        tensor = grpcclient.InferInput("INPUT0", [2], "FP32")
        tensor.set_data_from_numpy(np.array([3, 4], np.float32))
        assert client.infer("echo", [tensor]).as_numpy("OUTPUT0").tolist() == [3, 4]
    finally:
        client.close()
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text
