"""Tests for pyserve.protocol: descriptor parity with Triton, wire compatibility, JSON form."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, text_format
from google.protobuf.descriptor import (
    Descriptor,
    EnumDescriptor,
    FieldDescriptor,
    FileDescriptor,
)

import pyserve.protocol as proto
from pyserve.protocol.config_json import model_config_from_dict, model_config_from_json, model_config_to_dict

try:
    from tritonclient.grpc import model_config_pb2 as triton_config
    from tritonclient.grpc import service_pb2 as triton_service
except ImportError:  # pragma: no cover - tritonclient is a test dependency
    triton_config = triton_service = None

REPO_ROOT = Path(__file__).resolve().parents[2]
requires_triton = pytest.mark.skipif(triton_config is None, reason="needs tritonclient[grpc]")

OUR_FILES = {
    "model_config": proto.POOL.FindFileByName("pyserve/protocol/model_config.proto"),
    "grpc_service": proto.POOL.FindFileByName("pyserve/protocol/grpc_service.proto"),
}
TRITON_FILES = (
    {}
    if triton_config is None
    else {"model_config": triton_config.DESCRIPTOR, "grpc_service": triton_service.DESCRIPTOR}
)


# ---------------------------------------------------------------------------
# Descriptor walking helpers


def _messages(file: FileDescriptor) -> Iterator[Descriptor]:
    """Every message of ``file``, nested and map-entry types included."""
    stack = list(file.message_types_by_name.values())
    while stack:
        message = stack.pop()
        yield message
        stack.extend(message.nested_types)


def _enums(file: FileDescriptor) -> Iterator[EnumDescriptor]:
    """Every enum of ``file``, nested ones included."""
    yield from file.enum_types_by_name.values()
    for message in _messages(file):
        yield from message.enum_types


def _by_name(files: dict[str, FileDescriptor], walk: Any) -> dict[str, Any]:
    return {item.full_name: item for file in files.values() for item in walk(file)}


_TYPE_NAMES = {
    value: name for name, value in vars(FieldDescriptor).items() if name.startswith("TYPE_")
}


def _label(field: FieldDescriptor) -> str:
    if field.is_repeated:
        return "repeated"
    return "required" if field.is_required else "optional"


def _field_facts(field: FieldDescriptor) -> dict[str, Any]:
    return {
        "number": field.number,
        "type": _TYPE_NAMES[field.type],
        "label": _label(field),
        "has_presence": field.has_presence,
        "message_type": field.message_type.full_name if field.message_type else None,
        "enum_type": field.enum_type.full_name if field.enum_type else None,
        "oneof": field.containing_oneof.name if field.containing_oneof else None,
        "json_name": field.json_name,
    }


OUR_MESSAGES = _by_name(OUR_FILES, _messages)
TRITON_MESSAGES = _by_name(TRITON_FILES, _messages)
OUR_ENUMS = _by_name(OUR_FILES, _enums)
TRITON_ENUMS = _by_name(TRITON_FILES, _enums)


# ---------------------------------------------------------------------------
# Descriptor parity with tritonclient


@requires_triton
@pytest.mark.parametrize("full_name", sorted(OUR_MESSAGES.keys() | TRITON_MESSAGES.keys()))
def test_message_matches_triton(full_name: str) -> None:
    assert full_name in TRITON_MESSAGES, f"{full_name}: defined by pyserve but not by Triton"
    assert full_name in OUR_MESSAGES, f"{full_name}: defined by Triton but missing in pyserve"
    ours, theirs = OUR_MESSAGES[full_name], TRITON_MESSAGES[full_name]

    assert ours.GetOptions().map_entry == theirs.GetOptions().map_entry, full_name
    our_fields, their_fields = set(ours.fields_by_name), set(theirs.fields_by_name)
    assert our_fields == their_fields, (
        f"{full_name}: only in pyserve {sorted(our_fields - their_fields)}, "
        f"only in Triton {sorted(their_fields - our_fields)}"
    )
    for name in sorted(their_fields):
        our_facts = _field_facts(ours.fields_by_name[name])
        their_facts = _field_facts(theirs.fields_by_name[name])
        for fact, expected in their_facts.items():
            assert our_facts[fact] == expected, (
                f"{full_name}.{name}: {fact} is {our_facts[fact]!r}, Triton has {expected!r}"
            )
    assert sorted(o.name for o in ours.oneofs) == sorted(o.name for o in theirs.oneofs), full_name


@requires_triton
@pytest.mark.parametrize("full_name", sorted(OUR_ENUMS.keys() | TRITON_ENUMS.keys()))
def test_enum_matches_triton(full_name: str) -> None:
    assert full_name in TRITON_ENUMS, f"{full_name}: enum defined by pyserve but not by Triton"
    assert full_name in OUR_ENUMS, f"{full_name}: enum defined by Triton but missing in pyserve"
    ours = {v.name: v.number for v in OUR_ENUMS[full_name].values}
    theirs = {v.name: v.number for v in TRITON_ENUMS[full_name].values}
    assert ours == theirs, f"{full_name}: values {ours} differ from Triton's {theirs}"


@requires_triton
def test_service_matches_triton() -> None:
    theirs = triton_service.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    ours = proto.SERVICE_DESCRIPTOR
    assert ours.full_name == theirs.full_name == "inference.GRPCInferenceService"

    def facts(service: Any) -> dict[str, tuple[str, str, bool, bool]]:
        return {
            m.name: (
                m.input_type.full_name,
                m.output_type.full_name,
                m.client_streaming,
                m.server_streaming,
            )
            for m in service.methods
        }

    our_methods, their_methods = facts(ours), facts(theirs)
    assert our_methods.keys() == their_methods.keys()
    for name, expected in their_methods.items():
        assert our_methods[name] == expected, f"rpc {name}: {our_methods[name]} != {expected}"


@requires_triton
def test_files_define_the_same_top_level_names() -> None:
    for key, theirs in TRITON_FILES.items():
        ours = OUR_FILES[key]
        assert ours.package == theirs.package == "inference"
        assert set(ours.message_types_by_name) == set(theirs.message_types_by_name), key
        assert set(ours.enum_types_by_name) == set(theirs.enum_types_by_name), key
        assert set(ours.services_by_name) == set(theirs.services_by_name), key


def test_health_service() -> None:
    service = proto.HEALTH_SERVICE_DESCRIPTOR
    assert service.full_name == "grpc.health.v1.Health"
    check = service.methods_by_name["Check"]
    assert check.input_type.full_name == "grpc.health.v1.HealthCheckRequest"
    assert check.output_type.full_name == "grpc.health.v1.HealthCheckResponse"
    assert not check.client_streaming and not check.server_streaming
    status = proto.HealthCheckResponse.DESCRIPTOR.enum_types_by_name["ServingStatus"]
    assert {v.name: v.number for v in status.values} == {
        "UNKNOWN": 0,
        "SERVING": 1,
        "NOT_SERVING": 2,
        "SERVICE_UNKNOWN": 3,
    }


# ---------------------------------------------------------------------------
# Module surface


def test_every_top_level_message_is_exported() -> None:
    for file in (*OUR_FILES.values(), proto.HEALTH_SERVICE_DESCRIPTOR.file):
        for name, descriptor in file.message_types_by_name.items():
            cls = getattr(proto, name, None)
            assert cls is not None, f"pyserve.protocol does not export {name}"
            assert cls.DESCRIPTOR is descriptor, name
            assert proto.message_class(descriptor.full_name) is cls


def test_private_pool() -> None:
    from google.protobuf import descriptor_pool

    with pytest.raises(KeyError):
        descriptor_pool.Default().FindFileByName("pyserve/protocol/model_config.proto")
    assert proto.ModelConfig.DESCRIPTOR.file.pool is proto.POOL
    with pytest.raises(KeyError):
        proto.message_class("inference.NoSuchMessage")


def test_data_type_helpers() -> None:
    assert proto.data_type_name(11) == "TYPE_FP32"
    assert proto.data_type_value("TYPE_BF16") == 14
    assert proto.DataType.TYPE_STRING == 13
    assert proto.DataType.Name(proto.DataType.TYPE_INT64) == "TYPE_INT64"
    for value in proto.DataType.values():
        assert proto.data_type_value(proto.data_type_name(value)) == value
    with pytest.raises(ValueError, match="99"):
        proto.data_type_name(99)
    with pytest.raises(ValueError, match="FP32"):
        proto.data_type_value("FP32")


# ---------------------------------------------------------------------------
# Wire compatibility

DYNAMIC_CONFIG = """
name: "classifier"
backend: "python"
max_batch_size: 8
version_policy { specific { versions: [1, 3] } }
input [
  {
    name: "INPUT0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [-1, 16]
    reshape { shape: [16, -1] }
    optional: true
  }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT64 dims: [4] label_filename: "labels.txt" }
]
instance_group [ { name: "gpu_group" kind: KIND_GPU count: 2 gpus: [0, 1] } ]
dynamic_batching {
  preferred_batch_size: [4, 8]
  max_queue_delay_microseconds: 100
  priority_levels: 2
  default_priority_level: 1
  priority_queue_policy {
    key: 2
    value { timeout_action: DELAY default_timeout_microseconds: 5000 max_queue_size: 4 }
  }
}
parameters { key: "EXECUTION_ENV_PATH" value { string_value: "env.tar.gz" } }
model_transaction_policy { decoupled: true }
"""

SEQUENCE_CONFIG = """
name: "stateful"
platform: "onnxruntime_onnx"
max_batch_size: 4
version_policy { latest { num_versions: 2 } }
input [ { name: "IN" data_type: TYPE_INT32 dims: [1] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [1] } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  oldest { max_candidate_sequences: 4 preferred_batch_size: [2] }
  control_input [
    {
      name: "START"
      control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [0, 1] } ]
    }
  ]
  state [
    {
      input_name: "STATE_IN"
      output_name: "STATE_OUT"
      data_type: TYPE_FP32
      dims: [-1]
      initial_state [ { name: "init" data_type: TYPE_FP32 dims: [1] zero_data: true } ]
    }
  ]
}
optimization {
  cuda { graphs: true graph_spec [ { batch_size: 2 input { key: "IN" value { dim: [1] } } } ] }
  execution_accelerators {
    gpu_execution_accelerator [
      { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } }
    ]
  }
}
model_warmup [
  {
    name: "w"
    batch_size: 1
    inputs { key: "IN" value { data_type: TYPE_INT32 dims: [1] random_data: true } }
  }
]
"""


@requires_triton
@pytest.mark.parametrize(
    "config_text", [DYNAMIC_CONFIG, SEQUENCE_CONFIG], ids=["dynamic", "sequence"]
)
def test_model_config_wire_compatible(config_text: str) -> None:
    ours = text_format.Parse(config_text, proto.ModelConfig())
    theirs = triton_config.ModelConfig.FromString(ours.SerializeToString())
    assert text_format.MessageToString(theirs) == text_format.MessageToString(ours)

    theirs = text_format.Parse(config_text, triton_config.ModelConfig())
    ours = proto.ModelConfig.FromString(theirs.SerializeToString())
    assert text_format.MessageToString(ours) == text_format.MessageToString(theirs)
    our_bytes = ours.SerializeToString(deterministic=True)
    assert our_bytes == theirs.SerializeToString(deterministic=True)


@requires_triton
def test_infer_request_wire_compatible() -> None:
    ours = proto.ModelInferRequest(model_name="m", model_version="1", id="req-1")
    ours.parameters["priority"].uint64_param = 3
    ours.parameters["sequence_id"].int64_param = -7
    tensor = ours.inputs.add(name="INPUT0", datatype="INT64", shape=[2, 2])
    tensor.contents.int64_contents.extend([1, -2, 3, -4])
    ours.outputs.add(name="OUTPUT0").parameters["binary_data"].bool_param = True
    ours.raw_input_contents.append(b"\x00\x01")

    theirs = triton_service.ModelInferRequest.FromString(ours.SerializeToString())
    assert text_format.MessageToString(theirs) == text_format.MessageToString(ours)
    assert proto.ModelInferRequest.FromString(theirs.SerializeToString()) == ours


# ---------------------------------------------------------------------------
# JSON form


def test_config_json_types_and_defaults() -> None:
    config = text_format.Parse(DYNAMIC_CONFIG, proto.ModelConfig())
    data = model_config_to_dict(config)

    assert data["max_batch_size"] == 8
    assert data["version_policy"] == {"specific": {"versions": [1, 3]}}
    assert data["input"][0]["dims"] == [-1, 16]
    assert data["input"][0]["reshape"] == {"shape": [16, -1]}
    assert data["input"][0]["data_type"] == "TYPE_FP32"
    assert data["input"][0]["optional"] is True
    assert data["input"][0]["allow_ragged_batch"] is False
    assert data["output"][0]["dims"] == [4]
    assert data["output"][0]["label_filename"] == "labels.txt"
    assert data["instance_group"][0]["kind"] == "KIND_GPU"

    batching = data["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == 100
    assert batching["priority_levels"] == 2
    assert batching["preserve_ordering"] is False
    assert batching["priority_queue_policy"] == {
        "2": {
            "timeout_action": "DELAY",
            "default_timeout_microseconds": 5000,
            "allow_timeout_override": False,
            "max_queue_size": 4,
        }
    }
    assert "default_queue_policy" not in batching  # unset sub-message

    # Fields without presence are printed even at their defaults.
    assert data["platform"] == ""
    assert data["batch_input"] == []
    assert data["cc_model_filenames"] == {}
    assert data["parameters"] == {"EXECUTION_ENV_PATH": {"string_value": "env.tar.gz"}}
    assert data["model_transaction_policy"] == {"decoupled": True}
    # Unset sub-messages and oneof members are omitted.
    for absent in ("optimization", "sequence_batching", "ensemble_scheduling", "response_cache"):
        assert absent not in data

    assert model_config_from_dict(data) == config


def test_config_json_defaults_of_empty_config() -> None:
    data = model_config_to_dict(proto.ModelConfig())
    assert data["max_batch_size"] == 0
    assert data["name"] == ""
    assert data["input"] == []
    assert data["batch_input"] == []
    assert "version_policy" not in data
    assert list(data) == [f.name for f in proto.ModelConfig.DESCRIPTOR.fields if f.name in data]


def test_config_json_all_int64_kinds() -> None:
    config = text_format.Parse(SEQUENCE_CONFIG, proto.ModelConfig())
    config.instance_group.add(kind="KIND_CPU").secondary_devices.add(device_id=3)
    data = model_config_to_dict(config)
    sequence = data["sequence_batching"]
    assert sequence["max_sequence_idle_microseconds"] == 5000000
    assert sequence["oldest"]["max_queue_delay_microseconds"] == 0
    assert sequence["state"][0]["dims"] == [-1]
    assert sequence["control_input"][0]["control"][0]["fp32_false_true"] == [0.0, 1.0]
    graph_spec = data["optimization"]["cuda"]["graph_spec"][0]
    assert graph_spec["input"] == {"IN": {"dim": [1]}}  # int64 inside a map value
    assert data["model_warmup"][0]["inputs"]["IN"]["dims"] == [1]
    devices = data["instance_group"][0]["secondary_devices"]
    assert devices == [{"kind": "KIND_NVDLA", "device_id": 3}]
    assert model_config_from_dict(data) == config


@requires_triton
def test_config_json_same_for_triton_message() -> None:
    ours = text_format.Parse(SEQUENCE_CONFIG, proto.ModelConfig())
    theirs = text_format.Parse(SEQUENCE_CONFIG, triton_config.ModelConfig())
    assert model_config_to_dict(theirs) == model_config_to_dict(ours)


def test_config_from_json_accepts_numbers_and_strings() -> None:
    config = model_config_from_json(
        '{"name": "m", "max_batch_size": 2, "input": [{"name": "x", "dims": [-1, "3"],'
        ' "data_type": "TYPE_UINT8"}],'
        ' "dynamic_batching": {"max_queue_delay_microseconds": "250",'
        ' "priority_queue_policy": {"1": {"max_queue_size": 1}}}}'
    )
    assert list(config.input[0].dims) == [-1, 3]
    assert config.input[0].data_type == proto.DataType.TYPE_UINT8
    assert config.dynamic_batching.max_queue_delay_microseconds == 250
    assert config.dynamic_batching.priority_queue_policy[1].max_queue_size == 1


def test_config_from_json_takes_keys_without_quotes() -> None:
    """As Triton's JSON reader does (its QA load requests send ``{direct: {...}}``); strings
    that look like keys are left alone."""
    config = model_config_from_json(
        '{name: "m:1", max_batch_size : 2, sequence_batching: { direct: { max_queue_delay_microseconds: 10 } },'
        ' "parameters": {"k": {string_value: "a\\"b: c"}}}'
    )
    assert config.name == "m:1" and config.max_batch_size == 2
    assert config.sequence_batching.direct.max_queue_delay_microseconds == 10
    assert config.parameters["k"].string_value == 'a"b: c'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"name": "m", "bogus": 1}', "bogus"),
        ('{"max_batch_size": "many"}', "max_batch_size"),
        ('{"input": [{"data_type": "TYPE_NOPE"}]}', "TYPE_NOPE"),
        ("[1, 2]", "JSON object"),
        ("{not json", "not valid JSON"),
        ("{name: m}", "not valid JSON"),  # a bare key is taken, a bare value is not
    ],
)
def test_config_from_json_rejects_bad_input(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_config_from_json(text)


# ---------------------------------------------------------------------------
# Generated descriptor set


def test_descriptor_set_is_up_to_date(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools.protoc")
    output = tmp_path / "descriptors.binpb"
    # protoc runs in its own process: its C++ runtime must not share this one's state.
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "gen_protos.py"), "--output", str(output)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr

    committed_bytes = (REPO_ROOT / "pyserve" / "protocol" / "descriptors.binpb").read_bytes()
    generated = descriptor_pb2.FileDescriptorSet.FromString(output.read_bytes())
    committed = descriptor_pb2.FileDescriptorSet.FromString(committed_bytes)
    assert generated == committed, "descriptors.binpb is stale: run scripts/gen_protos.py"
    assert [f.name for f in committed.file] == [
        "pyserve/protocol/model_config.proto",
        "pyserve/protocol/grpc_service.proto",
        "pyserve/protocol/health.proto",
    ]
    assert not any(f.HasField("source_code_info") for f in committed.file)


# ---------------------------------------------------------------------------
# Coexistence with tritonclient in one process


@requires_triton
def test_coexists_with_tritonclient_imported_first() -> None:
    # This module imports pyserve.protocol before tritonclient; check the opposite order.
    script = textwrap.dedent(
        """
        import tritonclient.grpc
        from tritonclient.grpc import model_config_pb2
        import pyserve.protocol as proto

        theirs = model_config_pb2.ModelConfig(name="m", max_batch_size=4)
        ours = proto.ModelConfig.FromString(theirs.SerializeToString())
        assert ours.name == "m" and ours.max_batch_size == 4
        assert type(ours) is not type(theirs)
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@requires_triton
def test_coexists_with_tritonclient_in_this_process() -> None:
    import tritonclient.grpc  # noqa: F401

    theirs = triton_config.ModelConfig(name="m")
    assert proto.ModelConfig.FromString(theirs.SerializeToString()).name == "m"
    assert proto.ModelConfig.DESCRIPTOR is not triton_config.ModelConfig.DESCRIPTOR
