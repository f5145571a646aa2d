"""Model lifecycle edges an audit found: odd instance counts, version folder names, warmup
sizes, exiting servers, sequence batch sizes, model file names and reloaded ensemble steps.

Real servers on loopback ports, real ``tritonclient`` calls.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format, text_format
from suite_support import wait_for, write_model
from tritonclient.utils import InferenceServerException

import pyserve
from pyserve import InferRequest, InferResponse, InstanceContext
from pyserve.protocol import ModelConfig
from pyserve.server.core import ServerThread

StartServer = Callable[..., ServerThread]


class Echo(pyserve.Backend):
    """OUT = IN; counts created and finalized instances; an execute sleeps for the model
    parameter ``sleep_s`` (seconds) when it is set, and with the model parameter ``hold`` waits
    (60 s at most) for ``release``; ``executing`` is set once such an execute began."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.created = 0
        self.finalized = 0
        self.executing = threading.Event()
        self.release = threading.Event()

    def create_instance(self, instance: InstanceContext) -> object:
        with self.lock:
            self.created += 1
        return None

    def finalize_instance(self, instance: InstanceContext) -> None:
        with self.lock:
            self.finalized += 1

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[Any]:
        delay = float(instance.model.parameters.get("sleep_s") or 0)
        if delay:
            time.sleep(delay)
        if instance.model.parameters.get("hold"):
            self.executing.set()
            self.release.wait(60)
        return [InferResponse({"OUT": request.inputs["IN"]}) for request in requests]


def config(extra: str = "", dims: str = "2", datatype: str = "TYPE_FP32", batch: int = 4) -> str:
    return f"""
        backend: "echo"
        max_batch_size: {batch}
        input [ {{ name: "IN" data_type: {datatype} dims: [ {dims} ] }} ]
        output [ {{ name: "OUT" data_type: {datatype} dims: [ {dims} ] }} ]
        {extra}
        """


ENSEMBLE = """
    platform: "ensemble"
    max_batch_size: 4
    input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
    output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
    ensemble_scheduling { step [ { model_name: "step" model_version: -1
      input_map { key: "IN" value: "IN" } output_map { key: "OUT" value: "OUT" } } ] }
"""
"""One step, model ``step``: OUT = step(IN)."""


def index(server: ServerThread) -> dict[tuple[str, str], dict[str, Any]]:
    entries = httpx.post(f"http://{server.url}/v2/repository/index").json()
    return {(e["name"], e.get("version", "")): e for e in entries}


