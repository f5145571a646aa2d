"""The onnxruntime backend served by a real server: results equal a direct ONNX Runtime call."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import numpy as np
import onnxruntime as ort
import ort_models
import pyserve_backend_onnxruntime
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from pyserve.repository.model_config import gpu_count
from pyserve.runtime.scheduling import AdaptiveBatcher, AdaptiveScheduler, DynamicBatcher
from pyserve.server.core import ServerThread
from pyserve.testing import (
    OWN_GRPC_CONNECTION,
    BatchRecorder,
    ServerFactory,
    require_owner_connections,
    serve,
    write_model,
)

BACKENDS = {"onnxruntime": pyserve_backend_onnxruntime}

MLP_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 16
input [ { name: "x", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 3 ] } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
"""

CONV_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "image", data_type: TYPE_FP32, dims: [ 1, 8, 8 ] } ]
output [
  { name: "logits", data_type: TYPE_FP32, dims: [ 2 ] },
  { name: "features", data_type: TYPE_FP32, dims: [ 4 ] }
]
"""

STRINGS_BATCHED_CONFIG = (
    'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
    'input [ { name: "text", data_type: TYPE_STRING, dims: [ 2 ] } ]\n'
    'output [ { name: "echo", data_type: TYPE_STRING, dims: [ 2 ] } ]\n'
    'dynamic_batching { max_queue_delay_microseconds: 300000 }\n'
)


def _broken(config: str, old: str, new: str) -> str:
    assert old in config
    return config.replace(old, new)


@pytest.fixture(scope="module")
def recorder() -> BatchRecorder:
    return BatchRecorder()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, recorder: BatchRecorder) -> Iterator[ServerThread]:
    """A server of its own for the tests that count executes: while ``recorder`` (a plugin
    object of this process) wraps execute, ``auto`` replicates nothing, so it sees every execute
    and one batcher takes the requests of every connection."""
    repo = tmp_path_factory.mktemp("ort_recorded")
    mlp = ort_models.mlp()
    write_model(repo, "mlp", MLP_CONFIG, {"1/model.onnx": mlp})
    write_model(repo, "mlp_auto", None, {"1/model.onnx": mlp})
    write_model(repo, "mlp_fixed", None, {"1/model.onnx": ort_models.mlp(batch=2)})
    write_model(repo, "strings_batched", STRINGS_BATCHED_CONFIG, {"1/model.onnx": ort_models.strings()})
    with serve(repo, backends=BACKENDS, server_plugins=(recorder,), use_entry_points=False) as thread:
        yield thread


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """The models as users get them: replicated in the frontend processes of the test layout."""
    repo = tmp_path_factory.mktemp("ort_repo")
    mlp, conv = ort_models.mlp(), ort_models.convnet()
    write_model(repo, "mlp", MLP_CONFIG, {"1/model.onnx": mlp})
    write_model(repo, "conv", CONV_CONFIG, {"1/model.onnx": conv})
    write_model(repo, "mlp_auto", None, {"1/model.onnx": mlp})  # no config.pbtxt at all
    write_model(repo, "conv_auto", 'platform: "onnxruntime_onnx"\n', {"1/model.onnx": conv})
    write_model(repo, "mlp_fixed", None, {"1/model.onnx": ort_models.mlp(batch=2)})  # cannot batch
    write_model(
        repo,
        "mlp_tuned",
        MLP_CONFIG
        + 'default_model_filename: "graph"\noptimization { graph { level: 1 } '
        + 'execution_accelerators { cpu_execution_accelerator [ { name: "openvino" } ] } }\n'
        + 'parameters [ { key: "intra_op_thread_count", value: { string_value: "1" } },'
        + ' { key: "inter_op_thread_count", value: { string_value: "2" } },'
        + ' { key: "execution_mode", value: { string_value: "1" } },'
        + ' { key: "session.use_device_allocator_for_initializers", value: { string_value: "1" } },'
        + ' { key: "memory.enable_memory_arena_shrinkage", value: { string_value: "cpu:0" } } ]\n',
        {"1/graph/model.onnx": mlp},
    )
    write_model(
        repo,
        "strings",
        'platform: "onnxruntime_onnx"\nmax_batch_size: 4\n'
        'input [ { name: "text", data_type: TYPE_STRING, dims: [ 2 ] } ]\n'
        'output [ { name: "echo", data_type: TYPE_STRING, dims: [ 2 ] } ]\n',
        {"1/model.onnx": ort_models.strings()},
    )
    write_model(repo, "bad_arena", MLP_CONFIG + 'parameters { key: "memory.enable_memory_arena_shrinkage" '
                'value { string_value: "bogus:9" } }\n', {"1/model.onnx": mlp})
    write_model(repo, "arena_no_device", MLP_CONFIG + 'parameters { key: "memory.enable_memory_arena_shrinkage" '
                'value { string_value: "cpu:7" } }\n', {"1/model.onnx": mlp})
    write_model(repo, "huge_threads", MLP_CONFIG + 'parameters { key: "inter_op_thread_count" '
                'value { string_value: "99999999999" } }\n', {"1/model.onnx": mlp})
    write_model(repo, "bad_name", _broken(MLP_CONFIG, 'name: "x"', 'name: "input"'), {"1/model.onnx": mlp})
    write_model(repo, "bad_type", _broken(MLP_CONFIG, "TYPE_FP32, dims: [ 4 ]", "TYPE_INT32, dims: [ 4 ]"), {"1/model.onnx": mlp})
    write_model(repo, "bad_dims", _broken(MLP_CONFIG, "dims: [ 3 ]", "dims: [ 5 ]"), {"1/model.onnx": mlp})
    write_model(repo, "bad_output", _broken(MLP_CONFIG, 'name: "y"', 'name: "z"'), {"1/model.onnx": mlp})
    write_model(repo, "corrupt", MLP_CONFIG, {"1/model.onnx": b"this is not an onnx model"})
    write_model(repo, "corrupt_auto", None, {"1/model.onnx": b"\x08\x07garbage"})
    write_model(repo, "missing", MLP_CONFIG)
    write_model(repo, "bad_mode", MLP_CONFIG + 'parameters { key: "execution_mode" value { string_value: "2" } }\n',
                {"1/model.onnx": mlp})
    write_model(repo, "bad_accelerator", MLP_CONFIG + 'optimization { execution_accelerators { '
                'cpu_execution_accelerator [ { name: "magic" } ] } }\n', {"1/model.onnx": mlp})
    write_model(repo, "bad_trt", MLP_CONFIG + 'optimization { execution_accelerators { gpu_execution_accelerator [ '
                '{ name: "tensorrt" parameters { key: "precision_mode" value: "FP8" } } ] } }\n', {"1/model.onnx": mlp})
    write_model(
        repo,
        "bad_param",
        MLP_CONFIG + 'parameters [ { key: "intra_op_thread_count", value: { string_value: "many" } } ]\n',
        {"1/model.onnx": mlp},
    )
    with serve(repo, backends=BACKENDS, use_entry_points=False) as thread:
        yield thread


def direct(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def http_infer(url: str, model: str, inputs: dict[str, np.ndarray], datatype: str = "FP32") -> httpclient.InferResult:
    client = httpclient.InferenceServerClient(url)
    tensors = []
    for name, array in inputs.items():
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return client.infer(model, tensors)


def grpc_infer(url: str, model: str, inputs: dict[str, np.ndarray], datatype: str = "FP32") -> grpcclient.InferResult:
    client = grpcclient.InferenceServerClient(url)
    tensors = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return client.infer(model, tensors)


def repository_index(server: ServerThread) -> dict[str, dict[str, str]]:
    client = httpclient.InferenceServerClient(server.url)
    return {entry["name"]: entry for entry in client.get_model_repository_index()}


# --------------------------------------------------------------------------- packaging


def test_plugin_import_does_not_import_onnxruntime() -> None:
    code = (
        "import sys, pyserve_backend_onnxruntime\n"
        "heavy = [m for m in ('onnxruntime', 'onnx', 'torch', 'tensorflow') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_entry_points_declare_backend_and_platform() -> None:
    backends = {ep.name: ep.value for ep in metadata.entry_points(group="pyserve.backends")}
    platforms = {ep.name: ep.value for ep in metadata.entry_points(group="pyserve.platforms")}
    if "onnxruntime" not in backends:
        pytest.skip("pyserve-backend-onnxruntime is not installed (pip install -e)")
    assert backends["onnxruntime"] == "pyserve_backend_onnxruntime"
    assert platforms["onnxruntime_onnx"] == "onnxruntime"


# --------------------------------------------------------------------------- inference


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_mlp_matches_onnxruntime(server: ServerThread, protocol: str) -> None:
    x = np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)
    if protocol == "http":
        got = http_infer(server.url, "mlp", {"x": x}).as_numpy("y")
    else:
        got = grpc_infer(server.grpc_url, "mlp", {"x": x}).as_numpy("y")
    np.testing.assert_allclose(got, direct(ort_models.mlp(), {"x": x})[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_convnet_two_outputs_match_onnxruntime(server: ServerThread, protocol: str) -> None:
    image = np.random.default_rng(4).standard_normal((3, 1, 8, 8)).astype(np.float32)
    infer = http_infer if protocol == "http" else grpc_infer
    url = server.url if protocol == "http" else server.grpc_url
    result = infer(url, "conv", {"image": image})
    logits, features = direct(ort_models.convnet(), {"image": image})
    np.testing.assert_allclose(result.as_numpy("logits"), logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.as_numpy("features"), features, rtol=1e-5, atol=1e-6)


def test_requested_output_only(server: ServerThread) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    image = np.ones((1, 1, 8, 8), dtype=np.float32)
    tensor = grpcclient.InferInput("image", [1, 1, 8, 8], "FP32")
    tensor.set_data_from_numpy(image)
    result = client.infer("conv", [tensor], outputs=[grpcclient.InferRequestedOutput("features")])
    assert result.as_numpy("logits") is None
    np.testing.assert_allclose(result.as_numpy("features"), direct(ort_models.convnet(), {"image": image})[1], rtol=1e-5)


def test_strings_round_trip(server: ServerThread) -> None:
    text = np.array([[b"hello", "wörld".encode()], [b"", b"x"]], dtype=object)
    result = http_infer(server.url, "strings", {"text": text}, "BYTES")
    assert result.as_numpy("echo").tolist() == text.tolist()


def test_non_utf8_string_fails_only_its_own_request_of_a_batch(recorded: ServerThread, recorder: BatchRecorder) -> None:
    """onnxruntime takes strings as text: a request with other bytes gets 400 naming the input,
    and the requests batched with it still get their results (HTTP and gRPC)."""
    good = [np.array([[f"row{i}".encode(), "wörld".encode()]], dtype=object) for i in range(3)]
    bad = np.array([[b"ok", b"\xff\xfe"]], dtype=object)
    before = len(recorder.sizes.get("strings_batched", []))

    def call(args: tuple[str, np.ndarray]) -> object:
        protocol, text = args
        try:
            if protocol == "http":
                return http_infer(recorded.url, "strings_batched", {"text": text}, "BYTES").as_numpy("echo")
            return grpc_infer(recorded.grpc_url, "strings_batched", {"text": text}, "BYTES").as_numpy("echo")
        except InferenceServerException as exc:
            return exc

    for protocol, refused_status in (("http", "400"), ("grpc", "StatusCode.INVALID_ARGUMENT")):
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(call, [(protocol, t) for t in (*good, bad)]))
        for got, sent in zip(results[:3], good):
            assert isinstance(got, np.ndarray), got
            assert got.tolist() == sent.tolist()
        error = results[3]
        assert isinstance(error, InferenceServerException)
        assert error.status() == refused_status
        assert "input 'text'" in error.message() and "not UTF-8" in error.message()
        # alone, the bad request is refused the same way (not a 500 from onnxruntime)
        alone = call((protocol, bad))
        assert isinstance(alone, InferenceServerException) and alone.status() == refused_status
    assert max(recorder.sizes["strings_batched"][before:]) > 1, "the requests were never batched"


def test_arena_shrinkage_device_without_arena_is_a_server_error(server: ServerThread) -> None:
    """A well-formed device list naming a device the session has no arena for fails at run time:
    500 naming the parameter, not a 400 blaming the client's inputs."""
    with pytest.raises(InferenceServerException) as caught:
        http_infer(server.url, "arena_no_device", {"x": np.ones((1, 4), dtype=np.float32)})
    assert caught.value.status() == "500"
    assert "memory.enable_memory_arena_shrinkage" in caught.value.message()


