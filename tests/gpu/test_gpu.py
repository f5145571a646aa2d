"""GPU paths against a real ``pyserve run`` (marker ``gpu``: skipped without an NVIDIA GPU).

``scripts/gpu_check.sh`` runs this module and turns its results into the table docs/gpu.md
holds; docs/gpu.md says what each check proves. Every check is one test, so a failure names
its path; figures go into the JUnit report as ``record_property`` entries.

``test_repository_serves_on_cpu`` checks the checks' own plumbing (the models, the probe
``model.py``, the ensembles, the launcher) on any machine; it runs under the script
(``PYSERVE_GPU_CHECK`` set), which ``tests/gpu/test_gpu_check.py`` runs in CI with ``--cpu-only``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from gpu_support import (
    CHECK_ENV,
    SKIP_ENV,
    Repository,
    Server,
    carries_no_data,
    cuda_shm_reason,
    cupy_reason,
    expected,
    gpu_reason,
    module_reason,
    nvidia_smi,
    ort_cuda_reason,
    reports,
    sample,
    torch_cuda_reason,
    write_repository,
)
from gpu_triton import compare, find_triton
from suite_support import wait_for
from tritonclient.utils import InferenceServerException

MATMUL_TOLERANCE = 2e-3
"""rtol/atol for the linear layer on a GPU against the CPU: cuBLAS may use TF32 (10-bit mantissa)
for FP32 products; the elementwise output must be exactly equal."""

Record = Callable[[str, object], None]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Repository:
    skip = frozenset(filter(None, os.environ.get(SKIP_ENV, "").split(",")))
    return write_repository(tmp_path_factory.mktemp("gpu") / "repo", gpu=gpu_reason() is None, skip=skip)


@pytest.fixture(scope="module")
def server(repository: Repository) -> Iterator[tuple[Server, dict[str, int]]]:
    process = Server(["--model-repository", str(repository.path), "--frontend-processes", "0",
                      "--metrics-interval-ms", "200"])
    try:
        ports = process.ports()
        yield process, ports
    finally:
        process.close()
        _keep_log(process, "pyserve-server.log")


def _keep_log(process: Server, name: str) -> None:
    """Under the script, the server's log goes into its --out directory (it comes back with the results)."""
    out = os.environ.get("PYSERVE_GPU_CHECK_OUT")
    if out:
        Path(out, name).write_text(process.stderr)


@pytest.fixture(scope="module")
def http(server: tuple[Server, dict[str, int]]) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server[1]['HTTPService']}", network_timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc(server: tuple[Server, dict[str, int]]) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server[1]['GRPCInferenceService']}")
    yield client
    client.close()


def _need(*reasons: str | None) -> None:
    for reason in reasons:
        if reason is not None:
            pytest.skip(reason)


def _ready(http: httpclient.InferenceServerClient, repository: Repository, name: str) -> None:
    """Skip when ``name`` was left out here; fail with the server's reason when it did not load."""
    for framework, reason in repository.left_out.items():
        if name.startswith(framework) or (framework == "torch" and name == "ens_torch_py"):
            pytest.skip(reason)
    entries = {e["name"]: e for e in http.get_model_repository_index()}
    entry = entries.get(name, {})
    assert entry.get("state") == "READY", f"model '{name}' is not READY: {entry}"


INPUT_NAMES = {"onnx": "X", "onnx_cpu": "X", "torch": "INPUT__0", "torch_cpu": "INPUT__0"}
"""The input of each model that does not call it ``IN``."""


def _infer(client: Any, module: Any, model: str, x: np.ndarray, outputs: list[str]) -> Any:
    tensor = module.InferInput(INPUT_NAMES.get(model, "IN"), list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor], outputs=[module.InferRequestedOutput(n) for n in outputs])


def _log_says(server: tuple[Server, dict[str, int]], text: str) -> None:
    assert text in server[0].stderr, f"the server log does not say {text!r}:\n{server[0].stderr[-3000:]}"


# -- the plumbing, on any machine ----------------------------------------------------------------


