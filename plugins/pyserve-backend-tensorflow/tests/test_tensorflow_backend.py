"""The tensorflow backend served by a real server: results equal calling the tf.Module directly.

TensorFlow is slow to import and to load models, so the whole module shares one server.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pyserve_backend_tensorflow
import pytest
import tensorflow as tf
import tf_models
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from pyserve.runtime.scheduling import AdaptiveBatcher, DynamicBatcher
from pyserve.server.core import ServerThread
from pyserve.testing import (
    OWN_GRPC_CONNECTION,
    BatchRecorder,
    ServerFactory,
    require_owner_connections,
    serve,
    write_model,
)

BACKENDS = {"tensorflow": pyserve_backend_tensorflow}

MLP_CONFIG = """
platform: "tensorflow_savedmodel"
max_batch_size: 16
input [ { name: "x", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [
  { name: "y", data_type: TYPE_FP32, dims: [ 3 ] },
  { name: "norm", data_type: TYPE_FP32, dims: [ 1 ] }
]
dynamic_batching { max_queue_delay_microseconds: 20000 }
"""

GRAPHDEF_CONFIG = """
platform: "tensorflow_graphdef"
max_batch_size: 8
input [ { name: "x", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 3 ] } ]
"""

SIGNATURE = 'parameters [ { key: "signature_name", value: { string_value: "predict" } } ]\n'


def _parameters(**values: str) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in values.items())


def _broken(config: str, old: str, new: str) -> str:
    assert old in config
    return config.replace(old, new)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# the batcher without a queue delay, and a generous limit for "short" (a slow test machine)
MLP_LOOP_CONFIG = (_broken(MLP_CONFIG, "max_queue_delay_microseconds: 20000", "")
                   + _parameters(pyserve_inline_max_us="100000"))

UPPER_BATCHED_CONFIG = (
    'backend: "tensorflow"\nmax_batch_size: 8\n'
    'input [ { name: "text", data_type: TYPE_STRING, dims: [ 1 ], reshape: { shape: [ ] } } ]\n'
    'output [ { name: "upper", data_type: TYPE_STRING, dims: [ 1 ], reshape: { shape: [ ] } } ]\n'
    'dynamic_batching { max_queue_delay_microseconds: 300000 }\n'
)


@pytest.fixture(scope="module")
def modules() -> dict[str, tf.Module]:
    return {"mlp": tf_models.MLP(), "conv": tf_models.ConvNet(), "upper": tf_models.Upper()}


@pytest.fixture(scope="module")
def recorder() -> BatchRecorder:
    return BatchRecorder()


@pytest.fixture(scope="module")
def recorded(
    tmp_path_factory: pytest.TempPathFactory, modules: dict[str, tf.Module], recorder: BatchRecorder
) -> Iterator[ServerThread]:
    """A server of its own for the tests that count executes: while ``recorder`` (a plugin
    object of this process) wraps execute, ``auto`` replicates nothing, so it sees every execute
    and one batcher takes the requests of every connection."""
    files = tmp_path_factory.mktemp("tf_recorded_files")
    tf_models.save(modules["mlp"], files / "mlp")
    tf_models.save(modules["upper"], files / "upper")
    mlp = {f"1/model.savedmodel/{k}": v for k, v in _tree(files / "mlp").items()}
    upper = {f"1/model.savedmodel/{k}": v for k, v in _tree(files / "upper").items()}
    repo = tmp_path_factory.mktemp("tf_recorded")
    write_model(repo, "mlp", MLP_CONFIG, mlp)
    write_model(repo, "mlp_auto", None, mlp)
    write_model(repo, "mlp_loop", MLP_LOOP_CONFIG, mlp)
    write_model(repo, "upper_batched", UPPER_BATCHED_CONFIG, upper)
    with serve(repo, backends=BACKENDS, server_plugins=(recorder,), use_entry_points=False) as thread:
        yield thread


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, modules: dict[str, tf.Module]) -> Iterator[ServerThread]:
    """The models as users get them: replicated in the frontend processes of the test layout."""
    files = tmp_path_factory.mktemp("tf_files")
    tf_models.save(modules["mlp"], files / "mlp")
    tf_models.save(modules["conv"], files / "conv", signature="predict")
    tf_models.save(modules["upper"], files / "upper")
    tf_models.save_frozen_graphdef(modules["mlp"], files / "mlp.graphdef")
    mlp = {f"1/model.savedmodel/{k}": v for k, v in _tree(files / "mlp").items()}
    conv = {f"1/model.savedmodel/{k}": v for k, v in _tree(files / "conv").items()}
    upper = {f"1/model.savedmodel/{k}": v for k, v in _tree(files / "upper").items()}
    graphdef = {"1/model.graphdef": (files / "mlp.graphdef").read_bytes()}
    repo = tmp_path_factory.mktemp("tf_repo")
    write_model(repo, "mlp", MLP_CONFIG, mlp)
    write_model(repo, "mlp_auto", None, mlp)  # no config.pbtxt at all
    write_model(repo, "conv", 'platform: "tensorflow_savedmodel"\n' + SIGNATURE, conv)
    write_model(repo, "upper", 'backend: "tensorflow"\nmax_batch_size: 0\n', upper)
    write_model(repo, "graphdef", GRAPHDEF_CONFIG, graphdef)
    write_model(repo, "bad_name", _broken(MLP_CONFIG, 'name: "x"', 'name: "input"'), mlp)
    write_model(repo, "bad_type", _broken(MLP_CONFIG, "TYPE_FP32, dims: [ 4 ]", "TYPE_FP16, dims: [ 4 ]"), mlp)
    write_model(repo, "bad_dims", _broken(MLP_CONFIG, "dims: [ 3 ]", "dims: [ 2 ]"), mlp)
    write_model(repo, "bad_signature", MLP_CONFIG + SIGNATURE, mlp)
    write_model(repo, "corrupt", MLP_CONFIG, {"1/model.savedmodel/saved_model.pb": b"\x0a\xffcorrupt"})
    write_model(repo, "missing", MLP_CONFIG)
    write_model(repo, "graphdef_no_io", 'platform: "tensorflow_graphdef"\n', graphdef)
    write_model(repo, "graphdef_bad_name", _broken(GRAPHDEF_CONFIG, 'name: "y"', 'name: "logits"'), graphdef)
    write_model(repo, "graphdef_corrupt", GRAPHDEF_CONFIG, {"1/model.graphdef": b"\xff\xff\xffnot a graph"})
    # Triton's parameter names: TF_SIGNATURE_DEF, TF_GRAPH_TAG, TF_NUM_INTRA_THREADS
    write_model(repo, "conv_triton", 'platform: "tensorflow_savedmodel"\n' + _parameters(TF_SIGNATURE_DEF="predict",
                                                                                        TF_GRAPH_TAG="serve"), conv)
    write_model(repo, "bad_tag", MLP_CONFIG + _parameters(TF_GRAPH_TAG="train"), mlp)
    write_model(repo, "bad_threads", MLP_CONFIG + _parameters(TF_NUM_INTRA_THREADS="-2"), mlp)
    with serve(repo, backends=BACKENDS, use_entry_points=False) as thread:
        yield thread


def infer(server: ServerThread, protocol: str, model: str, inputs: dict[str, np.ndarray], datatype: str = "FP32",
          client: Any = None) -> Any:
    """One call, on a new connection unless ``client`` (of ``protocol``) is given."""
    module = httpclient if protocol == "http" else grpcclient
    if client is None:
        client = module.InferenceServerClient(server.url if protocol == "http" else server.grpc_url)
    tensors = []
    for name, array in inputs.items():
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return client.infer(model, tensors)


def repository_index(server: ServerThread) -> dict[str, dict[str, str]]:
    client = httpclient.InferenceServerClient(server.url)
    return {entry["name"]: entry for entry in client.get_model_repository_index()}


# --------------------------------------------------------------------------- packaging


def test_plugin_import_does_not_import_tensorflow() -> None:
    code = (
        "import sys, pyserve_backend_tensorflow\n"
        "print([m for m in ('tensorflow', 'torch', 'onnxruntime') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_entry_points_declare_backend_and_platforms() -> None:
    backends = {ep.name: ep.value for ep in metadata.entry_points(group="pyserve.backends")}
    platforms = {ep.name: ep.value for ep in metadata.entry_points(group="pyserve.platforms")}
    if "tensorflow" not in backends:
        pytest.skip("pyserve-backend-tensorflow is not installed (pip install -e)")
    assert backends["tensorflow"] == "pyserve_backend_tensorflow"
    assert platforms["tensorflow_savedmodel"] == platforms["tensorflow_graphdef"] == "tensorflow"


def test_aligned_writable_arrays_enter_tensorflow_without_a_copy() -> None:
    from pyserve_backend_tensorflow.runtime import to_tf

    buffer = np.zeros(32, dtype=np.float32)
    start = (-buffer.ctypes.data % 64) // 4  # first 64-byte aligned element
    array = buffer[start:start + 8].reshape(2, 4)
    array[:] = np.arange(8, dtype=np.float32).reshape(2, 4)
    tensor = to_tf(array)
    array[0, 0] = 42.0  # shared memory: the tensor sees the write
    assert float(tensor.numpy()[0, 0]) == 42.0
    unaligned = buffer[start + 1:start + 9].reshape(2, 4)  # TensorFlow would abort on this one
    np.testing.assert_array_equal(tf.matmul(to_tf(unaligned), tf.ones([4, 1])).numpy(), unaligned @ np.ones((4, 1)))
    array.flags.writeable = False
    copied = to_tf(array)  # read-only: copied once into an aligned buffer
    np.testing.assert_array_equal(copied.numpy(), array)
    buffer[start] = -1.0  # the source changes; the copy does not
    assert float(copied.numpy()[0, 0]) == 42.0


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int64, np.float16, np.float64])
def test_request_shaped_arrays_reach_tensorflow_intact(dtype: Any) -> None:
    """Inputs as a request carries them: read-only views at odd offsets of a received message."""
    from pyserve_backend_tensorflow.runtime import TF_ALIGNMENT, aligned_copy, to_tf

    values = np.arange(12).astype(dtype).reshape(3, 4)
    message = b"\x07" + values.tobytes()  # the tensor starts one byte into the message
    view = np.frombuffer(message, dtype=dtype, offset=1).reshape(3, 4)
    assert not view.flags.writeable
    tensor = to_tf(view)
    assert tensor.dtype == tf.as_dtype(dtype) and tensor.shape == (3, 4)
    np.testing.assert_array_equal(tensor.numpy(), values)
    copy = aligned_copy(view)
    assert copy.ctypes.data % TF_ALIGNMENT == 0 and copy.flags.writeable and copy.flags.c_contiguous
    np.testing.assert_array_equal(copy, values)
    empty = to_tf(np.zeros((0, 4), dtype))
    assert empty.shape == (0, 4)


# --------------------------------------------------------------------------- inference


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_savedmodel_matches_tensorflow(server: ServerThread, modules: dict[str, Any], protocol: str) -> None:
    x = np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)
    result = infer(server, protocol, "mlp", {"x": x})
    want = modules["mlp"](tf.constant(x))
    np.testing.assert_allclose(result.as_numpy("y"), want["y"].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result.as_numpy("norm"), want["norm"].numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_named_signature_and_auto_complete(server: ServerThread, modules: dict[str, Any], protocol: str) -> None:
    image = np.random.default_rng(4).standard_normal((3, 8, 8, 1)).astype(np.float32)
    want = modules["conv"](tf.constant(image))
    for model in ("conv", "conv_triton"):  # signature_name and Triton's TF_SIGNATURE_DEF
        result = infer(server, protocol, model, {"image": image})
        np.testing.assert_allclose(result.as_numpy("logits"), want["logits"].numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(result.as_numpy("features"), want["features"].numpy(), rtol=1e-5, atol=1e-5)


def test_graphdef_matches_tensorflow(server: ServerThread, modules: dict[str, Any]) -> None:
    x = np.random.default_rng(8).standard_normal((2, 4)).astype(np.float32)
    got = infer(server, "grpc", "graphdef", {"x": x}).as_numpy("y")
    np.testing.assert_allclose(got, modules["mlp"](tf.constant(x))["y"].numpy(), rtol=1e-5, atol=1e-5)


def test_strings_one_scalar_per_row(server: ServerThread) -> None:
    # auto-complete: signature [None] -> max_batch_size 4, dims [1] reshaped to [] per row
    text = np.array([[b"hello"], [b"tf"]], dtype=object)
    result = infer(server, "http", "upper", {"text": text}, "BYTES")
    assert result.as_numpy("upper").tolist() == [[b"HELLO"], [b"TF"]]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_non_utf8_strings_in_a_batch_are_raw_bytes(recorded: ServerThread, recorder: BatchRecorder,
                                                     protocol: str) -> None:
    """tf.string holds raw bytes: a request with bytes that are not UTF-8 runs, batched with others."""
    sent = [b"alpha", b"beta", b"\xff\xfe raw", b"gamma"]
    before = len(recorder.sizes.get("upper_batched", []))

    def one(word: bytes) -> list[bytes]:
        text = np.array([[word]], dtype=object)
        return infer(recorded, protocol, "upper_batched", {"text": text}, "BYTES").as_numpy("upper").reshape(-1).tolist()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, sent))
    assert results == [[b"ALPHA"], [b"BETA"], [b"\xff\xfe RAW"], [b"GAMMA"]]
    assert max(recorder.sizes["upper_batched"][before:]) > 1, "the requests were never batched"


def test_dynamic_batching_gives_the_rows_of_single_calls(
    recorded: ServerThread, modules: dict[str, Any], recorder: BatchRecorder
) -> None:
    rows = np.random.default_rng(5).standard_normal((16, 1, 4)).astype(np.float32)
    expected = [modules["mlp"](tf.constant(row))["y"].numpy() for row in rows]
    before = len(recorder.sizes.get("mlp", []))
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda row: infer(recorded, "grpc", "mlp", {"x": row}).as_numpy("y"), rows))
    for got, want in zip(results, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    sizes = recorder.sizes["mlp"][before:]
    assert sum(sizes) == 16
    assert max(sizes) > 1, f"the dynamic batcher never joined requests: {sizes}"


def test_one_client_gets_its_executes_on_the_event_loop(
    recorded: ServerThread, modules: dict[str, Any], recorder: BatchRecorder
) -> None:
    """SavedModels are compute-only: once one client alone sends requests, their short executes
    run on the server's event loop (no thread hand-off), with the same results."""
    require_owner_connections(recorded)
    assert type(recorded.server.models.get("mlp").scheduler) is DynamicBatcher  # it has a queue delay
    assert type(recorded.server.models.get("mlp_auto").scheduler) is AdaptiveBatcher  # dynamic_batching { }
    assert type(recorded.server.models.get("mlp_loop").scheduler) is AdaptiveBatcher
    x = np.random.default_rng(11).standard_normal((1, 4)).astype(np.float32)
    want = modules["mlp"](tf.constant(x))["y"].numpy()
    recorder.until_on_the_loop(
        "mlp_loop",
        lambda: grpcclient.InferenceServerClient(recorded.grpc_url, channel_args=OWN_GRPC_CONNECTION),
        lambda client: np.testing.assert_allclose(
            infer(recorded, "grpc", "mlp_loop", {"x": x}, client=client).as_numpy("y"), want, rtol=1e-5, atol=1e-5),
    )


# --------------------------------------------------------------------------- auto-complete


def test_auto_complete_without_config(server: ServerThread) -> None:
    config = httpclient.InferenceServerClient(server.url).get_model_config("mlp_auto")
    assert config["platform"] == "tensorflow_savedmodel"
    assert config["max_batch_size"] == 4
    assert "dynamic_batching" in config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [("x", "TYPE_FP32", [4])]
    assert sorted((t["name"], t["dims"]) for t in config["output"]) == [("norm", [1]), ("y", [3])]
    x = np.ones((2, 4), dtype=np.float32)
    assert infer(server, "http", "mlp_auto", {"x": x}).as_numpy("norm").tolist() == [[2.0], [2.0]]


def test_auto_complete_named_signature_and_scalar_rows(server: ServerThread) -> None:
    client = httpclient.InferenceServerClient(server.url)
    conv = client.get_model_config("conv")
    assert conv["max_batch_size"] == 4
    assert [(t["name"], t["dims"]) for t in conv["input"]] == [("image", [8, 8, 1])]
    upper = client.get_model_config("upper")
    # max_batch_size 0 is indistinguishable from unset in proto3, so the signature's unknown
    # first dimension makes this a batching model; its scalar rows are dims [1] reshaped to [].
    assert upper["max_batch_size"] == 4
    assert [(t["name"], t["data_type"], t["dims"], t["reshape"]["shape"]) for t in upper["input"]] == [
        ("text", "TYPE_STRING", [1], [])
    ]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("model", "fragments"),
    [
        ("bad_name", ["input 'input'", "signature 'serving_default'", "inputs: x"]),
        ("bad_type", ["input 'x'", "TYPE_FP16", "TYPE_FP32"]),
        ("bad_dims", ["output 'y'", "[-1, 2]", "[-1, 3]"]),
        ("bad_signature", ["no signature 'predict'", "serving_default"]),
        ("corrupt", ["cannot load TensorFlow SavedModel"]),
        ("missing", ["SavedModel directory", "not found"]),
        ("graphdef_no_io", ["GraphDef", "config.pbtxt"]),
        ("graphdef_bad_name", ["output 'logits'", "not a tensor of GraphDef", "placeholders: x"]),
        ("graphdef_corrupt", ["cannot load TensorFlow GraphDef"]),
        ("bad_tag", ["cannot load TensorFlow SavedModel", "with tags ['train']"]),
        ("bad_threads", ["TF_NUM_INTRA_THREADS must be a whole number from 0 to 1024, got '-2'"]),
    ],
)
def test_bad_models_are_unavailable_with_a_reason(server: ServerThread, model: str, fragments: list[str]) -> None:
    entry = repository_index(server)[model]
    assert entry["state"] == "UNAVAILABLE"
    for fragment in fragments:
        assert fragment in entry["reason"], entry["reason"]


