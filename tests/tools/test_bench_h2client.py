"""``pyserve bench``'s lean gRPC client against both of pyserve's gRPC servers (grpc.aio's core
has a 64 KB initial window, so large requests exercise the client's flow control)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from suite_support import FP32_ECHO_CONFIG, write_model

from pyserve import protocol as pb
from pyserve.frontends.grpc.server import GRPC_SERVERS, GrpcOptions
from pyserve.server.core import ServerThread
from pyserve.testing import serve
from pyserve.tools.bench.h2client import CallFailed, LeanChannel

INFER = "/inference.GRPCInferenceService/ModelInfer"
ECHO = FP32_ECHO_CONFIG


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repo = tmp_path_factory.mktemp("h2client")
    write_model(repo, "echo", ECHO)
    with serve(repo, grpc=GrpcOptions(implementation=request.param)) as thread:
        yield thread


def message(model: str, size: int) -> bytes:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[size])
    request.raw_input_contents.append(np.ones(size, np.float32).tobytes())
    return request.SerializeToString()


def test_calls_small_and_large_and_concurrent(server: ServerThread) -> None:
    async def run() -> None:
        channel = LeanChannel("127.0.0.1", server.server.grpc_port)
        try:
            await channel.unary(INFER, message("echo", 4))
            await channel.unary(INFER, message("echo", 1_000_000))  # 4 MB: past every initial window
            await asyncio.gather(*(channel.unary(INFER, message("echo", 1000 + i)) for i in range(64)))
        finally:
            channel.close()

    asyncio.run(run())


def test_failed_calls_carry_the_status(server: ServerThread) -> None:
    async def run() -> CallFailed:
        channel = LeanChannel("127.0.0.1", server.server.grpc_port)
        try:
            with pytest.raises(CallFailed) as error:
                await channel.unary(INFER, message("no_such_model", 4))
            await channel.unary(INFER, message("echo", 4))  # the connection is still good
            return error.value
        finally:
            channel.close()

    failure = asyncio.run(run())
    assert failure.code == "NOT_FOUND" and "no_such_model" in failure.details


def test_unreachable_server_is_unavailable(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, not listening: connections are refused

        async def run() -> None:
            await LeanChannel("127.0.0.1", port).unary(INFER, b"")

        with pytest.raises(CallFailed) as error:
            asyncio.run(run())
    assert error.value.code == "UNAVAILABLE"
