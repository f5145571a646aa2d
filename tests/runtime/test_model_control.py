"""Model control: ``--model-control-mode`` none / explicit / poll and the repository API.

Real servers, driven with tritonclient (HTTP and gRPC ``load_model`` / ``unload_model`` /
``get_model_repository_index``) and raw HTTP where the client cannot express a request.
"""

from __future__ import annotations

import base64
import json
import shutil
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc as grpcio
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from suite_support import wait_for, write_model
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

import pyserve
from pyserve import (
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelContext,
)
from pyserve.server.core import ServerThread

StartServer = Callable[..., ServerThread]


def scale_config(factor: float = 2.0, extra: str = "") -> str:
    return textwrap.dedent(f"""
        backend: "scale"
        max_batch_size: 0
        input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 2 ] }} ]
        output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] }} ]
        parameters {{ key: "factor" value: {{ string_value: "{factor}" }} }}
    """) + textwrap.dedent(extra)


ENSEMBLE = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
ensemble_scheduling { step [ {
  model_name: "base" model_version: -1
  input_map { key: "IN" value: "X" }
  output_map { key: "OUT" value: "Y" }
} ] }
"""


class Scale(pyserve.Backend):
    """OUT = IN * factor; the factor comes from ``<version>/factor.txt`` if present, else from
    the ``factor`` parameter. Records model creation and finalization."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.created: list[tuple[str, int, Path]] = []
        self.finalized: list[tuple[str, int]] = []

    def create_model(self, model: ModelContext) -> float:
        if model.parameters.get("fail_create"):
            raise RuntimeError("this model refuses to load")
        with self.lock:
            self.created.append((model.name, model.version, model.path))
        factor_file = model.version_path / "factor.txt"
        if factor_file.is_file():
            return float(factor_file.read_text())
        return float(model.parameters.get("factor", "1"))

    def finalize_model(self, model: ModelContext) -> None:
        with self.lock:
            self.finalized.append((model.name, model.version))

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        delay = float(instance.model.parameters.get("delay", "0"))
        if delay:
            time.sleep(delay)
        return [InferResponse({"OUT": r.inputs["IN"] * np.float32(instance.model.state)}) for r in requests]


@pytest.fixture
def scale() -> Scale:
    return Scale()


def http(server: ServerThread) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url)


def grpc(server: ServerThread) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


@pytest.fixture
def clients(request: pytest.FixtureRequest) -> Iterator[list[Any]]:
    """Clients to close at the end of a test."""
    made: list[Any] = []
    yield made
    for client in made:
        client.close()


def index(server: ServerThread) -> dict[str, list[dict[str, Any]]]:
    """The repository index by model name."""
    response = httpx.post(f"http://{server.url}/v2/repository/index")
    assert response.status_code == 200, response.text
    found: dict[str, list[dict[str, Any]]] = {}
    for entry in response.json():
        found.setdefault(entry["name"], []).append(entry)
    return found


def infer_out(server: ServerThread, name: str, data: Sequence[float] = (1.0, 2.0), version: str = "") -> list[float]:
    path = f"/v2/models/{name}" + (f"/versions/{version}" if version else "") + "/infer"
    body = {"inputs": [{"name": "IN", "shape": [2], "datatype": "FP32", "data": list(data)}]}
    response = httpx.post(f"http://{server.url}{path}", json=body, timeout=10)
    assert response.status_code == 200, response.text
    return list(response.json()["outputs"][0]["data"])


# ---------------------------------------------------------------------------
# none mode


def test_none_mode_refuses_load_and_unload(start_server: StartServer, tmp_path: Path, scale: Scale,
                                           clients: list[Any]) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config())
    server = start_server(repo, backends={"scale": scale})
    message = "explicit model load / unload is not allowed if polling is enabled"
    for action in ("load", "unload"):
        response = httpx.post(f"http://{server.url}/v2/repository/models/base/{action}")
        assert response.status_code == 503
        assert response.json() == {"error": message}
    client = grpc(server)
    clients.append(client)
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("base")
    assert caught.value.status() == "StatusCode.UNAVAILABLE"
    assert message in caught.value.message()
    metadata = httpx.get(f"http://{server.url}/v2").json()
    assert {"model_repository", "model_repository(unload_dependents)"} <= set(metadata["extensions"])


# ---------------------------------------------------------------------------
# explicit mode


