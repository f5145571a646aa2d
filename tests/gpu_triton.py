"""The optional comparison of ``tests/gpu/test_gpu.py``: one GPU model's throughput on pyserve and on
Triton 2.51 (the ``tritonserver`` of the ``nvidia-pytriton`` wheel, found as
``benchmarks/_triton.py`` finds it) on the same GPU, in the same run.

The model is one Python-backend ``model.py`` both servers load unmodified: a 1024 x 1024 FP32
linear layer and ReLU in torch on the instance's device. Triton's stub embeds its own
interpreter, which does not read ``PYTHONPATH``, so the file names the site directories torch
is in.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from suite_support import REPO_ROOT, wait_for

from pyserve.testing import write_model

TRITON_VENV_ENV = "PYSERVE_GPU_TRITON_VENV"
"""A venv holding ``nvidia-pytriton`` and numpy < 2 (``scripts/gpu_check.sh --triton-venv``)."""
WIDTH = 1024
MODEL = "torch_linear"

MODEL_PY = '''
"""relu(x @ W) in torch on the instance's device (W seeded: the same on both servers)."""

import sys

for path in {site_dirs!r}:
    if path not in sys.path:
        sys.path.append(path)

import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        kind = args["model_instance_kind"]
        self.device = torch.device("cuda", int(args["model_instance_device_id"])) if kind == "GPU" else torch.device("cpu")
        weights = torch.randn({width}, {width}, generator=torch.Generator().manual_seed(0)) / {width} ** 0.5
        self.weights = weights.to(self.device)

    def execute(self, requests):
        responses = []
        for request in requests:
            x = torch.from_numpy(pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()).to(self.device)
            y = torch.relu(x @ self.weights).cpu().numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", y)]))
        return responses
