"""Triton's own compiled Python backend (``libtriton_python.so`` from the nvidia-pytriton
wheel, unchanged) hosted by pyserve, serving model.py files.

The wheel's layout is mirrored in a temporary directory (the library's RPATH is relative to
its own location, and Triton looks for ``triton_python_backend_stub`` next to the library).
The stub embeds CPython and was built against numpy 1.x, so the models run in a small
environment with ``numpy<2`` given to them through Triton's own ``EXECUTION_ENV_PATH``
parameter; pyserve itself keeps its numpy.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from pyserve.testing import ServerFactory, shared_python_environment, write_model

MODELS = Path(__file__).resolve().parent / "python_models"
pytestmark = pytest.mark.timeout(300)


def _pytriton_root() -> Path:
    spec = importlib.util.find_spec("pytriton")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("nvidia-pytriton is not installed (pip install nvidia-pytriton==0.7.0)")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def triton_backends(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A backend directory holding the wheel's python backend and the stub for this Python."""
    root = _pytriton_root()
    source = root / "tritonserver" / "backends" / "python"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not (source / "libtriton_python.so").is_file() or not stub.is_file():
        pytest.skip(f"the nvidia-pytriton wheel has no python backend for Python {version}")
    site = tmp_path_factory.mktemp("pytriton-site")
    backends = site / "pytriton" / "tritonserver" / "backends"
    python = backends / "python"
    python.mkdir(parents=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy(source / name, python / name)
    shutil.copy(stub, python / "triton_python_backend_stub")
    (site / "nvidia_pytriton.libs").symlink_to(root.parent / "nvidia_pytriton.libs", target_is_directory=True)
    return backends


@pytest.fixture(scope="session")
def stub_environment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with numpy<2 for the models (the stub's pybind11 needs numpy 1)."""
    return shared_python_environment(tmp_path_factory, ["numpy<2"])


@pytest.fixture
def stub_libpython(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the stub load the libpython of this interpreter (same patch level as its stdlib)."""
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and any(Path(libdir).glob("libpython3*.so*")):
        monkeypatch.setenv("LD_LIBRARY_PATH", os.pathsep.join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")])))


def _python_model(repo: Path, name: str, source: str, config: str, env: Path) -> None:
    model_dir = write_model(repo, name, f"""
        backend: "python"
        runtime: "libtriton_python.so"
        {config}
        parameters {{ key: "EXECUTION_ENV_PATH" value: {{ string_value: "{env}" }} }}
    """)
    shutil.copy(MODELS / source, model_dir / "1" / "model.py")


ADD_ONE = """
    max_batch_size: 0
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""
COUNT_UP = """
    max_batch_size: 0
    model_transaction_policy { decoupled: true }
    input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""
BLS_DOUBLE = """
    max_batch_size: 0
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] },
             { name: "COUNTED", data_type: TYPE_INT32, dims: [ -1 ] } ]
"""


@pytest.fixture
def python_server(
    tmp_path: Path, triton_backends: Path, stub_environment: Path, stub_libpython: None, pyserve_server_factory: ServerFactory
) -> Any:
    repo = tmp_path / "repo"
    _python_model(repo, "add_one", "add_one.py", ADD_ONE, stub_environment)
    _python_model(repo, "count_up", "count_up.py", COUNT_UP, stub_environment)
    _python_model(repo, "bls_double", "bls_double.py", BLS_DOUBLE, stub_environment)
    return pyserve_server_factory(repo, backend_directory=str(triton_backends))


def test_model_py_through_triton_python_backend(python_server: Any) -> None:
    with httpclient.InferenceServerClient(python_server.url) as client:
        for model in ("add_one", "count_up", "bls_double"):
            assert client.is_model_ready(model), client.get_model_repository_index()
        x = np.array([1.0, 2.5, 0.5], dtype=np.float32)
        inp = httpclient.InferInput("INPUT0", [3], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("add_one", [inp]).as_numpy("OUTPUT0"), [2.0, 3.5, 1.5])
        inp = httpclient.InferInput("INPUT0", [1], "FP32")
        inp.set_data_from_numpy(np.array([-1.0], dtype=np.float32))
        with pytest.raises(Exception, match="negative values are not allowed"):
            client.infer("add_one", [inp])
    loaded = [b for b in python_server.server.plugins.loaded_backends() if b.info.source.startswith("native:")]
    assert [b.info.source.rsplit("/", 1)[1] for b in loaded] == ["libtriton_python.so"]


def test_decoupled_model_py(python_server: Any) -> None:
    received: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(python_server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: received.put((result, error)))
        inp = grpcclient.InferInput("IN", [1], "INT32")
        inp.set_data_from_numpy(np.array([4], dtype=np.int32))
        client.async_stream_infer("count_up", [inp], enable_empty_final_response=True)
        values = []
        while True:
            result, error = received.get(timeout=60)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            values.append(int(result.as_numpy("OUT")[0]))
        client.stop_stream()
    assert values == [0, 1, 2, 3]


def test_bls_from_model_py(python_server: Any) -> None:
    with httpclient.InferenceServerClient(python_server.url) as client:
        inp = httpclient.InferInput("INPUT0", [2], "FP32")
        inp.set_data_from_numpy(np.array([1.0, 4.0], dtype=np.float32))
        result = client.infer("bls_double", [inp])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [4.0, 10.0])  # (x + 1) * 2
        np.testing.assert_array_equal(result.as_numpy("COUNTED"), [0, 1, 2])  # decoupled BLS
