"""The wheels ``make dist`` builds, installed outside the checkout as a user installs them.

Each test makes a fresh virtual environment (no system or checkout site-packages, no pip of its
own: this interpreter's pip installs into it with ``--python``) and installs from files only
(``--no-index``): the wheels of ``make dist`` and a wheelhouse of their dependencies downloaded
once per module (pip's cache and any configured local index serve it). The servers then run
from a folder outside the checkout, so everything they serve comes from the installed wheels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from suite_support import REPO_ROOT, RunningServer

pytestmark = pytest.mark.timeout(900)

EXAMPLE_MODELS = ["add_sub", "classifier", "identity_bytes", "identity_fp32", "sentiment", "simple", "square",
                  "tiny_lm"]
EXAMPLE_BACKENDS = ["pyserve-backend-identity", "pyserve-backend-python", "pyserve-backend-square",
                    "pyserve-backend-string-processor"]


@dataclass(frozen=True)
class Wheels:
    """The folder ``make dist`` filled, and one holding the wheels of their dependencies."""

    dist: Path
    wheelhouse: Path

    def wheel(self, distribution: str) -> Path:
        [found] = self.dist.glob(distribution.replace("-", "_") + "-*.whl")
        return found


def _run(command: list[str], cwd: Path | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, f"{command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _clean_env() -> dict[str, str]:
    """This environment without what would point a child at the checkout or at this venv."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Wheels:
    root = tmp_path_factory.mktemp("wheels")
    dist, wheelhouse = root / "dist", root / "wheelhouse"
    _run(["make", "-s", "dist", f"DIST={dist}", f"BIN={Path(sys.executable).parent}"], cwd=REPO_ROOT)
    built = sorted(p.name.split("-")[0] for p in dist.glob("*.whl"))
    plugins = sorted(p.name.replace("-", "_") for p in (REPO_ROOT / "plugins").glob("pyserve-backend-*"))
    assert built == sorted(["pyserve_server", "pyserve_backend_string_processor", *plugins]), built
    wheels = Wheels(dist, wheelhouse)
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary", ":all:", "--dest", str(wheelhouse),
          "--find-links", str(dist), str(wheels.wheel("pyserve-server")),
          f"{wheels.wheel('pyserve-backend-onnxruntime')}[cpu]"])
    return wheels


class FreshEnvironment:
    """A virtual environment of its own, installed into from files only."""

    def __init__(self, root: Path, wheels: Wheels) -> None:
        venv.create(root, with_pip=False, symlinks=True)
        self.root, self.wheels = root.resolve(), wheels
        self.python = root / "bin" / "python"
        self.pyserve = root / "bin" / "pyserve"

    def install(self, *requirements: str) -> None:
        _run([sys.executable, "-m", "pip", "--python", str(self.python), "install", "--quiet", "--no-index",
              "--find-links", str(self.wheels.wheelhouse), "--find-links", str(self.wheels.dist), *requirements],
             env=_clean_env())

    def distributions(self) -> set[str]:
        script = "import importlib.metadata as m; print('\\n'.join(d.metadata['Name'] for d in m.distributions()))"
        return set(_run([str(self.python), "-c", script], env=_clean_env(), cwd=self.root).stdout.split())

    def where(self, expression: str) -> Path:
        script = f"import pyserve, pyserve_hookspecs, pyserve.repository.bundled; print({expression})"
        return Path(_run([str(self.python), "-c", script], env=_clean_env(), cwd=self.root).stdout.strip())


Serve = Callable[..., RunningServer]
"""``serve(environment, *args)``: ``pyserve run *args`` from that environment, in a folder of its own."""


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    started: list[RunningServer] = []

    def start(environment: FreshEnvironment, *args: str) -> RunningServer:
        server = RunningServer(args, command=[str(environment.pyserve)], cwd=tmp_path, env=_clean_env())
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def _infer(url: str, model: str, inputs: dict[str, np.ndarray], output: str) -> np.ndarray:
    client = httpclient.InferenceServerClient(url, network_timeout=60)
    try:
        tensors = []
        for name, value in inputs.items():
            tensor = httpclient.InferInput(name, list(value.shape), "FP32")
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        result = client.infer(model, tensors).as_numpy(output)
        assert result is not None
        return result
    finally:
        client.close()


