"""The HTTP/REST frontend driven by the official asyncio client, ``tritonclient.http.aio``.

The core paths (health, metadata, config, index, JSON and binary inference, parameters,
classification, compression, errors) plus 50 concurrent requests with distinct data, each
of which must get its own answer. Each test runs its coroutine with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import tritonclient.http.aio as aioclient
from suite_support import write_model
from tritonclient.utils import InferenceServerException

from pyserve import (
    Backend,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from pyserve.host.plugins import PluginHost
from pyserve.server.core import Server, ServerOptions, ServerThread


class ParamsBackend(Backend):
    """Returns the request parameters as response parameters and as a JSON BYTES output."""

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        return [
            InferResponse(
                {"PARAMS": np.array([json.dumps(r.parameters, sort_keys=True).encode()], dtype=object)},
                dict(r.parameters),
            )
            for r in requests
        ]


MODELS = {
    "id_fp32": """
        name: "id_fp32"
        backend: "identity"
        max_batch_size: 8
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
        dynamic_batching { }
        instance_group [ { count: 2 kind: KIND_CPU } ]
    """,
    "pair": """
        name: "pair"
        backend: "identity"
        max_batch_size: 0
        input [ { name: "I0" data_type: TYPE_INT64 dims: [ -1 ] },
                { name: "I1" data_type: TYPE_STRING dims: [ -1 ] } ]
        output [ { name: "O0" data_type: TYPE_INT64 dims: [ -1 ] },
                 { name: "O1" data_type: TYPE_STRING dims: [ -1 ] } ]
    """,
    "cls": """
        name: "cls"
        backend: "identity"
        max_batch_size: 2
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 3 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 3 ] label_filename: "labels.txt" } ]
    """,
    "params": """
        name: "params"
        backend: "params"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "PARAMS" data_type: TYPE_STRING dims: [ 1 ] } ]
    """,
}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    repo = tmp_path_factory.mktemp("http_aio")
    for name, config in MODELS.items():
        write_model(repo, name, config)
    (repo / "cls" / "labels.txt").write_text("red\ngreen\nblue\n")
    host = PluginHost(extra_backends={"params": ParamsBackend()})
    thread = ServerThread(
        Server(ServerOptions(model_repositories=[repo], host="127.0.0.1", http_port=0, grpc_port=0), host)
    )
    thread.start()
    yield thread.url
    thread.stop()


def run(url: str, body: Any) -> Any:
    """Run ``body(client)`` on a fresh aio client inside ``asyncio.run``."""

    async def main() -> Any:
        async with aioclient.InferenceServerClient(url, conn_limit=64) as client:
            return await body(client)

    return asyncio.run(main())


def make_input(name: str, array: np.ndarray, datatype: str, binary: bool = True) -> aioclient.InferInput:
    tensor = aioclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def test_health_metadata_config_index(url: str) -> None:
    async def body(client: aioclient.InferenceServerClient) -> None:
        assert await client.is_server_live()
        assert await client.is_server_ready()
        assert await client.is_model_ready("pair")
        assert not await client.is_model_ready("nope")
        assert not await client.is_model_ready("pair", "2")
        metadata = await client.get_server_metadata()
        assert metadata["name"] == "pyserve"
        assert "binary_tensor_data" in metadata["extensions"]
        assert await client.get_model_metadata("id_fp32") == {
            "name": "id_fp32",
            "versions": ["1"],
            "platform": "identity",
            "inputs": [{"name": "IN", "datatype": "FP32", "shape": [-1, -1]}],
            "outputs": [{"name": "OUT", "datatype": "FP32", "shape": [-1, -1]}],
        }
        config = await client.get_model_config("pair", "1")
        assert config["input"][1]["data_type"] == "TYPE_STRING"
        assert config["max_batch_size"] == 0
        assert (await client.get_model_config("id_fp32"))["instance_group"][0]["count"] == 2
        index = await client.get_model_repository_index()
        assert index == [{"name": n, "version": "1", "state": "READY"} for n in sorted(MODELS)]

    run(url, body)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_two_inputs(url: str, binary: bool) -> None:
    ints = np.array([-(2**62), 0, 2**62], dtype=np.int64)
    strings = np.array([b"alpha", b"", "\u00fcber".encode()], dtype=object)

    async def body(client: aioclient.InferenceServerClient) -> None:
        result = await client.infer(
            "pair",
            [make_input("I0", ints, "INT64", binary), make_input("I1", strings, "BYTES", binary)],
            outputs=[aioclient.InferRequestedOutput(n, binary_data=binary) for n in ("O0", "O1")],
            request_id="aio-1",
        )
        response = result.get_response()
        assert response["id"] == "aio-1"
        assert response["model_name"] == "pair" and response["model_version"] == "1"
        np.testing.assert_array_equal(result.as_numpy("O0"), ints)
        got = result.as_numpy("O1").tolist()
        assert got == (strings.tolist() if binary else [s.decode() for s in strings])

    run(url, body)


def test_parameters_round_trip(url: str) -> None:
    params = {"alpha": 1.25, "beta": "b", "gamma": False, "delta": 7}

    async def body(client: aioclient.InferenceServerClient) -> None:
        result = await client.infer(
            "params", [make_input("IN", np.array([1], dtype=np.int32), "INT32")], parameters=params
        )
        assert result.get_response()["parameters"] == params
        assert json.loads(result.as_numpy("PARAMS")[0]) == params

    run(url, body)


def test_classification(url: str) -> None:
    data = np.array([[0.2, 0.7, 0.1], [3.0, 1.0, 2.0]], dtype=np.float32)

    async def body(client: aioclient.InferenceServerClient) -> None:
        result = await client.infer(
            "cls",
            [make_input("IN", data, "FP32")],
            outputs=[aioclient.InferRequestedOutput("OUT", class_count=2)],
        )
        assert result.as_numpy("OUT").tolist() == [
            [b"0.700000:1:green", b"0.200000:0:red"],
            [b"3.000000:0:red", b"2.000000:2:blue"],
        ]

    run(url, body)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compression(url: str, algorithm: str) -> None:
    data = np.arange(1000, dtype=np.float32).reshape(2, 500)

    async def body(client: aioclient.InferenceServerClient) -> None:
        result = await client.infer(
            "id_fp32",
            [make_input("IN", data, "FP32")],
            request_compression_algorithm=algorithm,
            response_compression_algorithm=algorithm,
        )
        np.testing.assert_array_equal(result.as_numpy("OUT"), data)

    run(url, body)


def test_errors(url: str) -> None:
    async def body(client: aioclient.InferenceServerClient) -> None:
        data = np.array([[1.0]], dtype=np.float32)
        with pytest.raises(InferenceServerException) as info:
            await client.infer("nope", [make_input("IN", data, "FP32")])
        assert info.value.status() == "404"
        assert "Request for unknown model: 'nope' is not found" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            await client.infer("id_fp32", [make_input("IN", data.astype(np.float64), "FP64")])
        assert info.value.status() == "400"
        assert "data-type is 'FP64', but model 'id_fp32' expects 'FP32'" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            await client.get_model_metadata("id_fp32", "3")
        assert "'id_fp32' version 3 is not found" in info.value.message()
        # the client still works afterwards
        result = await client.infer("id_fp32", [make_input("IN", data, "FP32")])
        np.testing.assert_array_equal(result.as_numpy("OUT"), data)

    run(url, body)


def test_fifty_concurrent_requests(url: str) -> None:
    """50 requests in flight at once, each with its own data, id and form; each answer is its own."""
    count = 50

    def data(i: int) -> np.ndarray:
        return (np.arange(i % 7 + 1, dtype=np.float32) + 1000 * i).reshape(1, -1)

    async def one(client: aioclient.InferenceServerClient, i: int) -> tuple[int, Any]:
        binary = i % 2 == 0
        result = await client.infer(
            "id_fp32",
            [make_input("IN", data(i), "FP32", binary)],
            outputs=[aioclient.InferRequestedOutput("OUT", binary_data=i % 3 != 0)],
            request_id=f"req-{i}",
        )
        return i, result

    async def body(client: aioclient.InferenceServerClient) -> None:
        results = await asyncio.gather(*(one(client, i) for i in range(count)))
        assert len(results) == count
        for i, result in results:
            assert result.get_response()["id"] == f"req-{i}"
            out = result.as_numpy("OUT")
            assert out.dtype == np.float32
            np.testing.assert_array_equal(out, data(i))

    run(url, body)


def test_concurrent_mixed_good_and_bad(url: str) -> None:
    """Bad requests in the same burst fail alone; the good ones are answered correctly."""

    async def one(client: aioclient.InferenceServerClient, i: int) -> tuple[int, Any]:
        values = np.full((1, 3), i, dtype=np.float32)
        datatype = "FP32"
        if i % 5 == 0:
            values = values.astype(np.float64)
            datatype = "FP64"
        try:
            return i, (await client.infer("id_fp32", [make_input("IN", values, datatype)])).as_numpy("OUT")
        except InferenceServerException as exc:
            return i, exc

    async def body(client: aioclient.InferenceServerClient) -> None:
        for i, outcome in await asyncio.gather(*(one(client, i) for i in range(30))):
            if i % 5 == 0:
                assert isinstance(outcome, InferenceServerException)
                assert outcome.status() == "400"
            else:
                np.testing.assert_array_equal(outcome, np.full((1, 3), i, dtype=np.float32))

    run(url, body)
