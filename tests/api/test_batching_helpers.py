"""``pyserve.api.batching``: ``gather_inputs`` / ``split_outputs``, alone and under the dynamic batcher.

The unit tests build ``InferRequest`` objects directly; the last test serves a backend that
uses both helpers behind a real server and checks, with concurrent clients, that every client
gets exactly its own rows back.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient

from pyserve import (
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from pyserve.api.backend import Backend
from pyserve.api.batching import gather_inputs, split_outputs
from pyserve.server.core import ServerThread

StartServer = Callable[..., ServerThread]
MakeRepo = Callable[..., Path]


def request(batch: int = 1, **inputs: np.ndarray) -> InferRequest:
    return InferRequest("m", 1, dict(inputs), ("OUT",), batch_size=batch)


# -- gather_inputs ------------------------------------------------------------------------------
def test_gather_one_request_returns_the_same_array() -> None:
    array = np.arange(6, dtype=np.float32).reshape(3, 2)
    gathered = gather_inputs([request(3, IN=array)])
    assert gathered["IN"] is array


def test_gather_joins_separate_arrays_in_request_order() -> None:
    a = np.array([[1, 2]], dtype=np.int32)
    b = np.array([[3, 4], [5, 6]], dtype=np.int32)
    c = np.array([[7, 8]], dtype=np.int32)
    gathered = gather_inputs([request(1, IN=a), request(2, IN=b), request(1, IN=c)])
    np.testing.assert_array_equal(gathered["IN"], [[1, 2], [3, 4], [5, 6], [7, 8]])
    assert not np.shares_memory(gathered["IN"], a)


def test_gather_back_to_back_views_of_one_buffer_is_a_view() -> None:
    buffer = np.arange(12, dtype=np.float32).reshape(6, 2)
    parts = [buffer[0:2], buffer[2:5], buffer[5:6]]
    gathered = gather_inputs([request(len(p), IN=p) for p in parts])["IN"]
    assert gathered.shape == (6, 2)
    assert np.shares_memory(gathered, buffer)
    np.testing.assert_array_equal(gathered, buffer)


def test_gather_views_out_of_order_are_copied() -> None:
    buffer = np.arange(12, dtype=np.float32).reshape(6, 2)
    parts = [buffer[3:6], buffer[0:3]]
    gathered = gather_inputs([request(3, IN=p) for p in parts])["IN"]
    np.testing.assert_array_equal(gathered, np.concatenate(parts))
    assert not np.shares_memory(gathered, buffer)


def test_gather_only_named_inputs() -> None:
    a = np.zeros((1, 2), np.float32)
    gathered = gather_inputs([request(1, IN=a, OTHER=a)], names=["IN"])
    assert list(gathered) == ["IN"]


def test_gather_shape_mismatch_raises() -> None:
    a = np.zeros((1, 2), np.float32)
    b = np.zeros((1, 3), np.float32)
    with pytest.raises(InferError, match="'IN'"):
        gather_inputs([request(1, IN=a), request(1, IN=b)])


def test_gather_missing_input_raises() -> None:
    a = np.zeros((1, 2), np.float32)
    with pytest.raises(InferError, match="'IN'"):
        gather_inputs([request(1, IN=a), request(1, OTHER=a)])


def test_gather_nothing() -> None:
    assert gather_inputs([]) == {}


# -- split_outputs --------------------------------------------------------------------------------
def test_split_outputs_gives_views_sized_by_batch_size() -> None:
    requests = [request(2), request(1), request(3)]
    out = np.arange(12, dtype=np.float32).reshape(6, 2)
    responses = split_outputs(requests, {"OUT": out}, {"k": 1})
    assert [r.outputs["OUT"].shape for r in responses] == [(2, 2), (1, 2), (3, 2)]
    for response in responses:
        assert np.shares_memory(response.outputs["OUT"], out)
        assert response.parameters == {"k": 1}
    np.testing.assert_array_equal(responses[1].outputs["OUT"], [[4, 5]])
    np.testing.assert_array_equal(np.concatenate([r.outputs["OUT"] for r in responses]), out)


def test_split_outputs_wrong_leading_dimension_raises() -> None:
    with pytest.raises(InferError, match="'OUT'"):
        split_outputs([request(2), request(1)], {"OUT": np.zeros((4, 2), np.float32)})
    with pytest.raises(InferError, match="'OUT'"):
        split_outputs([request(1)], {"OUT": np.float32(1.0)})


# -- under the dynamic batcher ----------------------------------------------------------------------
class AffineBackend(Backend):
    """``OUT = 2 * IN + 1`` computed once over the gathered batch, then split back."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batches: list[list[int]] = []

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        with self.lock:
            self.batches.append([r.batch_size for r in requests])
        batch = gather_inputs(requests)
        return split_outputs(requests, {"OUT": batch["IN"] * 2 + 1})


AFFINE = """
backend: "affine"
max_batch_size: 16
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 3 ] } ]
dynamic_batching { max_queue_delay_microseconds: 300000 }
"""


def test_helpers_under_the_dynamic_batcher_give_each_client_its_rows(
    start_server: StartServer, make_repo: MakeRepo
) -> None:
    backend = AffineBackend()
    server = start_server(make_repo({"affine": AFFINE}), backends={"affine": backend})
    sizes = [1, 3, 2, 1, 2]

    async def one(client: aioclient.InferenceServerClient, k: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        data = (np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + 100 * k)
        inp = httpclient.InferInput("IN", [rows, 3], "FP32")
        inp.set_data_from_numpy(data)
        result = await client.infer("affine", [inp])
        return data, result.as_numpy("OUT")

    async def main() -> list[tuple[np.ndarray, np.ndarray]]:
        client = aioclient.InferenceServerClient(server.url)
        try:
            return await asyncio.gather(*(one(client, k, n) for k, n in enumerate(sizes)))
        finally:
            await client.close()

    for sent, got in asyncio.run(main()):
        np.testing.assert_array_equal(got, sent * 2 + 1)
    assert sum(sum(b) for b in backend.batches) == sum(sizes)
    assert max(len(b) for b in backend.batches) > 1, backend.batches
