"""The pytorch backend served by a real server: results equal calling the module directly."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pt_models
import pyserve_backend_pytorch
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from pyserve.api.backend_support import ProcessWideSettings
from pyserve.runtime.scheduling import AdaptiveScheduler, DynamicBatcher
from pyserve.server.core import ServerThread
from pyserve.testing import (
    OWN_GRPC_CONNECTION,
    BatchRecorder,
    ServerFactory,
    require_owner_connections,
    serve,
    write_model,
)

BACKENDS = {"pytorch": pyserve_backend_pytorch}

MLP_CONFIG = """
platform: "pytorch_libtorch"
max_batch_size: 16
input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 3 ] } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
"""

CONV_CONFIG = """
platform: "libtorch"
max_batch_size: 8
input [ { name: "image", data_type: TYPE_FP32, dims: [ 1, 8, 8 ] } ]
output [
  { name: "logits__0", data_type: TYPE_FP32, dims: [ 2 ] },
  { name: "features__1", data_type: TYPE_FP32, dims: [ 4 ] }
]
"""

TWO_CONFIG = """
backend: "pytorch"
max_batch_size: 4
input [
  { name: "y", data_type: TYPE_FP32, dims: [ 3 ] },
  { name: "x", data_type: TYPE_FP32, dims: [ 3 ] }
]
output [
  { name: "count", data_type: TYPE_INT64, dims: [ 1 ] },
  { name: "sum", data_type: TYPE_FP32, dims: [ 3 ] }
]
"""

EXPORTED_CONFIG = """
backend: "pytorch"
max_batch_size: 8
default_model_filename: "model.pt2"
input [ { name: "x", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 3 ] } ]
parameters [
  { key: "torch_compile", value: { string_value: "true" } },
  { key: "torch_compile_backend", value: { string_value: "eager" } }
]
"""


SHOUT_CONFIG = """
backend: "pytorch"
input [ { name: "text", data_type: TYPE_STRING, dims: [ -1 ] } ]
output [
  { name: "OUTPUT__0", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "OUTPUT__1", data_type: TYPE_INT64, dims: [ -1 ] }
]
"""

ECHO_CONFIG = """
backend: "pytorch"
max_batch_size: 8
input [ { name: "INPUT__0", data_type: TYPE_STRING, dims: [ 1 ], reshape: { shape: [ ] } } ]
output [ { name: "OUTPUT__0", data_type: TYPE_STRING, dims: [ 1 ], reshape: { shape: [ ] } } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
"""

TRITON_FLAGS_CONFIG = (
    MLP_CONFIG.replace("dynamic_batching { max_queue_delay_microseconds: 20000 }",
                       "instance_group [ { count: 2 kind: KIND_CPU } ]")
    + 'parameters [ { key: "DISABLE_OPTIMIZED_EXECUTION", value: { string_value: "true" } },'
    ' { key: "ENABLE_WEIGHT_SHARING", value: { string_value: "true" } },'
    ' { key: "ENABLE_CACHE_CLEANING", value: { string_value: "true" } } ]\n'
)


def _broken(config: str, old: str, new: str) -> str:
    assert old in config
    return config.replace(old, new)


@pytest.fixture(scope="module")
def modules() -> dict[str, torch.nn.Module]:
    return {
        "mlp": pt_models.seeded(pt_models.MLP(), 0),
        "conv": pt_models.seeded(pt_models.ConvNet(), 1),
        "two": pt_models.TwoInputs().eval(),
        "shout": pt_models.Shout().eval(),
        "echo": pt_models.Echo().eval(),
        "tensor_for_strings": pt_models.TensorForStrings().eval(),
    }


@pytest.fixture(scope="module")
def recorder() -> BatchRecorder:
    return BatchRecorder()


@pytest.fixture(scope="module")
def recorded(
    tmp_path_factory: pytest.TempPathFactory, modules: dict[str, torch.nn.Module], recorder: BatchRecorder
) -> Iterator[ServerThread]:
    """A server of its own for the tests that count executes: while ``recorder`` (a plugin
    object of this process) wraps execute, ``auto`` replicates nothing, so it sees every execute
    and one batcher takes the requests of every connection."""
    files = tmp_path_factory.mktemp("pt_recorded_files")
    pt_models.save_traced(modules["mlp"], torch.zeros(2, 4), files / "mlp.pt")
    pt_models.save_scripted(modules["echo"], files / "echo.pt")
    mlp, echo = (files / "mlp.pt").read_bytes(), (files / "echo.pt").read_bytes()
    repo = tmp_path_factory.mktemp("pt_recorded")
    write_model(repo, "mlp", MLP_CONFIG, {"1/model.pt": mlp})
    write_model(repo, "triton_flags", TRITON_FLAGS_CONFIG, {"1/model.pt": mlp})
    write_model(repo, "echo_slow", ECHO_CONFIG.replace("20000", "300000"), {"1/model.pt": echo})
    with serve(repo, backends=BACKENDS, server_plugins=(recorder,), use_entry_points=False) as thread:
        yield thread


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, modules: dict[str, torch.nn.Module]) -> Iterator[ServerThread]:
    """The models as users get them: replicated in the frontend processes of the test layout."""
    files = tmp_path_factory.mktemp("pt_files")
    pt_models.save_traced(modules["mlp"], torch.zeros(2, 4), files / "mlp.pt")
    pt_models.save_scripted(modules["conv"], files / "conv.pt")
    pt_models.save_scripted(modules["two"], files / "two.pt")
    pt_models.save_exported(modules["mlp"], torch.zeros(2, 4), files / "mlp.pt2")
    mlp, conv, two = ((files / f"{n}.pt").read_bytes() for n in ("mlp", "conv", "two"))
    repo = tmp_path_factory.mktemp("pt_repo")
    write_model(repo, "mlp", MLP_CONFIG, {"1/model.pt": mlp})
    write_model(repo, "conv", CONV_CONFIG, {"1/model.pt": conv})
    write_model(repo, "two", TWO_CONFIG, {"1/model.pt": two})
    write_model(repo, "exported", EXPORTED_CONFIG, {"1/model.pt2": (files / "mlp.pt2").read_bytes()})
    write_model(repo, "config_order", _broken(CONV_CONFIG, 'name: "image"', 'name: "picture"'), {"1/model.pt": conv})
    write_model(repo, "bad_name", _broken(CONV_CONFIG, '{ name: "image", data_type: TYPE_FP32, dims: [ 1, 8, 8 ] }',
                                          '{ name: "picture", data_type: TYPE_FP32, dims: [ 1, 8, 8 ] }, '
                                          '{ name: "extra", data_type: TYPE_FP32, dims: [ 1 ] }'), {"1/model.pt": conv})
    write_model(repo, "bad_index", _broken(MLP_CONFIG, "INPUT__0", "INPUT__1"), {"1/model.pt": mlp})
    write_model(repo, "bad_dims", _broken(MLP_CONFIG, "dims: [ 3 ]", "dims: [ 5 ]"), {"1/model.pt": mlp})
    write_model(repo, "bad_type", _broken(MLP_CONFIG, "TYPE_FP32, dims: [ 3 ]", "TYPE_FP64, dims: [ 3 ]"), {"1/model.pt": mlp})
    write_model(repo, "bad_input_dims", _broken(MLP_CONFIG, "dims: [ 4 ]", "dims: [ 6 ]"), {"1/model.pt": mlp})
    write_model(repo, "bad_missing_arg", _broken(TWO_CONFIG, '{ name: "y", data_type: TYPE_FP32, dims: [ 3 ] },', ""),
                {"1/model.pt": two})
    write_model(repo, "corrupt", MLP_CONFIG, {"1/model.pt": b"PK\x03\x04 not a torchscript archive"})
    write_model(repo, "missing", MLP_CONFIG)
    write_model(repo, "compile_script", _broken(EXPORTED_CONFIG, 'default_model_filename: "model.pt2"\n', ""),
                {"1/model.pt": mlp})
    write_model(repo, "bad_threads", MLP_CONFIG + 'parameters [ { key: "INTRA_OP_THREAD_COUNT", '
                'value: { string_value: "-2" } } ]\n', {"1/model.pt": mlp})
    write_model(repo, "triton_flags", TRITON_FLAGS_CONFIG, {"1/model.pt": mlp})
    write_model(repo, "bad_flag", MLP_CONFIG + 'parameters [ { key: "ENABLE_WEIGHT_SHARING", '
                'value: { string_value: "sometimes" } } ]\n', {"1/model.pt": mlp})
    for name in ("shout", "echo", "tensor_for_strings"):
        pt_models.save_scripted(modules[name], files / f"{name}.pt")
    shout, echo, tensor_for_strings = ((files / f"{n}.pt").read_bytes() for n in ("shout", "echo", "tensor_for_strings"))
    write_model(repo, "shout", SHOUT_CONFIG, {"1/model.pt": shout})
    write_model(repo, "echo", ECHO_CONFIG, {"1/model.pt": echo})
    write_model(repo, "bad_string_dims", _broken(SHOUT_CONFIG, "TYPE_STRING, dims: [ -1 ] }", "TYPE_STRING, dims: [ 2, -1 ] }"),
                {"1/model.pt": shout})
    write_model(repo, "bad_batched_string", _broken(ECHO_CONFIG, ', reshape: { shape: [ ] } } ]\noutput', " } ]\noutput"),
                {"1/model.pt": echo})
    write_model(repo, "bad_string_output", ECHO_CONFIG.replace("INPUT__0", "words").replace("dynamic_batching", "#"),
                {"1/model.pt": tensor_for_strings})
    with serve(repo, backends=BACKENDS, use_entry_points=False) as thread:
        yield thread


def infer(server: ServerThread, protocol: str, model: str, inputs: dict[str, np.ndarray],
          outputs: list[str] | None = None, client: Any = None) -> Any:
    """One call, on a new connection unless ``client`` (of ``protocol``) is given."""
    module = httpclient if protocol == "http" else grpcclient
    if client is None:
        client = module.InferenceServerClient(server.url if protocol == "http" else server.grpc_url)
    tensors = []
    for name, array in inputs.items():
        tensor = module.InferInput(name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    requested = [module.InferRequestedOutput(n) for n in outputs] if outputs else None
    return client.infer(model, tensors, outputs=requested)


def call(module: torch.nn.Module, *arrays: np.ndarray) -> Any:
    with torch.inference_mode():
        return module(*(torch.from_numpy(a) for a in arrays))


def repository_index(server: ServerThread) -> dict[str, dict[str, str]]:
    client = httpclient.InferenceServerClient(server.url)
    return {entry["name"]: entry for entry in client.get_model_repository_index()}


# --------------------------------------------------------------------------- packaging


def test_plugin_import_does_not_import_torch() -> None:
    code = (
        "import sys, pyserve_backend_pytorch\n"
        "print([m for m in ('torch', 'onnxruntime', 'tensorflow') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_entry_points_declare_backend_and_platforms() -> None:
    backends = {ep.name: ep.value for ep in metadata.entry_points(group="pyserve.backends")}
    platforms = {ep.name: ep.value for ep in metadata.entry_points(group="pyserve.platforms")}
    if "pytorch" not in backends:
        pytest.skip("pyserve-backend-pytorch is not installed (pip install -e)")
    assert backends["pytorch"] == "pyserve_backend_pytorch"
    assert platforms["pytorch_libtorch"] == platforms["libtorch"] == "pytorch"


def test_inputs_share_memory_with_contiguous_arrays() -> None:
    from pyserve_backend_pytorch.runtime import to_numpy, to_torch

    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    array.flags.writeable = False  # the server hands backends read-only views
    tensor = to_torch(array, torch.device("cpu"))
    assert tensor.data_ptr() == array.ctypes.data
    back = to_numpy(tensor)
    assert back.ctypes.data == array.ctypes.data


def test_results_reach_numpy_whatever_forward_returns() -> None:
    """A parameter (requires grad), a bfloat16 tensor and an inference tensor all become arrays."""
    from pyserve_backend_pytorch.runtime import BFLOAT16, to_numpy

    weight = torch.nn.Parameter(torch.ones(2, 3))
    np.testing.assert_array_equal(to_numpy(weight), np.ones((2, 3), np.float32))
    halves = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    back = to_numpy(halves)
    assert back.dtype == BFLOAT16 and back.astype(np.float32).tolist() == [1.5, -2.0]
    with torch.inference_mode():
        made = torch.arange(4.0)
    assert to_numpy(made).tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("inference_mode", [True, False])
def test_forward_runs_under_the_configured_grad_mode(inference_mode: bool) -> None:
    from pyserve_backend_pytorch.runtime import grad_guard

    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    with grad_guard(inference_mode)():
        assert not torch.is_grad_enabled()
        assert torch.is_inference_mode_enabled() == inference_mode
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


# --------------------------------------------------------------------------- inference


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_mlp_index_names_match_torch(server: ServerThread, modules: dict[str, Any], protocol: str) -> None:
    x = np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)
    got = infer(server, protocol, "mlp", {"INPUT__0": x}).as_numpy("OUTPUT__0")
    np.testing.assert_allclose(got, call(modules["mlp"], x).numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_convnet_named_input_indexed_outputs(server: ServerThread, modules: dict[str, Any], protocol: str) -> None:
    image = np.random.default_rng(4).standard_normal((3, 1, 8, 8)).astype(np.float32)
    result = infer(server, protocol, "conv", {"image": image})
    logits, features = call(modules["conv"], image)
    np.testing.assert_allclose(result.as_numpy("logits__0"), logits.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.as_numpy("features__1"), features.numpy(), rtol=1e-5, atol=1e-6)


def test_keyword_inputs_in_any_order_and_dict_outputs(server: ServerThread) -> None:
    x = np.array([[1.0, -2.0, 3.0]], dtype=np.float32)
    y = np.array([[10.0, 20.0, 30.0]], dtype=np.float32)
    result = infer(server, "grpc", "two", {"y": y, "x": x})
    np.testing.assert_allclose(result.as_numpy("sum"), x * 2 + y)
    assert result.as_numpy("count").tolist() == [[2]]
    assert result.as_numpy("count").dtype == np.int64


def test_requested_output_only(server: ServerThread, modules: dict[str, Any]) -> None:
    image = np.ones((1, 1, 8, 8), dtype=np.float32)
    result = infer(server, "http", "conv", {"image": image}, outputs=["features__1"])
    assert result.as_numpy("logits__0") is None
    np.testing.assert_allclose(result.as_numpy("features__1"), call(modules["conv"], image)[1].numpy(), rtol=1e-5)


def test_inputs_following_neither_convention_go_in_config_order(server: ServerThread, modules: dict[str, Any]) -> None:
    """As Triton's STRICT_CONFIG_ORDERING (its python_based_backends QA model names inputs
    INPUT0/INPUT1 for forward(input0, input1)): 'picture' is forward's first argument."""
    image = np.random.default_rng(9).standard_normal((1, 1, 8, 8)).astype(np.float32)
    result = infer(server, "grpc", "config_order", {"picture": image})
    np.testing.assert_allclose(result.as_numpy("logits__0"), call(modules["conv"], image)[0].numpy(), rtol=1e-5)


