"""pyserve's own gRPC server against hostile peers: memory set aside only for bytes that arrived
(within budgets), restricted calls refused from their headers, HPACK indexes that always mean
what RFC 7541 says, floods bounded (rapid reset, SETTINGS, CONTINUATION, gzip bombs), idle and
half-sent connections closed, a connection cap, and malformed HTTP/2 requests refused.

Every test talks raw HTTP/2 to a real server on a loopback port (``RawClient``); what a model saw
is checked through a Python-backend model that returns the parameters it was given.
"""

from __future__ import annotations

import json
import logging
import socket
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from suite_support import FP32_ECHO_CONFIG, wait_for, write_model
from test_grpc_http2 import INFER_PATH, RawClient, framed, infer_message, response_tensor, status

from pyserve import protocol as pb
from pyserve.frontends.grpc import guard
from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.grpc.server import GrpcOptions
from pyserve.frontends.restricted import parse_restrictions
from pyserve.server.core import ServerThread
from pyserve.testing import require_owner_connections, serve

PARAMS_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("PARAMS", np.array([r.parameters().encode()], dtype=object))]
            )
            for r in requests
        ]
'''
PARAMS_CONFIG = """
    backend: "python"
    max_batch_size: 0
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "PARAMS" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("grpc_hardening")
    write_model(path, "echo", FP32_ECHO_CONFIG)
    write_model(path, "params", PARAMS_CONFIG, files={"1/model.py": PARAMS_PY})
    return path


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[ServerThread]:
    with serve(repo, grpc=GrpcOptions(header_forward_pattern="x-fwd-.*")) as thread:
        yield thread


def budget(thread: ServerThread) -> guard.BufferBudget:
    return thread.server._grpc.buffer_budget  # type: ignore[no-any-return]


def echo_is_served(thread: ServerThread) -> None:
    client = grpcclient.InferenceServerClient(thread.grpc_url)
    try:
        tensor = grpcclient.InferInput("INPUT0", [2], "FP32")
        tensor.set_data_from_numpy(np.array([3, 4], np.float32))
        assert client.infer("echo", [tensor]).as_numpy("OUTPUT0").tolist() == [3, 4]
    finally:
        client.close()


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


# -- 1. memory only for bytes that arrived ------------------------------------------------------------


def test_a_declared_length_sets_nothing_aside_and_bytes_are_counted_as_they_arrive(server: ServerThread) -> None:
    """Three streams declaring messages of 2 GiB - 1 (the default cap) with a few bytes each: the
    server holds what was sent, not what was declared, and serves other clients meanwhile."""
    require_owner_connections(server)  # the budget and the memory looked at are this process's
    before = rss_bytes()
    client = RawClient(server.server.grpc_port)
    try:
        for stream_id in (1, 3, 5):
            client.headers(stream_id)
            client.data(stream_id, b"\x00" + (2**31 - 1).to_bytes(4, "big") + b"x" * 10, end_stream=False)
        wait_for(lambda: budget(server).held == 30, what="the 30 bytes sent to be held")
        echo_is_served(server)
        assert rss_bytes() - before < 256 * 1024 * 1024
    finally:
        client.close()
    wait_for(lambda: budget(server).held == 0, what="the bytes of the closed connection to be released")


def test_messages_past_the_connection_budget_are_refused_and_the_others_complete(repo: Path) -> None:
    options = GrpcOptions(max_connection_buffer=80_000)
    with serve(repo, grpc=options) as thread:
        client = RawClient(thread.server.grpc_port)
        try:
            whole = framed(infer_message("echo", np.arange(15_000, dtype=np.float32)))  # 60 KB
            client.headers(1)
            client.data(1, whole[:50_000], end_stream=False)
            client.headers(3)
            client.data(3, whole[:50_000], end_stream=False)  # twice 49,995 held > 80,000
            _, _, trailers = client.reply(3)
            code, message = status(trailers)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert "--grpc-max-connection-buffer" in message
            client.data(1, whole[50_000:])
            _, body, trailers = client.reply(1)
            assert status(trailers) == (0, "")
            assert response_tensor(body).tolist() == list(range(15_000))
            assert budget(thread).held == 0
        finally:
            client.close()


def test_the_server_budget_is_shared_by_connections(repo: Path) -> None:
    with serve(repo, grpc=GrpcOptions(max_connection_buffer=1 << 20, max_server_buffer=70_000)) as thread:
        first, second = RawClient(thread.server.grpc_port), RawClient(thread.server.grpc_port)
        try:
            whole = framed(infer_message("echo", np.arange(15_000, dtype=np.float32)))
            first.headers(1)
            first.data(1, whole[:40_000], end_stream=False)
            wait_for(lambda: budget(thread).held == 39_995, what="the first message's bytes (its prefix is not held)")
            second.headers(1)
            second.data(1, whole[:40_000], end_stream=False)
            code, message = status(second.reply(1)[2])
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "--grpc-max-server-buffer" in message
            first.data(1, whole[40_000:])
            assert status(first.reply(1)[2]) == (0, "")
        finally:
            first.close()
            second.close()


def test_a_restricted_call_is_refused_from_its_headers_before_its_body(repo: Path) -> None:
    restrictions = parse_restrictions(["inference:secret=open-sesame"], grpc=True)
    with serve(repo, grpc=GrpcOptions(restrictions=restrictions)) as thread:
        client = RawClient(thread.server.grpc_port)
        try:
            client.headers(1)  # no body at all: the answer comes from the headers
            code, message = status(client.reply(1)[2])
            assert code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert message == "This protocol is restricted, expecting header 'triton-grpc-protocol-secret'"
            client.headers(3, extra=(("triton-grpc-protocol-secret", "open-sesame"),))
            client.data(3, framed(infer_message("echo", np.ones(2, np.float32))))
            assert status(client.reply(3)[2]) == (0, "")
        finally:
            client.close()


# -- 3. HPACK ---------------------------------------------------------------------------------------


def _tenant_block(tenant: bytes | None) -> bytes:
    """A request's header block: fields as literals that never enter the table, then the tenant
    as a literal with incremental indexing (new entry 62), or (None) as index 62."""
    fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", INFER_PATH.encode()),
              (b":authority", b"localhost"), (b"content-type", b"application/grpc"), (b"te", b"trailers")]
    block = b"".join(h2.literal(name, value) for name, value in fields)
    if tenant is None:
        return block + b"\xbe"  # indexed field 62: the newest dynamic entry
    return block + b"\x40" + h2.literal(b"x-fwd-tenant", tenant)[1:]


def test_an_index_means_the_entry_the_table_holds_now(server: ServerThread) -> None:
    """alice (inserted), 62, bob (inserted), 62: the last call is bob's (RFC 7541 §2.3.3)."""
    client = RawClient(server.server.grpc_port)
    message = framed(infer_message("params", np.ones(1, np.float32)))
    seen = []
    try:
        for stream_id, tenant in ((1, b"alice"), (3, None), (5, b"bob"), (7, None)):
            client.send(h2.frame(h2.HEADERS, h2.END_HEADERS, stream_id, _tenant_block(tenant)))
            client.data(stream_id, message)
            _, body, trailers = client.reply(stream_id)
            assert status(trailers) == (0, "")
            response = pb.ModelInferResponse.FromString(body[5:])
            raw = response.raw_output_contents[0]
            seen.append(json.loads(raw[4:4 + int.from_bytes(raw[:4], "little")])["x-fwd-tenant"])
    finally:
        client.close()
    assert seen == ["alice", "alice", "bob", "bob"]


# -- 4. floods ----------------------------------------------------------------------------------------


def _executions(thread: ServerThread, model: str) -> int:
    client = grpcclient.InferenceServerClient(thread.grpc_url)
    try:
        stats = client.get_inference_statistics(model, as_json=True)
        return int(stats["model_stats"][0].get("execution_count", 0))
    finally:
        client.close()


def test_rapid_reset_is_ended_with_enhance_your_calm_and_reset_calls_do_not_run(repo: Path) -> None:
    calls = 20_000
    with serve(repo) as thread:
        before = _executions(thread, "echo")
        client = RawClient(thread.server.grpc_port)
        message = framed(infer_message("echo", np.ones(2, np.float32)))
        headers = client.encoder.encode([
            (":method", "POST"), (":scheme", "http"), (":path", INFER_PATH), (":authority", "localhost"),
            ("content-type", "application/grpc"), ("te", "trailers")])
        try:
            batch = []
            for index in range(calls):
                stream_id = 2 * index + 1
                batch.append(h2.frame(h2.HEADERS, h2.END_HEADERS, stream_id, headers)
                             + h2.frame(h2.DATA, h2.END_STREAM, stream_id, message)
                             + h2.rst_stream(stream_id, h2.CANCEL))
                if len(batch) == 200:
                    try:
                        client.send(b"".join(batch))
                    except OSError:  # the server already dropped the connection
                        break
                    batch = []
            code, _ = client.goaway()
            assert code == h2.ENHANCE_YOUR_CALM
        except ConnectionError:
            pass  # closed after its GOAWAY was read past: the count below still tells
        finally:
            client.close()
        echo_is_served(thread)
        assert _executions(thread, "echo") - before <= guard.RESET_BURST + 200


def test_a_settings_flood_from_a_peer_that_does_not_read_ends_its_connection(server: ServerThread) -> None:
    sock = socket.create_connection(("127.0.0.1", server.server.grpc_port), timeout=30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    chunk = h2.settings({h2.ENABLE_PUSH: 0}) * 10_000
    sent = 0
    try:
        sock.sendall(h2.PREFACE)
        with pytest.raises(OSError):  # reset by the server long before 3 M frames went out
            while sent < 3_000_000:
                sock.sendall(chunk)
                sent += 10_000
    finally:
        sock.close()
    echo_is_served(server)


def test_a_continuation_flood_ends_the_connection(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port)
    try:
        block = client.encoder.encode([(":method", "POST"), (":path", INFER_PATH)])
        client.send(h2.frame(h2.HEADERS, 0, 1, block) + h2.frame(h2.CONTINUATION, 0, 1) * 1000)
        code, debug = client.goaway()
        assert code == h2.ENHANCE_YOUR_CALM and b"CONTINUATION" in debug
    finally:
        client.close()
    echo_is_served(server)


def test_a_gzip_bomb_inflates_no_further_than_the_buffer_budget(repo: Path) -> None:
    """256 MiB of zeros in a 250 KB gzip message, under a 512 MiB message cap but an 8 MiB
    connection budget: refused, and the server never held the inflated bytes."""
    bomb = zlib.compressobj(9, zlib.DEFLATED, 31)
    payload = bomb.compress(bytes(256 << 20)) + bomb.flush()
    options = GrpcOptions(max_message_bytes=512 << 20, max_connection_buffer=8 << 20)
    with serve(repo, grpc=options) as thread:
        before = rss_bytes()
        client = RawClient(thread.server.grpc_port)
        try:
            client.headers(1, extra=(("grpc-encoding", "gzip"),))
            client.data(1, framed(payload, compressed=True))
            code, message = status(client.reply(1)[2])
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "8388608" in message
            assert rss_bytes() - before < 128 << 20
        finally:
            client.close()


# -- 6. idle and half-sent connections, the connection cap -------------------------------------------


def test_an_idle_connection_is_closed_with_goaway_but_not_one_with_a_call(repo: Path) -> None:
    slow = FP32_ECHO_CONFIG + 'parameters { key: "execute_delay_ms" value { string_value: "1500" } }'
    write_model(repo, "slow_idle", slow)
    with serve(repo, grpc=GrpcOptions(idle_timeout_secs=0.3)) as thread:
        with RawClient(thread.server.grpc_port) as idle, RawClient(thread.server.grpc_port) as busy:
            busy.call(1, infer_message("slow_idle", np.ones(2, np.float32)))
            assert idle.goaway() == (h2.NO_ERROR, b"")
            assert status(busy.reply(1)[2]) == (0, "")  # a call through several idle periods


def test_a_half_sent_message_ends_its_call_and_frees_its_bytes(repo: Path) -> None:
    with serve(repo, grpc=GrpcOptions(message_timeout_secs=0.3)) as thread:
        client = RawClient(thread.server.grpc_port)
        try:
            client.headers(1)
            client.data(1, framed(infer_message("echo", np.ones(100, np.float32)))[:50], end_stream=False)
            code, message = status(client.reply(1)[2])
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            assert "--grpc-message-timeout-secs" in message
            assert budget(thread).held == 0
        finally:
            client.close()


def test_a_header_block_that_never_ends_closes_the_connection(repo: Path) -> None:
    with serve(repo, grpc=GrpcOptions(message_timeout_secs=0.3)) as thread:
        sock = socket.create_connection(("127.0.0.1", thread.server.grpc_port), timeout=30)
        try:  # a raw socket: nothing (not even a SETTINGS acknowledgement) may follow the HEADERS
            block = RawClient.__new__(RawClient)
            sock.sendall(h2.PREFACE + h2.settings({}) + h2.frame(h2.HEADERS, 0, 1, b"\x83"))
            block.sock, block.buffer, block.pending = sock, b"", []
            block.send = lambda data: None  # type: ignore[method-assign]
            code, debug = block.goaway()
            assert code == h2.PROTOCOL_ERROR and b"header block" in debug
        finally:
            sock.close()


def test_connections_past_the_limit_get_a_goaway_naming_it_and_a_warning(
    repo: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "pyserve.frontends.grpc")
    with serve(repo, grpc=GrpcOptions(max_connections=2)) as thread, \
            RawClient(thread.server.grpc_port) as first, RawClient(thread.server.grpc_port) as second:
        first.call(1, infer_message("echo", np.ones(2, np.float32)))
        second.call(1, infer_message("echo", np.ones(2, np.float32)))
        assert status(first.reply(1)[2]) == status(second.reply(1)[2]) == (0, "")
        with RawClient(thread.server.grpc_port) as third:
            code, debug = third.goaway()
            assert code == h2.ENHANCE_YOUR_CALM and b"limit of 2 connections" in debug
        assert "--grpc-max-connections" in caplog.text
        first.close()
        wait_for(lambda: len(thread.server._grpc.connections) == 1, what="the first connection to close")
        with RawClient(thread.server.grpc_port) as fourth:
            fourth.call(1, infer_message("echo", np.ones(2, np.float32)))
            assert status(fourth.reply(1)[2]) == (0, "")


# -- 10. malformed HTTP/2 ------------------------------------------------------------------------------


def _rst_code(client: RawClient, stream_id: int) -> int:
    while True:
        kind, _, sid, payload = client.frame()
        if kind == h2.RST_STREAM and sid == stream_id:
            return int.from_bytes(payload, "big")
        if kind == h2.GOAWAY:
            raise AssertionError(f"GOAWAY instead of a reset: {payload!r}")


def test_upper_case_header_names_reset_the_stream(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port)
    try:
        client.headers(1, extra=(("X-Upper", "1"),))
        assert _rst_code(client, 1) == h2.PROTOCOL_ERROR
        client.call(3, infer_message("echo", np.ones(2, np.float32)))  # the connection goes on
        assert status(client.reply(3)[2]) == (0, "")
    finally:
        client.close()


def test_a_stream_that_depends_on_itself_is_reset(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port)
    try:
        client.send(h2.frame(h2.PRIORITY, 0, 1, (1).to_bytes(4, "big") + b"\x10"))
        assert _rst_code(client, 1) == h2.PROTOCOL_ERROR
        block = client.encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", INFER_PATH),
                                       ("content-type", "application/grpc")])
        client.send(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.PRIORITY_FLAG, 3, (3).to_bytes(4, "big") + b"\x10" + block))
        assert _rst_code(client, 3) == h2.PROTOCOL_ERROR
    finally:
        client.close()


@pytest.mark.parametrize("frame", [
    pytest.param(h2.frame(h2.PRIORITY, 0, 0, bytes(5)), id="priority-on-stream-0"),
])
def test_priority_on_stream_0_ends_the_connection(server: ServerThread, frame: bytes) -> None:
    client = RawClient(server.server.grpc_port)
    try:
        client.send(frame)
        assert client.goaway()[0] == h2.PROTOCOL_ERROR
    finally:
        client.close()


def test_a_new_stream_below_the_last_id_ends_the_connection(server: ServerThread) -> None:
    client = RawClient(server.server.grpc_port)
    try:
        client.call(5, infer_message("echo", np.ones(2, np.float32)))
        assert status(client.reply(5)[2]) == (0, "")
        client.headers(3)
        code, debug = client.goaway()
        assert code == h2.PROTOCOL_ERROR and b"not above" in debug
    finally:
        client.close()
