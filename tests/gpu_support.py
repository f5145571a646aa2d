"""What the GPU checks (``tests/gpu/test_gpu.py``, run by ``scripts/gpu_check.sh``) need: finding
out whether a GPU and each GPU library can be used here, the model repository they serve, and a
``pyserve run`` subprocess with its three ports.

Imported as ``gpu_support`` (a name no other test folder uses). Nothing here imports a GPU
library at module level: each ``*_reason`` function imports what it checks and says why it
cannot be used, or returns None.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from suite_support import RunningServer, wait_for

from pyserve.testing import write_model

FEATURES = 16
"""Each model's input is FP32 ``[batch, FEATURES]``."""
HIDDEN = 8
"""The linear layer's width (the ONNX and TorchScript models compute the same function)."""
MAX_BATCH = 8

CHECK_ENV = "PYSERVE_GPU_CHECK"
"""Set by ``scripts/gpu_check.sh``: the tests that check the check's own plumbing run then."""
CPU_ONLY_ENV = "PYSERVE_GPU_CHECK_CPU_ONLY"
"""Set by ``scripts/gpu_check.sh --cpu-only``: the GPU checks skip even where there is a GPU."""
SKIP_ENV = "PYSERVE_GPU_CHECK_SKIP"
"""Comma-separated frameworks (``torch``, ``onnx``) whose models are left out (``--skip``)."""


# -- what can be used here -----------------------------------------------------------------------


@functools.cache
def gpu_reason() -> str | None:
    """None when ``nvidia-smi -L`` lists an NVIDIA GPU, else why there is none (cached)."""
    if os.environ.get(CPU_ONLY_ENV):
        return "scripts/gpu_check.sh --cpu-only"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no NVIDIA GPU here (nvidia-smi is not on PATH)"
    try:
        result = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi -L failed: {exc}"
    if result.returncode != 0 or not result.stdout.lstrip().startswith("GPU "):
        return f"nvidia-smi -L lists no GPU: {(result.stderr or result.stdout).strip()[:200]}"
    return None


@functools.cache
def cupy_reason() -> str | None:
    """None when cupy imports and sees a CUDA device, else why not."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # ImportError, or a CUDA error without a driver
        return f"cupy is not usable: {type(exc).__name__}: {exc}"
    return None if count > 0 else "cupy sees no CUDA device"


@functools.cache
def torch_cuda_reason() -> str | None:
    """None when torch imports and ``torch.cuda.is_available()``, else why not."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not installed: {exc}"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (a CPU build, or no driver)"
    return None


@functools.cache
def ort_cuda_reason() -> str | None:
    """None when onnxruntime offers CUDAExecutionProvider, else why not."""
    try:
        import onnxruntime
    except ImportError as exc:
        return f"onnxruntime is not installed: {exc}"
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return (f"onnxruntime {onnxruntime.__version__} has no CUDAExecutionProvider "
                "(onnxruntime-gpu is not installed: see docs/gpu.md)")
    return None


@functools.cache
def cuda_shm_reason() -> str | None:
    """None when tritonclient's CUDA shared-memory utilities import (they need cuda-python)."""
    try:
        import tritonclient.utils.cuda_shared_memory  # noqa: F401
    except Exception as exc:  # RuntimeError without cuda-python
        return f"tritonclient.utils.cuda_shared_memory is not usable: {exc}"
    return None


def module_reason(name: str) -> str | None:
    """None when module ``name`` imports, else the ImportError."""
    try:
        __import__(name)
    except ImportError as exc:
        return f"{name} is not installed: {exc}"
    return None


