"""The model repository ``perf_analyzer_modes.py`` serves: Triton Python-backend models that run
unchanged on pyserve and on Triton, one for each kind of perf_analyzer run.

* ``add_sub``: two FP32 ``[16]`` inputs, their sum and difference; batching (8), dynamic batcher.
* ``strings``: a BYTES ``[1]`` input echoed (string data).
* ``accumulate``: a sequence model (sequence batcher, ``START`` control input) that keeps a
  running sum per sequence id.
* ``decoupled``: a decoupled echo (response sender, then the final flag), for gRPC streaming.
* ``pipeline``: an ensemble of two ``add_sub`` steps.
"""

from __future__ import annotations

from pathlib import Path

ADD_SUB_PY = '''"""Sum and difference of INPUT0 and INPUT1."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
'''

STRINGS_PY = '''"""Echoes the BYTES input INPUT0 as OUTPUT0."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests
        ]
'''

ACCUMULATE_PY = '''"""A running sum of INPUT per sequence; START (a control input) begins a new one."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            key = request.correlation_id()
            total = value if int(start.reshape(-1)[0]) or key not in self.sums else self.sums[key] + value
            self.sums[key] = total
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", total.astype(np.int32))]))
        return responses
'''

DECOUPLED_PY = '''"""Decoupled echo: one response through the response sender, then the final flag."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def _tensors(kind: str, entries: list[tuple[str, str, str]]) -> str:
    inner = ", ".join(f'{{ name: "{n}", data_type: {t}, dims: [ {d} ] }}' for n, t, d in entries)
    return f"{kind} [ {inner} ]"


_ADD_SUB_IO = (
    _tensors("input", [("INPUT0", "TYPE_FP32", "16"), ("INPUT1", "TYPE_FP32", "16")]) + "\n"
    + _tensors("output", [("OUTPUT0", "TYPE_FP32", "16"), ("OUTPUT1", "TYPE_FP32", "16")])
)

CONFIGS = {
    "add_sub": f'name: "add_sub"\nbackend: "python"\nmax_batch_size: 8\n{_ADD_SUB_IO}\n'
               "instance_group [ { count: 1, kind: KIND_CPU } ]\ndynamic_batching { }\n",
    "strings": 'name: "strings"\nbackend: "python"\nmax_batch_size: 8\n'
               + _tensors("input", [("INPUT0", "TYPE_STRING", "1")]) + "\n"
               + _tensors("output", [("OUTPUT0", "TYPE_STRING", "1")]) + "\n"
               "instance_group [ { count: 1, kind: KIND_CPU } ]\n",
    "accumulate": 'name: "accumulate"\nbackend: "python"\nmax_batch_size: 8\n'
                  + _tensors("input", [("INPUT", "TYPE_INT32", "1")]) + "\n"
                  + _tensors("output", [("OUTPUT", "TYPE_INT32", "1")]) + "\n"
                  "instance_group [ { count: 1, kind: KIND_CPU } ]\n"
                  "sequence_batching {\n  max_sequence_idle_microseconds: 10000000\n"
                  '  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START '
                  "int32_false_true: [ 0, 1 ] } ] } ]\n}\n",
    "decoupled": 'name: "decoupled"\nbackend: "python"\nmax_batch_size: 8\n'
                 + _tensors("input", [("INPUT0", "TYPE_FP32", "16")]) + "\n"
                 + _tensors("output", [("OUTPUT0", "TYPE_FP32", "16")]) + "\n"
                 "instance_group [ { count: 1, kind: KIND_CPU } ]\n"
                 "model_transaction_policy { decoupled: true }\n",
    "pipeline": f'name: "pipeline"\nplatform: "ensemble"\nmax_batch_size: 8\n{_ADD_SUB_IO}\n'
                "ensemble_scheduling { step [\n"
                '  { model_name: "add_sub" model_version: -1\n'
                '    input_map { key: "INPUT0" value: "INPUT0" } input_map { key: "INPUT1" value: "INPUT1" }\n'
                '    output_map { key: "OUTPUT0" value: "sum" } output_map { key: "OUTPUT1" value: "diff" } },\n'
                '  { model_name: "add_sub" model_version: -1\n'
                '    input_map { key: "INPUT0" value: "sum" } input_map { key: "INPUT1" value: "diff" }\n'
                '    output_map { key: "OUTPUT0" value: "OUTPUT0" } output_map { key: "OUTPUT1" value: "OUTPUT1" } }\n'
                "] }\n",
}

MODEL_PY = {"add_sub": ADD_SUB_PY, "strings": STRINGS_PY, "accumulate": ACCUMULATE_PY, "decoupled": DECOUPLED_PY}

MODELS = tuple(CONFIGS)


def write_repository(root: Path) -> Path:
    """Write every model under ``root`` (which must not hold them yet); returns ``root``."""
    for name, config in CONFIGS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
        if name in MODEL_PY:
            (root / name / "1" / "model.py").write_text(MODEL_PY[name])
    return root