def test_exported_program_with_torch_compile(server: ServerThread, modules: dict[str, Any]) -> None:
    x = np.random.default_rng(7).standard_normal((3, 4)).astype(np.float32)
    got = infer(server, "grpc", "exported", {"x": x}).as_numpy("OUTPUT__0")
    np.testing.assert_allclose(got, call(modules["mlp"], x).numpy(), rtol=1e-5, atol=1e-6)


def test_dynamic_batching_gives_the_rows_of_single_calls(
    recorded: ServerThread, modules: dict[str, Any], recorder: BatchRecorder
) -> None:
    rows = np.random.default_rng(5).standard_normal((16, 1, 4)).astype(np.float32)
    expected = [call(modules["mlp"], row).numpy() for row in rows]
    before = len(recorder.sizes.get("mlp", []))
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda row: infer(recorded, "grpc", "mlp", {"INPUT__0": row}).as_numpy("OUTPUT__0"), rows))
    for got, want in zip(results, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    sizes = recorder.sizes["mlp"][before:]
    assert sum(sizes) == 16
    assert max(sizes) > 1, f"the dynamic batcher never joined requests: {sizes}"


def test_one_client_gets_its_executes_on_the_event_loop(
    recorded: ServerThread, modules: dict[str, Any], recorder: BatchRecorder
) -> None:
    """TorchScript models are compute-only: once one client alone sends requests, their short
    executes run on the server's event loop (no thread hand-off), with the same results."""
    require_owner_connections(recorded)
    assert type(recorded.server.models.get("mlp").scheduler) is DynamicBatcher  # it has a queue delay
    assert type(recorded.server.models.get("triton_flags").scheduler) is AdaptiveScheduler  # two instances
    x = np.random.default_rng(11).standard_normal((1, 4)).astype(np.float32)
    want = call(modules["mlp"], x).numpy()
    recorder.until_on_the_loop(
        "triton_flags",
        lambda: grpcclient.InferenceServerClient(recorded.grpc_url, channel_args=OWN_GRPC_CONNECTION),
        lambda client: np.testing.assert_allclose(
            infer(recorded, "grpc", "triton_flags", {"INPUT__0": x}, client=client).as_numpy("OUTPUT__0"),
            want, rtol=1e-5, atol=1e-6),
    )


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("model", "fragments"),
    [
        ("bad_name", ["input 'picture'", "forward(image)", "'<name>__<index>'", "2 input(s) cannot be passed"]),
        ("bad_index", ["INPUT__1", "numbered 0..0"]),
        ("bad_dims", ["output 'OUTPUT__0'", "dims [5]", "[3]"]),
        ("bad_type", ["output 'OUTPUT__0'", "TYPE_FP64", "TYPE_FP32"]),
        ("bad_input_dims", ["probe run", "INPUT__0: [1, 6]"]),
        ("bad_missing_arg", ["forward argument 'y'", "forward(x, y)"]),
        ("corrupt", ["cannot load PyTorch model", "model.pt"]),
        ("missing", ["model file", "not found"]),
        ("compile_script", ["torch_compile", "TorchScript"]),
        ("bad_threads", ["INTRA_OP_THREAD_COUNT", "integer from 0 to 1024", "'-2'"]),
    ],
)
def test_bad_models_are_unavailable_with_a_reason(server: ServerThread, model: str, fragments: list[str]) -> None:
    entry = repository_index(server)[model]
    assert entry["state"] == "UNAVAILABLE"
    for fragment in fragments:
        assert fragment in entry["reason"], entry["reason"]


