"""Model repositories as Triton reads them: configs, versions, platforms, auto-complete.

Each test serves a repository on a real server and checks what the KServe v2 API reports
(repository index reasons, version readiness, ``/config``); configuration errors are also
checked through ``validate_repositories`` (what ``pyserve validate`` prints).
"""

from __future__ import annotations

import logging
import textwrap
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from suite_support import wait_for, write_model

import pyserve
from pyserve import (
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelContext,
)
from pyserve.protocol import data_type_value
from pyserve.repository.model_config import gpu_count
from pyserve.repository.validate import validate_repositories
from pyserve.server.core import ServerThread

StartServer = Callable[..., ServerThread]
MakeRepo = Callable[..., Path]

IDENTITY = """
backend: "identity"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def identity(extra: str = "", name: str | None = None) -> str:
    head = f'name: "{name}"\n' if name else ""
    return head + textwrap.dedent(IDENTITY) + textwrap.dedent(extra)


def index(server: ServerThread) -> list[dict[str, Any]]:
    client = httpclient.InferenceServerClient(server.url)
    try:
        return list(client.get_model_repository_index())
    finally:
        client.close()


def entry(server: ServerThread, name: str) -> dict[str, Any]:
    found = [e for e in index(server) if e["name"] == name]
    assert len(found) == 1, found
    return found[0]


def version_ready(server: ServerThread, name: str, version: int) -> bool:
    response = httpx.get(f"http://{server.url}/v2/models/{name}/versions/{version}/ready")
    assert response.status_code in (200, 400), response.text
    return response.status_code == 200


def ready_versions(server: ServerThread, name: str, candidates: Sequence[int] = range(1, 6)) -> list[int]:
    return [v for v in candidates if version_ready(server, name, v)]


def infer(server: ServerThread, name: str, inputs: dict[str, np.ndarray], outputs: Sequence[str]) -> dict[str, Any]:
    client = httpclient.InferenceServerClient(server.url)
    try:
        tensors = []
        for key, array in inputs.items():
            tensor = httpclient.InferInput(key, list(array.shape), "FP32")
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        result = client.infer(name, tensors)
        return {o: result.as_numpy(o) for o in outputs}
    finally:
        client.close()


def model_config_json(server: ServerThread, name: str) -> dict[str, Any]:
    client = httpclient.InferenceServerClient(server.url)
    try:
        return dict(client.get_model_config(name))
    finally:
        client.close()


@pytest.fixture
def pyserve_logs(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    """caplog for pyserve's loggers, even if ``pyserve.logs.configure`` stopped propagation."""
    monkeypatch.setattr(logging.getLogger("pyserve"), "propagate", True)
    return caplog


# ---------------------------------------------------------------------------
# config.pbtxt errors


@pytest.mark.parametrize(
    ("text", "where", "message"),
    [
        ('backend: "identity"\nmax_batch_size: many\n', ":2:17:", "Couldn't parse integer"),
        ('backend: "identity"\ninput [ { name: "x" dims: [ 1 } ]\n', ":2:", 'Expected ","'),
        ('backend: "identity"\n\nbogus_field: 1\n', ":3:1:", 'no field named "bogus_field"'),
    ],
    ids=["bad-value", "syntax", "unknown-field"],
)
def test_config_parse_errors_name_file_line_column(
    start_server: StartServer, make_repo: MakeRepo, text: str, where: str, message: str
) -> None:
    repo = make_repo({"broken": text, "ok": identity()})
    server = start_server(repo)
    found = entry(server, "broken")
    assert found["state"] == "UNAVAILABLE"
    assert f"config.pbtxt{where}" in found["reason"]
    assert message in found["reason"]
    assert entry(server, "ok")["state"] == "READY"

    problems = validate_repositories([repo])
    assert len(problems) == 1
    assert problems[0].startswith("broken: ")
    assert f"config.pbtxt{where}" in problems[0] and message in problems[0]


def test_name_mismatch(start_server: StartServer, make_repo: MakeRepo) -> None:
    repo = make_repo({"real": identity(name="other")})
    server = start_server(repo)
    found = entry(server, "real")
    assert found["state"] == "UNAVAILABLE"
    assert "'other'" in found["reason"] and "'real'" in found["reason"]
    assert any("does not match the model directory name" in p for p in validate_repositories([repo]))


