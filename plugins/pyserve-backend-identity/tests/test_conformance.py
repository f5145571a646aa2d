"""The identity backend against ``pyserve.testing.BackendConformance``.

One model echoes one input of every KServe datatype, behind the dynamic batcher with two
instances, so every check of the suite applies. The backend is found through its installed
entry point, which also checks the packaging.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from pyserve.testing import BackendConformance

DATATYPES = (
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BF16",
    "BYTES",
)


def _config(name: str) -> str:
    def tensors(kind: str, prefix: str) -> str:
        data_type = {"BYTES": "TYPE_STRING"}
        entries = ",\n  ".join(
            f'{{ name: "{prefix}_{d}" data_type: {data_type.get(d, "TYPE_" + d)} dims: [ -1 ] }}'
            for d in DATATYPES
        )
        return f"{kind} [\n  {entries}\n]\n"

    return (
        f'name: "{name}"\nbackend: "identity"\nmax_batch_size: 8\n'
        + tensors("input", "IN")
        + tensors("output", "OUT")
        + "dynamic_batching { max_queue_delay_microseconds: 2000 }\n"
        + "instance_group [ { count: 2 kind: KIND_CPU } ]\n"
    )


class TestIdentityConformance(BackendConformance):
    backend = "identity"
    model = "identity_all"
    datatypes = DATATYPES
    decoupled = False

    def conformance_repository(self, tmp_path: Path) -> Path:
        model_dir = tmp_path / self.model
        (model_dir / "1").mkdir(parents=True)
        (model_dir / "config.pbtxt").write_text(_config(self.model))
        return tmp_path

    def expected_outputs(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        return {f"OUT_{name.removeprefix('IN_')}": array for name, array in inputs.items()}
