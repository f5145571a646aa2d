"""A TorchScript module that fills one buffer in ``forward`` and returns it must not change
answers still being encoded or sent by its next forward: the server sends CPU results as
copies (as Triton copies every result into the response), except a result over a large input
of the same batch, which is sent as it lies."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pt_models
import pyserve_backend_pytorch
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from pyserve_backend_pytorch.runtime import COPIED_UP_TO

from pyserve.testing import ServerFactory, write_model

BACKENDS = {"pytorch": pyserve_backend_pytorch}
LARGE = 2 * COPIED_UP_TO  # FP32 elements: 8x the size copied without looking

CONFIG = """
platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ -1 ] } ]
parameters { key: "probe_run" value { string_value: "false" } }
"""


class FillsItsBuffer(torch.nn.Module):
    """Copies the input into a buffer it keeps (resized when the shape changes) and returns it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("kept", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kept.shape != x.shape:
            self.kept = torch.zeros_like(x)
        self.kept.copy_(x)
        return self.kept


class Echo(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _served(tmp_path: Path, factory: ServerFactory, module: torch.nn.Module) -> Any:
    pt_models.save_scripted(module, tmp_path / "model.pt")
    write_model(tmp_path / "repo", "m", CONFIG, {"1/model.pt": (tmp_path / "model.pt").read_bytes()})
    return factory(tmp_path / "repo", backends=BACKENDS, use_entry_points=False)


def _wrong_answers(client_module: Any, url: str, size: int, threads: int = 4, each: int = 25) -> list[str]:
    wrong: list[str] = []

    def run(number: int) -> None:
        client = client_module.InferenceServerClient(url)
        try:
            for index in range(each):
                value = float(number * 1000 + index)
                item = client_module.InferInput("INPUT__0", [size], "FP32")
                item.set_data_from_numpy(np.full(size, value, dtype=np.float32))
                answer = client.infer("m", [item]).as_numpy("OUTPUT__0")
                if answer.shape != (size,) or not (answer == value).all():
                    wrong.append(f"thread {number} request {index}: sent {value}, got {answer[:3]}...")
        finally:
            client.close()

    workers = [threading.Thread(target=run, args=(number,)) for number in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    assert not any(worker.is_alive() for worker in workers)
    return wrong


@pytest.mark.parametrize("size", [16, LARGE])
def test_a_module_returning_the_buffer_it_refills_answers_each_client_its_own_values(
    tmp_path: Path, pyserve_server_factory: ServerFactory, size: int
) -> None:
    server = _served(tmp_path, pyserve_server_factory, FillsItsBuffer().eval())
    assert _wrong_answers(httpclient, server.url, size) == []
    assert _wrong_answers(grpcclient, server.grpc_url, size) == []


def test_a_result_is_sent_as_a_copy_unless_it_lies_over_a_large_input_of_the_batch(
    tmp_path: Path, pyserve_server_factory: ServerFactory
) -> None:
    from pyserve_backend_pytorch.runtime import TorchInstance

    seen: list[tuple[int, bool]] = []
    original = TorchInstance.to_host

    def recording(self: TorchInstance, value: Any) -> np.ndarray:
        array = original(self, value)
        seen.append((array.nbytes, bool(np.shares_memory(array, value.numpy()))))
        return array

    TorchInstance.to_host = recording  # type: ignore[method-assign]
    try:
        server = _served(tmp_path, pyserve_server_factory, Echo().eval())
        for size in (16, LARGE):
            assert _wrong_answers(grpcclient, server.grpc_url, size, threads=1, each=1) == []
    finally:
        TorchInstance.to_host = original  # type: ignore[method-assign]
    assert seen == [(64, False), (LARGE * 4, True)]  # a small echo is copied, a large one is not