def test_explicit_mode_without_load_model(start_server: StartServer, tmp_path: Path, scale: Scale,
                                          clients: list[Any]) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config(3))
    write_model(repo, "other", scale_config())
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit")
    assert index(server) == {"base": [{"name": "base"}], "other": [{"name": "other"}]}
    assert scale.created == []
    assert httpx.get(f"http://{server.url}/v2/health/ready").status_code == 200
    hc = http(server)
    clients.append(hc)
    assert not hc.is_model_ready("base")

    hc.load_model("base")
    assert hc.is_model_ready("base")
    assert infer_out(server, "base") == [3.0, 6.0]
    entries = {e["name"]: e for e in hc.get_model_repository_index()}
    assert entries["base"]["state"] == "READY" and entries["base"]["version"] == "1"
    assert entries["other"] == {"name": "other"}

    gc = grpc(server)
    clients.append(gc)
    gc.unload_model("base")
    assert scale.finalized == [("base", 1)]
    grpc_index = gc.get_model_repository_index(as_json=True)["models"]
    base = [e for e in grpc_index if e["name"] == "base"]
    assert base == [{"name": "base", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]
    response = httpx.get(f"http://{server.url}/v2/models/base")
    assert response.status_code == 404
    assert "has no available versions" in response.json()["error"]
    assert httpx.get(f"http://{server.url}/v2/health/ready").status_code == 200

    gc.load_model("base")  # loads again after an unload
    assert infer_out(server, "base") == [3.0, 6.0]
    hc.unload_model("never-loaded-but-harmless")


@pytest.mark.parametrize("load", [["base"], ["*"]], ids=["named", "star"])
def test_explicit_mode_with_load_model(start_server: StartServer, tmp_path: Path, scale: Scale, load: list[str]) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config())
    write_model(repo, "other", scale_config())
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit", load_models=load)
    found = index(server)
    assert found["base"][0]["state"] == "READY"
    if load == ["*"]:
        assert found["other"][0]["state"] == "READY"
    else:
        assert found["other"] == [{"name": "other"}]


def test_a_missing_startup_model_is_logged_not_listed(
    start_server: StartServer, tmp_path: Path, scale: Scale, caplog: pytest.LogCaptureFixture
) -> None:
    """``--load-model`` of a model the repository lacks: as Triton 2.51 (without exit on error),
    an error in the log, no index entry, and the server ready; with --exit-on-error it stops."""
    from pyserve.server.core import StartupError

    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config())
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit",
                          load_models=["nothere", "base"])
    assert sorted(index(server)) == ["base"]
    assert httpx.get(f"http://{server.url}/v2/health/ready").status_code == 200
    assert "failed to load 'nothere', failed to poll from model repository" in caplog.text
    with pytest.raises(StartupError, match="failed to load all models"):
        start_server(repo, backends={"scale": scale}, model_control_mode="explicit",
                     load_models=["nothere", "base"], exit_on_error=True)


def test_load_of_a_missing_model(start_server: StartServer, tmp_path: Path, scale: Scale, clients: list[Any]) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config())
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit")
    response = httpx.post(f"http://{server.url}/v2/repository/models/nothere/load")
    assert response.status_code == 500
    assert response.json() == {"error": "failed to load 'nothere', failed to poll from model repository"}
    gc = grpc(server)
    clients.append(gc)
    with pytest.raises(InferenceServerException) as caught:
        gc.load_model("nothere")
    assert caught.value.status() == "StatusCode.INTERNAL"
    assert "failed to poll from model repository" in caught.value.message()


def test_failed_load_reports_the_reason_and_keeps_the_loaded_version(
    start_server: StartServer, tmp_path: Path, scale: Scale, clients: list[Any]
) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config(2))
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit", load_models=["base"])
    hc = http(server)
    clients.append(hc)
    broken = json.dumps({"backend": "scale", "max_batch_size": 0,
                         "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [2]}],
                         "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [2]}],
                         "parameters": {"fail_create": {"string_value": "yes"}}})
    with pytest.raises(InferenceServerException) as caught:
        hc.load_model("base", config=broken)
    assert caught.value.status() == "400"  # as Triton 2.51 answers a model that fails to load
    assert "load failed for model 'base'" in caught.value.message()
    assert "this model refuses to load" in caught.value.message()
    gc = grpc(server)
    clients.append(gc)
    with pytest.raises(InferenceServerException) as caught:
        gc.load_model("base", config=broken)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert infer_out(server, "base") == [2.0, 4.0]  # the previous version still serves
    with pytest.raises(InferenceServerException) as caught:
        hc.load_model("base", config="{not json")
    assert caught.value.status() == "400"