@pytest.mark.skipif(CHECK_ENV not in os.environ, reason="run by scripts/gpu_check.sh (tests/gpu/test_gpu_check.py)")
def test_repository_serves_on_cpu(http: httpclient.InferenceServerClient, repository: Repository,
                                  server: tuple[Server, dict[str, int]]) -> None:
    """Every model of the checks loads and answers (the CPU twins on any machine)."""
    x = sample()
    y, z = expected(x)
    names = ["py_probe_cpu", "py_probe", "py_source", "ens_py_py", "ident"]
    if "onnx" not in repository.left_out:
        names += ["onnx", "onnx_cpu"]
    if "torch" not in repository.left_out:
        names += ["torch", "torch_cpu", "ens_torch_py"]
    for name in names:
        _ready(http, repository, name)
    if "onnx" not in repository.left_out:
        result = _infer(http, httpclient, "onnx_cpu", x, ["Y", "Z"])
        np.testing.assert_allclose(result.as_numpy("Y"), y, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(result.as_numpy("Z"), z)
    if "torch" not in repository.left_out:
        result = _infer(http, httpclient, "torch_cpu", x, ["OUTPUT__0", "OUTPUT__1"])
        np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), y, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), z)
        result = _infer(http, httpclient, "ens_torch_py", x, ["OUT", "REPORT"])
        np.testing.assert_array_equal(result.as_numpy("OUT"), 4 * x)
    result = _infer(http, httpclient, "py_probe_cpu", x, ["OUT", "REPORT"])
    np.testing.assert_array_equal(result.as_numpy("OUT"), 2 * x)
    assert all(r["input_is_cpu"] for r in reports(result)) and len(reports(result)) == len(x)
    result = _infer(http, httpclient, "ens_py_py", x, ["OUT", "REPORT", "SOURCE_REPORT"])
    np.testing.assert_array_equal(result.as_numpy("OUT"), 2 * (x + 1))
    assert reports(result, "SOURCE_REPORT")[0]["input_is_cpu"] is True
    metrics = _metrics(server)
    assert "nv_cpu_utilization" in metrics and "nv_inference_count" in metrics


# -- KIND_GPU instances --------------------------------------------------------------------------


@pytest.mark.gpu
def test_onnxruntime_kind_gpu_matches_cpu(http: httpclient.InferenceServerClient, repository: Repository,
                                          server: tuple[Server, dict[str, int]], record_property: Record) -> None:
    _need(ort_cuda_reason())
    _ready(http, repository, "onnx")
    _log_says(server, "model 'onnx': GPU instances use CUDAExecutionProvider (GPU 0)")
    x = sample(8)
    gpu = _infer(http, httpclient, "onnx", x, ["Y", "Z"])
    cpu = _infer(http, httpclient, "onnx_cpu", x, ["Y", "Z"])
    np.testing.assert_array_equal(gpu.as_numpy("Z"), cpu.as_numpy("Z"))
    np.testing.assert_allclose(gpu.as_numpy("Y"), cpu.as_numpy("Y"), rtol=MATMUL_TOLERANCE, atol=MATMUL_TOLERANCE)
    record_property("onnx GPU-CPU max abs diff", float(np.max(np.abs(gpu.as_numpy("Y") - cpu.as_numpy("Y")))))


@pytest.mark.gpu
def test_pytorch_kind_gpu_matches_cpu(http: httpclient.InferenceServerClient, repository: Repository,
                                      server: tuple[Server, dict[str, int]], record_property: Record) -> None:
    _need(torch_cuda_reason())
    _ready(http, repository, "torch")
    _log_says(server, "model 'torch': GPU instances run on cuda:0")
    x = sample(8)
    gpu = _infer(http, httpclient, "torch", x, ["OUTPUT__0", "OUTPUT__1"])
    cpu = _infer(http, httpclient, "torch_cpu", x, ["OUTPUT__0", "OUTPUT__1"])
    np.testing.assert_array_equal(gpu.as_numpy("OUTPUT__1"), cpu.as_numpy("OUTPUT__1"))
    np.testing.assert_allclose(gpu.as_numpy("OUTPUT__0"), cpu.as_numpy("OUTPUT__0"),
                               rtol=MATMUL_TOLERANCE, atol=MATMUL_TOLERANCE)
    record_property("torch GPU-CPU max abs diff",
                    float(np.max(np.abs(gpu.as_numpy("OUTPUT__0") - cpu.as_numpy("OUTPUT__0")))))


