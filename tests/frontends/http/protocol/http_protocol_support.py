"""The shared pieces of the HTTP/REST protocol tests: the inline backends, the repository
the module servers serve, and helpers for the wire forms (imported by conftest and the tests)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np
import orjson
import tritonclient.http as httpclient
from suite_support import DATATYPES, identity_config

from pyserve import (
    Backend,
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
)

# -- datatypes -------------------------------------------------------------------------------

JSON_INPUT_UNSUPPORTED = {"FP16", "BF16"}
"""Triton refuses these datatypes as JSON input data (they must be sent binary)."""


# -- inline backends -------------------------------------------------------------------------


def _info_output(instance: InstanceContext, request: InferRequest, info: dict[str, Any]) -> np.ndarray:
    text = json.dumps(info, sort_keys=True).encode()
    batched = instance.model.config.max_batch_size > 0
    return np.full((request.batch_size, 1) if batched else (1,), text, dtype=object)


class InspectBackend(Backend):
    """Reports what it received: output ``INFO`` is a JSON document of the request's id,
    parameters, input shapes and batch size; the request parameters come back as response
    parameters."""

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        out = []
        for r in requests:
            info = {
                "id": r.id,
                "parameters": r.parameters,
                "shapes": {name: list(a.shape) for name, a in r.inputs.items()},
                "dtypes": {name: a.dtype.name for name, a in r.inputs.items()},
                "batch_size": r.batch_size,
            }
            out.append(InferResponse({"INFO": _info_output(instance, r, info)}, dict(r.parameters)))
        return out


class FlakyBackend(Backend):
    """Echoes ``IN`` to ``OUT`` unless the request parameter ``mode`` says otherwise:
    ``raise`` raises from execute (failing the call), ``error`` returns an ``InferError`` and
    ``exception`` returns an exception instance for that request alone."""

    def execute(
        self, instance: InstanceContext, requests: Sequence[InferRequest]
    ) -> list[InferResponse | InferError | BaseException]:
        if any(r.parameters.get("mode") == "raise" for r in requests):
            raise RuntimeError("flaky backend raised on purpose")
        out: list[InferResponse | InferError | BaseException] = []
        for r in requests:
            mode = r.parameters.get("mode")
            if mode == "error":
                out.append(InferError.invalid(f"request {r.id} rejected by the backend"))
            elif mode == "exception":
                out.append(ValueError(f"request {r.id} failed in the backend"))
            elif mode == "bytes_parameter":  # response parameters must be bool/int/float/str
                out.append(InferResponse({"OUT": r.inputs["IN"]}, {"p": b"raw"}))  # type: ignore[dict-item]
            else:
                out.append(InferResponse({"OUT": r.inputs["IN"]}))
        return out


# -- the shared server -----------------------------------------------------------------------

LABELS = ["cat", "dog", "bird", "fish"]

MODELS: dict[str, str] = {
    **{f"id_{dt.lower()}": identity_config(f"id_{dt.lower()}", dt) for dt in DATATYPES},
    "two": """
        name: "two"
        backend: "identity"
        max_batch_size: 8
        input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
                { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
                 { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
    """,
    "one_bytes": """
        name: "one_bytes"
        backend: "identity"
        max_batch_size: 8
        input [ { name: "IN" data_type: TYPE_STRING dims: [ 1 ] } ]
        output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
    """,
    "two_var": """
        name: "two_var"
        backend: "identity"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP16 dims: [ -1, -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP16 dims: [ -1, -1 ] } ]
    """,
    "fixed_nb": """
        name: "fixed_nb"
        backend: "identity"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2, 3 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2, 3 ] } ]
    """,
    "cls": """
        name: "cls"
        backend: "identity"
        max_batch_size: 4
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "labels.txt" } ]
    """,
    "cls_nb": """
        name: "cls_nb"
        backend: "identity"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
    """,
    "cls_int": """
        name: "cls_int"
        backend: "identity"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ 4 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 4 ] label_filename: "labels.txt" } ]
    """,
    "multi": """
        name: "multi"
        backend: "identity"
        max_batch_size: 0
        version_policy: { all { } }
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
    """,
    "inspect": """
        name: "inspect"
        backend: "inspect"
        max_batch_size: 0
        input [ { name: "A" data_type: TYPE_INT32 dims: [ -1 ] },
                { name: "B" data_type: TYPE_FP32 dims: [ -1 ] optional: true } ]
        output [ { name: "INFO" data_type: TYPE_STRING dims: [ 1 ] } ]
    """,
    "reshaped": """
        name: "reshaped"
        backend: "inspect"
        max_batch_size: 4
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape: { shape: [ 6 ] } } ]
        output [ { name: "INFO" data_type: TYPE_STRING dims: [ 1 ] } ]
    """,
    "flaky": """
        name: "flaky"
        backend: "flaky"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
    """,
}



def assert_error(response: httpx.Response, status: int, message: str) -> None:
    """Triton's error form: the status, a JSON content type and exactly ``{"error": ...}``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"error": message}


def make_input(name: str, array: np.ndarray, datatype: str, binary: bool) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def split_binary(response: httpx.Response) -> tuple[dict[str, Any], bytes]:
    """A binary response: the JSON header and the binary tail."""
    assert response.headers["content-type"] == "application/octet-stream"
    length = int(response.headers["inference-header-content-length"])
    return orjson.loads(response.content[:length]), response.content[length:]