def test_repository_name_is_not_supported(start_server: StartServer, tmp_path: Path, scale: Scale) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config())
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit")
    for action in ("load", "unload"):
        response = httpx.post(f"http://{server.url}/v2/repository/myrepo/models/base/{action}")
        assert response.status_code == 501
        assert response.json() == {"error": "'repository_name' specification is not supported"}


# ---------------------------------------------------------------------------
# config and file overrides


def test_load_with_config_override(start_server: StartServer, tmp_path: Path, scale: Scale, clients: list[Any]) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config(2))
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit", load_models=["base"])
    assert infer_out(server, "base") == [2.0, 4.0]
    override = {
        "backend": "scale",
        "max_batch_size": 0,
        "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [2]}],
        "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [2]}],
        "parameters": {"factor": {"string_value": "5"}},
    }
    hc = http(server)
    clients.append(hc)
    hc.load_model("base", config=json.dumps(override))
    assert infer_out(server, "base") == [5.0, 10.0]
    assert hc.get_model_config("base")["parameters"]["factor"]["string_value"] == "5"
    assert ("base", 1) in scale.finalized  # the replaced version was finalized

    override["parameters"] = {"factor": {"string_value": "7"}}
    gc = grpc(server)
    clients.append(gc)
    gc.load_model("base", config=json.dumps(override))
    assert infer_out(server, "base") == [7.0, 14.0]

    created = len(scale.created)
    hc.load_model("base")  # without an override, files unchanged: the override stays, as in Triton
    assert infer_out(server, "base") == [7.0, 14.0]
    assert len(scale.created) == created
    write_model(repo, "base", scale_config(3))  # config.pbtxt edited: a plain load reads it
    hc.load_model("base")
    assert infer_out(server, "base") == [3.0, 6.0]


def test_a_plain_load_of_an_unchanged_model_does_not_reload_it(
    start_server: StartServer, tmp_path: Path, scale: Scale, clients: list[Any]
) -> None:
    """As in Triton: ``load`` of a model loaded from files that have not changed since is a
    no-op (its instances are not created again); a changed file, or an earlier load that
    failed, loads it again."""
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config(2))
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit", load_models=["base"])
    hc, gc = http(server), grpc(server)
    clients.extend([hc, gc])
    created = len(scale.created)
    for client in (hc, gc, hc):
        client.load_model("base")
    assert len(scale.created) == created and scale.finalized == []
    assert infer_out(server, "base") == [2.0, 4.0]

    (repo / "base" / "1" / "factor.txt").write_text("4")  # a new file in the version folder
    hc.load_model("base")
    assert len(scale.created) == created + 1
    assert infer_out(server, "base") == [4.0, 8.0]

    write_model(repo, "base", scale_config(2, 'parameters { key: "fail_create" value: { string_value: "1" } }'))
    for _ in range(2):  # a reload that failed is tried again, not taken as done
        with pytest.raises(InferenceServerException, match="this model refuses to load"):
            hc.load_model("base")
    assert infer_out(server, "base") == [4.0, 8.0]  # the loaded version keeps serving
    hc.unload_model("base")
    write_model(repo, "base", scale_config(2))
    (repo / "base" / "1" / "factor.txt").unlink()
    hc.load_model("base")  # unloaded: loaded again
    assert infer_out(server, "base") == [2.0, 4.0]