def nvidia_smi(fields: Sequence[str]) -> list[dict[str, str]]:
    """One dict per GPU of ``nvidia-smi --query-gpu=<fields>`` (values as printed, no units)."""
    result = subprocess.run(
        ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    return [dict(zip(fields, (v.strip() for v in line.split(",")))) for line in result.stdout.splitlines() if line]


# -- the model repository ------------------------------------------------------------------------


def weights() -> tuple[np.ndarray, np.ndarray]:
    """The linear layer both frameworks' models use (seeded: the same on every run)."""
    rng = np.random.default_rng(35)
    return (rng.standard_normal((FEATURES, HIDDEN)).astype(np.float32),
            rng.standard_normal(HIDDEN).astype(np.float32))


def sample(rows: int = 4, seed: int = 1) -> np.ndarray:
    """An FP32 ``[rows, FEATURES]`` input."""
    return np.random.default_rng(seed).standard_normal((rows, FEATURES)).astype(np.float32)


def expected(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the ONNX and TorchScript models compute: ``relu(x @ W + B)`` and ``x + x``."""
    w, b = weights()
    return np.maximum(x @ w + b, 0), x + x


def _group(kind: str) -> str:
    gpus = " gpus: [ 0 ]" if kind == "KIND_GPU" else ""
    return f"instance_group [ {{ kind: {kind} count: 1{gpus} }} ]"


def _onnx_bytes() -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    w, b = weights()
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["XW"]), helper.make_node("Add", ["XW", "B"], ["XWB"]),
         helper.make_node("Relu", ["XWB"], ["Y"]), helper.make_node("Add", ["X", "X"], ["Z"])],
        "gpu_check",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", FEATURES])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", HIDDEN]),
         helper.make_tensor_value_info("Z", TensorProto.FLOAT, ["N", FEATURES])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what every onnxruntime since 1.15 reads
    return bytes(model.SerializeToString())


def _onnx_config(kind: str) -> str:
    return f"""
        backend: "onnxruntime"
        max_batch_size: {MAX_BATCH}
        input [ {{ name: "X" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]
        output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ {HIDDEN} ] }},
                 {{ name: "Z" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]
        {_group(kind)}
    """


def _torchscript(path: Path) -> None:
    import torch

    w, b = weights()

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("w", torch.from_numpy(w.copy()))
            self.register_buffer("b", torch.from_numpy(b.copy()))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.relu(x @ self.w + self.b), x + x

    with warnings.catch_warnings():  # torch >= 2.9 deprecates TorchScript, which the backend still loads
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(Net()), str(path))


def _torch_config(kind: str) -> str:
    return f"""
        backend: "pytorch"
        max_batch_size: {MAX_BATCH}
        input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]
        output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ {HIDDEN} ] }},
                 {{ name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]
        {_group(kind)}
    """


PROBE_PY = '''
"""Reports where its input lives and whether the tensor it returns is the device array it made.

OUT = 2 * IN (cupy on the GPU when cupy is there, numpy otherwise), handed back with
pb_utils.Tensor.from_dlpack; REPORT is one JSON text per request: input_is_cpu, input_ptr
(device pointer of the input, through DLPack), result_ptr (the cupy array it computed),
output_is_cpu / output_ptr (what pb_utils made of it) and error (why the device path failed).
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

FACTOR = {factor}
OUTPUT = "OUT"


def _device_path(tensor, report):
    import cupy

    if tensor.is_cpu():
        array = cupy.asarray(tensor.as_numpy())
    else:
        array = cupy.from_dlpack(tensor)
        report["input_ptr"] = int(array.data.ptr)
    result = array * FACTOR + {offset}
    report["result_ptr"] = int(result.data.ptr)
    out = pb_utils.Tensor.from_dlpack(OUTPUT, result)
    report["output_is_cpu"] = bool(out.is_cpu())
    if not out.is_cpu():
        report["output_ptr"] = int(cupy.from_dlpack(out).data.ptr)
    return out


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "IN")
            report = {{"input_is_cpu": bool(tensor.is_cpu())}}
            try:
                out = _device_path(tensor, report)
            except Exception as exc:  # no cupy, or pb_utils refused a device tensor
                if not tensor.is_cpu():
                    raise
                report["error"] = f"{{type(exc).__name__}}: {{exc}}"
                host = tensor.as_numpy()
                out = pb_utils.Tensor(OUTPUT, (host * FACTOR + {offset}).astype(np.float32))
            rows = tensor.shape()[0]
            text = np.array([[json.dumps(report).encode()]] * rows, dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([out, pb_utils.Tensor("REPORT", text)]))
        return responses
