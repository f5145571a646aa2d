"""Python-based backends: ``<backend-directory>/<name>/model.py`` serves every model whose
config says ``backend: "<name>"`` (Triton's layout, that of its vLLM backend). The models'
version folders hold only their settings, which the backend's model.py finds through
``pb_utils.get_model_dir()``; the backend folder's own helper modules import."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyserve_backend_python
import pytest
import tritonclient.grpc as grpcclient
from pyserve_backend_python import based
from python_backend_helpers import PROCESS_MODE

from pyserve.host.plugins import PluginHost
from pyserve.server.core import Server, ServerOptions, ServerThread

BACKEND_MODEL = """
import json
from collections.abc import Iterator
import os

import triton_python_backend_utils as pb_utils
from arithmetic import OPERATIONS  # a helper module beside this file, in the backend folder


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        names = {entry["name"] for entry in config.as_dict().get("input", [])}
        for name in ("A", "B"):
            if name not in names:
                config.add_input({"name": name, "data_type": "TYPE_FP32", "dims": [3]})
        if not config.as_dict().get("output"):
            config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [3]})
        return config

    def initialize(self, args):
        with open(os.path.join(pb_utils.get_model_dir(), "settings.json")) as settings:
            self.operation = OPERATIONS[json.load(settings)["operation"]]

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", self.operation(
            pb_utils.get_input_tensor_by_name(r, "A").as_numpy(), pb_utils.get_input_tensor_by_name(r, "B").as_numpy()))])
            for r in requests]
"""

HELPER = """
OPERATIONS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b}
"""


def _layout(root: Path) -> tuple[Path, Path]:
    backends, repo = root / "backends", root / "repo"
    (backends / "mathop").mkdir(parents=True)
    (backends / "mathop" / "model.py").write_text(BACKEND_MODEL)
    (backends / "mathop" / "arithmetic.py").write_text(HELPER)
    for name, operation, extra in (("add", "add", ""), ("sub", "sub", PROCESS_MODE)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(f'backend: "mathop"\n{extra}')
        (repo / name / "1" / "settings.json").write_text(json.dumps({"operation": operation}))
    return backends, repo


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    backends, repo = _layout(tmp_path)
    host = PluginHost(extra_backends={"python": pyserve_backend_python}, server_plugins=[based.PythonBasedResolver()],
                      use_entry_points=False)
    thread = ServerThread(Server(ServerOptions(model_repositories=[repo], host="127.0.0.1", http_port=0, grpc_port=0,
                                               backend_directory=str(backends)), host))
    thread.start()
    yield thread
    thread.stop()


def test_the_backend_folders_model_py_serves_each_model(server: ServerThread) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        a, b = np.array([1, 2, 3], dtype=np.float32), np.array([10, 20, 30], dtype=np.float32)
        for name, expected in (("add", a + b), ("sub", a - b)):  # sub runs in a worker process
            tensors = [grpcclient.InferInput("A", [3], "FP32"), grpcclient.InferInput("B", [3], "FP32")]
            tensors[0].set_data_from_numpy(a)
            tensors[1].set_data_from_numpy(b)
            assert client.infer(name, tensors).as_numpy("OUT").tolist() == expected.tolist()
            config = client.get_model_config(name).config
            assert config.backend == "mathop" and [i.name for i in config.input] == ["A", "B"]
    finally:
        client.close()


def test_a_backend_folder_without_model_py_is_not_a_backend(tmp_path: Path) -> None:
    assert based.PythonBasedResolver().pyserve_resolve_backend(
        name="mathop", runtime="", model_path=tmp_path, version_paths=[], backend_directory=str(tmp_path)) is None
    (tmp_path / "mathop").mkdir()
    (tmp_path / "mathop" / "model.py").write_text(BACKEND_MODEL)
    found = based.PythonBasedResolver().pyserve_resolve_backend(
        name="mathop", runtime="", model_path=tmp_path, version_paths=[], backend_directory=str(tmp_path))
    assert found is not None and found[0] == f"python-based:{(tmp_path / 'mathop').resolve()}"
    (tmp_path / "mathop" / "libtriton_mathop.so").write_bytes(b"")  # a native library placed there wins
    assert based.PythonBasedResolver().pyserve_resolve_backend(
        name="mathop", runtime="", model_path=tmp_path, version_paths=[], backend_directory=str(tmp_path)) is None


def test_get_model_dir_outside_a_model_is_an_error() -> None:
    import triton_python_backend_utils as pb_utils

    with pytest.raises(pb_utils.TritonModelException, match="get_model_dir"):
        pb_utils.get_model_dir()
