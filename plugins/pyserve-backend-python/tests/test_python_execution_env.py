"""Triton's ``EXECUTION_ENV_PATH``: a model runs in its own Python environment (a worker process
started with that environment's interpreter), given as a directory or a packed archive.

The environments are virtual environments made at test time (``python -m venv --without-pip``,
no network). Each holds a package ``httpx`` of its own whose ``__version__`` is
``"from-the-environment"``: the server has the real httpx, so a model that reports the version
it imported shows whose packages come first in its worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from python_backend_helpers import start, write_python_model
from tritonclient.utils import InferenceServerException

from pyserve.server.core import ServerThread
from pyserve.testing import python_environment, shared_python_environment

pytestmark = pytest.mark.timeout(180)

SHADOW = "from-the-environment"

CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "WHERE" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

MODEL_PY = """
import os
import sys

import httpx  # the environment's own copy when it runs there
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        where = f"{httpx.__version__}|{sys.prefix}|{os.getpid()}"
        out = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", values + 1),
                pb_utils.Tensor("WHERE", np.array([where.encode()], dtype=np.object_)),
            ]))
        return out
"""

AUTO_COMPLETE_PY = MODEL_PY + """
    @staticmethod
    def auto_complete_config(config):
        assert httpx.__version__ == "from-the-environment"  # runs in the environment too
        config.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [-1]})
        config.add_output({"name": "OUT", "data_type": "TYPE_INT32", "dims": [-1]})
        config.add_output({"name": "WHERE", "data_type": "TYPE_STRING", "dims": [1]})
        config.set_max_batch_size(0)
        return config