def test_good_models_are_ready(server: ServerThread) -> None:
    index = repository_index(server)
    for name in ("mlp", "mlp_auto", "conv", "upper", "graphdef", "conv_triton"):
        assert index[name]["state"] == "READY", index[name]


# --------------------------------------------------------------------------- GPU


@pytest.mark.skipif(not tf.config.list_physical_devices("GPU"), reason="needs a GPU and a CUDA build of TensorFlow")
def test_gpu_instance_runs_on_gpu(tmp_path: Path, pyserve_server_factory: ServerFactory, modules: dict[str, Any]) -> None:
    tf_models.save(modules["mlp"], tmp_path / "mlp")
    repo = tmp_path / "gpu_repo"
    files = {f"1/model.savedmodel/{k}": v for k, v in _tree(tmp_path / "mlp").items()}
    write_model(repo, "mlp_gpu", MLP_CONFIG + "instance_group [ { kind: KIND_GPU, gpus: [ 0 ] } ]\n", files)
    gpu_server = pyserve_server_factory(repo, backends=BACKENDS, use_entry_points=False)
    x = np.random.default_rng(6).standard_normal((3, 4)).astype(np.float32)
    got = infer(gpu_server, "grpc", "mlp_gpu", {"x": x}).as_numpy("y")
    np.testing.assert_allclose(got, modules["mlp"](tf.constant(x))["y"].numpy(), rtol=1e-4, atol=1e-4)


THREADS_PROBE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from pyserve_backend_tensorflow.runtime import apply_model_parameters
apply_model_parameters("first", {"TF_NUM_INTRA_THREADS": "1", "TF_NUM_INTER_THREADS": "2"})
apply_model_parameters("second", {"TF_NUM_INTRA_THREADS": "3", "MAX_SESSION_SHARE_COUNT": "2"})
import tensorflow as tf
print("intra", tf.config.threading.get_intra_op_parallelism_threads(),
      "inter", tf.config.threading.get_inter_op_parallelism_threads())
"""


def test_thread_parameters_set_tensorflow_pools_once_per_process() -> None:
    """In a fresh process (TensorFlow refuses new pool sizes once it has run anything)."""
    done = subprocess.run([sys.executable, "-c", THREADS_PROBE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert done.returncode == 0, done.stderr
    assert "intra 1 inter 2" in done.stdout
    assert "model 'second': parameter TF_NUM_INTRA_THREADS=3 ignored: model 'first' set it to 1" in done.stdout
    assert "model 'second': parameter MAX_SESSION_SHARE_COUNT has no effect" in done.stdout
