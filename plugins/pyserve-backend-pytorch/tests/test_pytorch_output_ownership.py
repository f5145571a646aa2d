"""A TorchScript module that fills one buffer in ``forward`` and returns it must not change
answers still being encoded or sent by its next forward: the server sends CPU results as
copies (as Triton copies every result into the response), except a result over a large input
of the same batch, which is sent as it lies."""

from __future__ import annotations

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

from pyserve.testing import ServerFactory, write_model, wrong_echo_answers

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


@pytest.mark.parametrize("size", [16, LARGE])
def test_a_module_returning_the_buffer_it_refills_answers_each_client_its_own_values(
    tmp_path: Path, pyserve_server_factory: ServerFactory, size: int
) -> None:
    server = _served(tmp_path, pyserve_server_factory, FillsItsBuffer().eval())
    names = ("INPUT__0", "OUTPUT__0")
    assert wrong_echo_answers(httpclient, server.url, "m", size, names) == []
    assert wrong_echo_answers(grpcclient, server.grpc_url, "m", size, names) == []


def test_a_result_is_sent_as_a_copy_unless_it_lies_over_a_large_input_of_the_batch() -> None:
    from pyserve_backend_pytorch.runtime import TorchInstance

    instance = TorchInstance.__new__(TorchInstance)  # the hand-off alone: run over an echoing forward
    instance.torch = torch
    instance.string_outputs = ()
    instance.forward = lambda inputs: {name: torch.from_dlpack(array) for name, array in inputs.items()}  # type: ignore[method-assign]
    large, small = np.ones(LARGE, np.float32), np.ones(16, np.float32)
    results = instance.run({"LARGE": large, "SMALL": small}, ["LARGE", "SMALL"])
    assert np.shares_memory(instance.to_host(results["LARGE"]), large)  # an echo of a large input
    assert not np.shares_memory(instance.to_host(results["SMALL"]), small)
    kept = torch.zeros(LARGE)  # module state, say
    assert not np.shares_memory(instance.to_host(kept), kept.numpy())
    assert np.shares_memory(instance.to_host(results["LARGE"][1:]), large)  # a view of it: still the input
