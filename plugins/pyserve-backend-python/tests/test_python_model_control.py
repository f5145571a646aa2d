"""``pb_utils.load_model`` / ``unload_model`` / ``is_model_ready`` from a model's ``execute``,
on a real server in explicit model-control mode, driven with tritonclient."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from python_backend_helpers import ADD_100_CONFIG, ADD_100_SOURCE, PROCESS_MODE, start, write_python_model
from tritonclient.utils import InferenceServerException

CONTROL_SOURCE = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            action = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            target = request.parameters() and json.loads(request.parameters()).get("target", "target") or "target"
            if action == 0:
                value = int(pb_utils.is_model_ready(target))
            elif action == 1:
                pb_utils.load_model(target)
                value = int(pb_utils.is_model_ready(target, "1"))
            elif action == 2:
                pb_utils.unload_model(target)
                value = int(pb_utils.is_model_ready(target))
            else:
                config = json.loads(json.loads(request.parameters())["config"])
                pb_utils.load_model(target, config=json.dumps(config))
                value = int(pb_utils.is_model_ready(target))
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], dtype=np.int32))]))
        return out
"""


def _call(client: httpclient.InferenceServerClient, action: int, **parameters: str) -> int:
    tensor = httpclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([action], dtype=np.int32))
    return int(client.infer("control", [tensor], parameters=parameters or None).as_numpy("OUT")[0])


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_model_loads_and_unloads_another(tmp_path: Path, mode: str) -> None:
    repo = tmp_path / "repo"
    config = ADD_100_CONFIG + f'parameters {{ key: "execution_mode" value {{ string_value: "{mode}" }} }}\n'
    write_python_model(repo, "control", config, CONTROL_SOURCE)
    write_python_model(repo, "target", ADD_100_CONFIG, ADD_100_SOURCE)
    server = start(repo, model_control_mode="explicit", load_models=["control"])
    try:
        with httpclient.InferenceServerClient(server.url) as client:
            assert not client.is_model_ready("target")
            assert _call(client, 0) == 0
            assert _call(client, 1) == 1  # load_model, then is_model_ready(target, "1")
            assert client.is_model_ready("target")
            tensor = httpclient.InferInput("IN", [1], "INT32")
            tensor.set_data_from_numpy(np.array([5], dtype=np.int32))
            assert int(client.infer("target", [tensor]).as_numpy("OUT")[0]) == 105
            config = client.get_model_config("target")
            config["parameters"] = {"marker": {"string_value": "reloaded"}}
            assert _call(client, 3, config=json.dumps(config)) == 1  # reload with a config override
            assert client.get_model_config("target")["parameters"]["marker"]["string_value"] == "reloaded"
            assert _call(client, 2) == 0  # unload_model
            assert not client.is_model_ready("target")
            with pytest.raises(InferenceServerException, match="failed to load 'missing'"):
                _call(client, 1, target="missing")
    finally:
        server.stop()


def test_loading_needs_explicit_mode(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_python_model(repo, "control", ADD_100_CONFIG, CONTROL_SOURCE)
    write_python_model(repo, "target", ADD_100_CONFIG, ADD_100_SOURCE)
    server = start(repo)  # model control mode "none"
    try:
        with httpclient.InferenceServerClient(server.url) as client:
            assert _call(client, 0) == 1  # is_model_ready works in every mode
            with pytest.raises(InferenceServerException, match="explicit"):
                _call(client, 2)
    finally:
        server.stop()


def test_process_mode_reports_refusals_as_the_models_exception(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    process = ADD_100_CONFIG + PROCESS_MODE
    write_python_model(repo, "control", process, CONTROL_SOURCE)
    write_python_model(repo, "target", ADD_100_CONFIG, ADD_100_SOURCE)
    server = start(repo)  # model control mode "none": loading is refused, readiness answered
    try:
        with httpclient.InferenceServerClient(server.url) as client:
            assert _call(client, 0) == 1
            with pytest.raises(InferenceServerException, match="explicit"):
                _call(client, 2)
            assert _call(client, 0) == 1  # the worker goes on serving
    finally:
        server.stop()