# ---------------------------------------------------------------------------
# Versions


def test_version_policies(start_server: StartServer, tmp_path: Path, pyserve_logs: pytest.LogCaptureFixture) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "latest2", identity("version_policy { latest { num_versions: 2 } }"), versions=(1, 2, 3))
    write_model(repo, "every", identity("version_policy { all { } }"), versions=(1, 2, 3))
    write_model(repo, "some", identity("version_policy { specific { versions: [ 1, 3, 4 ] } }"), versions=(1, 2, 3))
    write_model(repo, "default", identity(), versions=(1, 2, 3))
    write_model(repo, "absent", identity("version_policy { specific { versions: [ 7 ] } }"), versions=(1,))
    with pyserve_logs.at_level(logging.WARNING, logger="pyserve"):
        server = start_server(repo)

    assert ready_versions(server, "latest2") == [2, 3]
    assert ready_versions(server, "every") == [1, 2, 3]
    assert ready_versions(server, "some") == [1, 3]
    assert ready_versions(server, "default") == [3]
    assert ready_versions(server, "absent") == []
    # A missing specific version does not stop the others, but it is reported.
    assert any("version 4" in r.getMessage() and "'some'" in r.getMessage() for r in pyserve_logs.records)
    absent = entry(server, "absent")
    assert absent["state"] == "UNAVAILABLE" and "version 7" in absent["reason"]
    assert [e.get("version") for e in index(server) if e["name"] == "latest2"] == ["2", "3"]
    out = infer(server, "latest2", {"INPUT0": np.ones(2, np.float32)}, ["OUTPUT0"])
    np.testing.assert_array_equal(out["OUTPUT0"], [1, 1])
    assert any("version 4" in p for p in validate_repositories([repo]))


