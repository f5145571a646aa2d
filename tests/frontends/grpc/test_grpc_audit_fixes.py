"""pyserve's own gRPC server under a flood of streamed responses, expired deadlines and bad
stream messages: one call must not starve the others, and every call gets its status.

The streaming clients speak raw HTTP/2 (``RawClient``) so they can read slowly, not at all,
or reset the stream; the bystander calls go through grpcio.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import uvloop
from suite_support import SQUARE_CONFIG, wait_for, write_model
from test_grpc_http2 import RawClient, framed, status

from pyserve import protocol as pb
from pyserve.frontends.grpc import http2 as h2
from pyserve.server.core import ServerThread
from pyserve.testing import serve

SERVICE = "/inference.GRPCInferenceService/"
STREAM_PATH = SERVICE + "ModelStreamInfer"
LIVE_PATH = SERVICE + "ServerLive"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """A server on uvloop, the loop ``pyserve serve`` runs on (its timers and tasks interleave
    differently from asyncio's)."""
    path: Path = tmp_path_factory.mktemp("grpc_audit")
    write_model(path, "square", SQUARE_CONFIG)
    policy = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        with serve(path, frontend_processes=0) as thread:  # the tests read this process's gRPC connections
            asyncio.set_event_loop_policy(policy)
            yield thread
    finally:
        asyncio.set_event_loop_policy(policy)


def square_request(count: int) -> bytes:
    request = pb.ModelInferRequest(model_name="square", id="flood")
    request.inputs.add(name="IN", datatype="INT32", shape=[1])
    request.raw_input_contents.append(np.array([count], dtype=np.int32).tobytes())
    return request.SerializeToString()


def live_latencies(port: int, stop: threading.Event, pause: float = 0.02) -> list[float]:
    """Seconds taken by each ServerLive call (another connection) until ``stop`` is set."""
    latencies: list[float] = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        live = channel.unary_unary(LIVE_PATH, request_serializer=lambda m: m, response_deserializer=lambda m: m)
        live(b"", timeout=10)  # connected before measuring
        while not stop.is_set():
            started = time.monotonic()
            live(b"", timeout=30)
            latencies.append(time.monotonic() - started)
            time.sleep(pause)
    return latencies


class StreamReader(threading.Thread):
    """Reads one stream's reply as it comes (DATA bytes counted, not parsed), returning the
    window in steps of 32 KiB as it reads (as grpc clients do with their default windows)."""

    def __init__(self, client: RawClient, stream_id: int) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.stream_id = stream_id
        self.data_bytes = 0
        self.trailers: list[tuple[str, str]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._read()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _read(self) -> None:
        sock, buffer, position = self.client.sock, bytearray(), 0
        sock.settimeout(120)
        granted = 0
        while True:
            while len(buffer) - position >= 9:
                length = int.from_bytes(buffer[position:position + 3], "big")
                if len(buffer) - position - 9 < length:
                    break
                kind, flags = buffer[position + 3], buffer[position + 4]
                sid = int.from_bytes(buffer[position + 5:position + 9], "big") & 0x7FFFFFFF
                payload = bytes(buffer[position + 9:position + 9 + length])
                position += 9 + length
                if kind == h2.DATA and sid == self.stream_id:
                    self.data_bytes += length
                    granted += length
                elif kind == h2.HEADERS and sid == self.stream_id and flags & h2.END_STREAM:
                    self.trailers = [tuple(pair) for pair in self.client.decoder.decode(payload)]  # type: ignore[misc]
                    return
                elif kind == h2.HEADERS:
                    self.client.decoder.decode(payload)
                elif kind == h2.SETTINGS and not flags & h2.ACK:
                    sock.sendall(h2.frame(h2.SETTINGS, h2.ACK, 0))
            del buffer[:position]
            position = 0
            if granted >= 32 * 1024:
                sock.sendall(h2.window_update(0, granted) + h2.window_update(self.stream_id, granted))
                granted = 0
            chunk = sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("closed by the server")
            buffer += chunk


def test_a_flood_of_streamed_responses_leaves_other_connections_served(server: ServerThread) -> None:
    count = 60_000
    client = RawClient(server.server.grpc_port)
    stop = threading.Event()
    latencies: list[float] = []
    bystander = threading.Thread(
        target=lambda: latencies.extend(live_latencies(server.server.grpc_port, stop)), daemon=True)
    try:
        bystander.start()
        time.sleep(0.3)
        reader = StreamReader(client, 1)
        reader.start()
        client.headers(1, path=STREAM_PATH)
        client.data(1, framed(square_request(count)))
        reader.join(120)
        stop.set()
        bystander.join(60)
        assert not reader.is_alive(), "the stream did not finish in 120 s"
        assert reader.error is None
        assert status(reader.trailers) == (0, "")
        assert reader.data_bytes > count * 20  # every response came (each is some 60 bytes)
        assert latencies, "the other connection was not served while the stream flowed"
    finally:
        stop.set()
        client.close()


def _live(port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        live = channel.unary_unary(LIVE_PATH, request_serializer=lambda m: m, response_deserializer=lambda m: m)
        live(b"", timeout=30)


def test_a_client_that_never_reads_then_resets_does_not_keep_the_server_busy(server: ServerThread) -> None:
    port = server.server.grpc_port
    client = RawClient(port, {h2.INITIAL_WINDOW_SIZE: 0})
    try:
        client.headers(1, path=STREAM_PATH)
        client.data(1, framed(square_request(300_000)))
        dataplane = server.server.dataplane
        wait_for(lambda: dataplane.in_flight > 0, what="the stream's request to run")
        _live(port)  # another connection is served meanwhile
        client.send(h2.rst_stream(1, h2.CANCEL))
        client.close()
        # once reset, the stream's request ends (its model is no longer held by the writer) and
        # the server keeps no state of the call or the connection
        wait_for(lambda: dataplane.in_flight == 0, what="the reset request to end")
        wait_for(lambda: not server.server._grpc.connections, what="the reset connection to close")
        _live(port)
    finally:
        client.close()


def call_frames(client: RawClient, stream_id: int, path: str, message: bytes, timeout: str | None) -> bytes:
    """HEADERS and DATA of one call (to be sent with others in one write)."""
    fields = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "localhost"),
              ("content-type", "application/grpc"), ("te", "trailers")]
    if timeout is not None:
        fields.append(("grpc-timeout", timeout))
    block = client.encoder.encode(fields)
    return (h2.frame(h2.HEADERS, h2.END_HEADERS, stream_id, block)
            + h2.frame(h2.DATA, h2.END_STREAM, stream_id, framed(message)))


def statuses(client: RawClient, stream_ids: set[int]) -> dict[int, int]:
    """grpc-status of each of ``stream_ids`` (-1 for a stream reset by the server)."""
    found: dict[int, int] = {}
    while len(found) < len(stream_ids):
        kind, flags, sid, payload = client.frame()
        if kind == h2.HEADERS:
            fields = dict(client.decoder.decode(payload))
            if sid in stream_ids and flags & h2.END_STREAM:
                found[sid] = int(fields["grpc-status"])
        elif kind == h2.RST_STREAM and sid in stream_ids and sid not in found:
            found[sid] = -1  # reset before any status (NO_ERROR after the trailers is normal)
        elif kind == h2.GOAWAY:
            raise ConnectionError("GOAWAY")
    return found


@pytest.mark.parametrize("timeout", ["0n", "1u", "100u"])
def test_unary_calls_with_expired_deadlines_are_answered(server: ServerThread, timeout: str) -> None:
    port = server.server.grpc_port
    client, other = RawClient(port), RawClient(port)  # two calling connections: calls become tasks
    try:
        client.sock.settimeout(10)
        ids = list(range(1, 600, 2))
        other.send(b"".join(call_frames(other, sid, LIVE_PATH, b"", None) for sid in ids))
        client.send(b"".join(call_frames(client, sid, LIVE_PATH, b"", timeout) for sid in ids))
        found = statuses(client, set(ids))
        assert set(found.values()) <= {grpc.StatusCode.DEADLINE_EXCEEDED.value[0], 0}
    finally:
        client.close()
        other.close()


@contextlib.contextmanager
def raw_client(server: ServerThread, timeout: float) -> Iterator[RawClient]:
    """A raw HTTP/2 connection to the server's gRPC port, reads timing out after ``timeout`` s."""
    client = RawClient(server.server.grpc_port)
    client.sock.settimeout(timeout)
    try:
        yield client
    finally:
        client.close()


@pytest.mark.parametrize("timeout", ["0n", "1u", "100u"])
def test_streaming_calls_with_expired_deadlines_get_deadline_exceeded(server: ServerThread, timeout: str) -> None:
    with raw_client(server, 10) as client:
        for stream_id in range(1, 41, 2):
            client.headers(stream_id, path=STREAM_PATH, extra=(("grpc-timeout", timeout),))
            client.data(stream_id, framed(square_request(2)))
            _, _, trailers = client.reply(stream_id)
            assert status(trailers) == (grpc.StatusCode.DEADLINE_EXCEEDED.value[0], "Deadline Exceeded")


def test_many_expired_deadlines_never_fill_the_stream_limit(server: ServerThread) -> None:
    port = server.server.grpc_port
    client, other = RawClient(port), RawClient(port)
    try:
        client.sock.settimeout(10)
        for first in range(1, 2 * 4400, 2 * 440):  # more calls than MAX_CONCURRENT_STREAMS (4096)
            ids = range(first, first + 2 * 440, 2)
            other.send(b"".join(call_frames(other, sid, LIVE_PATH, b"", None) for sid in ids))
            client.send(b"".join(call_frames(client, sid, LIVE_PATH, b"", "1u") for sid in ids))
        last = 2 * 4400 + 1
        client.send(call_frames(client, last, LIVE_PATH, b"", None))
        found = statuses(client, set(range(1, last + 2, 2)))
        assert found[last] == 0
        assert -1 not in found.values()  # none refused
    finally:
        client.close()
        other.close()


def test_a_garbage_message_on_a_stream_gets_internal(server: ServerThread) -> None:
    with raw_client(server, 10) as client:
        client.headers(1, path=STREAM_PATH)
        client.data(1, framed(b"\xff\xff\xff"))
        _, _, trailers = client.reply(1)
        assert status(trailers) == (grpc.StatusCode.INTERNAL.value[0], "Exception deserializing request!")


def test_a_stream_window_update_above_the_maximum_resets_the_stream(server: ServerThread) -> None:
    with raw_client(server, 5) as client:
        client.headers(1, path=STREAM_PATH)  # open: the server waits for its messages
        client.send(h2.window_update(1, h2.MAX_WINDOW))  # 65,535 + 2^31-1 is above 2^31-1
        while True:
            kind, _, sid, payload = client.frame()
            if kind == h2.RST_STREAM and sid == 1:
                assert int.from_bytes(payload, "big") == h2.FLOW_CONTROL_ERROR
                break
            assert kind != h2.GOAWAY
        client.headers(3, path=LIVE_PATH)  # the connection goes on
        client.data(3, framed(b""))
        assert status(client.reply(3)[2]) == (0, "")


@pytest.mark.parametrize(("frame", "code"), [
    (h2.settings({h2.ENABLE_PUSH: 2}), h2.PROTOCOL_ERROR),
    (h2.frame(h2.SETTINGS, h2.ACK, 0, b"\x00\x02\x00\x00\x00\x00"), h2.FRAME_SIZE_ERROR),
])
def test_bad_settings_end_the_connection(server: ServerThread, frame: bytes, code: int) -> None:
    with raw_client(server, 5) as client:
        client.send(frame)
        assert client.goaway()[0] == code


def test_invalid_hpack_is_reported_without_object_addresses(server: ServerThread) -> None:
    with raw_client(server, 5) as client:
        client.send(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, 1, b"\x3f"))  # a cut-off integer
        code, text = client.goaway()
        assert code == h2.COMPRESSION_ERROR
        assert text.startswith(b"invalid header block") and b"0x" not in text and b"memory" not in text