# -- DLPack on the device: the Python backend and ensembles --------------------------------------


@pytest.mark.gpu
def test_python_model_returns_device_tensor_without_copy(
    http: httpclient.InferenceServerClient, repository: Repository, record_property: Record
) -> None:
    """``pb_utils.Tensor.from_dlpack(cupy_array)`` keeps the array: same device pointer."""
    _need(cupy_reason())
    _ready(http, repository, "py_probe")
    x = sample()
    result = _infer(http, httpclient, "py_probe", x, ["OUT", "REPORT"])
    report = reports(result)[0]
    record_property("py_probe report", report)
    np.testing.assert_array_equal(result.as_numpy("OUT"), 2 * x)
    assert "error" not in report, f"the device path failed in model.py: {report['error']}"
    assert report["output_is_cpu"] is False, f"the returned tensor was moved to the host: {report}"
    assert report["output_ptr"] == report["result_ptr"], f"the returned tensor is a copy: {report}"


@pytest.mark.gpu
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_python_model_receives_gpu_input(
    protocol: str, http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient,
    repository: Repository, record_property: Record,
) -> None:
    """An input in CUDA shared memory reaches a FORCE_CPU_ONLY_INPUT_TENSORS "no" model on the GPU."""
    _need(cupy_reason(), cuda_shm_reason())
    _ready(http, repository, "py_probe")
    from tritonclient.utils import cuda_shared_memory as cudashm

    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    x = sample()
    region = cudashm.create_shared_memory_region(f"probe_in_{protocol}", x.nbytes, 0)
    try:
        cudashm.set_shared_memory_region(region, [x])
        client.register_cuda_shared_memory(f"probe_in_{protocol}", cudashm.get_raw_handle(region), 0, x.nbytes)
        tensor = module.InferInput("IN", list(x.shape), "FP32")
        tensor.set_shared_memory(f"probe_in_{protocol}", x.nbytes)
        result = client.infer("py_probe", [tensor], outputs=[module.InferRequestedOutput(n) for n in ("OUT", "REPORT")])
    finally:
        client.unregister_cuda_shared_memory(f"probe_in_{protocol}")
        cudashm.destroy_shared_memory_region(region)
    np.testing.assert_array_equal(result.as_numpy("OUT"), 2 * x)
    report = reports(result)[0]
    record_property(f"py_probe report ({protocol}, CUDA shm input)", report)
    assert report["input_is_cpu"] is False, f"the CUDA shared-memory input reached model.py in host memory: {report}"


@pytest.mark.gpu
def test_ensemble_python_steps_share_device_tensor(
    http: httpclient.InferenceServerClient, repository: Repository, record_property: Record
) -> None:
    """py_source's device output reaches py_probe as the same device memory (no host round trip)."""
    _need(cupy_reason())
    _ready(http, repository, "ens_py_py")
    x = sample()
    result = _infer(http, httpclient, "ens_py_py", x, ["OUT", "REPORT", "SOURCE_REPORT"])
    np.testing.assert_array_equal(result.as_numpy("OUT"), 2 * (x + 1))
    source, probe = reports(result, "SOURCE_REPORT")[0], reports(result)[0]
    record_property("ens_py_py reports", {"source": source, "probe": probe})
    assert "error" not in source, f"py_source could not return a device tensor: {source['error']}"
    assert probe["input_is_cpu"] is False, f"the tensor went through host memory between the steps: {probe}"
    assert probe["input_ptr"] == source["output_ptr"], f"the tensor was copied between the steps: {source} {probe}"


@pytest.mark.gpu
def test_ensemble_pytorch_to_python_stays_on_device(
    http: httpclient.InferenceServerClient, repository: Repository, record_property: Record
) -> None:
    """A KIND_GPU PyTorch step's output reaches the next (Python, GPU inputs) step on the GPU."""
    _need(cupy_reason(), torch_cuda_reason())
    _ready(http, repository, "ens_torch_py")
    x = sample()
    result = _infer(http, httpclient, "ens_torch_py", x, ["OUT", "REPORT"])
    np.testing.assert_array_equal(result.as_numpy("OUT"), 4 * x)
    probe = reports(result)[0]
    record_property("ens_torch_py report", probe)
    assert probe["input_is_cpu"] is False, f"the PyTorch output went through host memory: {probe}"