'''


def _python_config(kind: str) -> str:
    return f"""
        backend: "python"
        max_batch_size: {MAX_BATCH}
        input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]
        output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ {FEATURES} ] }},
                 {{ name: "REPORT" data_type: TYPE_STRING dims: [ 1 ] }} ]
        parameters {{ key: "FORCE_CPU_ONLY_INPUT_TENSORS" value {{ string_value: "no" }} }}
        {_group(kind)}
    """


def _ensemble_config(first: str, first_in: str, first_out: str, extra_map: str = "") -> str:
    """``first`` (IN → its ``first_out``) then ``py_probe``: OUT and REPORT, plus ``extra_map``."""
    outputs = f"""output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ {FEATURES} ] }},
                 {{ name: "REPORT" data_type: TYPE_STRING dims: [ 1 ] }}"""
    if extra_map:
        outputs += ', { name: "SOURCE_REPORT" data_type: TYPE_STRING dims: [ 1 ] }'
    return f"""
        platform: "ensemble"
        max_batch_size: {MAX_BATCH}
        input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]
        {outputs} ]
        ensemble_scheduling {{ step [
          {{ model_name: "{first}" model_version: -1
            input_map {{ key: "{first_in}" value: "IN" }}
            output_map {{ key: "{first_out}" value: "middle" }} {extra_map} }},
          {{ model_name: "py_probe" model_version: -1
            input_map {{ key: "IN" value: "middle" }}
            output_map {{ key: "OUT" value: "OUT" }}
            output_map {{ key: "REPORT" value: "REPORT" }} }}
        ] }}
    """


IDENTITY_CONFIG = """
    backend: "identity"
    max_batch_size: 0
    input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


@dataclass(frozen=True)
class Repository:
    """A written repository: its path, the kind its device models got, what was left out and why."""

    path: Path
    device_kind: str
    left_out: dict[str, str]


def write_repository(root: Path, gpu: bool, skip: frozenset[str] = frozenset()) -> Repository:
    """Write the checks' models under ``root``: ``onnx``/``torch``/``py_probe``/``py_source`` on
    the device under test (KIND_GPU when ``gpu``, else KIND_CPU), their ``*_cpu`` twins, the
    ensembles ``ens_torch_py`` and ``ens_py_py``, and ``ident`` (identity, for shared memory).

    A framework in ``skip``, or one that cannot be imported here, leaves its models out
    (``left_out`` says why).
    """
    kind = "KIND_GPU" if gpu else "KIND_CPU"
    left_out: dict[str, str] = {}
    root.mkdir(parents=True, exist_ok=True)
    skipped = "left out by --skip"
    reason = skipped if "onnx" in skip else module_reason("onnx") or module_reason("onnxruntime")
    if reason is None:
        for name, group in (("onnx", kind), ("onnx_cpu", "KIND_CPU")):
            write_model(root, name, _onnx_config(group), files={"1/model.onnx": _onnx_bytes()})
    else:
        left_out["onnx"] = reason
    reason = skipped if "torch" in skip else module_reason("torch")
    if reason is None:
        for name, group in (("torch", kind), ("torch_cpu", "KIND_CPU")):
            _torchscript(write_model(root, name, _torch_config(group)) / "1" / "model.pt")
        write_model(root, "ens_torch_py", _ensemble_config("torch", "INPUT__0", "OUTPUT__1"))
    else:
        left_out["torch"] = reason
    for name, group, factor, offset in (("py_probe", kind, 2, 0), ("py_probe_cpu", "KIND_CPU", 2, 0),
                                        ("py_source", kind, 1, 1)):
        write_model(root, name, _python_config(group),
                    files={"1/model.py": PROBE_PY.format(factor=factor, offset=offset)})
    write_model(root, "ens_py_py", _ensemble_config(
        "py_source", "IN", "OUT", 'output_map { key: "REPORT" value: "SOURCE_REPORT" }'))
    write_model(root, "ident", IDENTITY_CONFIG)
    return Repository(root, kind, left_out)


def reports(result: Any, name: str = "REPORT") -> list[dict[str, Any]]:
    """The JSON reports of a probe output (one per row) from a tritonclient result."""
    return [json.loads(item) for item in result.as_numpy(name).reshape(-1)]


def carries_no_data(result: Any, name: str) -> bool:
    """Whether a tritonclient (HTTP or gRPC) result's output ``name`` came without data (it was
    written to shared memory instead)."""
    output = result.get_output(name)
    if isinstance(output, dict):
        return "data" not in output and "binary_data_size" not in output.get("parameters", {})
    return not any(result.get_response().raw_output_contents) and not output.contents.ListFields()


# -- a real `pyserve run` ------------------------------------------------------------------------

_PORT = re.compile(r"Started (HTTPService|GRPCInferenceService|Metrics Service) at \S+:(\d+)")


class Server(RunningServer):
    """``pyserve run`` (loopback, ports chosen by the system) with its HTTP, gRPC and metrics ports."""

    def __init__(self, args: Sequence[str]) -> None:
        super().__init__(["--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1", *args])

    def ports(self, timeout: float = 180) -> dict[str, int]:
        """``{"HTTPService": port, "GRPCInferenceService": port, "Metrics Service": port}`` once all
        three are logged.

        :raises AssertionError: the server exited or did not log them within ``timeout`` s.
        """
        found: dict[str, int] = {}

        def ready() -> bool:
            for line in list(self.lines):
                match = _PORT.search(line)
                if match:
                    found[match.group(1)] = int(match.group(2))
            if self.process.poll() is not None:
                raise AssertionError("pyserve run exited:\n" + self.stderr[-4000:])
            return len(found) == 3

        wait_for(ready, timeout, "pyserve run to log its three ports")
        return found
