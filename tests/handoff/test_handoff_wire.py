"""The hand-off frames between frontend processes and the owner, and the replication rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from google.protobuf import text_format

from pyserve import protocol as pb
from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.handoff import wire
from pyserve.handoff.replicas import ReplicationMode, replicable
from pyserve.handoff.wire import Kind
from pyserve.metrics.stats import ModelStats, counters_delta
from pyserve.runtime.versions import ModelVersion


def _frames(parts_list: list[list[Any]], chunk: int) -> list[tuple[int, int, bytes]]:
    stream = b"".join(bytes(p) for parts in parts_list for p in parts)
    got: list[tuple[int, int, bytes]] = []
    reader = wire.FrameReader(lambda kind, rid, payload: got.append((kind, rid, bytes(payload))))
    for start in range(0, len(stream), chunk):
        reader.feed(stream[start : start + chunk])
    return got


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 22])
def test_frames_survive_any_split_of_the_stream(chunk: int) -> None:
    big = np.arange(600_000, dtype=np.float32)  # 2.4 MB: collected into its own buffer
    frames = [
        wire.frame(Kind.HELLO, 0, {"pid": 1}),
        wire.frame(Kind.CANCEL, 7),
        wire.frame(Kind.INFER, 9, {"x": 1}, [memoryview(big).cast("B")]),
        wire.frame(Kind.RESULT, 10, {"y": [1, 2]}, [b"abc"]),
    ]
    got = _frames(frames, chunk)
    assert [(k, r) for k, r, _ in got] == [(Kind.HELLO, 0), (Kind.CANCEL, 7), (Kind.INFER, 9), (Kind.RESULT, 10)]
    header, data = wire.split_payload(got[2][2])
    assert header == {"x": 1} and np.array_equal(np.frombuffer(data, np.float32), big)
    assert got[1][2] == b""
    assert wire.split_payload(got[3][2])[0] == {"y": [1, 2]}


def test_an_unknown_frame_kind_is_refused() -> None:
    reader = wire.FrameReader(lambda *a: None)
    with pytest.raises(ValueError, match="unknown frame kind 99"):
        reader.feed(bytes(wire.retarget(wire.frame(Kind.HELLO, 0)[0], 0))[:4] + b"\x63" + b"\0\0\0\0")


def test_a_request_round_trips_with_every_datatype() -> None:
    inputs = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "i64": np.array([[-(2**62), 2**62]], dtype=np.int64),
        "u8": np.array([], dtype=np.uint8).reshape(0, 4),
        "b": np.array([True, False]),
        "bf16": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16),
        "bytes": np.array([[b"a", b""], [b"\xff\x00", "text"]], dtype=object),
        "strided": np.arange(10, dtype=np.int16)[::2],
        "big_endian": np.arange(3, dtype=">f8"),
    }
    request = InferRequest("m", 1, inputs, ("out",), id="r1", parameters={"k": "v", "n": 2**63},
                           flags=1, correlation_id="seq-1", priority=2, timeout_us=5, batch_size=2)
    request.trace_parent = "00-abc"
    [(kind, rid, payload)] = _frames([wire.request_frame(3, request, 42, ("m", None))], 1 << 20)
    header, data = wire.split_payload(payload)
    assert (kind, rid, header["g"], header["m"]) == (Kind.INFER, 3, 42, ["m", None])
    assert (header["id"], header["p"], header["f"], header["c"], header["pr"], header["t"], header["b"], header["tp"]) == (
        "r1", {"k": "v", "n": 2**63}, 1, "seq-1", 2, 5, 2, "00-abc")
    arrays = wire.read_tensors(header["i"], data)
    for name, original in inputs.items():
        assert arrays[name].shape == original.shape, name
        if original.dtype == object:
            expected = [x if isinstance(x, bytes) else x.encode() for x in original.reshape(-1)]
            assert list(arrays[name].reshape(-1)) == expected
        else:
            assert arrays[name].dtype == original.dtype.newbyteorder("=") and np.array_equal(arrays[name], original), name


def test_results_and_errors_round_trip() -> None:
    response = InferResponse({"out": np.array([[1, 2]], dtype=np.int32)}, {"p": True})
    [(_, _, payload)] = _frames([wire.result_frame(5, response)], 64)
    header, data = wire.split_payload(payload)
    assert header["p"] == {"p": True}
    assert np.array_equal(wire.read_tensors(header["o"], data)["out"], [[1, 2]])
    [(_, _, payload)] = _frames([wire.result_frame(6, InferError("queue full", ErrorCode.UNAVAILABLE))], 64)
    assert wire.split_payload(payload)[0] == {"e": "queue full", "c": int(ErrorCode.UNAVAILABLE)}


def test_tensors_running_past_their_frame_are_refused() -> None:
    with pytest.raises(ValueError, match="runs past the end"):
        wire.read_tensors([["x", "float32", [4], 16]], memoryview(b"\0" * 8))


def test_replica_counters_add_up_in_the_owner() -> None:
    replica, owner = ModelStats(), ModelStats()
    before = replica.counters()
    replica.success_count, replica.inference_count, replica.execution_count = 5, 5, 2
    replica.batches = {1: [1, 10, 20, 30], 4: [1, 1, 2, 3]}
    replica.failures[1] = 2
    replica.last_inference_ns = 123
    owner.success_count, owner.batches = 1, {1: [1, 1, 1, 1]}
    owner.absorb(counters_delta(replica.counters(), before))
    assert (owner.success_count, owner.inference_count, owner.execution_count) == (6, 5, 2)
    assert owner.batches == {1: [2, 11, 21, 31], 4: [1, 1, 2, 3]} and owner.failures[1] == 2
    assert owner.last_inference_ns == 123
    again = counters_delta(replica.counters(), replica.counters())
    assert again["success_count"] == 0 and again["batches"] == {1: [0, 0, 0, 0], 4: [0, 0, 0, 0]}


def _version(config: str, tmp_path: Path | None = None) -> ModelVersion:
    message = text_format.Parse(config, pb.ModelConfig())
    return ModelVersion(name=message.name, version=1, config=message)


@pytest.mark.parametrize(
    ("config", "mode", "expected", "reason"),
    [
        ('name: "a" backend: "identity"', "auto", True, ""),
        ('name: "a" backend: "identity"', "none", False, "not selected"),
        ('name: "a" backend: "identity"', "a,b", True, ""),
        ('name: "a" backend: "identity" sequence_batching {}', "auto", False, "sequence batcher"),
        ('name: "a" backend: "identity" model_transaction_policy { decoupled: true }', "a", False, "decoupled"),
        ('name: "a" platform: "ensemble"', "auto", False, "ensemble"),
        ('name: "a" backend: "identity" instance_group [ { kind: KIND_GPU } ]', "auto", False, "GPU"),
        ('name: "a" backend: "identity" response_cache { enable: true }', "auto", False, "response cache"),
        ('name: "a" backend: "identity" dynamic_batching { max_queue_delay_microseconds: 100 }', "auto", True, ""),
        ('name: "a" backend: "identity" dynamic_batching { }', "auto", True, ""),
        ('name: "a" backend: "identity" dynamic_batching { max_queue_delay_microseconds: 1000 }', "auto", True, ""),
        ('name: "a" backend: "identity" dynamic_batching { max_queue_delay_microseconds: 12000000 }', "auto", False,
         "waits up to 12000000 us to fill a batch"),
        ('name: "a" backend: "identity" dynamic_batching { max_queue_delay_microseconds: 12000000 }', "a", True, ""),
        ('name: "a" backend: "identity" dynamic_batching { priority_levels: 2 default_priority_level: 1 }', "auto",
         False, "orders requests by priority level"),
        ('name: "a" backend: "identity" dynamic_batching { priority_levels: 1 default_priority_level: 1 }', "auto",
         True, ""),
        ('name: "a" backend: "identity" dynamic_batching { preserve_ordering: true }', "auto", False,
         "preserves the order of responses"),
        ('name: "a" backend: "identity" dynamic_batching { default_queue_policy { max_queue_size: 2 } }', "auto",
         False, "its queue policy (max_queue_size, timeouts)"),
        ('name: "a" backend: "identity" dynamic_batching { default_queue_policy { default_timeout_microseconds: 9 } }',
         "auto", False, "its queue policy"),
        ('name: "a" backend: "identity" dynamic_batching { default_queue_policy { allow_timeout_override: true } }',
         "auto", False, "its queue policy"),
        ('name: "a" backend: "identity" dynamic_batching { priority_levels: 1 default_priority_level: 1 '
         'priority_queue_policy { key: 1 value: { max_queue_size: 3 } } }', "auto", False, "its queue policy"),
        ('name: "a" backend: "identity" dynamic_batching { default_queue_policy { max_queue_size: 2 } }', "a",
         True, ""),
        ('name: "a" backend: "identity" dynamic_batching { max_queue_delay_microseconds: 100 }', "a", True, ""),
        ('name: "a" backend: "identity" instance_group [ { rate_limiter { resources [ { name: "R" count: 1 } ] } } ]',
         "auto", False, "rate-limiter resources"),
        ('name: "a" backend: "identity" parameters { key: "pyserve_replicate" value { string_value: "false" } }',
         "auto", False, "is false"),
        ('name: "a" backend: "identity" instance_group [ { kind: KIND_GPU } ] '
         'parameters { key: "pyserve_replicate" value { string_value: "true" } }', "none", True, ""),
    ],
)
def test_replication_rules(config: str, mode: str, expected: bool, reason: str) -> None:
    chosen, why = replicable(_version(config), ReplicationMode(mode))
    assert chosen is expected and reason in why


def test_auto_replicates_nothing_while_an_in_process_plugin_wraps_execute() -> None:
    """An execute wrapper living in the owner (``PluginHost.in_process_execute_wrappers``) holds
    ``auto`` back, named in the reason; naming the model or ``pyserve_replicate: "true"`` still
    replicates it, and without a wrapper registered ``auto`` replicates."""
    from pyserve.host.plugins import PluginHost
    from pyserve.testing import BatchRecorder

    version = _version('name: "a" backend: "identity"')
    both = PluginHost(server_plugins=[BatchRecorder()], use_entry_points=False)
    both.add_server_plugin(BatchRecorder(), name="audit")
    chosen, why = replicable(version, ReplicationMode("auto", both))
    assert not chosen and why == ("the in-process server plugins BatchRecorder, audit wrap pyserve_execute "
                                  "and would not see a frontend's executes")
    one = PluginHost(server_plugins=[BatchRecorder()], use_entry_points=False)
    assert "plugin BatchRecorder wraps pyserve_execute" in replicable(version, ReplicationMode("auto", one))[1]
    assert replicable(version, ReplicationMode("a", one)) == (True, "")
    forced = _version('name: "a" backend: "identity" parameters { key: "pyserve_replicate" value { string_value: "true" } }')
    assert replicable(forced, ReplicationMode("auto", one)) == (True, "")
    decoupled = _version('name: "a" backend: "identity" model_transaction_policy { decoupled: true }')
    assert replicable(decoupled, ReplicationMode("auto", one))[1].startswith("it is decoupled")
    assert replicable(version, ReplicationMode("auto", PluginHost(use_entry_points=False))) == (True, "")


def test_auto_leaves_models_of_a_backend_only_this_process_has_with_the_owner(tmp_path: Path) -> None:
    """A backend object handed to the server that is not installed: a frontend started afresh
    reads the entry points and has no such backend. An installed name given as an object
    (a test handing the installed package's module) is replicated."""
    from pyserve.api.backend import BackendContext, ModelContext
    from pyserve.host.plugins import PluginHost

    def version_of(backend: str) -> ModelVersion:
        version = _version(f'name: "a" backend: "{backend}"')
        version.context = ModelContext(name="a", version=1, config=version.config, path=tmp_path,
                                       backend=BackendContext(name=backend))
        return version

    host = PluginHost(extra_backends={"mine": object(), "python": object()}, use_entry_points=False)
    assert host.in_process_only_backend("mine") and not host.in_process_only_backend("python")  # python is installed
    assert not host.in_process_only_backend("onnxruntime")  # not handed over at all
    chosen, why = replicable(version_of("mine"), ReplicationMode("auto", host))
    assert not chosen and "backend 'mine' was handed to this server as an object" in why
    assert replicable(version_of("python"), ReplicationMode("auto", host)) == (True, "")
    assert replicable(version_of("mine"), ReplicationMode("a", host)) == (True, "")  # asked for by name

def test_a_backend_can_keep_a_model_in_the_owner(tmp_path: Path) -> None:
    """``ModelContext.single_process_reason`` (a model that calls the server or keeps custom
    metrics, as its backend knows): never replicated by ``auto``, and the reason is the backend's."""
    from pyserve.api.backend import BackendContext, ModelContext

    version = _version('name: "a" backend: "python"')
    version.context = ModelContext(name="a", version=1, config=version.config, path=tmp_path,
                                   backend=BackendContext(name="python"), single_process_reason="it calls the server")
    assert replicable(version, ReplicationMode("auto")) == (False, "it calls the server")
    version.context.single_process_reason = ""
    assert replicable(version, ReplicationMode("auto")) == (True, "")


def test_bad_replication_mode() -> None:
    with pytest.raises(ValueError, match="--replicate-models"):
        ReplicationMode("a,,b")