# -- CUDA shared memory through tritonclient -----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_cuda_shared_memory(
    protocol: str, http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient,
    repository: Repository,
) -> None:
    """Register, status, infer with input and output in CUDA regions (identity and a GPU model),
    unregister; a request naming an unregistered region is refused."""
    _need(cuda_shm_reason())
    _ready(http, repository, "ident")
    from tritonclient.utils import cuda_shared_memory as cudashm

    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    metadata = http.get_server_metadata()
    assert "cuda_shared_memory" in metadata["extensions"], metadata
    x = sample(4)
    name_in, name_out = f"in_{protocol}", f"out_{protocol}"
    region_in = cudashm.create_shared_memory_region(name_in, x.nbytes, 0)
    region_out = cudashm.create_shared_memory_region(name_out, 3 * x.nbytes, 0)
    try:
        cudashm.set_shared_memory_region(region_in, [x])
        client.register_cuda_shared_memory(name_in, cudashm.get_raw_handle(region_in), 0, x.nbytes)
        client.register_cuda_shared_memory(name_out, cudashm.get_raw_handle(region_out), 0, 3 * x.nbytes)
        status = client.get_cuda_shared_memory_status(**({"as_json": True} if protocol == "grpc" else {}))
        regions = status if protocol == "http" else list(status.get("regions", {}).values())
        assert {r["name"]: (int(r.get("device_id", 0)), int(r["byte_size"])) for r in regions} == {
            name_in: (0, x.nbytes), name_out: (0, 3 * x.nbytes)}, status

        flat = x.reshape(-1)
        tensor = module.InferInput("IN", [flat.size], "FP32")
        tensor.set_shared_memory(name_in, x.nbytes)
        out = module.InferRequestedOutput("OUT")
        out.set_shared_memory(name_out, x.nbytes)
        result = client.infer("ident", [tensor], outputs=[out])
        assert carries_no_data(result, "OUT")  # the data is in the region, not in the response
        np.testing.assert_array_equal(cudashm.get_contents_as_numpy(region_out, "FP32", [flat.size]), flat)

        if torch_cuda_reason() is None and "torch" not in repository.left_out:
            _ready(http, repository, "torch")
            tensor = module.InferInput("INPUT__0", list(x.shape), "FP32")
            tensor.set_shared_memory(name_in, x.nbytes)
            outs = [module.InferRequestedOutput("OUTPUT__1"), module.InferRequestedOutput("OUTPUT__0")]
            outs[0].set_shared_memory(name_out, x.nbytes, offset=x.nbytes)
            client.infer("torch", [tensor], outputs=outs)
            contents = cudashm.get_contents_as_numpy(region_out, "FP32", [3 * flat.size])
            np.testing.assert_array_equal(contents[flat.size:2 * flat.size], 2 * flat)

        client.unregister_cuda_shared_memory(name_in)
        with pytest.raises(InferenceServerException, match="Unable to find shared memory region"):
            client.infer("ident", [_shm_input(module, name_in, x)], outputs=[out])
    finally:
        client.unregister_cuda_shared_memory()
        cudashm.destroy_shared_memory_region(region_in)
        cudashm.destroy_shared_memory_region(region_out)
    status = client.get_cuda_shared_memory_status(**({"as_json": True} if protocol == "grpc" else {}))
    assert not (status if protocol == "http" else status.get("regions")), status


def _shm_input(module: Any, region: str, x: np.ndarray) -> Any:
    tensor = module.InferInput("IN", [x.size], "FP32")
    tensor.set_shared_memory(region, x.nbytes)
    return tensor


# -- NVML gauges ---------------------------------------------------------------------------------


def _metrics(server: tuple[Server, dict[str, int]]) -> dict[str, list[Any]]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{server[1]['Metrics Service']}/metrics", timeout=30).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


GPU_GAUGES = ("nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes", "nv_gpu_power_usage")


