"""The mixed-framework repository: built into a temporary folder, served by one server.

Every model (ONNX, TorchScript, SavedModel) and the Python-preprocessing ensemble is called
over HTTP and gRPC and compared with the frameworks called directly.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

for _module in ("onnx", "onnxruntime", "torch", "tensorflow"):
    pytest.importorskip(_module)

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402

from pyserve.host.plugins import PluginHost  # noqa: E402
from pyserve.server.core import Server, ServerOptions, ServerThread  # noqa: E402

REPOSITORY = Path(__file__).resolve().parent.parent / "mixed_repository"
BACKENDS = ("onnxruntime", "pytorch", "tensorflow", "python")


def _build_models() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mixed_build_models", REPOSITORY / "build_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_models = _build_models()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    host = PluginHost()
    missing = [b for b in BACKENDS if not host.is_installed(b)]
    if missing:
        pytest.skip(f"backend(s) not installed: {', '.join(missing)}")
    repo = build_models.build(tmp_path_factory.mktemp("mixed"))
    settings = ServerOptions(model_repositories=[repo], host="127.0.0.1", http_port=0, grpc_port=0)
    thread = ServerThread(Server(settings, host))
    thread.start()
    yield thread
    thread.stop()


def infer(server: ServerThread, protocol: str, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(server.url if protocol == "http" else server.grpc_url)
    tensors = []
    for name, array in inputs.items():
        tensor = module.InferInput(name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    result = client.infer(model, tensors)
    response = result.get_response()
    names = [o["name"] for o in response["outputs"]] if protocol == "http" else [o.name for o in response.outputs]
    return {name: result.as_numpy(name) for name in names}


RNG = np.random.default_rng(11)
CASES = {
    "onnx_mlp": {"x": RNG.standard_normal((3, 4)).astype(np.float32)},
    "tf_mlp": {"x": RNG.standard_normal((2, 4)).astype(np.float32)},
    "torch_convnet": {"image": RNG.standard_normal((2, 1, 8, 8)).astype(np.float32)},
    "pipeline": {"RAW": (RNG.standard_normal((4, 4)) + 3.0).astype(np.float32)},
}


def test_every_model_is_ready(server: ServerThread) -> None:
    index = httpclient.InferenceServerClient(server.url).get_model_repository_index()
    states = {entry["name"]: (entry["state"], entry.get("reason", "")) for entry in index}
    assert {name: state for name, (state, _) in states.items()} == dict.fromkeys(build_models.MODELS, "READY"), states


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", sorted(CASES))
def test_model_matches_its_framework(server: ServerThread, model: str, protocol: str) -> None:
    got = infer(server, protocol, model, CASES[model])
    want = build_models.reference_outputs(model, CASES[model])
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        np.testing.assert_allclose(got[name], array, rtol=1e-4, atol=1e-5)


def test_tf_config_was_auto_completed(server: ServerThread) -> None:
    config = httpclient.InferenceServerClient(server.url).get_model_config("tf_mlp")
    assert config["max_batch_size"] == 4
    assert [(t["name"], t["dims"]) for t in config["input"]] == [("x", [4])]


def test_the_built_repository_validates(server: ServerThread) -> None:
    """``pyserve validate`` agrees with the server, which loaded every model: the SavedModel's
    config leaves its tensors to auto-complete, and the ensemble's plan is checked against the
    configs of its steps."""
    from pyserve.repository.validate import validate_repositories

    repositories = [Path(p) for p in server.server.options.model_repositories]
    assert validate_repositories(repositories) == []
