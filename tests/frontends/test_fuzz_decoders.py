"""Property-based fuzzing (hypothesis) of what parses client bytes: the HTTP JSON and binary
``/infer`` decoder, the gRPC message decoder, and the HTTP/2 frame layer of the gRPC server.

Each target may only answer or refuse: a decoder returns a request or raises ``InferError``
(which becomes a 4xx/gRPC status), never any other exception; the frame layer may end a
connection but never logs an error, and the server serves a normal call afterwards. Runs are
bounded by count (``FUZZ_EXAMPLES``, 200 by default in CI; set ``PYSERVE_FUZZ_EXAMPLES`` for a
longer run, see docs/security.md), with a fixed database-free seed so CI runs are repeatable.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import hpack
import numpy as np
import orjson
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from suite_support import write_model
from test_grpc_http2 import INFER_PATH, infer_message

from pyserve import protocol as pb
from pyserve.api.errors import InferError
from pyserve.frontends.grpc import codec as grpc_codec
from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.http import codec as http_codec
from pyserve.server.core import ServerThread
from pyserve.testing import serve

FUZZ_EXAMPLES = int(os.environ.get("PYSERVE_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

MODEL = """
    backend: "identity"
    max_batch_size: 4
    input [ { name: "A" data_type: TYPE_INT32 dims: [ 2 ] }, { name: "B" data_type: TYPE_FP32 dims: [ -1 ] },
            { name: "S" data_type: TYPE_STRING dims: [ 1 ] optional: true } ]
    output [ { name: "OA" data_type: TYPE_INT32 dims: [ 2 ] }, { name: "OB" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repo: Path = tmp_path_factory.mktemp("fuzz")
    write_model(repo, "m", MODEL)
    write_model(repo, "echo", """
        backend: "identity"
        max_batch_size: 0
        input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
    """)
    with serve(repo) as thread:
        yield thread


JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
TENSOR = st.fixed_dictionaries(
    {"name": st.sampled_from(["A", "B", "S", "X", ""]),
     "datatype": st.sampled_from(["INT32", "FP32", "BYTES", "BOOL", "FP16", "X"]),
     "shape": st.lists(st.integers(-2, 10**13), max_size=4) | JSON_VALUE},
    optional={"data": JSON_VALUE, "parameters": st.dictionaries(
        st.sampled_from(["binary_data_size", "shared_memory_region", "classification", "binary_data"]),
        JSON_VALUE, max_size=2)},
)
BODY = st.fixed_dictionaries({"inputs": st.lists(TENSOR, max_size=4)},
                             optional={"outputs": JSON_VALUE, "id": JSON_VALUE, "parameters": JSON_VALUE})


@seed(31)
@FUZZ
@given(body=BODY, binary=st.binary(max_size=64), split=st.one_of(st.none(), st.integers(-5, 400)))
def test_http_json_and_binary_decoding_answers_or_refuses(server: ServerThread, body: dict, binary: bytes,
                                                          split: int | None) -> None:
    model = server.server.models.get("m")
    header = orjson.dumps(body)
    data = header + binary if split is not None else header
    length = None if split is None else min(max(split, 0), len(data))
    with contextlib.suppress(InferError):
        http_codec.decode_infer(bytearray(data), length, model)


@seed(31)
@FUZZ
@given(st.binary(max_size=300))
def test_http_raw_bytes_decode_or_refuse(server: ServerThread, data: bytes) -> None:
    model = server.server.models.get("m")
    for length in (None, 0, len(data) // 2):
        with contextlib.suppress(InferError):
            http_codec.decode_infer(bytearray(data), length, model)


GRPC_TENSOR = st.builds(
    lambda name, datatype, shape, contents: (name, datatype, shape, contents),
    st.sampled_from(["A", "B", "S", "X"]), st.sampled_from(["INT32", "FP32", "BYTES", "BOOL", "X"]),
    st.lists(st.integers(-2, 2**40), max_size=4), st.binary(max_size=40),
)


@seed(31)
@FUZZ
@given(tensors=st.lists(GRPC_TENSOR, max_size=4), raw_count=st.integers(0, 5), mutation=st.binary(max_size=8),
       cut=st.integers(0, 200))
def test_grpc_message_decoding_answers_or_refuses(server: ServerThread, tensors: list, raw_count: int,
                                                  mutation: bytes, cut: int) -> None:
    model = server.server.models.get("m")
    request = pb.ModelInferRequest(model_name="m")
    for name, datatype, shape, contents in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        if len(request.raw_input_contents) < raw_count:
            request.raw_input_contents.append(contents)
    wire = request.SerializeToString()
    for data in (wire, wire[:cut] + mutation + wire[cut:]):
        try:
            message = grpc_codec.parse_infer_request(data)
        except DecodeError:
            continue
        with contextlib.suppress(InferError):
            grpc_codec.decode_infer(message, model)


FRAME = st.builds(
    lambda kind, flags, stream_id, payload: h2.frame(kind, flags, stream_id, payload),
    st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 255]),
    st.sampled_from([0, 1, 4, 5, 8, 0x20, 0x25, 0x2D, 255]),
    st.sampled_from([0, 1, 3, 5, 2**31 - 1]) | st.integers(0, 2**31 - 1),
    st.binary(max_size=40) | st.just(hpack.Encoder().encode([(":method", "POST"), (":path", INFER_PATH),
                                                              ("content-type", "application/grpc")])),
)


@seed(31)
@FUZZ
@given(frames=st.lists(FRAME, min_size=1, max_size=12), step=st.integers(1, 64))
def test_http2_frames_never_disturb_the_server(server: ServerThread, caplog: pytest.LogCaptureFixture,
                                               frames: list[bytes], step: int) -> None:
    caplog.set_level("ERROR")
    data = h2.PREFACE + b"".join(frames)
    with socket.create_connection(("127.0.0.1", server.server.grpc_port), timeout=5) as sock:
        for position in range(0, len(data), step):
            with contextlib.suppress(OSError):
                sock.sendall(data[position:position + step])
        sock.settimeout(0.01)
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text


def test_a_normal_call_is_served_after_the_fuzzing(server: ServerThread) -> None:
    from test_grpc_http2 import RawClient, response_tensor, status

    client = RawClient(server.server.grpc_port)
    try:
        client.call(1, infer_message("echo", np.array([3, 4], np.float32)))
        _, body, trailers = client.reply(1)
        assert status(trailers) == (0, "") and response_tensor(body).tolist() == [3, 4]
    finally:
        client.close()