def infer(server: ServerThread, model: str, data: np.ndarray, version: str = "") -> np.ndarray:
    client = httpclient.InferenceServerClient(server.url)
    try:
        tensor = httpclient.InferInput("IN", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        return client.infer(model, [tensor], model_version=version).as_numpy("OUT")
    finally:
        client.close()


@pytest.mark.parametrize("count", [-2, -1])
def test_a_count_below_one_means_one_instance(start_server: StartServer, tmp_path: Path, count: int) -> None:
    """As Triton: ``count`` < 1 is the default count. It used to load with no instance, and
    every request then waited for ever."""
    repo = tmp_path / "repo"
    write_model(repo, "m", config(f"instance_group [ {{ kind: KIND_CPU count: {count} }} ]"))
    echo = Echo()
    server = start_server(repo, backends={"echo": echo})
    assert echo.created == 1
    assert infer(server, "m", np.ones((1, 2), np.float32)).tolist() == [[1.0, 1.0]]


def test_version_folders_with_non_ascii_digits_are_ignored(start_server: StartServer, tmp_path: Path) -> None:
    """'²' and '١٠' pass ``str.isdigit``; as Triton, only ASCII numbers are version folders."""
    repo = tmp_path / "repo"
    model_dir = write_model(repo, "m", config())
    (model_dir / "\u00b2").mkdir()
    (model_dir / "\u0661\u0660").mkdir()
    server = start_server(repo, backends={"echo": Echo()})
    client = httpclient.InferenceServerClient(server.url)
    try:
        assert client.get_model_metadata("m")["versions"] == ["1"]
    finally:
        client.close()
    assert infer(server, "m", np.ones((1, 2), np.float32)).tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("version", ["\u00b2", "\u0661"])
def test_a_non_ascii_version_in_a_request_is_invalid(example_server: ServerThread, version: str) -> None:
    client = grpcclient.InferenceServerClient(example_server.grpc_url)
    try:
        tensor = grpcclient.InferInput("INPUT0", [4], "FP32")
        tensor.set_data_from_numpy(np.ones(4, np.float32))
        other = grpcclient.InferInput("INPUT1", [4], "FP32")
        other.set_data_from_numpy(np.ones(4, np.float32))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("add_sub", [tensor, other], model_version=version)
    finally:
        client.close()
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"  # not a version, as Triton 2.51 answers


def test_a_warmup_sample_too_large_is_refused_before_allocating(start_server: StartServer, tmp_path: Path) -> None:
    """A zero_data sample of 10^12 elements used to raise MemoryError and leave the model
    LOADING for ever, its instances never finalized."""
    repo = tmp_path / "repo"
    write_model(repo, "huge", config("""
        model_warmup { name: "big" batch_size: 1
          inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 1000000000000 ] zero_data: true } } }
        """, dims="-1"))
    write_model(repo, "fine", config())
    echo = Echo()
    server = start_server(repo, backends={"echo": echo})
    entries = index(server)
    assert entries[("huge", "1")]["state"] == "UNAVAILABLE"
    reason = entries[("huge", "1")]["reason"]
    assert "model warmup sample 'big'" in reason and "a warmup input may take" in reason
    assert entries[("fine", "1")]["state"] == "READY"
    assert echo.finalized == 1  # the failed version's instance was released


def test_live_answers_exiting_while_the_server_shuts_down(start_server: StartServer, tmp_path: Path) -> None:
    """As Triton: live is 503 (HTTP) / UNAVAILABLE (gRPC) once shutdown began."""
    repo = tmp_path / "repo"
    write_model(repo, "slow", config('parameters { key: "hold" value: { string_value: "1" } }'))
    echo = Echo()
    server = start_server(repo, backends={"echo": echo}, exit_timeout_secs=60)
    url = server.url
    assert httpx.get(f"http://{url}/v2/health/live").status_code == 200
    slow = threading.Thread(target=infer, args=(server, "slow", np.ones((1, 2), np.float32)))
    slow.start()
    assert echo.executing.wait(60)  # the request is executing (held until released)
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    try:
        deadline = time.monotonic() + 60
        response = httpx.get(f"http://{url}/v2/health/live", timeout=30)
        while response.status_code == 200 and time.monotonic() < deadline:  # until shutdown begins
            time.sleep(0.05)
            response = httpx.get(f"http://{url}/v2/health/live", timeout=30)
        # the listeners stay open while the in-flight request drains
        assert response.status_code == 503 and response.json() == {"error": "Server exiting"}
    finally:
        echo.release.set()
        slow.join(60)
        stopper.join(60)
    assert not slow.is_alive() and not stopper.is_alive()


def test_idle_models_are_finalized_when_the_exit_timeout_is_spent(start_server: StartServer, tmp_path: Path) -> None:
    """With --exit-timeout-secs 0 an idle instance still ends and is finalized; only an
    executing one is left."""
    repo = tmp_path / "repo"
    write_model(repo, "a", config())
    write_model(repo, "b", config())
    echo = Echo()
    server = start_server(repo, backends={"echo": echo}, exit_timeout_secs=0)
    assert infer(server, "a", np.ones((1, 2), np.float32)).tolist() == [[1.0, 1.0]]
    server.stop()
    assert echo.finalized == echo.created == 2


def test_a_sequence_request_with_a_batch_of_two_is_refused(start_server: StartServer, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "seq", config("sequence_batching { }"))
    server = start_server(repo, backends={"echo": Echo()})
    client = httpclient.InferenceServerClient(server.url)
    try:
        tensor = httpclient.InferInput("IN", [2, 2], "FP32")
        tensor.set_data_from_numpy(np.ones((2, 2), np.float32))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("seq", [tensor], sequence_id=7, sequence_start=True)
        assert caught.value.status() == "400"
        assert "must specify batch-size 1 due to requirements of sequence batcher" in str(caught.value)
        one = httpclient.InferInput("IN", [1, 2], "FP32")
        one.set_data_from_numpy(np.ones((1, 2), np.float32))
        result = client.infer("seq", [one], sequence_id=7, sequence_start=True, sequence_end=True)
        assert result.as_numpy("OUT").tolist() == [[1.0, 1.0]]
    finally:
        client.close()


@pytest.mark.parametrize("filename", ["../elsewhere.py", "/tmp/elsewhere.py", "sub/../../x.py"])
def test_default_model_filename_must_stay_in_the_version_folder(
    start_server: StartServer, tmp_path: Path, filename: str
) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "m", config(f'default_model_filename: "{filename}"'))
    server = start_server(repo, backends={"echo": Echo()})
    entry = index(server)[("m", "1")]
    assert entry["state"] == "UNAVAILABLE"
    assert "default_model_filename" in entry["reason"] and filename in entry["reason"]