def test_a_bad_config_override_is_reported_as_the_load_requests(
    start_server: StartServer, tmp_path: Path, scale: Scale
) -> None:
    """Problems in a load request's ``config`` name that parameter, not the model's config.pbtxt
    (which was not read); the served version stays."""
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config(2))
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit", load_models=["base"])
    bad = [
        ({"backend": "scale", "max_batch_size": -3}, "field 'max_batch_size' must be >= 0 (got -3)"),
        ({"backend": "scale", "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [0]}],
          "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [2]}]}, "field 'dims': dimension 0"),
        ({"name": "other", "backend": "scale"}, "field 'name': 'other' does not match the model directory name"),
    ]
    for config, problem in bad:
        response = httpx.post(f"http://{server.url}/v2/repository/models/base/load",
                              json={"parameters": {"config": json.dumps(config)}})
        assert response.status_code == 400
        message = response.json()["error"]
        assert "the load request's 'config' parameter: " in message and problem in message, message
        assert "config.pbtxt" not in message
        if "field 'name'" in problem:  # refused before loading, in the words Triton's QA test looks for
            assert message.startswith("failed to load 'base': "), message
    assert infer_out(server, "base") == [2.0, 4.0]


def test_load_with_file_override(start_server: StartServer, tmp_path: Path, scale: Scale, clients: list[Any]) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config(2))
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit", load_models=["base"])
    config = json.dumps({
        "backend": "scale", "max_batch_size": 0,
        "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [2]}],
        "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [2]}],
    })
    hc = http(server)
    clients.append(hc)
    hc.load_model("base", config=config, files={"file:1/factor.txt": b"4"})
    assert infer_out(server, "base") == [4.0, 8.0]
    override_dir = scale.created[-1][2]
    assert override_dir != repo / "base" and (override_dir / "1" / "factor.txt").read_bytes() == b"4"
    assert not (repo / "base" / "1" / "factor.txt").exists()

    gc = grpc(server)
    clients.append(gc)
    gc.load_model("overridden", config=config.replace('"backend"', '"name": "overridden", "backend"'),
                  files={"file:1/factor.txt": b"6"})  # a model that exists only as an override
    assert infer_out(server, "overridden") == [6.0, 12.0]

    hc.unload_model("base")
    assert not override_dir.exists()  # the private copy goes with the model


def test_a_leading_slash_in_a_file_override_is_the_model_directory(
    start_server: StartServer, tmp_path: Path, scale: Scale, clients: list[Any]
) -> None:
    """As Triton's model_control QA test loads ``file:/1/model.py``: the path is joined to the
    model directory; the same file named both ways is refused."""
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config(2))
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit")
    config = json.dumps({"backend": "scale", "max_batch_size": 0,
                         "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [2]}],
                         "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [2]}]})
    hc = http(server)
    clients.append(hc)
    hc.load_model("base", config=config, files={"file:/1/factor.txt": b"5"})
    assert infer_out(server, "base") == [5.0, 10.0]
    assert (scale.created[-1][2] / "1" / "factor.txt").read_bytes() == b"5"
    with pytest.raises(InferenceServerException) as caught:
        hc.load_model("base", config=config, files={"file:/1/factor.txt": b"5", "file:1/factor.txt": b"6"})
    assert "name the same file" in caught.value.message()


def test_file_override_requires_config(start_server: StartServer, tmp_path: Path, scale: Scale) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config())
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit")
    body = {"parameters": {"file:1/factor.txt": base64.b64encode(b"3").decode()}}
    response = httpx.post(f"http://{server.url}/v2/repository/models/base/load", json=body)
    assert response.status_code == 400
    assert "require the 'config' parameter" in response.json()["error"]


def test_load_parameters_other_than_config_and_files_are_refused_as_triton_refuses_them(
    start_server: StartServer, tmp_path: Path, scale: Scale
) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config())
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit")
    url = f"http://{server.url}/v2/repository/models/base/load"
    for parameters in ({"foo": "1"}, {"config": "{}", "unload_dependents": True}):
        response = httpx.post(url, json={"parameters": parameters})
        assert response.status_code == 400
        unknown = next(k for k in parameters if k != "config")
        assert response.json()["error"] == f"unrecognized load parameter '{unknown}'."
    response = httpx.post(url, json={"parameters": {"config": 5}})
    assert response.status_code == 400
    assert "invalid value type for load parameter 'config', expected string_param." in response.json()["error"]
    with grpcio.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for key, parameter in (("foo", service_pb2.ModelRepositoryParameter(string_param="1")),
                               ("config", service_pb2.ModelRepositoryParameter(bytes_param=b"{}"))):
            with pytest.raises(grpcio.RpcError) as refused:
                stub.RepositoryModelLoad(service_pb2.RepositoryModelLoadRequest(
                    model_name="base", parameters={key: parameter}), timeout=30)
            assert refused.value.code() == grpcio.StatusCode.INVALID_ARGUMENT
            expected = ("unrecognized load parameter 'foo'." if key == "foo"
                        else "invalid value type for load parameter 'config', expected string_param.")
            assert expected in (refused.value.details() or "")
    assert scale.created == []  # nothing was loaded by a refused request
    assert httpx.post(url, json={"parameters": {}}).status_code == 200


