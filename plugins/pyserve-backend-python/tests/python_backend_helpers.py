"""Helpers for the python backend tests: model repositories and servers (imported by conftest)."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pyserve_backend_python

from pyserve.host.plugins import PluginHost
from pyserve.server.core import Server, ServerOptions, ServerThread

MODELS = Path(__file__).resolve().parent / "models"

PROCESS_MODE = 'parameters { key: "execution_mode" value { string_value: "process" } }\n'
"""Config text that runs a Python model in a worker process (``execution_mode: "process"``)."""


ADD_100_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""
"""Config of a model with one INT32 input ``IN`` and output ``OUT`` of shape [1], unbatched."""

ADD_100_SOURCE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + 100)])
                for r in requests]
"""
"""model.py answering ``OUT = IN + 100`` for each request (a target for BLS and model control)."""


def copy_models(repo: Path, names: list[str] | None = None) -> Path:
    """Copy models from ``models/`` into ``repo`` (all of them by default)."""
    repo.mkdir(parents=True, exist_ok=True)
    for source in sorted(MODELS.iterdir()):
        if source.is_dir() and (names is None or source.name in names):
            shutil.copytree(source, repo / source.name, ignore=shutil.ignore_patterns("__pycache__"))
    return repo


def write_python_model(repo: Path, name: str, config: str | None, model_py: str, version: int = 1) -> Path:
    """Write ``repo/name`` with a config.pbtxt (unless None) and ``<version>/model.py``."""
    model_dir = repo / name
    (model_dir / str(version)).mkdir(parents=True, exist_ok=True)
    if config is not None:
        (model_dir / "config.pbtxt").write_text(textwrap.dedent(config))
    (model_dir / str(version) / "model.py").write_text(textwrap.dedent(model_py))
    return model_dir


def start(repo: Path, **options: object) -> ServerThread:
    """A server with the python backend on free loopback ports (HTTP and gRPC); models that
    fail to load are served UNAVAILABLE (``exit_on_error`` False unless given)."""
    host = PluginHost(extra_backends={"python": pyserve_backend_python}, use_entry_points=False)
    options.setdefault("exit_on_error", False)
    settings = ServerOptions(
        model_repositories=[repo], host="127.0.0.1", http_port=0, grpc_port=0, **options  # type: ignore[arg-type]
    )
    thread = ServerThread(Server(settings, host))
    thread.start()
    return thread