def test_an_ensemble_checks_its_step_against_the_step_models_current_config(
    start_server: StartServer, tmp_path: Path
) -> None:
    """The step model reloaded with an INT32 input: the ensemble becomes UNAVAILABLE, naming
    the mismatch, instead of passing FP32 tensors to it (and a request already inside the
    ensemble then is checked by the tensors' real datatype)."""
    repo = tmp_path / "repo"
    write_model(repo, "step", config())
    write_model(repo, "ens", ENSEMBLE)
    server = start_server(repo, backends={"echo": Echo()}, model_control_mode="explicit",
                          load_models=["ens"])
    data = np.ones((1, 2), np.float32)
    assert infer(server, "ens", data).tolist() == [[1.0, 1.0]]
    client = httpclient.InferenceServerClient(server.url)
    try:
        reloaded = text_format.Parse(config(datatype="TYPE_INT32"), ModelConfig())
        client.load_model("step", config=json_format.MessageToJson(reloaded))
        with pytest.raises(InferenceServerException) as caught:
            infer(server, "ens", data)
    finally:
        client.close()
    assert "input 'IN' is INT32 but ensemble tensor 'IN' is FP32" in str(caught.value)


def test_an_ensemble_follows_its_step_model_out_and_back(start_server: StartServer, tmp_path: Path) -> None:
    """As Triton: unloading a step model makes the ensemble UNAVAILABLE (it used to stay READY
    and answer 404 to every request); loading the step model again makes it READY again. An
    ensemble using that ensemble follows it."""
    repo = tmp_path / "repo"
    write_model(repo, "step", config())
    write_model(repo, "ens", ENSEMBLE)
    write_model(repo, "outer", ENSEMBLE.replace('model_name: "step"', 'model_name: "ens"'))
    server = start_server(repo, backends={"echo": Echo()}, model_control_mode="explicit",
                          load_models=["ens", "outer"])
    data = np.ones((1, 2), np.float32)
    client = httpclient.InferenceServerClient(server.url)
    try:
        assert client.is_model_ready("ens") and client.is_model_ready("outer")
        client.unload_model("step")
        assert not client.is_model_ready("ens") and not client.is_model_ready("outer")
        entry = index(server)[("ens", "1")]
        assert entry["state"] == "UNAVAILABLE" and "step 0 (model 'step')" in entry["reason"]
        with pytest.raises(InferenceServerException):
            infer(server, "ens", data)
        client.load_model("step")
        assert client.is_model_ready("ens") and client.is_model_ready("outer")
        assert index(server)[("ens", "1")]["state"] == "READY"
    finally:
        client.close()
    assert infer(server, "ens", data).tolist() == [[1.0, 1.0]]
    assert infer(server, "outer", data).tolist() == [[1.0, 1.0]]


class InputWatcher(pyserve.Backend):
    """Answers OUT = IN * 2 (a new array) and keeps only a weak reference to each input."""

    def __init__(self) -> None:
        self.inputs: list[weakref.ref[np.ndarray]] = []

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[Any]:
        self.inputs.extend(weakref.ref(request.inputs["IN"]) for request in requests)
        return [InferResponse({"OUT": request.inputs["IN"] * 2}) for request in requests]


@pytest.mark.parametrize("batching", ["", "dynamic_batching { }"])
def test_an_idle_instance_lets_go_of_the_requests_it_answered(
    start_server: StartServer, tmp_path: Path, batching: str
) -> None:
    """The last batch's inputs (a 1 GiB tensor, say) are freed once answered, not kept by the
    idle instance until its next request."""
    write_model(tmp_path, "m", config(batching).replace('"echo"', '"watch"'))
    backend = InputWatcher()
    server = start_server(tmp_path, backends={"watch": backend})
    assert infer(server, "m", np.ones((1, 2), dtype=np.float32)).tolist() == [[2.0, 2.0]]
    assert len(backend.inputs) == 1

    def freed() -> bool:
        gc.collect()
        return backend.inputs[0]() is None

    wait_for(freed, timeout=60, what="the answered request's input to be freed")