@pytest.mark.parametrize("path", ["../x", "/../x", "1/../../x", "1/../../../etc/cron.d/x"])
def test_file_override_paths_must_stay_in_the_model_directory(
    start_server: StartServer, tmp_path: Path, scale: Scale, clients: list[Any], path: str
) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config())
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit")
    config = json.dumps({"backend": "scale", "max_batch_size": 0,
                         "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [2]}],
                         "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [2]}]})
    hc = http(server)
    gc = grpc(server)
    clients.extend([hc, gc])
    for client in (hc, gc):
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("base", config=config, files={f"file:{path}": b"owned"})
        assert caught.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        assert f"invalid file override 'file:{path}'" in caught.value.message()
    assert not (tmp_path / "x").exists() and not (repo / "x").exists()
    assert scale.created == []


# ---------------------------------------------------------------------------
# ensembles and unload_dependents


def test_unload_dependents_unloads_the_ensembles_using_a_model(
    start_server: StartServer, tmp_path: Path, scale: Scale, clients: list[Any]
) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config(2))
    write_model(repo, "ens", ENSEMBLE)
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit")
    hc = http(server)
    clients.append(hc)
    hc.load_model("ens")  # loads the model the ensemble uses first
    assert hc.is_model_ready("base") and hc.is_model_ready("ens")
    result = hc.infer("ens", [httpclient.InferInput("X", [2], "FP32").set_data_from_numpy(np.ones(2, np.float32))])
    assert result.as_numpy("Y").tolist() == [2.0, 2.0]

    hc.unload_model("base")  # without dependents: the ensemble stays loaded, but UNAVAILABLE (as Triton)
    assert not hc.is_model_ready("ens") and not hc.is_model_ready("base")
    assert "model 'base'" in index(server)["ens"][0]["reason"]

    hc.load_model("base")  # and READY again with its step model
    assert hc.is_model_ready("ens")
    gc = grpc(server)
    clients.append(gc)
    gc.unload_model("base", unload_dependents=True)
    found = index(server)
    assert found["base"][0]["reason"] == "unloaded"
    assert found["ens"] == [{"name": "ens", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]

    hc.load_model("ens")
    hc.unload_model("ens", unload_dependents=True)  # an ensemble takes the models it used along
    assert index(server)["base"][0]["reason"] == "unloaded"


@pytest.mark.parametrize("by_name", ["load API", "--load-model"])
def test_unload_dependents_keeps_the_models_loaded_by_name(
    start_server: StartServer, tmp_path: Path, scale: Scale, clients: list[Any], by_name: str
) -> None:
    """As Triton 2.51 does (checked side by side): an ensemble's unload with dependents takes
    along the steps it loaded, not a step that was loaded by name itself."""
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config(2))
    write_model(repo, "ens", ENSEMBLE)
    startup = ["base"] if by_name == "--load-model" else []
    server = start_server(repo, backends={"scale": scale}, model_control_mode="explicit", load_models=startup)
    hc = http(server)
    clients.append(hc)
    if by_name == "load API":
        hc.load_model("base")
    hc.load_model("ens")
    hc.unload_model("ens", unload_dependents=True)
    assert hc.is_model_ready("base")
    assert index(server)["ens"][0]["reason"] == "unloaded"
    hc.unload_model("base")  # unloaded by name: a later ensemble load loads it as its step only
    hc.load_model("ens")
    hc.unload_model("ens", unload_dependents=True)
    assert not hc.is_model_ready("base")


# ---------------------------------------------------------------------------
# poll mode


class Hammer:
    """Sends requests from a thread (HTTP and gRPC in turn) until stopped; counts failures."""

    def __init__(self, server: ServerThread, name: str) -> None:
        self.server = server
        self.name = name
        self.outputs: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Hammer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        body = {"inputs": [{"name": "IN", "shape": [2], "datatype": "FP32", "data": [1.0, 1.0]}]}
        gc = grpcclient.InferenceServerClient(self.server.grpc_url)
        tensor = grpcclient.InferInput("IN", [2], "FP32")
        tensor.set_data_from_numpy(np.ones(2, np.float32))
        try:
            with httpx.Client(timeout=30) as client:
                turn = 0
                while not self._stop.is_set():
                    turn += 1
                    try:
                        if turn % 2:
                            response = client.post(f"http://{self.server.url}/v2/models/{self.name}/infer", json=body)
                            if response.status_code != 200:
                                self.failures.append(response.text)
                                continue
                            self.outputs.append(response.json()["outputs"][0]["data"][0])
                        else:
                            result = gc.infer(self.name, [tensor])
                            self.outputs.append(float(result.as_numpy("OUT")[0]))
                    except Exception as exc:  # every failure counts
                        self.failures.append(repr(exc))
        finally:
            gc.close()

    def latest(self) -> float | None:
        return self.outputs[-1] if self.outputs else None


def test_poll_reloads_an_edited_config_without_failing_requests(
    start_server: StartServer, tmp_path: Path, scale: Scale
) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config(2, 'parameters { key: "delay" value: { string_value: "0.002" } }'))
    server = start_server(repo, backends={"scale": scale}, model_control_mode="poll", repository_poll_secs=0.2)
    with Hammer(server, "base") as hammer:
        wait_for(lambda: len(hammer.outputs) > 20, what="first responses")
        (repo / "base" / "config.pbtxt").write_text(
            scale_config(3, 'parameters { key: "delay" value: { string_value: "0.002" } }'))
        wait_for(lambda: hammer.latest() == 3.0, what="the reloaded config")
        count = len(hammer.outputs)
        wait_for(lambda: len(hammer.outputs) > count + 20, what="more responses")
    assert hammer.failures == []
    assert 2.0 in hammer.outputs and hammer.outputs[-1] == 3.0
    assert ("base", 1) in scale.finalized


