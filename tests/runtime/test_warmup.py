"""Model warmup (``model_warmup``): samples run through the model's own instances before READY."""

from __future__ import annotations

import struct
import textwrap
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from suite_support import write_model

import pyserve
from pyserve import (
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from pyserve.server.core import ServerThread

StartServer = Callable[..., ServerThread]

BASE = """
backend: "recorder"
max_batch_size: 4
input [
  { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] },
  { name: "TEXT" data_type: TYPE_STRING dims: [ 2 ] optional: true }
]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


class Recorder(pyserve.Backend):
    """OUT = IN; records every warmup request it executes (and whether the model was
    already READY then); fails warmup requests when the model parameter ``fail`` is set."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.warmups: list[dict[str, Any]] = []
        self.instances_finalized = 0

    def finalize_instance(self, instance: InstanceContext) -> None:
        with self.lock:
            self.instances_finalized += 1

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[Any]:
        model = instance.model
        results: list[Any] = []
        for request in requests:
            if request.id.startswith("warmup"):
                with self.lock:
                    self.warmups.append({
                        "id": request.id,
                        "inputs": {k: np.array(v) for k, v in request.inputs.items()},
                        "batch_size": request.batch_size,
                        "ready": model.server.model_ready(model.name),
                        "instance": instance.name,
                    })
                if model.parameters.get("fail"):
                    results.append(InferError("the warmup input was rejected"))
                    continue
            results.append(InferResponse({"OUT": request.inputs["IN"]}))
        return results


def warmup_config(samples: str, extra: str = "") -> str:
    return textwrap.dedent(BASE) + textwrap.dedent(samples) + textwrap.dedent(extra)


def index_entry(server: ServerThread, name: str) -> dict[str, Any]:
    entries = [e for e in httpx.post(f"http://{server.url}/v2/repository/index").json() if e["name"] == name]
    assert len(entries) == 1, entries
    return entries[0]


def test_warmup_samples_run_before_the_model_is_ready(start_server: StartServer, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "warm", warmup_config("""
        model_warmup [
          { name: "zeros" batch_size: 2 count: 3
            inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } },
          { name: "random" batch_size: 1
            inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 2 ] random_data: true } }
            inputs { key: "TEXT" value: { data_type: TYPE_STRING dims: [ 2 ] random_data: true } } }
        ]
        """))
    recorder = Recorder()
    server = start_server(repo, backends={"recorder": recorder})
    ids = [w["id"] for w in recorder.warmups]
    assert ids == ["warmup-zeros"] * 3 + ["warmup-random"]
    assert not any(w["ready"] for w in recorder.warmups)
    zeros = recorder.warmups[0]
    assert zeros["batch_size"] == 2
    assert zeros["inputs"]["IN"].shape == (2, 2) and not zeros["inputs"]["IN"].any()
    random = recorder.warmups[-1]
    assert random["inputs"]["IN"].shape == (1, 2) and random["inputs"]["IN"].dtype == np.float32
    assert random["inputs"]["TEXT"].tolist() == [[b"", b""]]  # BYTES random data falls back to zeros
    assert index_entry(server, "warm")["state"] == "READY"
    client = httpclient.InferenceServerClient(server.url)
    try:
        tensor = httpclient.InferInput("IN", [1, 2], "FP32")
        tensor.set_data_from_numpy(np.array([[1, 2]], np.float32))
        assert client.infer("warm", [tensor]).as_numpy("OUT").tolist() == [[1.0, 2.0]]
    finally:
        client.close()
    assert len(recorder.warmups) == 4  # client requests are not warmup


def test_warmup_reads_data_files(start_server: StartServer, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    model_dir = write_model(repo, "warm", warmup_config("""
        model_warmup {
          name: "files" batch_size: 1
          inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 2 ] input_data_file: "in.bin" } }
          inputs { key: "TEXT" value: { data_type: TYPE_STRING dims: [ 2 ] input_data_file: "text.bin" } }
        }
        """))
    (model_dir / "warmup").mkdir()
    (model_dir / "warmup" / "in.bin").write_bytes(np.array([1.5, -2.0], "<f4").tobytes())
    (model_dir / "warmup" / "text.bin").write_bytes(
        b"".join(struct.pack("<I", len(s)) + s for s in (b"hello", b"")))
    recorder = Recorder()
    server = start_server(repo, backends={"recorder": recorder})
    assert index_entry(server, "warm")["state"] == "READY"
    (sample,) = recorder.warmups
    assert sample["inputs"]["IN"].tolist() == [[1.5, -2.0]]
    assert sample["inputs"]["TEXT"].tolist() == [[b"hello", b""]]


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ('inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } }',
         "the warmup input was rejected"),
        ('inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 2 ] input_data_file: "missing.bin" } }',
         "missing.bin"),
        ('inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 2 ] input_data_file: "../config.pbtxt" } }',
         "contains '..'"),
        ('inputs { key: "IN" value: { data_type: TYPE_INT32 dims: [ 2 ] zero_data: true } }',
         "data-type is 'INT32'"),
        ('inputs { key: "NOPE" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } }',
         "unexpected inference input 'NOPE'"),
        ('inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 2 ] } }',
         "warmup setting expects input 'IN' to have input_data_type set"),  # Triton 2.51's words
    ],
    ids=["backend-error", "missing-file", "escaping-file", "wrong-type", "unknown-input", "no-data"],
)
def test_a_failing_warmup_makes_the_model_unavailable(
    start_server: StartServer, tmp_path: Path, sample: str, message: str
) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "cold", warmup_config(
        f'model_warmup {{ name: "bad" batch_size: 1 {sample} }}',
        'parameters { key: "fail" value: { string_value: "1" } }' if "rejected" in message else "",
    ))
    write_model(repo, "fine", warmup_config(""))
    recorder = Recorder()
    server = start_server(repo, backends={"recorder": recorder})
    entry = index_entry(server, "cold")
    assert entry["state"] == "UNAVAILABLE"
    assert "model warmup sample 'bad'" in entry["reason"] and message in entry["reason"]
    assert index_entry(server, "fine")["state"] == "READY"
    if "rejected" in message:
        assert recorder.instances_finalized == 1  # the failed version's instance was released
    response = httpx.get(f"http://{server.url}/v2/models/cold/ready")
    assert response.status_code == 400


def test_warmup_runs_on_an_explicit_load(start_server: StartServer, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "warm", warmup_config("""
        model_warmup { name: "w" batch_size: 4
          inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } }
        """))
    recorder = Recorder()
    server = start_server(repo, backends={"recorder": recorder}, model_control_mode="explicit")
    assert recorder.warmups == []
    client = httpclient.InferenceServerClient(server.url)
    try:
        client.load_model("warm")
        assert client.is_model_ready("warm")
    finally:
        client.close()
    (sample,) = recorder.warmups
    assert sample["batch_size"] == 4 and not sample["ready"]
