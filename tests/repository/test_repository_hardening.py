"""The repository API against hostile load requests: ``label_filename`` confined to the model
directory like ``default_model_filename``, and ``file:`` overrides the system cannot write refused
with 400 / INVALID_ARGUMENT that never show a path of the server's machine. Real servers in
explicit mode, tritonclient HTTP and gRPC as clients."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from suite_support import write_model
from tritonclient.utils import InferenceServerException

from pyserve.server.core import ServerThread
from pyserve.testing import serve

LABELLED = {
    "backend": "identity", "max_batch_size": 0,
    "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [3]}],
    "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [3], "label_filename": "labels.txt"}],
}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    repo = tmp_path / "repo"
    write_model(repo, "labelled", json_to_pbtxt(), files={"labels.txt": "a\nb\nc\n"})
    (tmp_path / "secret.txt").write_text("root-password\nhunter2\nxyzzy\n")
    with serve(repo, model_control_mode="explicit") as thread:
        yield thread


def json_to_pbtxt() -> str:
    return """
        backend: "identity"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 3 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 3 ] label_filename: "labels.txt" } ]
    """


def classify(thread: ServerThread) -> list[str]:
    client = httpclient.InferenceServerClient(thread.url)
    try:
        tensor = httpclient.InferInput("IN", [3], "FP32")
        tensor.set_data_from_numpy(np.array([1, 3, 2], np.float32))
        output = httpclient.InferRequestedOutput("OUT", class_count=3)
        result = client.infer("labelled", [tensor], outputs=[output])
        return [item.decode().split(":")[-1] for item in result.as_numpy("OUT")]
    finally:
        client.close()


@pytest.mark.parametrize("label_file", ["../../secret.txt", "../secret.txt", "/etc/passwd", "sub/../../secret.txt"])
def test_a_config_override_cannot_read_labels_outside_the_model_directory(server: ServerThread, label_file: str) -> None:
    client = httpclient.InferenceServerClient(server.url)
    try:
        client.load_model("labelled")
        assert classify(server) == ["b", "c", "a"]
        config = dict(LABELLED, output=[dict(LABELLED["output"][0], label_filename=label_file)])
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("labelled", config=json.dumps(config))
        assert "label_filename" in str(caught.value)
        assert caught.value.status() == "400"
        assert classify(server) == ["b", "c", "a"]  # the version loaded before keeps serving
    finally:
        client.close()


def test_labels_through_a_link_out_of_the_model_directory_are_refused(server: ServerThread, tmp_path: Path) -> None:
    (tmp_path / "repo" / "labelled" / "linked.txt").symlink_to(tmp_path / "secret.txt")
    config = dict(LABELLED, output=[dict(LABELLED["output"][0], label_filename="linked.txt")])
    answer = requests.post(f"http://{server.url}/v2/repository/models/labelled/load",
                           json={"parameters": {"config": json.dumps(config)}}, timeout=60)
    assert answer.status_code == 400
    assert "symbolic link" in answer.json()["error"]


CONFIG = json.dumps({
    "backend": "identity", "max_batch_size": 0,
    "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [3]}],
    "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [3]}],
})


@pytest.mark.parametrize(("files", "reason"), [
    ({"file:1/": b"x"}, "ends with '/'"),
    ({"file:" + "a" * 300: b"x"}, "longer than 255 bytes"),
    ({"file:1": b"x", "file:1/model.py": b"y"}, "cannot also be a directory"),
])
def test_file_overrides_the_system_cannot_write_are_400_without_a_path(
    server: ServerThread, files: dict[str, bytes], reason: str,
) -> None:
    client = httpclient.InferenceServerClient(server.url)
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("override", config=CONFIG, files=files)
    finally:
        client.close()
    assert caught.value.status() == "400"
    assert reason in str(caught.value)
    assert "pyserve-override" not in str(caught.value) and "/tmp" not in str(caught.value)


def test_a_300_character_model_name_with_files_is_invalid_argument_over_grpc(server: ServerThread) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("m" * 300, config=CONFIG, files={"file:1/data": b"x"})
    finally:
        client.close()
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "longer than 255 bytes" in str(caught.value) and "pyserve-override" not in str(caught.value)