def test_poll_serves_an_added_version_without_failing_requests(
    start_server: StartServer, tmp_path: Path, scale: Scale
) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config(2))
    server = start_server(repo, backends={"scale": scale}, model_control_mode="poll", repository_poll_secs=0.2)
    with Hammer(server, "base") as hammer:
        wait_for(lambda: len(hammer.outputs) > 20, what="first responses")
        (repo / "base" / "2").mkdir()
        (repo / "base" / "2" / "factor.txt").write_text("5")
        wait_for(lambda: hammer.latest() == 5.0, what="version 2")
    assert hammer.failures == []
    versions = {e["version"]: e for e in index(server)["base"]}
    assert versions["2"]["state"] == "READY"
    assert versions["1"] == {"name": "base", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}


def test_poll_keeps_the_old_version_when_an_edit_breaks_the_model(
    start_server: StartServer, tmp_path: Path, scale: Scale
) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config(2))
    server = start_server(repo, backends={"scale": scale}, model_control_mode="poll", repository_poll_secs=0.2)
    config = repo / "base" / "config.pbtxt"
    config.write_text("backend: 'scale'\nmax_batch_size: what\n")
    time.sleep(1.0)  # several polls
    assert infer_out(server, "base") == [2.0, 4.0]
    assert index(server)["base"][0]["state"] == "READY"
    config.write_text(scale_config(2, 'parameters { key: "fail_create" value: { string_value: "1" } }'))
    time.sleep(1.0)
    assert infer_out(server, "base") == [2.0, 4.0]
    config.write_text(scale_config(4))
    wait_for(lambda: infer_out(server, "base") == [4.0, 8.0], what="the fixed config")


def test_poll_loads_added_and_unloads_removed_models(start_server: StartServer, tmp_path: Path, scale: Scale) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config(2))
    server = start_server(repo, backends={"scale": scale}, model_control_mode="poll", repository_poll_secs=0.2)
    write_model(repo, "added", scale_config(3))
    wait_for(lambda: "added" in index(server) and index(server)["added"][0].get("state") == "READY",
             what="the added model")
    assert infer_out(server, "added") == [3.0, 6.0]
    shutil.rmtree(repo / "base")
    wait_for(lambda: "base" not in index(server), what="the removed model")
    # the index lists the repository's folders: it drops the model before its unload has finished
    wait_for(lambda: ("base", 1) in scale.finalized, what="the removed model's finalize")
    response = httpx.get(f"http://{server.url}/v2/models/base/ready")
    assert response.status_code == 400
    assert httpx.get(f"http://{server.url}/v2/health/ready").status_code == 200
    response = httpx.post(f"http://{server.url}/v2/repository/models/added/unload")
    assert response.status_code == 503


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--load-model", "base"], "--load-model can only be used with --model-control-mode=explicit"),
        (["--model-control-mode", "explicit", "--load-model", "*", "--load-model", "base"],
         "--load-model=* must be the only --load-model argument"),
    ],
    ids=["not-explicit", "star-not-alone"],
)
def test_cli_checks_load_model(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    from pyserve.cli.main import build_parser, main

    repo = tmp_path / "repo"
    write_model(repo, "base", scale_config())
    assert main(["run", "--model-repository", str(repo), *flags]) == 2
    assert message in capsys.readouterr().err
    args = build_parser().parse_args(["run", "--model-control-mode", "poll", "--repository-poll-secs", "0.5"])
    assert (args.model_control_mode, args.repository_poll_secs, args.load_model) == ("poll", 0.5, [])