def test_session_options_and_directory_model_file(server: ServerThread) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    got = grpc_infer(server.grpc_url, "mlp_tuned", {"x": x}).as_numpy("y")
    np.testing.assert_allclose(got, direct(ort_models.mlp(), {"x": x})[0], rtol=1e-5, atol=1e-6)
    # Triton's parameter names reach the session and every run
    instance = server.server.models.get("mlp_tuned").instances[0].state
    options = instance.session.get_session_options()
    assert options.intra_op_num_threads == 1 and options.inter_op_num_threads == 2
    assert options.execution_mode == ort.ExecutionMode.ORT_PARALLEL  # (ORT goes sequential with 1 inter-op thread)
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    assert options.get_session_config_entry("session.use_device_allocator_for_initializers") == "1"
    assert instance._run_options.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
    # the openvino accelerator was asked for, but this onnxruntime has none: CPU, with a log line
    assert instance.session.get_providers() == ["CPUExecutionProvider"]


def test_tensorrt_accelerator_parameters_use_onnxruntime_names() -> None:
    from pyserve_backend_onnxruntime.runtime import tensorrt_options

    assert tensorrt_options({"precision_mode": "FP16", "max_workspace_size_bytes": "1073741824",
                             "trt_engine_cache_enable": "1", "int8_use_native_calibration_table": "0"}) == {
        "trt_fp16_enable": "True", "trt_max_workspace_size": "1073741824", "trt_engine_cache_enable": "1",
        "trt_int8_use_native_calibration_table": "0",
    }
    assert tensorrt_options({"precision_mode": "INT8"}) == {"trt_int8_enable": "True"}
    assert tensorrt_options({"precision_mode": "fp32"}) == {}
    with pytest.raises(ValueError, match="unknown parameter 'workspace'"):
        tensorrt_options({"workspace": "1"})


