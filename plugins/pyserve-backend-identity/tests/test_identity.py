"""Unit tests of the identity backend, driving its hooks through a real ``PluginHost``."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pyserve_backend_identity
import pytest

from pyserve import (
    BackendContext,
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelContext,
)
from pyserve.host.plugins import PluginHost
from pyserve.repository.model_config import (
    normalize,
    parameters,
    parse_config,
    validate,
)

DATATYPES = {
    "TYPE_BOOL": np.array([True, False, True]),
    "TYPE_UINT8": np.array([0, 7, 255], dtype=np.uint8),
    "TYPE_UINT16": np.array([0, 7, 65535], dtype=np.uint16),
    "TYPE_UINT32": np.array([0, 7, 2**32 - 1], dtype=np.uint32),
    "TYPE_UINT64": np.array([0, 7, 2**64 - 1], dtype=np.uint64),
    "TYPE_INT8": np.array([-128, 0, 127], dtype=np.int8),
    "TYPE_INT16": np.array([-1, 0, 1], dtype=np.int16),
    "TYPE_INT32": np.array([-1, 0, 1], dtype=np.int32),
    "TYPE_INT64": np.array([-(2**63), 0, 2**63 - 1], dtype=np.int64),
    "TYPE_FP16": np.array([0.5, -1.0, 65504.0], dtype=np.float16),
    "TYPE_FP32": np.array([0.5, -1.0, 3.25], dtype=np.float32),
    "TYPE_FP64": np.array([0.5, -1.0, 1e300], dtype=np.float64),
    "TYPE_STRING": np.array([b"", b"hello", b"\xff\x00binary"], dtype=object),
    "TYPE_BF16": np.array([0.5, -1.0, 3.0], dtype=ml_dtypes.bfloat16),
}


@pytest.fixture
def host() -> PluginHost:
    return PluginHost(extra_backends={"identity": pyserve_backend_identity}, use_entry_points=False)


def make_model(tmp_path: Path, config_text: str, name: str = "ident") -> ModelContext:
    """A ModelContext for ``config_text`` (without ``name``), normalized and validated."""
    model_dir = tmp_path / name
    (model_dir / "1").mkdir(parents=True)
    config = parse_config(config_text, model_dir / "config.pbtxt")
    normalize(config, model_dir)
    assert validate(config, model_dir) == []
    return ModelContext(
        name=name,
        version=1,
        config=config,
        path=model_dir,
        backend=BackendContext("identity"),
        parameters=parameters(config),
    )


def tensor(kind: str, name: str, data_type: str, dims: str = "[ -1 ]", extra: str = "") -> str:
    return f'{kind} [ {{ name: "{name}", data_type: {data_type}, dims: {dims} {extra} }} ]\n'


def param(key: str, value: str) -> str:
    return f'parameters [ {{ key: "{key}", value: {{ string_value: "{value}" }} }} ]\n'


def one_to_one(data_type: str = "TYPE_FP32", max_batch_size: int = 0, extra: str = "") -> str:
    return (
        f'backend: "identity"\nmax_batch_size: {max_batch_size}\n'
        + tensor("input", "INPUT0", data_type)
        + tensor("output", "OUTPUT0", data_type)
        + extra
    )


TWO_TO_TWO = (
    'backend: "identity"\nmax_batch_size: 8\n'
    + tensor("input", "INPUT0", "TYPE_INT32", "[ 4 ]")
    + tensor("input", "INPUT1", "TYPE_STRING", "[ -1 ]", "optional: true")
    + tensor("output", "OUTPUT0", "TYPE_INT32", "[ 4 ]")
    + tensor("output", "OUTPUT1", "TYPE_STRING", "[ -1 ]")
)


def create(host: PluginHost, model: ModelContext) -> InstanceContext:
    """Run model_create (storing the state as the server does) and return an instance."""
    model.state = host.backend("identity").hooks.model_create(model=model)
    return InstanceContext(name=f"{model.name}_0_0", kind="CPU", device_id=0, index=0, model=model)


def execute(host: PluginHost, instance: InstanceContext, requests: list[InferRequest]) -> list[Any]:
    responses = host.backend("identity").hooks.execute(instance=instance, requests=requests)
    assert len(responses) == len(requests)
    return list(responses)


def request(inputs: dict[str, np.ndarray], outputs: tuple[str, ...], batch_size: int = 1) -> InferRequest:
    return InferRequest("ident", 1, inputs, outputs, batch_size=batch_size)


@pytest.mark.parametrize("data_type", sorted(DATATYPES))
def test_every_datatype_echoes_the_same_array(host: PluginHost, tmp_path: Path, data_type: str) -> None:
    instance = create(host, make_model(tmp_path, one_to_one(data_type)))
    array = DATATYPES[data_type]

    [response] = execute(host, instance, [request({"INPUT0": array}, ("OUTPUT0",))])

    assert isinstance(response, InferResponse)
    assert response.outputs["OUTPUT0"] is array
    assert response.parameters == {}


def test_multi_input_maps_by_config_position(host: PluginHost, tmp_path: Path) -> None:
    instance = create(host, make_model(tmp_path, TWO_TO_TWO))
    ints = np.arange(8, dtype=np.int32).reshape(2, 4)
    texts = np.array([[b"a"], [b"b"]], dtype=object)

    [response] = execute(
        host, instance, [request({"INPUT0": ints, "INPUT1": texts}, ("OUTPUT0", "OUTPUT1"), batch_size=2)]
    )

    assert response.outputs["OUTPUT0"] is ints
    assert response.outputs["OUTPUT1"] is texts


def test_only_requested_outputs_are_produced(host: PluginHost, tmp_path: Path) -> None:
    instance = create(host, make_model(tmp_path, TWO_TO_TWO))
    inputs = {"INPUT0": np.zeros((1, 4), np.int32), "INPUT1": np.array([[b"x"]], dtype=object)}

    [response] = execute(host, instance, [request(inputs, ("OUTPUT1",))])

    assert list(response.outputs) == ["OUTPUT1"]


def test_missing_optional_input_answers_zeros_as_tritons(host: PluginHost, tmp_path: Path) -> None:
    instance = create(host, make_model(tmp_path, TWO_TO_TWO))
    full = {"INPUT0": np.zeros((1, 4), np.int32), "INPUT1": np.array([[b"x"]], dtype=object)}
    partial = {"INPUT0": np.ones((1, 4), np.int32)}

    good, bad, only_first = execute(
        host,
        instance,
        [
            request(full, ("OUTPUT0", "OUTPUT1")),
            request(partial, ("OUTPUT0", "OUTPUT1")),
            request(partial, ("OUTPUT0",)),
        ],
    )

    assert set(good.outputs) == {"OUTPUT0", "OUTPUT1"}
    # Triton's identity backend: the output of a left-out optional input is a zero tensor of the
    # input's dims (-1 as 1) after the batch dimension (empty strings for BYTES)
    assert isinstance(bad, InferResponse)
    assert bad.outputs["OUTPUT0"] is partial["INPUT0"]
    np.testing.assert_array_equal(bad.outputs["OUTPUT1"], np.array([[b""]], dtype=object))
    assert only_first.outputs["OUTPUT0"] is partial["INPUT0"]


def test_fewer_outputs_than_inputs_is_allowed(host: PluginHost, tmp_path: Path) -> None:
    config = (
        'backend: "identity"\n'
        + tensor("input", "A", "TYPE_FP32")
        + tensor("input", "B", "TYPE_INT8")
        + tensor("output", "A_OUT", "TYPE_FP32")
    )
    instance = create(host, make_model(tmp_path, config))
    a = np.ones(3, np.float32)

    [response] = execute(host, instance, [request({"A": a, "B": np.ones(2, np.int8)}, ("A_OUT",))])

    assert response.outputs == {"A_OUT": a}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            'backend: "identity"\n'
            + tensor("input", "IN", "TYPE_FP32")
            + tensor("output", "OUT", "TYPE_FP16"),
            ["'IN'", "'OUT'", "TYPE_FP32", "TYPE_FP16", "data_type"],
        ),
        (
            'backend: "identity"\n'
            + tensor("input", "IN", "TYPE_FP32", "[ 3 ]")
            + tensor("output", "OUT", "TYPE_FP32", "[ 4 ]"),
            ["'IN'", "'OUT'", "[3]", "[4]", "dims"],
        ),
        (
            'backend: "identity"\n'
            + tensor("input", "IN", "TYPE_FP32", "[ 3, -1 ]")
            + tensor("output", "OUT", "TYPE_FP32", "[ 3 ]"),
            ["'IN'", "'OUT'", "[3, -1]", "[3]"],
        ),
        (
            'backend: "identity"\n'
            + tensor("input", "IN", "TYPE_FP32", "[ 4 ]", "reshape: { shape: [ 2, 2 ] }")
            + tensor("output", "OUT", "TYPE_FP32", "[ 4 ]"),
            ["'IN'", "'OUT'", "[2, 2]", "[4]"],
        ),
        (
            'backend: "identity"\n'
            + tensor("input", "IN", "TYPE_FP32")
            + tensor("output", "OUT0", "TYPE_FP32")
            + tensor("output", "OUT1", "TYPE_FP32"),
            ["2 outputs", "1 inputs"],
        ),
    ],
    ids=["data_type", "dims", "rank", "reshape", "too-many-outputs"],
)
def test_config_mismatch_fails_create(
    host: PluginHost, tmp_path: Path, config: str, expected: list[str]
) -> None:
    model = make_model(tmp_path, config)

    with pytest.raises(ValueError) as caught:
        host.backend("identity").hooks.model_create(model=model)

    for fragment in expected:
        assert fragment in str(caught.value)


def test_no_inputs_fails_create(host: PluginHost, tmp_path: Path) -> None:
    # validate() would reject this config; the backend still refuses it on its own.
    model = make_model(tmp_path, one_to_one())
    model.config.ClearField("input")

    with pytest.raises(ValueError, match="at least one input"):
        host.backend("identity").hooks.model_create(model=model)


def test_variable_dims_on_either_side_are_compatible(host: PluginHost, tmp_path: Path) -> None:
    config = (
        'backend: "identity"\n'
        + tensor("input", "IN", "TYPE_FP32", "[ -1, 3 ]")
        + tensor("output", "OUT", "TYPE_FP32", "[ 2, -1 ]")
    )

    state = host.backend("identity").hooks.model_create(model=make_model(tmp_path, config))

    assert state.pairs == (("IN", "OUT"),)


def test_execute_delay_sleeps_once_per_batch(
    host: PluginHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = one_to_one(max_batch_size=16, extra=param("execute_delay_ms", "50"))
    instance = create(host, make_model(tmp_path, config))
    requests = [request({"INPUT0": np.ones((1, 2), np.float32)}, ("OUTPUT0",)) for _ in range(10)]
    slept: list[float] = []
    real_sleep = time.sleep
    this_thread = threading.get_ident()

    def sleep(seconds: float) -> None:  # the real sleep, counted on this thread (execute runs here)
        if threading.get_ident() == this_thread:
            slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(pyserve_backend_identity.time, "sleep", sleep)
    start = time.monotonic()
    responses = execute(host, instance, requests)
    elapsed = time.monotonic() - start

    assert all(isinstance(r, InferResponse) for r in responses)
    assert slept == [0.05]  # once for the batch of ten
    assert elapsed >= 0.045


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf", ""])
def test_bad_execute_delay_fails_create(host: PluginHost, tmp_path: Path, value: str) -> None:
    model = make_model(tmp_path, one_to_one(extra=param("execute_delay_ms", value)))

    with pytest.raises(ValueError, match="'execute_delay_ms'"):
        host.backend("identity").hooks.model_create(model=model)


def test_bad_report_batch_size_fails_create(host: PluginHost, tmp_path: Path) -> None:
    model = make_model(tmp_path, one_to_one(extra=param("report_batch_size", "yes")))

    with pytest.raises(ValueError, match="'report_batch_size'"):
        host.backend("identity").hooks.model_create(model=model)


def test_report_batch_size_adds_response_parameters(host: PluginHost, tmp_path: Path) -> None:
    config = one_to_one(max_batch_size=8, extra=param("report_batch_size", "true"))
    instance = create(host, make_model(tmp_path, config))
    first = [request({"INPUT0": np.ones((n, 2), np.float32)}, ("OUTPUT0",), batch_size=n) for n in (1, 3)]
    second = [request({"INPUT0": np.ones((2, 2), np.float32)}, ("OUTPUT0",), batch_size=2)]

    first_responses = execute(host, instance, first)
    [second_response] = execute(host, instance, second)

    assert [r.parameters for r in first_responses] == [
        {"batch_size": 4, "execute_count": 1, "request_count": 2}
    ] * 2
    assert second_response.parameters == {"batch_size": 2, "execute_count": 2, "request_count": 3}


def test_stats_are_kept_without_reporting(host: PluginHost, tmp_path: Path) -> None:
    model = make_model(tmp_path, one_to_one(max_batch_size=8))
    instance = create(host, model)
    batch = [request({"INPUT0": np.ones((n, 2), np.float32)}, ("OUTPUT0",), batch_size=n) for n in (2, 2)]

    responses = execute(host, instance, batch)
    execute(host, instance, batch[:1])

    assert all(r.parameters == {} for r in responses)
    snapshot = model.state.stats.snapshot()
    assert (snapshot.executes, snapshot.requests, snapshot.batch_sizes) == (2, 3, {4: 1, 2: 1})