def test_core_wheel_alone_installs_and_serves_the_bundled_repository(wheels: Wheels, tmp_path: Path,
                                                                     serve: Serve) -> None:
    environment = FreshEnvironment(tmp_path / "venv", wheels)
    environment.install(str(wheels.wheel("pyserve-server")))
    installed = environment.distributions()
    assert "pyserve-server" in installed and not {d for d in installed if d.startswith("pyserve-backend-")}
    site = environment.root / "lib"
    for expression in ("pyserve.__file__", "pyserve_hookspecs.__file__", "pyserve.repository.bundled.EXAMPLE_REPOSITORY"):
        assert site in environment.where(expression).parents, expression  # from the wheel, not the checkout

    # the core alone has no backend: with no flags it names what the bundled repository needs
    alone = subprocess.run([str(environment.pyserve), "run", "--http-port", "0", "--grpc-port", "0",
                            "--metrics-port", "0"], cwd=tmp_path, env=_clean_env(), capture_output=True,
                           text=True, timeout=120, check=False)
    assert alone.returncode == 1, alone.stderr
    assert "pip install 'pyserve-server[examples]'" in alone.stderr
    assert all(backend in alone.stderr for backend in EXAMPLE_BACKENDS), alone.stderr

    environment.install("pyserve-server[examples]")
    assert {d for d in environment.distributions() if d.startswith("pyserve-backend-")} == set(EXAMPLE_BACKENDS)
    server = serve(environment, "--exit-timeout-secs", "10")
    url = server.wait_started(timeout=120)
    client = httpclient.InferenceServerClient(url)
    try:
        assert client.is_server_ready()
        assert sorted(e["name"] for e in client.get_model_repository_index()) == EXAMPLE_MODELS
    finally:
        client.close()
    np.testing.assert_array_equal(
        _infer(url, "identity_fp32", {"INPUT0": np.array([[1.5, -2.0, 3.25]], np.float32)}, "OUTPUT0"),
        [[1.5, -2.0, 3.25]])
    a = np.arange(4, dtype=np.float32).reshape(1, 4)  # add_sub: its model.py, from the wheel
    b = np.full((1, 4), 0.5, np.float32)
    np.testing.assert_array_equal(_infer(url, "add_sub", {"INPUT0": a, "INPUT1": b}, "OUTPUT0"), a + b)
    assert server.stop(timeout=30) == 0, server.stderr


def _add_model() -> bytes:
    """``z = x + y`` over FP32 [N, 3]; no config.pbtxt: the server completes one from the model."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "y"], ["z"])], "add",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", 3]) for name in ("x", "y")],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def test_core_and_onnx_plugin_wheels_serve_an_onnx_model(wheels: Wheels, tmp_path: Path, serve: Serve) -> None:
    environment = FreshEnvironment(tmp_path / "venv", wheels)
    environment.install(str(wheels.wheel("pyserve-server")), f"{wheels.wheel('pyserve-backend-onnxruntime')}[cpu]")
    installed = environment.distributions()
    assert {d for d in installed if d.startswith("pyserve-")} == {"pyserve-server", "pyserve-backend-onnxruntime"}
    assert "onnxruntime" in installed
    repository = tmp_path / "models"
    (repository / "add" / "1").mkdir(parents=True)
    (repository / "add" / "1" / "model.onnx").write_bytes(_add_model())

    server = serve(environment, "--model-repository", str(repository))
    url = server.wait_started(timeout=120)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = np.full((2, 3), 10.0, np.float32)
    np.testing.assert_array_equal(_infer(url, "add", {"x": x, "y": y}, "z"), x + y)
    assert server.stop(timeout=30) == 0, server.stderr