def test_dynamic_batching_gives_the_rows_of_single_calls(recorded: ServerThread, recorder: BatchRecorder) -> None:
    rows = np.random.default_rng(5).standard_normal((16, 1, 4)).astype(np.float32)
    expected = [direct(ort_models.mlp(), {"x": row})[0] for row in rows]
    before = len(recorder.sizes.get("mlp", []))

    def call(row: np.ndarray) -> np.ndarray:
        return grpc_infer(recorded.grpc_url, "mlp", {"x": row}).as_numpy("y")

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, rows))
    for got, want in zip(results, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    sizes = recorder.sizes["mlp"][before:]
    assert sum(sizes) == 16
    assert max(sizes) > 1, f"the dynamic batcher never joined requests: {sizes}"


def test_one_client_gets_its_executes_on_the_event_loop(recorded: ServerThread, recorder: BatchRecorder) -> None:
    """ONNX models are compute-only: once one client alone sends requests, their short executes
    run on the server's event loop (no thread hand-off), with the same results."""
    require_owner_connections(recorded)
    schedulers = {name: type(recorded.server.models.get(name).scheduler) for name in ("mlp", "mlp_auto", "mlp_fixed")}
    assert schedulers == {"mlp": DynamicBatcher, "mlp_auto": AdaptiveBatcher, "mlp_fixed": AdaptiveScheduler}
    x = np.random.default_rng(11).standard_normal((1, 4)).astype(np.float32)
    want = direct(ort_models.mlp(), {"x": x})[0]
    tensor = grpcclient.InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(x)
    recorder.until_on_the_loop(
        "mlp_auto",
        lambda: grpcclient.InferenceServerClient(recorded.grpc_url, channel_args=OWN_GRPC_CONNECTION),
        lambda client: np.testing.assert_allclose(
            client.infer("mlp_auto", [tensor]).as_numpy("y"), want, rtol=1e-5, atol=1e-6),
    )


# --------------------------------------------------------------------------- auto-complete


def test_auto_complete_without_config(server: ServerThread) -> None:
    config = httpclient.InferenceServerClient(server.url).get_model_config("mlp_auto")
    assert config["platform"] == "onnxruntime_onnx"
    assert config["backend"] == "onnxruntime"
    assert config["max_batch_size"] == 4  # the backend config default-max-batch-size
    assert "dynamic_batching" in config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [("x", "TYPE_FP32", [4])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [("y", "TYPE_FP32", [3])]
    x = np.ones((2, 4), dtype=np.float32)
    np.testing.assert_allclose(
        http_infer(server.url, "mlp_auto", {"x": x}).as_numpy("y"), direct(ort_models.mlp(), {"x": x})[0], rtol=1e-5
    )


def test_auto_complete_from_platform_only(server: ServerThread) -> None:
    config = httpclient.InferenceServerClient(server.url).get_model_config("conv_auto")
    assert [(t["name"], t["dims"]) for t in config["input"]] == [("image", [1, 8, 8])]
    assert [(t["name"], t["dims"]) for t in config["output"]] == [("logits", [2]), ("features", [4])]
    image = np.zeros((1, 1, 8, 8), dtype=np.float32)
    result = grpc_infer(server.grpc_url, "conv_auto", {"image": image})
    np.testing.assert_allclose(result.as_numpy("logits"), direct(ort_models.convnet(), {"image": image})[0], rtol=1e-5)


def test_auto_complete_fixed_batch_dimension_is_not_batching(server: ServerThread) -> None:
    config = httpclient.InferenceServerClient(server.url).get_model_config("mlp_fixed")
    assert config["max_batch_size"] == 0
    assert "dynamic_batching" not in config
    assert config["input"][0]["dims"] == [2, 4]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("model", "fragments"),
    [
        ("bad_name", ["'input'", "not an input of the ONNX model", "x"]),
        ("bad_type", ["input 'x'", "TYPE_INT32", "TYPE_FP32"]),
        ("bad_dims", ["output 'y'", "[-1, 5]", "[-1, 3]"]),
        ("bad_output", ["output 'z'", "model outputs: y"]),
        ("corrupt", ["cannot load ONNX model", "model.onnx"]),
        ("corrupt_auto", ["cannot load ONNX model 'corrupt_auto/1/model.onnx'"]),  # says what it is: no step label
        ("missing", ["model file 'missing/1/model.onnx' not found"]),
        ("bad_param", ["intra_op_thread_count", "'many'"]),
        ("bad_mode", ["execution_mode", "0 (sequential) or 1 (parallel)", "got 2"]),
        ("bad_accelerator", ["unknown cpu_execution_accelerator 'magic'"]),
        ("bad_trt", ["precision_mode must be FP32, FP16 or INT8", "'FP8'"]),
        ("bad_arena", ["memory.enable_memory_arena_shrinkage", "'bogus:9'", "cpu:0;gpu:0"]),
        ("huge_threads", ["'inter_op_thread_count'", "from 0 to 1024", "'99999999999'"]),
    ],
)
def test_bad_models_are_unavailable_with_a_reason(server: ServerThread, model: str, fragments: list[str]) -> None:
    entry = repository_index(server)[model]
    assert entry["state"] == "UNAVAILABLE"
    for fragment in fragments:
        assert fragment in entry["reason"], entry["reason"]


def test_wrong_request_shape_is_invalid_argument(server: ServerThread) -> None:
    with pytest.raises(Exception, match="unexpected shape|shape"):
        http_infer(server.url, "mlp", {"x": np.ones((1, 5), dtype=np.float32)})


def test_good_models_are_ready(server: ServerThread) -> None:
    index = repository_index(server)
    for name in ("mlp", "conv", "mlp_auto", "conv_auto", "mlp_fixed", "mlp_tuned", "strings"):
        assert index[name]["state"] == "READY", json.dumps(index[name])


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() == 0 or "CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="needs a GPU and onnxruntime-gpu")
def test_gpu_instance_uses_cuda_provider(tmp_path: Path, pyserve_server_factory: ServerFactory) -> None:
    repo = tmp_path / "gpu_repo"
    write_model(repo, "mlp_gpu", MLP_CONFIG + "instance_group [ { kind: KIND_GPU, gpus: [ 0 ] } ]\n",
                {"1/model.onnx": ort_models.mlp()})
    gpu_server = pyserve_server_factory(repo, backends=BACKENDS, use_entry_points=False)
    x = np.random.default_rng(6).standard_normal((3, 4)).astype(np.float32)
    got = grpc_infer(gpu_server.grpc_url, "mlp_gpu", {"x": x}).as_numpy("y")
    np.testing.assert_allclose(got, direct(ort_models.mlp(), {"x": x})[0], rtol=1e-4, atol=1e-5)


SEQUENCE_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [
  { name: "OUTPUT", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "STARTED", data_type: TYPE_INT32, dims: [ 1 ] }
]
instance_group [ { count: 2, kind: KIND_CPU } ]
sequence_batching {
  direct { }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
}
"""


def test_a_sequence_model_gets_its_control_inputs_and_implicit_state(tmp_path: Path) -> None:
    """The sequence batcher's START control and the implicit state reach the graph beside the
    config input (a control the graph does not take, READY, is not fed to it), and the state
    output carries over to the sequence's next request, per sequence, never to the client."""
    write_model(tmp_path / "repo", "accumulator", SEQUENCE_CONFIG, {"1/model.onnx": ort_models.accumulator()})
    with serve(tmp_path / "repo", backends=BACKENDS) as server:
        client = httpclient.InferenceServerClient(server.url)

        def send(sequence: int, value: int, **flags: bool) -> tuple[int, int]:
            given = httpclient.InferInput("INPUT", [1], "INT32")
            given.set_data_from_numpy(np.array([value], dtype=np.int32))
            result = client.infer("accumulator", [given], sequence_id=sequence, **flags)
            assert result.as_numpy("STATE_OUT") is None
            return int(result.as_numpy("OUTPUT")[0]), int(result.as_numpy("STARTED")[0])

        # two instances: a slot each, so the two sequences run side by side
        assert send(1, 1, sequence_start=True) == (1, 1)
        assert send(2, 10, sequence_start=True) == (10, 1)
        assert send(1, 2) == (3, 0)
        assert send(2, 5) == (15, 0)
        assert send(1, 3, sequence_end=True) == (6, 0)
        assert send(1, 7, sequence_start=True) == (7, 1)  # START again: the state starts over
        client.close()
