"""The input-count errors in Triton 2.51's words (its L0_input_validation script matches them
exactly), over HTTP and gRPC: the plain form for a model without optional inputs, the
"between N and M" form for one with some."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from pyserve.server.core import ServerThread


def _config(optional: bool) -> str:
    inputs = ", ".join(
        f'{{ name: "INPUT{i}" data_type: TYPE_FP32 dims: [ 1 ] {"optional: true" if optional and i == 3 else ""} }}'
        for i in range(4 if optional else 3)
    )
    return f"""
        backend: "identity"
        max_batch_size: 0
        input [ {inputs} ]
        output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
    """


@pytest.fixture
def server(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> ServerThread:
    return start_server(make_repo({"all_required": _config(False), "with_optional": _config(True)}))


def _errors(server: ServerThread, model: str, names: list[str], datatype: str = "FP32") -> list[str]:
    messages = []
    for module, url in ((httpclient, server.url), (grpcclient, server.grpc_url)):
        inputs = []
        for name in names:
            tensor = module.InferInput(name, [1], datatype)
            tensor.set_data_from_numpy(np.ones(1, dtype=np.float32 if datatype == "FP32" else np.float64))
            inputs.append(tensor)
        with module.InferenceServerClient(url) as client, pytest.raises(InferenceServerException) as caught:
            client.infer(model, inputs)
        assert caught.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        messages.append(caught.value.message())
    return messages


def test_the_plain_form(server: ServerThread) -> None:
    expected = ("expected 3 inputs but got 1 inputs for model 'all_required'. Got input(s) ['INPUT0'], but missing "
                "required input(s) ['INPUT1','INPUT2']. Please provide all required input(s).")
    assert _errors(server, "all_required", ["INPUT0"]) == [expected, expected]
    none = ("expected 3 inputs but got 0 inputs for model 'all_required'. Got input(s) [], but missing "
            "required input(s) ['INPUT0','INPUT1','INPUT2']. Please provide all required input(s).")
    assert _errors(server, "all_required", []) == [none, none]


def test_the_form_with_optional_inputs(server: ServerThread) -> None:
    expected = ("expected number of inputs between 3 and 4 but got 2 inputs for model 'with_optional'. Got input(s) "
                "['INPUT0','INPUT3'], but missing required input(s) ['INPUT1','INPUT2']. Please provide all "
                "required input(s).")
    assert _errors(server, "with_optional", ["INPUT3", "INPUT0"]) == [expected, expected]


def test_the_count_is_checked_before_the_datatypes(server: ServerThread) -> None:
    """As Triton (its bls QA model sends add_sub one FP64 input of two FP32 ones): the missing
    input is reported, not the datatype."""
    expected = ("expected 3 inputs but got 1 inputs for model 'all_required'. Got input(s) ['INPUT0'], but missing "
                "required input(s) ['INPUT1','INPUT2']. Please provide all required input(s).")
    assert _errors(server, "all_required", ["INPUT0"], "FP64") == [expected, expected]