"""


@contextmanager
def _serving(repo: Path, **options: object) -> Iterator[ServerThread]:
    server = start(repo, **options)
    try:
        yield server
    finally:
        server.stop()


def _parameter(value: str, mode: str | None = None) -> str:
    text = f'parameters {{ key: "EXECUTION_ENV_PATH" value {{ string_value: "{value}" }} }}\n'
    if mode is not None:
        text += f'parameters {{ key: "execution_mode" value {{ string_value: "{mode}" }} }}\n'
    return text


@pytest.fixture(scope="module")
def environment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment of this Python with its own ``httpx`` package."""
    root = python_environment(tmp_path_factory.mktemp("model-env") / "env")
    site = Path(subprocess.run(
        [str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    (site / "httpx").mkdir(parents=True)
    (site / "httpx" / "__init__.py").write_text(f'__version__ = "{SHADOW}"\n')
    return root


@pytest.fixture(scope="module")
def packed(environment: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same environment as a gzipped tar archive (as conda-pack writes them)."""
    archive = tmp_path_factory.mktemp("packed") / "env.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for entry in sorted(environment.iterdir()):
            tar.add(entry, arcname=entry.name)
    return archive


def _ask(server: object, model: str) -> tuple[np.ndarray, str, str, int]:
    with httpclient.InferenceServerClient(server.url) as client:  # type: ignore[attr-defined]
        data = httpclient.InferInput("IN", [3], "INT32")
        data.set_data_from_numpy(np.array([1, 2, 3], dtype=np.int32))
        result = client.infer(model, [data])
    version, prefix, pid = result.as_numpy("WHERE")[0].decode().split("|")
    return result.as_numpy("OUT"), version, prefix, int(pid)


def _reason(server: object, model: str) -> str:
    with httpclient.InferenceServerClient(server.url) as client:  # type: ignore[attr-defined]
        index = client.get_model_repository_index()
    return next(entry.get("reason", "") for entry in index if entry["name"] == model)


def test_a_directory_environment_runs_the_model_with_its_own_packages(tmp_path: Path, environment: Path) -> None:
    repo = tmp_path / "repo"
    write_python_model(repo, "own_env", CONFIG + _parameter(str(environment)), MODEL_PY)
    write_python_model(repo, "server_env", CONFIG, MODEL_PY)
    with _serving(repo) as server:
        out, version, prefix, pid = _ask(server, "own_env")
        assert out.tolist() == [2, 3, 4]
        assert version == SHADOW and Path(prefix) == environment  # its own interpreter and httpx
        assert pid != os.getpid()  # a worker process (process mode is implied)
        os.kill(pid, signal.SIGKILL)  # a worker that dies is started again, in the environment
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                out, version, prefix, again = _ask(server, "own_env")
                break
            except InferenceServerException as exc:
                assert "exited with code" in str(exc)
        assert again != pid and version == SHADOW and Path(prefix) == environment
        _, version, prefix, pid = _ask(server, "server_env")
        assert version != SHADOW and pid == os.getpid()  # the other model: in-process, server's httpx


def test_a_packed_environment_is_unpacked_per_load_and_removed_at_unload(tmp_path: Path, packed: Path) -> None:
    repo = tmp_path / "repo"
    model_dir = write_python_model(repo, "packed_env", CONFIG + _parameter("$$TRITON_MODEL_DIRECTORY/env.tar.gz"),
                                   MODEL_PY)
    (model_dir / "env.tar.gz").write_bytes(packed.read_bytes())
    with _serving(repo, model_control_mode="explicit", load_models=["packed_env"]) as server:
        out, version, prefix, _ = _ask(server, "packed_env")
        assert out.tolist() == [2, 3, 4] and version == SHADOW
        unpacked = Path(prefix)
        assert unpacked.is_dir() and unpacked != packed.parent
        with httpclient.InferenceServerClient(server.url) as client:
            client.unload_model("packed_env")
        assert not unpacked.exists()


def test_auto_complete_config_runs_in_the_environment(tmp_path: Path, environment: Path) -> None:
    repo = tmp_path / "repo"
    write_python_model(repo, "completed", 'backend: "python"\n' + _parameter(str(environment)), AUTO_COMPLETE_PY)
    with _serving(repo) as server:
        out, version, _, _ = _ask(server, "completed")
        assert out.tolist() == [2, 3, 4] and version == SHADOW
        with httpclient.InferenceServerClient(server.url) as client:
            config = client.get_model_config("completed")
        assert [o["name"] for o in config["output"]] == ["OUT", "WHERE"]


def test_unusable_environments_leave_the_model_unavailable_with_the_reason(tmp_path: Path, environment: Path) -> None:
    repo = tmp_path / "repo"
    write_python_model(repo, "missing", CONFIG + _parameter(str(tmp_path / "nowhere")), MODEL_PY)
    write_python_model(repo, "thread_mode", CONFIG + _parameter(str(environment), "thread"), MODEL_PY)
    not_archive = write_python_model(repo, "not_archive", CONFIG + _parameter("$$TRITON_MODEL_DIRECTORY/env.tar.gz"),
                                     MODEL_PY)
    (not_archive / "env.tar.gz").write_bytes(b"not a tar archive")
    other = tmp_path / "other-python" / "bin"
    other.mkdir(parents=True)
    (other / "python3").write_text("#!/bin/sh\necho 2.7\n")
    (other / "python3").chmod(0o755)
    write_python_model(repo, "other_version", CONFIG + _parameter(str(other.parent)), MODEL_PY)
    write_python_model(repo, "fine", CONFIG, MODEL_PY)
    with _serving(repo) as server:
        assert "is neither a directory nor an archive file" in _reason(server, "missing")
        assert "EXECUTION_ENV_PATH needs execution_mode 'process'" in _reason(server, "thread_mode")
        assert "cannot be unpacked" in _reason(server, "not_archive")
        reason = _reason(server, "other_version")
        assert "holds Python 2.7, but pyserve runs on Python" in reason, reason
        assert _ask(server, "fine")[0].tolist() == [2, 3, 4]  # the others load as usual
        assert json.dumps(_reason(server, "fine")) == '""'


NUMPY_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", values + 1),
                pb_utils.Tensor("WHERE", np.array([f"{np.__version__}|-|0".encode()], dtype=np.object_)),
            ]))
        return out
"""


@pytest.fixture(scope="module")
def numpy1_environment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with ``numpy<2`` (what a model built for Triton's stub often pins)."""
    return shared_python_environment(tmp_path_factory, ["numpy<2"])


def test_the_model_and_the_worker_run_on_the_environments_numpy(tmp_path: Path, numpy1_environment: Path) -> None:
    if np.__version__.startswith("1."):
        pytest.skip("the server itself has numpy 1: the environment's would not be told apart")
    repo = tmp_path / "repo"
    write_python_model(repo, "numpy1", CONFIG + _parameter(str(numpy1_environment)), NUMPY_PY)
    with _serving(repo) as server:
        out, version, _, _ = _ask(server, "numpy1")
    assert out.tolist() == [2, 3, 4]
    assert version.startswith("1.")  # pyserve's worker code ran on it too