def test_thread_counts_are_process_wide_and_the_first_model_wins(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from pyserve_backend_pytorch import runtime

    monkeypatch.setattr(runtime, "SETTINGS", ProcessWideSettings("torch", runtime.log))
    original = torch.get_num_threads()
    wanted = 1 if original != 1 else 2
    try:
        with caplog.at_level("INFO", logger="pyserve.backend.pytorch"):
            runtime.apply_thread_counts("first", wanted, None)
            assert torch.get_num_threads() == wanted
            runtime.apply_thread_counts("second", wanted + 1, None)  # the first model's value stays
            assert torch.get_num_threads() == wanted
            runtime.apply_thread_counts("third", None, 1)  # applied, or refused if the pool started
        messages = caplog.text
        assert "model 'second': parameter INTRA_OP_THREAD_COUNT=%d ignored: model 'first'" % (wanted + 1) in messages
        assert "INTER_OP_THREAD_COUNT" in messages  # either "set to 1" or "not applied"
    finally:
        torch.set_num_threads(original)


def test_triton_parameters_weight_sharing_and_unoptimized_execution(server: ServerThread,
                                                                      modules: dict[str, Any]) -> None:
    version = server.server.models.get("triton_flags")
    first, second = (instance.state for instance in version.instances)
    assert first.module is second.module  # ENABLE_WEIGHT_SHARING: one module for both instances
    assert not first.model.optimized_execution and first.model.cache_cleaning
    x = np.random.default_rng(8).standard_normal((3, 4)).astype(np.float32)
    got = infer(server, "grpc", "triton_flags", {"INPUT__0": x}).as_numpy("OUTPUT__0")
    np.testing.assert_allclose(got, call(modules["mlp"], x).numpy(), rtol=1e-5, atol=1e-6)
    entry = repository_index(server)["bad_flag"]
    assert entry["state"] == "UNAVAILABLE" and "ENABLE_WEIGHT_SHARING" in entry["reason"], entry


def test_process_flags_are_set_once_per_process(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    from pyserve_backend_pytorch import runtime

    monkeypatch.setattr(runtime, "SETTINGS", ProcessWideSettings("torch", runtime.log))
    before = torch.backends.cudnn.enabled
    try:
        with caplog.at_level("INFO", logger="pyserve.backend.pytorch"):
            runtime.apply_process_flags("first", {"DISABLE_CUDNN": "true"})
            assert torch.backends.cudnn.enabled is False
            runtime.apply_process_flags("second", {"DISABLE_CUDNN": "false"})
            assert torch.backends.cudnn.enabled is False  # the first model's setting stays
        assert "model 'second': parameter DISABLE_CUDNN=False ignored: model 'first' set it to True" in caplog.text
    finally:
        torch.backends.cudnn.enabled = before


def test_good_models_are_ready(server: ServerThread) -> None:
    index = repository_index(server)
    for name in ("mlp", "conv", "two", "exported", "triton_flags", "shout", "echo"):
        assert index[name]["state"] == "READY", index[name]


# --------------------------------------------------------------------------- strings


def _bytes_input(module: Any, name: str, values: np.ndarray) -> Any:
    tensor = module.InferInput(name, list(values.shape), "BYTES")
    tensor.set_data_from_numpy(values)
    return tensor


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_string_inputs_and_outputs_are_lists_of_str(server: ServerThread, protocol: str, tmp_path: Path) -> None:
    """TYPE_STRING tensors reach TorchScript as List[str] and come back as BYTES, as in Triton."""
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(server.url if protocol == "http" else server.grpc_url)
    words = ["héllo", "", "torch script"]
    text = np.array([w.encode() for w in words], dtype=object)
    result = client.infer("shout", [_bytes_input(module, "text", text)])
    pt_models.save_scripted(pt_models.Shout().eval(), tmp_path / "shout.pt")
    shouted, counts = pt_models.load_scripted(tmp_path / "shout.pt")(words)  # the TorchScript module called directly
    assert result.as_numpy("OUTPUT__0").tolist() == [s.encode() for s in shouted]
    assert result.as_numpy("OUTPUT__0")[2] == b"TORCH SCRIPT!"
    assert result.as_numpy("OUTPUT__1").tolist() == counts.tolist()


def test_batched_strings_are_joined_and_split_per_request(server: ServerThread) -> None:
    """With max_batch_size, each request's strings are one entry per batch row (dims [1], reshape [])."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    words = [[b"alpha"], [b"beta", b"gamma"], [b"delta"]]

    def one(rows: list[bytes]) -> list[bytes]:
        values = np.array(rows, dtype=object).reshape(len(rows), 1)
        answer = client.infer("echo", [_bytes_input(grpcclient, "INPUT__0", values)]).as_numpy("OUTPUT__0")
        assert answer.shape == (len(rows), 1)
        return answer.reshape(-1).tolist()

    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(one, words)) == words


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_string_input_that_is_not_utf8_is_refused(server: ServerThread, protocol: str) -> None:
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(server.url if protocol == "http" else server.grpc_url)
    text = np.array([b"fine", b"\xff\xfe broken"], dtype=object)
    with pytest.raises(Exception) as caught:
        client.infer("shout", [_bytes_input(module, "text", text)])
    message = str(caught.value)
    assert "input 'text'" in message and "not UTF-8" in message
    status = caught.value.status()  # type: ignore[attr-defined]
    assert status in ("400", "StatusCode.INVALID_ARGUMENT"), status
    assert client.infer("shout", [_bytes_input(module, "text", text[:1])]).as_numpy("OUTPUT__1").tolist() == [4]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_non_utf8_string_fails_only_its_own_request_of_a_batch(recorded: ServerThread, recorder: BatchRecorder,
                                                                 protocol: str) -> None:
    """The bad request alone gets 400 / INVALID_ARGUMENT; the requests batched with it run."""
    module = httpclient if protocol == "http" else grpcclient
    url = recorded.url if protocol == "http" else recorded.grpc_url
    sent = [[b"alpha"], [b"beta"], [b"gamma"], [b"\xff broken"]]
    before = len(recorder.sizes.get("echo_slow", []))

    def one(rows: list[bytes]) -> Any:
        values = np.array(rows, dtype=object).reshape(len(rows), 1)
        try:
            client = module.InferenceServerClient(url)
            return client.infer("echo_slow", [_bytes_input(module, "INPUT__0", values)]).as_numpy("OUTPUT__0")
        except InferenceServerException as exc:
            return exc

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, sent))
    for got, rows in zip(results[:3], sent):
        assert isinstance(got, np.ndarray), got
        assert got.reshape(-1).tolist() == rows
    error = results[3]
    assert isinstance(error, InferenceServerException)
    assert error.status() in ("400", "StatusCode.INVALID_ARGUMENT"), error.status()
    assert "input 'INPUT__0'" in error.message() and "not UTF-8" in error.message()
    assert max(recorder.sizes["echo_slow"][before:]) > 1, "the requests were never batched"


@pytest.mark.parametrize(
    ("model", "fragments"),
    [
        ("bad_string_dims", ["input 'text'", "TYPE_STRING", "[2, -1]", "one-dimensional List[str]"]),
        ("bad_batched_string", ["input 'INPUT__0'", "['batch', 1]", "reshape"]),
        ("bad_string_output", ["output 'OUTPUT__0'", "TYPE_STRING", "TYPE_FP32"]),
    ],
)
def test_bad_string_models_are_unavailable_with_a_reason(server: ServerThread, model: str,
                                                         fragments: list[str]) -> None:
    entry = repository_index(server)[model]
    assert entry["state"] == "UNAVAILABLE"
    for fragment in fragments:
        assert fragment in entry["reason"], entry["reason"]


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch")
def test_gpu_instance_runs_on_cuda(tmp_path: Path, pyserve_server_factory: ServerFactory, modules: dict[str, Any]) -> None:
    pt_models.save_traced(modules["mlp"], torch.zeros(2, 4), tmp_path / "mlp.pt")
    repo = tmp_path / "gpu_repo"
    write_model(repo, "mlp_gpu", MLP_CONFIG + "instance_group [ { kind: KIND_GPU, gpus: [ 0 ] } ]\n",
                {"1/model.pt": (tmp_path / "mlp.pt").read_bytes()})
    gpu_server = pyserve_server_factory(repo, backends=BACKENDS, use_entry_points=False)
    x = np.random.default_rng(6).standard_normal((3, 4)).astype(np.float32)
    got = infer(gpu_server, "grpc", "mlp_gpu", {"INPUT__0": x}).as_numpy("OUTPUT__0")
    np.testing.assert_allclose(got, call(modules["mlp"], x).numpy(), rtol=1e-4, atol=1e-5)


class OnCurrentDevice(torch.nn.Module):
    """Adds ones made on ``"cuda"``: CUDA's current device, not the input's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.ones(x.size(), dtype=x.dtype, device=torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_instance_forward_runs_with_its_device_current(tmp_path: Path, pyserve_server_factory: ServerFactory) -> None:
    """A GPU 1 instance's forward sees cuda:1 as the current device (Triton's device guard)."""
    pt_models.save_scripted(OnCurrentDevice(), tmp_path / "current.pt")
    config = MLP_CONFIG.replace('dims: [ 3 ]', 'dims: [ 4 ]') + "instance_group [ { kind: KIND_GPU, gpus: [ 1 ] } ]\n"
    write_model(tmp_path / "repo", "current", config + 'parameters { key: "probe_run" value { string_value: "false" } }\n',
                {"1/model.pt": (tmp_path / "current.pt").read_bytes()})
    server = pyserve_server_factory(tmp_path / "repo", backends=BACKENDS, use_entry_points=False)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(infer(server, "grpc", "current", {"INPUT__0": x}).as_numpy("OUTPUT__0"), x + 1)


SEQUENCE_CONFIG = """
backend: "pytorch"
max_batch_size: 1
input [ { name: "INPUT__0", data_type: TYPE_INT64, dims: [ 1 ] } ]
output [
  { name: "OUTPUT__0", data_type: TYPE_INT64, dims: [ 1 ] },
  { name: "STARTED__2", data_type: TYPE_FP32, dims: [ 1 ] }
]
instance_group [ { count: 1, kind: KIND_CPU } ]
sequence_batching {
  oldest { max_candidate_sequences: 2 }
  control_input [ { name: "START__1" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "STATE_IN__2" output_name: "STATE_OUT__1" data_type: TYPE_INT64 dims: [ 1 ] } ]
}
"""


def test_control_and_state_inputs_are_forward_arguments(tmp_path: Path) -> None:
    """As Triton's libtorch backend: the sequence batcher's control input and implicit state
    count among forward's '__<index>' arguments, and the state output among its results; the
    state carries over per sequence and never reaches the client. The model passes the load's
    probe run too (the probe feeds the control and state inputs)."""
    pt_models.save_scripted(pt_models.Accumulator(), tmp_path / "accumulator.pt")
    write_model(tmp_path / "repo", "accumulator", SEQUENCE_CONFIG,
                {"1/model.pt": (tmp_path / "accumulator.pt").read_bytes()})
    with serve(tmp_path / "repo", backends=BACKENDS) as server:
        client = httpclient.InferenceServerClient(server.url)

        def send(sequence: int, value: int, **flags: bool) -> tuple[int, float]:
            given = httpclient.InferInput("INPUT__0", [1, 1], "INT64")
            given.set_data_from_numpy(np.array([[value]], dtype=np.int64))
            result = client.infer("accumulator", [given], sequence_id=sequence, **flags)
            assert result.as_numpy("STATE_OUT__1") is None
            return int(result.as_numpy("OUTPUT__0")[0, 0]), float(result.as_numpy("STARTED__2")[0, 0])

        assert send(1, 1, sequence_start=True) == (1, 1.0)
        assert send(2, 10, sequence_start=True) == (10, 1.0)
        assert send(1, 2) == (3, 0.0)
        assert send(2, 5) == (15, 0.0)
        assert send(1, 3, sequence_end=True) == (6, 0.0)
        client.close()