@pytest.mark.gpu
def test_gpu_metrics(server: tuple[Server, dict[str, int]], record_property: Record) -> None:
    """The four gauges, one sample per GPU labelled ``gpu_uuid`` as nvidia-smi names it, with
    readings nvidia-smi agrees with."""
    _need(module_reason("pynvml"))
    smi = nvidia_smi(["uuid", "memory.total", "power.draw"])
    deadline = time.monotonic() + 30
    metrics = _metrics(server)
    while not all(name in metrics for name in GPU_GAUGES) and time.monotonic() < deadline:
        time.sleep(0.5)
        metrics = _metrics(server)
    for name in GPU_GAUGES:
        samples = metrics.get(name)
        assert samples, f"{name} is not on /metrics (families: {sorted(n for n in metrics if n.startswith('nv_gpu'))})"
        assert [s.labels for s in samples] == [{"gpu_uuid": gpu["uuid"]} for gpu in smi], (name, samples, smi)
    by_name = {name: metrics[name][0].value for name in GPU_GAUGES}
    record_property("gauges (GPU 0)", by_name)
    assert 0.0 <= by_name["nv_gpu_utilization"] <= 1.0
    assert abs(by_name["nv_gpu_memory_total_bytes"] - float(smi[0]["memory.total"]) * 2**20) < 2**21
    assert 0 < by_name["nv_gpu_memory_used_bytes"] <= by_name["nv_gpu_memory_total_bytes"]
    assert by_name["nv_gpu_power_usage"] > 0, f"power reading: {by_name['nv_gpu_power_usage']} (nvidia-smi: {smi[0]})"


@pytest.mark.gpu
def test_model_metrics_carry_gpu_uuid(http: httpclient.InferenceServerClient, repository: Repository,
                                      server: tuple[Server, dict[str, int]]) -> None:
    """Triton labels a GPU instance's per-model series with its device's ``gpu_uuid`` too."""
    _need(torch_cuda_reason())
    _ready(http, repository, "torch")
    _infer(http, httpclient, "torch", sample(), ["OUTPUT__1"])
    uuid = nvidia_smi(["uuid"])[0]["uuid"]
    samples = [s for s in _metrics(server)["nv_inference_count"] if s.labels.get("model") == "torch"]
    assert samples and all(s.labels.get("gpu_uuid") == uuid for s in samples), samples


# -- the default layout --------------------------------------------------------------------------


@pytest.mark.gpu
def test_default_layout_serves_gpu_models(repository: Repository) -> None:
    """``pyserve run`` with its default process layout (frontend processes, replicas) serves a
    KIND_GPU PyTorch model and a GPU Python model, CUDA being started after the fork."""
    _need(torch_cuda_reason())
    models = ["torch", "py_probe"]
    process = Server(["--model-repository", str(repository.path), "--model-control-mode", "explicit",
                      *[f"--load-model={m}" for m in models]])
    try:
        ports = process.ports()
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTPService']}", network_timeout=120)
        try:
            wait_for(lambda: all(client.is_model_ready(m) for m in models), 60, "the models to be READY")
            x = sample()
            for _ in range(4):  # several connections' worth: frontends answer some
                result = _infer(client, httpclient, "torch", x, ["OUTPUT__1"])
                np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), 2 * x)
                result = _infer(client, httpclient, "py_probe", x, ["OUT"])
                np.testing.assert_array_equal(result.as_numpy("OUT"), 2 * x)
        finally:
            client.close()
    finally:
        process.close()
        _keep_log(process, "pyserve-server-default-layout.log")


# -- against Triton (optional) -------------------------------------------------------------------


@pytest.mark.gpu
def test_throughput_against_triton(tmp_path: Path, record_property: Record) -> None:
    """One GPU model's throughput on pyserve and on Triton 2.51 on the same GPU, same run: a
    figure (the ratio), no threshold. Skipped where no nvidia-pytriton is at hand or its Triton
    cannot serve the model on the GPU."""
    _need(torch_cuda_reason())
    install, why = find_triton()
    if install is None:
        pytest.skip(why)
    figures = compare(tmp_path, "KIND_GPU", install)
    if isinstance(figures, str):
        pytest.skip(f"Triton cannot serve the GPU model here: {figures[-500:]}")
    for name, value in figures.items():
        record_property(name, value)