'''


def _helpers() -> ModuleType:
    """``benchmarks/_triton.py`` (a script folder, not a package)."""
    spec = importlib.util.spec_from_file_location("_triton_for_gpu_check", REPO_ROOT / "benchmarks" / "_triton.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def find_triton() -> tuple[Any, str]:
    """The Triton install to compare with, or None and why there is none."""
    helpers = _helpers()
    venv = Path(os.environ.get(TRITON_VENV_ENV) or helpers.default_venv())
    install = helpers.find(venv)
    if install is None:
        return None, (f"no nvidia-pytriton with numpy < 2 in {venv} nor here "
                      f"(scripts/gpu_check.sh --triton-venv; docs/gpu.md says how to carry it)")
    return install, ""


def write_linear_model(root: Path, kind: str) -> Path:
    """The comparison's repository: ``torch_linear`` with one instance of ``kind``."""
    import torch

    site_dirs = sorted({str(Path(torch.__file__).resolve().parent.parent), *(
        p for p in sys.path if p.endswith(("site-packages", "dist-packages")))})
    gpus = " gpus: [ 0 ]" if kind == "KIND_GPU" else ""
    write_model(root, MODEL, f"""
        backend: "python"
        max_batch_size: 0
        input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1, {WIDTH} ] }} ]
        output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1, {WIDTH} ] }} ]
        instance_group [ {{ kind: {kind} count: 1{gpus} }} ]
    """, files={"1/model.py": MODEL_PY.format(site_dirs=site_dirs, width=WIDTH)})
    return root


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Triton:
    """A ``tritonserver`` on loopback ports serving ``repository``; ``close`` stops it."""

    def __init__(self, install: Any, repository: Path, work: Path) -> None:
        backends = install.prepare_backends(work / "triton-backends")
        self.grpc_port = _free_port()
        self.log_path = work / "triton.log"
        command = [str(install.binary), "--model-repository", str(repository), "--backend-directory", str(backends),
                   "--http-address", "127.0.0.1", "--http-port", str(_free_port()), "--grpc-address", "127.0.0.1",
                   "--grpc-port", str(self.grpc_port), "--allow-metrics", "false", "--exit-on-error", "false"]
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=install.environment())

    def wait_ready(self, timeout: float = 180) -> str | None:
        """None once the model is READY; else the reason (the server exited, or the model failed)."""
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return "tritonserver exited: " + self.log_path.read_text()[-2000:]
                try:
                    if client.is_server_ready() or client.is_server_live():
                        index = client.get_model_repository_index(as_json=True).get("models", [])
                        entry = next((m for m in index if m.get("name") == MODEL), {})
                        if entry.get("state") == "READY":
                            return None
                        if entry.get("state") == "UNAVAILABLE":
                            return f"Triton could not load the model: {entry.get('reason', '')}"
                except Exception:  # not listening yet
                    pass
                time.sleep(0.5)
            return "Triton did not become ready: " + self.log_path.read_text()[-2000:]
        finally:
            client.close()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()


def infer(url: str, x: np.ndarray) -> np.ndarray:
    """One gRPC request to ``torch_linear``."""
    client = grpcclient.InferenceServerClient(url)
    try:
        tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return client.infer(MODEL, [tensor]).as_numpy("OUTPUT0")
    finally:
        client.close()


def throughput(url: str, x: np.ndarray, seconds: float, concurrency: int) -> float:
    """Requests per second that ``concurrency`` gRPC clients, each one request at a time,
    complete in ``seconds`` (after one warm-up request each).

    :raises AssertionError: a request failed.
    """
    done = [0] * concurrency
    errors: list[BaseException] = []
    start = threading.Barrier(concurrency + 1)
    stop = threading.Event()

    def client_loop(index: int) -> None:
        client = grpcclient.InferenceServerClient(url)
        tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        try:
            client.infer(MODEL, [tensor])
            start.wait()
            while not stop.is_set():
                client.infer(MODEL, [tensor])
                done[index] += 1
        except BaseException as exc:  # noqa: B036 - reported to the caller
            errors.append(exc)
            stop.set()
            start.abort()
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    with contextlib.suppress(threading.BrokenBarrierError):  # a client failed: reported below
        start.wait(timeout=120)
    began = time.monotonic()
    time.sleep(seconds)
    stop.set()
    elapsed = time.monotonic() - began
    wait_for(lambda: not any(t.is_alive() for t in threads), 120, "the load clients to finish")
    assert not errors, f"a request failed: {errors[0]!r}"
    return sum(done) / elapsed


def compare(work: Path, kind: str, install: Any, seconds: float = 5.0, concurrency: int = 8) -> dict[str, float] | str:
    """Serve ``torch_linear`` (one ``kind`` instance) on Triton and on ``pyserve run``, check
    they answer alike, and measure each in turn: the figures, or why Triton could not serve it.

    :raises AssertionError: pyserve failed, or the two answers differ.
    """
    from gpu_support import Server

    repository = write_linear_model(work / "linear-repo", kind)
    x = np.random.default_rng(2).standard_normal((8, WIDTH)).astype(np.float32)
    try:
        triton = Triton(install, repository, work)
    except RuntimeError as exc:  # prepare_backends: no stub for this Python, or its libpython missing
        return str(exc)
    try:
        reason = triton.wait_ready()
        if reason is not None:
            return reason
        server = Server(["--model-repository", str(repository), "--frontend-processes", "0"])
        try:
            url = f"127.0.0.1:{server.ports()['GRPCInferenceService']}"
            triton_url = f"127.0.0.1:{triton.grpc_port}"
            np.testing.assert_allclose(infer(url, x), infer(triton_url, x), rtol=1e-5, atol=1e-5)
            pyserve_rate = throughput(url, x, seconds, concurrency)
            triton_rate = throughput(triton_url, x, seconds, concurrency)
        finally:
            server.close()
    finally:
        triton.close()
    return {"pyserve req/s": round(pyserve_rate, 1), "Triton req/s": round(triton_rate, 1),
            "pyserve/Triton": round(pyserve_rate / triton_rate, 3) if triton_rate else float("nan")}