def test_odd_version_folders_are_ignored(start_server: StartServer, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    model = write_model(repo, "m", identity("version_policy { all { } }"), versions=(1, 2))
    for odd in ("01", "00", "abc", "3a", ".5"):
        (model / odd).mkdir()
    (model / "7").write_text("a file, not a folder")
    server = start_server(repo)
    assert [(e["version"], e["state"]) for e in index(server) if e["name"] == "m"] == [("1", "READY"), ("2", "READY")]


def test_version_zero_is_a_version(start_server: StartServer, tmp_path: Path) -> None:
    """As Triton 2.51 (checked side by side): a folder ``0`` is version 0, served and listed;
    only a leading zero before other digits makes a folder name no version."""
    repo = tmp_path / "repo"
    write_model(repo, "zero", identity(), versions=(0,))
    write_model(repo, "both", identity("version_policy { all { } }"), versions=(0, 1))
    server = start_server(repo)
    assert [(e["name"], e["version"], e["state"]) for e in index(server)] == [
        ("both", "0", "READY"), ("both", "1", "READY"), ("zero", "0", "READY")]
    out = infer(server, "zero", {"INPUT0": np.array([1, 2], np.float32)}, ["OUTPUT0"])
    np.testing.assert_array_equal(out["OUTPUT0"], [1, 2])
    assert version_ready(server, "both", 0) and version_ready(server, "both", 1)


def test_model_without_version_folder(start_server: StartServer, make_repo: MakeRepo) -> None:
    repo = make_repo({"empty": identity()}, versions=())
    server = start_server(repo)
    found = entry(server, "empty")
    assert found["state"] == "UNAVAILABLE"
    assert "no version directory" in found["reason"]
    assert "at least one version must be available under the version policy of model 'empty'" in found["reason"]
    assert any("empty: " in p and "no version directory" in p for p in validate_repositories([repo]))


def test_duplicate_model_names_across_repositories(start_server: StartServer, tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    write_model(first, "twin", identity())
    write_model(second, "twin", identity())
    write_model(second, "single", identity())
    server = start_server(first, second)
    found = entry(server, "twin")
    assert found["state"] == "UNAVAILABLE"
    assert str(first) in found["reason"] and str(second) in found["reason"]
    assert entry(server, "single")["state"] == "READY"
    assert any("twin: " in p and "not unique" in p for p in validate_repositories([first, second]))


# ---------------------------------------------------------------------------
# Platforms and backends


def test_platform_maps_to_backend(start_server: StartServer, make_repo: MakeRepo) -> None:
    onnx = """
    platform: "tensorrt_plan"
    max_batch_size: 0
    input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
    output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
    """
    unknown = onnx.replace("tensorrt_plan", "no_such_platform")
    repo = make_repo({"onnx": onnx, "weird": unknown})
    server = start_server(repo)
    found = entry(server, "onnx")
    assert found["state"] == "UNAVAILABLE"
    assert "backend 'tensorrt'" in found["reason"]  # no TensorRT backend is installed here
    assert "pip install pyserve-backend-tensorrt" in found["reason"]
    weird = entry(server, "weird")
    assert weird["state"] == "UNAVAILABLE" and "no_such_platform" in weird["reason"]


ENSEMBLE = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
ensemble_scheduling {
  step [ { model_name: "STEP" model_version: -1
           input_map { key: "INPUT0" value: "INPUT0" } output_map { key: "OUTPUT0" value: "OUTPUT0" } } ]
}
"""


def test_ensemble_runs_its_steps_or_names_the_missing_model(start_server: StartServer, make_repo: MakeRepo) -> None:
    repo = make_repo({"pipeline": ENSEMBLE.replace("STEP", "ident"), "dangling": ENSEMBLE.replace("STEP", "nowhere"),
                      "ident": identity()})
    server = start_server(repo)
    assert entry(server, "pipeline")["state"] == "READY"
    out = infer(server, "pipeline", {"INPUT0": np.array([3, 4], np.float32)}, ["OUTPUT0"])
    np.testing.assert_array_equal(out["OUTPUT0"], [3, 4])
    found = entry(server, "dangling")
    assert found["state"] == "UNAVAILABLE"
    assert "nowhere" in found["reason"]


# ---------------------------------------------------------------------------
# Missing config and auto-complete


class Filler(pyserve.Backend):
    """Completes configs with one FP32 input/output pair; records the calls."""

    def __init__(self) -> None:
        self.auto_completed: list[str] = []
        self.configs: list[dict[str, str]] = []
        self._lock = threading.Lock()

    def initialize(self, backend: pyserve.BackendContext) -> None:
        self.configs.append(dict(backend.config))

    def auto_complete_config(self, model: ModelContext) -> bool:
        with self._lock:
            self.auto_completed.append(model.name)
        config = model.config
        if config.input or config.output:
            return False
        for tensors, name in ((config.input, "IN"), (config.output, "OUT")):
            tensor = tensors.add()
            tensor.name = name
            tensor.data_type = data_type_value("TYPE_FP32")
            tensor.dims.append(3)
        return True

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        return [InferResponse({"OUT": r.inputs["IN"] - 1}) for r in requests]


def test_missing_config_in_strict_mode(start_server: StartServer, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "noconf.filler" / "1").mkdir(parents=True)
    write_model(repo, "ok", identity())
    filler = Filler()
    server = start_server(repo, backends={"filler": filler}, auto_complete=False)
    found = entry(server, "noconf.filler")
    assert found["state"] == "UNAVAILABLE"
    assert "config.pbtxt" in found["reason"] and "auto-complete is disabled" in found["reason"]
    assert filler.auto_completed == []
    assert entry(server, "ok")["state"] == "READY"


def test_missing_config_is_auto_completed_by_the_backend(start_server: StartServer, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "noconf.filler" / "1").mkdir(parents=True)
    write_model(repo, "partial", 'backend: "filler"\n')
    filler = Filler()
    server = start_server(repo, backends={"filler": filler})
    assert sorted(filler.auto_completed) == ["noconf.filler", "partial"]
    assert filler.configs[0]["auto-complete-config"] == "true"
    for name in ("noconf.filler", "partial"):
        assert entry(server, name)["state"] == "READY"
        out = infer(server, name, {"IN": np.array([1, 2, 3], np.float32)}, ["OUT"])
        np.testing.assert_array_equal(out["OUT"], [0, 1, 2])
        config = model_config_json(server, name)
        assert config["backend"] == "filler"
        assert [i["name"] for i in config["input"]] == ["IN"]
        assert [o["name"] for o in config["output"]] == ["OUT"]


def test_strict_model_config_skips_the_auto_complete_hook(start_server: StartServer, make_repo: MakeRepo) -> None:
    repo = make_repo({"partial": 'backend: "filler"\n'})
    filler = Filler()
    server = start_server(repo, backends={"filler": filler}, auto_complete=False)
    assert filler.auto_completed == []
    assert filler.configs[0]["auto-complete-config"] == "false"
    assert entry(server, "partial")["state"] == "READY"  # a model without tensors is allowed, as in Triton
    config = model_config_json(server, "partial")
    assert config["input"] == [] and config["output"] == []


# ---------------------------------------------------------------------------
# Instance groups, labels, backend config


def test_instance_groups_in_config(start_server: StartServer, make_repo: MakeRepo) -> None:
    groups = """
    instance_group [ { count: 2 kind: KIND_CPU }, { name: "extra" kind: KIND_CPU } ]
    """
    repo = make_repo({"grouped": identity(groups)})
    server = start_server(repo)
    config = model_config_json(server, "grouped")
    summary = [(g["name"], g["count"], g["kind"]) for g in config["instance_group"]]
    assert summary == [("grouped_0", 2, "KIND_CPU"), ("extra", 1, "KIND_CPU")]
    out = infer(server, "grouped", {"INPUT0": np.array([5, 6], np.float32)}, ["OUTPUT0"])
    np.testing.assert_array_equal(out["OUTPUT0"], [5, 6])


def test_default_instance_group(start_server: StartServer, make_repo: MakeRepo) -> None:
    repo = make_repo({"plain": identity()})
    server = start_server(repo)
    groups = model_config_json(server, "plain")["instance_group"]
    assert len(groups) == 1
    assert groups[0]["name"] == "plain" and groups[0]["count"] == 1  # as Triton 2.51 names the group it adds
    assert groups[0]["kind"] == ("KIND_GPU" if gpu_count() else "KIND_CPU")


DYNAMIC_BATCHING_RULES = {  # the dynamic_batching block → Triton 2.51's refusal ("" loads)
    "po_levels": ("preserve_ordering: true priority_levels: 2 default_priority_level: 1",
                  "Only one priority level is allowed when 'preserve_ordering' is true"),
    "po_delay": ("preserve_ordering: true default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 9 }",
                 "Queue policy can not have DELAY as timeout action when 'preserve_ordering' is true"),
    "po_delay_level": ("preserve_ordering: true priority_levels: 1 default_priority_level: 1 priority_queue_policy "
                       "{ key: 1 value: { timeout_action: DELAY default_timeout_microseconds: 9 } }",
                       "Queue policy can not have DELAY as timeout action when 'preserve_ordering' is true"),
    "po_delay_no_timeout": ("preserve_ordering: true default_queue_policy { timeout_action: DELAY }", ""),
    "level_unset": ("priority_levels: 2", "default priority level must be in range [1, 2]"),
    "level_above": ("priority_levels: 2 default_priority_level: 3", "default priority level must be in range [1, 2]"),
    "policy_level": ("priority_levels: 2 default_priority_level: 1 priority_queue_policy { key: 3 value: { max_queue_size: 1 } }",
                     "priority queue policy must have priority level in range [1, 2]"),
    "no_levels": ("default_priority_level: 2", ""),
    "levels": ("priority_levels: 2 default_priority_level: 2", ""),
    "preferred_zero": ("preferred_batch_size: [ 0 ]", "dynamic batching preferred size must be positive"),
    "preferred_above": ("preferred_batch_size: [ 9 ]", "dynamic batching preferred size must be <= max batch size"),
}


def test_dynamic_batching_rules_as_triton_checks_them(start_server: StartServer, make_repo: MakeRepo) -> None:
    configs = {name: identity(f"dynamic_batching {{ {block} }}").replace("max_batch_size: 0", "max_batch_size: 8")
               .replace("dims: [ 2 ]", "dims: [ -1 ]") for name, (block, _) in DYNAMIC_BATCHING_RULES.items()}
    repo = make_repo(configs)
    server = start_server(repo)
    for name, (_, refusal) in DYNAMIC_BATCHING_RULES.items():
        found = entry(server, name)
        if refusal:
            assert found["state"] == "UNAVAILABLE", name
            assert refusal in found["reason"], (name, found["reason"])
        else:
            assert found["state"] == "READY", (name, found)
    problems = validate_repositories([repo])
    assert sorted(p.split(":", 1)[0] for p in problems) == sorted(n for n, (_, r) in DYNAMIC_BATCHING_RULES.items() if r)


def _controls(*controls: str) -> str:
    return "control_input [ " + ", ".join(
        f'{{ name: "C{i}" control [ {{ {c} }} ] }}' for i, c in enumerate(controls)) + " ]"


SEQUENCE_BATCHING_RULES = {  # the sequence_batching block → Triton 2.51's refusal ("" loads)
    "corrid_untyped": (_controls("kind: CONTROL_SEQUENCE_CORRID"),
                       "unexpected data type for control CONTROL_SEQUENCE_CORRID. Allowed data types are "
                       "TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"),
    "corrid_float": (_controls("kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32"),
                     "unexpected data type for control CONTROL_SEQUENCE_CORRID"),
    "two_starts": (_controls("kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ]",
                             "kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ]"),
                   "sequence batching specifies multiple CONTROL_SEQUENCE_START tensors"),
    "two_value_pairs": (_controls("kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] fp32_false_true: [ 0, 1 ]"),
                        "sequence batching specifies more than one from 'int32_false_true', 'fp32_false_true' and "
                        "'bool_false_true' for CONTROL_SEQUENCE_START"),
    "no_value_pair": (_controls("kind: CONTROL_SEQUENCE_START data_type: TYPE_INT32"),
                      "sequence batching must specify either 'int32_false_true', 'fp32_false_true' or "
                      "'bool_false_true' for CONTROL_SEQUENCE_START"),
    "three_values": (_controls("kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1, 2 ]"),
                     "sequence batching control 'int32_false_true' must have exactly 2 entries for CONTROL_SEQUENCE_END"),
    "oldest_above": ("oldest { max_candidate_sequences: 4 preferred_batch_size: [ 8 ] }",
                     "sequence batching preferred batch size must be <= max batch size"),
    "controls": (_controls("kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING",
                           "kind: CONTROL_SEQUENCE_START bool_false_true: [ false, true ]",
                           "kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ]"), ""),
    "oldest": ("oldest { max_candidate_sequences: 4 preferred_batch_size: [ 4 ] }", ""),
    "direct_utilization_above": ("direct { minimum_slot_utilization: 1.5 }",
                                 "sequence batching minimum slot utilization must be in range (0.0, 1.0]"),
    "direct_utilization_negative": ("direct { minimum_slot_utilization: -0.25 }",
                                    "sequence batching minimum slot utilization must be in range (0.0, 1.0]"),
    "direct_utilization": ("direct { max_queue_delay_microseconds: 100 minimum_slot_utilization: 1.0 }", ""),
}


def test_sequence_batching_rules_as_triton_checks_them(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name, (block, _) in SEQUENCE_BATCHING_RULES.items():
        write_model(repo, name, identity(f"sequence_batching {{ {block} }}").replace("max_batch_size: 0",
                                                                                 "max_batch_size: 4"))
    problems = {p.split(":", 1)[0]: p for p in validate_repositories([repo])}
    for name, (_, refusal) in SEQUENCE_BATCHING_RULES.items():
        if refusal:
            assert refusal in problems.get(name, ""), (name, problems.get(name))
        else:
            assert name not in problems, problems[name]


def _step_model(batch: int, dims_in: str, dims_out: str) -> str:
    return (f'backend: "identity"\nmax_batch_size: {batch}\n'
            f'input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: {dims_in} }} ]\n'
            f'output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: {dims_out} }} ]\n')


def _ensemble(batch: int, dims_in: str, dims_out: str, steps: Sequence[tuple[str, str, str]]) -> str:
    maps = ", ".join(f'{{ model_name: "{m}" model_version: -1 input_map {{ key: "INPUT0" value: "{a}" }} '
                     f'output_map {{ key: "OUTPUT0" value: "{b}" }} }}' for m, a, b in steps)
    return (f'platform: "ensemble"\nmax_batch_size: {batch}\n'
            f'input [ {{ name: "X" data_type: TYPE_FP32 dims: {dims_in} }} ]\n'
            f'output [ {{ name: "Y" data_type: TYPE_FP32 dims: {dims_out} }} ]\n'
            f"ensemble_scheduling {{ step [ {maps} ] }}\n")


ENSEMBLE_SHAPES = {  # ensemble → Triton 2.51's refusal ("" loads), checked side by side
    "e_ok": (_ensemble(0, "[ 4 ]", "[ 4 ]", [("m4", "X", "Y")]), ""),
    "e_any": (_ensemble(0, "[ -1 ]", "[ -1 ]", [("m4", "X", "Y")]), ""),
    "e_batch": (_ensemble(8, "[ 4 ]", "[ 4 ]", [("b4", "X", "Y")]), ""),
    "e_batch_as_dim": (_ensemble(0, "[ 2, 4 ]", "[ 2, 4 ]", [("b4", "X", "Y")]), ""),
    "e_in": (_ensemble(0, "[ 5 ]", "[ 4 ]", [("m4", "X", "Y")]),
             "in ensemble e_in, ensemble tensor X: inconsistent shape: [5] is inferred from model e_in "
             "while [4] is inferred from model m4"),
    "e_batched_in": (_ensemble(8, "[ 5 ]", "[ 4 ]", [("b4", "X", "Y")]),
                     "ensemble tensor X: inconsistent shape: [-1,5] is inferred from model e_batched_in while "
                     "[-1,4] is inferred from model b4"),
    "e_mid": (_ensemble(0, "[ 4 ]", "[ 4 ]", [("m3", "X", "t"), ("m4", "t", "Y")]),
              "ensemble tensor t: inconsistent shape: [3] is inferred from model m3 while [4] is inferred from model m4"),
    "e_out": (_ensemble(0, "[ 4 ]", "[ 4 ]", [("m3", "X", "Y")]),
              "ensemble tensor Y: inconsistent shape: [4] is inferred from model e_out while [3] is inferred from model m3"),
    "e_rank": (_ensemble(0, "[ 4 ]", "[ 4 ]", [("m24", "X", "Y")]),
               "ensemble tensor X: inconsistent shape: [4] is inferred from model e_rank while [2,4] is inferred "
               "from model m24"),
    "e_unused": (_ensemble(0, "[ 4 ]", "[ 4 ]", [("m4", "X", "Y"), ("m4", "X", "spare")]),
                 "ensemble tensor 'spare' is unused in ensemble 'e_unused'"),
}


def test_ensemble_tensor_shapes_are_checked_as_triton_checks_them(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    steps = {"m4": _step_model(0, "[ 4 ]", "[ 4 ]"), "m3": _step_model(0, "[ 4 ]", "[ 3 ]"),
             "b4": _step_model(8, "[ 4 ]", "[ 4 ]"), "m24": _step_model(0, "[ 2, 4 ]", "[ 2, 4 ]")}
    for name, config in steps.items():
        write_model(repo, name, config)
    for name, (config, _) in ENSEMBLE_SHAPES.items():
        write_model(repo, name, config)
    problems: dict[str, str] = {}
    for problem in validate_repositories([repo]):
        name = problem.split(":", 1)[0]
        problems[name] = problems.get(name, "") + problem
    for name, (_, refusal) in ENSEMBLE_SHAPES.items():
        if refusal:
            assert refusal in problems.get(name, ""), (name, problems.get(name))
        else:
            assert name not in problems, problems[name]
    assert not set(steps) & set(problems)


@pytest.mark.skipif(gpu_count() > 0, reason="this machine has a GPU")
def test_gpu_instances_without_gpu(start_server: StartServer, make_repo: MakeRepo) -> None:
    repo = make_repo({"gpu": identity("instance_group [ { kind: KIND_GPU } ]"), "ok": identity()})
    server = start_server(repo)
    found = entry(server, "gpu")
    assert found["state"] == "UNAVAILABLE"
    assert "KIND_GPU" in found["reason"] and "no GPU is available" in found["reason"]
    # as Triton: the model is there and its version failed to load (not a refused config), so
    # the server is not ready
    assert found["version"] == "1"
    assert not version_ready(server, "gpu", 1)
    assert httpx.get(f"http://{server.url}/v2/health/ready").status_code == 400
    assert entry(server, "ok")["state"] == "READY"


def test_missing_label_file(start_server: StartServer, make_repo: MakeRepo) -> None:
    labelled = identity().replace('dims: [ 2 ] } ]\n', 'dims: [ 2 ] label_filename: "labels.txt" } ]\n', 2)
    labelled = labelled.replace('dims: [ 2 ] label_filename: "labels.txt" } ]\n', 'dims: [ 2 ] } ]\n', 1)
    assert labelled.count("label_filename") == 1
    repo = make_repo({"labelled": labelled})
    server = start_server(repo)
    found = entry(server, "labelled")
    assert found["state"] == "UNAVAILABLE"
    assert "labels.txt" in found["reason"] and "does not exist" in found["reason"]
    assert any("labels.txt" in p for p in validate_repositories([repo]))


def test_backend_config_reaches_the_backend(start_server: StartServer, make_repo: MakeRepo) -> None:
    filler = Filler()
    repo = make_repo({"m": 'backend: "identity"\n'})
    start_server(repo, backends={"identity": filler}, use_entry_points=False,
                 backend_config={"identity": {"k": "v"}, "": {"shared": "1"}, "other": {"no": "x"}})
    assert len(filler.configs) == 1
    config = filler.configs[0]
    assert config["k"] == "v" and config["shared"] == "1" and "no" not in config
    assert config["default-max-batch-size"] == "4"


def test_auto_complete_failure(start_server: StartServer, make_repo: MakeRepo) -> None:
    class Broken(Filler):
        def auto_complete_config(self, model: ModelContext) -> bool:
            raise OSError("cannot read the model file")

    repo = make_repo({"partial": 'backend: "broken"\n'})
    server = start_server(repo, backends={"broken": Broken()})
    found = entry(server, "partial")
    assert found["state"] == "UNAVAILABLE"
    assert "auto-complete" in found["reason"] and "cannot read the model file" in found["reason"]


# --------------------------------------------------------------------------- --model-config-name


def _config_of(server: ServerThread, name: str) -> dict[str, Any]:
    return httpx.get(f"http://{server.url}/v2/models/{name}/config").json()


@pytest.mark.parametrize("mode", ["none", "poll"])
def test_a_refused_config_does_not_hold_the_server_readiness_back(
    start_server: StartServer, tmp_path: Path, mode: str
) -> None:
    """As Triton 2.51 answers (checked side by side): a model whose config cannot be used never
    becomes a model, so the server stays ready; one whose load fails does not."""
    repo = tmp_path / "repo"
    write_model(repo, "good", identity())
    if mode == "none":
        write_model(repo, "bad", identity(name="other"))  # the name does not match the directory
    server = start_server(repo, model_control_mode=mode, repository_poll_secs=0.2)
    client = httpclient.InferenceServerClient(server.url)
    try:
        if mode == "poll":  # a broken model appears while the server runs
            write_model(repo, "bad", identity('input [ { name: "X" data_type: TYPE_FOO dims: [ 1 ] } ]'))
            wait_for(lambda: any(e["name"] == "bad" and e.get("state") for e in index(server)),
                     timeout=60, what="the poll to see the new model")
        assert entry(server, "bad")["state"] == "UNAVAILABLE"  # listed, with its reason
        assert client.is_server_ready()
        write_model(repo, "fails", identity().replace('backend: "identity"', 'backend: "nosuch"'))
        if mode == "none":
            assert client.is_server_ready()  # not loaded: the repository is read at start only
        else:
            wait_for(lambda: not client.is_server_ready(), timeout=60, what="the failed load to count")
    finally:
        client.close()


def test_model_config_name_reads_configs_name_pbtxt_where_a_model_has_one(
    start_server: StartServer, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "custom", identity())
    (repo / "custom" / "configs").mkdir()
    (repo / "custom" / "configs" / "small.pbtxt").write_text(identity('parameters { key: "which" value { string_value: "small" } }\n'))
    (repo / "custom" / "configs" / "other.pbtxt").write_text(identity('parameters { key: "which" value { string_value: "other" } }\n'))
    write_model(repo, "plain", identity())  # no configs/: config.pbtxt
    server = start_server(repo, model_config_name="small")
    assert _config_of(server, "custom")["parameters"] == {"which": {"string_value": "small"}}
    assert _config_of(server, "plain")["parameters"] == {}
    assert httpclient.InferenceServerClient(server.url).is_server_ready()

    default = start_server(repo)
    assert _config_of(default, "custom")["parameters"] == {}
    assert validate_repositories([repo], config_name="small") == []


def test_a_broken_named_config_is_reported_under_its_own_file(start_server: StartServer, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "custom", identity())
    (repo / "custom" / "configs").mkdir()
    (repo / "custom" / "configs" / "small.pbtxt").write_text(identity("max_batch_size: what\n"))
    (repo / "custom" / "configs" / "renamed.pbtxt").write_text(identity(name="someone_else"))
    server = start_server(repo, model_config_name="small")
    reason = entry(server, "custom")["reason"]
    assert entry(server, "custom")["state"] == "UNAVAILABLE"
    assert reason.startswith("custom/configs/small.pbtxt:") and "max_batch_size" in reason  # relative to the repository
    problems = validate_repositories([repo], config_name="renamed")
    assert len(problems) == 1 and str(repo / "custom" / "configs" / "renamed.pbtxt") in problems[0]
    assert "'someone_else' does not match the model directory name 'custom'" in problems[0]
    assert validate_repositories([repo]) == []  # config.pbtxt itself is fine


@pytest.mark.parametrize("name", ["../elsewhere", "a/b", "..", "."])
def test_model_config_name_must_be_a_file_name(start_server: StartServer, tmp_path: Path, name: str) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "plain", identity())
    with pytest.raises(pyserve.server.core.StartupError, match="--model-config-name must be a file name"):
        start_server(repo, model_config_name=name)


def test_an_ensembles_config_shows_its_transaction_policy(start_server: StartServer, make_repo: MakeRepo) -> None:
    """Triton 2.51 fills in ``model_transaction_policy { decoupled: false }`` for an ensemble."""
    repo = make_repo({
        "plain": identity(),
        "chain": """
            platform: "ensemble"
            input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
            output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
            ensemble_scheduling { step [ { model_name: "plain" model_version: -1
              input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "OUT" } } ] }
        """,
    })
    server = start_server(repo)
    assert entry(server, "chain")["state"] == "READY"
    assert model_config_json(server, "chain")["model_transaction_policy"] == {"decoupled": False}


def test_validate_asks_each_backend_about_its_model_versions(tmp_path: Path) -> None:
    """``pyserve_model_validate``: a backend's own checks, run per selected version, with the
    ``--backend-config`` settings; a backend whose check raises is reported, not fatal."""
    from pyserve.host.plugins import PluginHost

    seen: list[tuple[str, int, dict[str, str]]] = []

    class Checking(pyserve.Backend):
        def validate_model(self, model: Any) -> list[str]:
            seen.append((model.name, model.version, dict(model.backend.config)))
            return [f"weights file missing in {model.version_path.name}"] if model.name == "bad" else []

        def execute(self, instance: Any, requests: Any) -> Any:
            return []

    class Raising(pyserve.Backend):
        def validate_model(self, model: Any) -> list[str]:
            raise RuntimeError("cannot tell")

        def execute(self, instance: Any, requests: Any) -> Any:
            return []

    repo = tmp_path / "repo"
    config = 'backend: "{}"\nmax_batch_size: 0\nversion_policy: {{ all {{ }} }}\n' \
             'input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }} ]\n' \
             'output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]\n'
    write_model(repo, "bad", config.format("checking"), versions=(1, 2))
    write_model(repo, "good", config.format("checking"))
    write_model(repo, "odd", config.format("raising"))
    host = PluginHost(extra_backends={"checking": Checking(), "raising": Raising()}, use_entry_points=False)
    problems = validate_repositories([repo], host=host, backend_config={"checking": {"key": "value"}})
    assert problems == [
        "bad: version 1: weights file missing in 1",
        "bad: version 2: weights file missing in 2",
        "odd: version 1: backend 'raising' could not check it: RuntimeError: cannot tell",
    ]
    assert [(name, version) for name, version, _ in seen] == [("bad", 1), ("bad", 2), ("good", 1)]
    assert all(settings == {"key": "value"} for _, _, settings in seen)
