"""Bad ``/infer`` requests and the exact error each one gets, as a table.

Each row of ``CASES`` reads as documentation: what is sent, the HTTP status, and a piece of
the error message. Every error must come back as exactly ``{"error": "<message>"}`` with a
JSON content type, and without the server allocating what a request merely
declares. After the table the server must still be healthy.

Models of the main server (identity backend):

* ``m``: batched (``max_batch_size: 2``); inputs ``A`` INT32 ``[4]`` and ``B`` FP32 ``[-1]``.
* ``i8``, ``i32``, ``i64``, ``f16``, ``f32``, ``s`` (BYTES), ``b`` (BOOL): not batched, one
  input ``IN`` of dims ``[-1]``.

A second server runs with ``http_max_input_size=1024`` for the size-limit rows.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from suite_support import write_model

from pyserve.frontends.http.codec import SHAPE_MISMATCH
from pyserve.server.core import Server, ServerOptions, ServerThread

SMALL_LIMIT = 1024
HUGE = 10**12


def _model(name: str, config_type: str, batch: int = 0, dims: str = "[ -1 ]") -> str:
    return f"""
        name: "{name}"
        backend: "identity"
        max_batch_size: {batch}
        input [ {{ name: "IN" data_type: {config_type} dims: {dims} }} ]
        output [ {{ name: "OUT" data_type: {config_type} dims: {dims} }} ]
    """


MODELS = {
    "m": """
        name: "m"
        backend: "identity"
        max_batch_size: 2
        input [ { name: "A" data_type: TYPE_INT32 dims: [ 4 ] },
                { name: "B" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "OA" data_type: TYPE_INT32 dims: [ 4 ] },
                 { name: "OB" data_type: TYPE_FP32 dims: [ -1 ] } ]
    """,
    "i8": _model("i8", "TYPE_INT8"),
    "i32": _model("i32", "TYPE_INT32"),
    "i64": _model("i64", "TYPE_INT64"),
    "f16": _model("f16", "TYPE_FP16"),
    "f32": _model("f32", "TYPE_FP32"),
    "s": _model("s", "TYPE_STRING"),
    "b": _model("b", "TYPE_BOOL"),
}


def _start(repo: Any, **options: Any) -> ServerThread:
    thread = ServerThread(
        Server(ServerOptions(model_repositories=[repo], host="127.0.0.1", http_port=0, grpc_port=0, **options))
    )
    thread.start()
    return thread


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("http_bad_inputs")
    for name, config in MODELS.items():
        write_model(path, name, config)
    return path


@pytest.fixture(scope="module")
def servers(repo: Any) -> Iterator[dict[str, httpx.Client]]:
    main = _start(repo)
    small = _start(repo, http_max_input_size=SMALL_LIMIT)
    small_uvicorn = _start(repo, http_max_input_size=SMALL_LIMIT, http_server="uvicorn")
    clients = {
        "main": httpx.Client(base_url=f"http://{main.url}", timeout=30),
        "small": httpx.Client(base_url=f"http://{small.url}", timeout=30),
        "small-uvicorn": httpx.Client(base_url=f"http://{small_uvicorn.url}", timeout=30),
    }
    yield clients
    for c in clients.values():
        c.close()
    small_uvicorn.stop()
    small.stop()
    main.stop()


# -- building request bodies -----------------------------------------------------------------

A = {"name": "A", "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4]}
B = {"name": "B", "datatype": "FP32", "shape": [1, 2], "data": [0.5, 1.5]}


def tensor(
    datatype: str, shape: list[Any], data: Any = None, name: str = "IN", **params: Any
) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
    if data is not None:
        entry["data"] = data
    if params:
        entry["parameters"] = params
    return entry


def body(*inputs: dict[str, Any], **extra: Any) -> bytes:
    return orjson.dumps({"inputs": list(inputs), **extra})


def with_binary(json_body: bytes, tail: bytes) -> tuple[bytes, dict[str, str]]:
    """A body with a binary tail and its ``Inference-Header-Content-Length``."""
    return json_body + tail, {"Inference-Header-Content-Length": str(len(json_body))}


def f32_bytes(n: int) -> bytes:
    return np.arange(n, dtype="<f4").tobytes()


def bytes_element(value: bytes) -> bytes:
    return struct.pack("<I", len(value)) + value


@dataclass(frozen=True)
class Case:
    """One bad request: ``sent`` says in words what it is."""

    id: str
    sent: str
    content: bytes
    status: int
    error: str
    model: str = "m"
    headers: dict[str, str] = field(default_factory=dict)
    path: str | None = None
    server: str = "main"


def binary_case(
    id: str, sent: str, json_body: bytes, tail: bytes, status: int, error: str, model: str
) -> Case:
    content, headers = with_binary(json_body, tail)
    return Case(id, sent, content, status, error, model, headers)


GOOD = body(A, B)

# fmt: off
CASES: list[Case] = [
    # -- routing
    Case("unknown-model", "a good body to /v2/models/nope/infer", GOOD, 404,
         "Request for unknown model: 'nope' is not found", path="/v2/models/nope/infer"),
    Case("unknown-version", "a good body to version 7 of 'm' (only 1 exists)", GOOD, 404,
         "Request for unknown model: 'm' version 7 is not found", path="/v2/models/m/versions/7/infer"),
    # -- the set of inputs
    Case("missing-input", "only input A; B is required", body(A), 400,
         "expected 2 inputs but got 1 inputs for model 'm'. Got input(s) ['A'], but missing required input(s) "
         "['B']. Please provide all required input(s)."),
    Case("unexpected-input", "A, B and an input C the model does not have",
         body(A, B, {**A, "name": "C"}), 400, "unexpected inference input 'C' for model 'm'"),
    Case("duplicate-input", "input A twice", body(A, A, B), 400, "input 'A' is given more than once for model 'm'"),
    Case("no-inputs", "'inputs' is an empty list", body(), 400,  # Triton's text, word for word
         "expected 2 inputs but got 0 inputs for model 'm'. Got input(s) [], but missing required input(s) "
         "['A','B']. Please provide all required input(s)."),
    Case("inputs-missing", "a JSON object without 'inputs'", b"{}", 400, "request 'inputs' must be a non-empty list"),
    Case("input-not-object", "'inputs' holds a number", orjson.dumps({"inputs": [1]}), 400,
         "each entry of 'inputs' must be a JSON object"),
    # -- datatype
    Case("wrong-datatype", "A declared FP32; the model expects INT32", body({**A, "datatype": "FP32"}, B), 400,
         "inference input 'A' data-type is 'FP32', but model 'm' expects 'INT32'"),
    Case("unknown-datatype", "A declared as 'INT33'", body({**A, "datatype": "INT33"}, B), 400,
         "inference input 'A' data-type is 'INT33', but model 'm' expects 'INT32'"),
    # -- shape
    Case("shape-not-matching-dims", "A of shape [1,5]; dims are [4]",
         body({**A, "shape": [1, 5], "data": [1, 2, 3, 4, 5]}, B), 400,
         "unexpected shape for input 'A' for model 'm'. Expected [-1,4], got [1,5]"),
    Case("wrong-rank", "A of shape [4] on a batched model", body({**A, "shape": [4]}, B), 400,
         "unexpected shape for input 'A' for model 'm'. Expected [-1,4], got [4]"),
    Case("batch-too-large", "batch 3 on a model with max_batch_size 2",
         body({**A, "shape": [3, 4], "data": list(range(12))}, {**B, "shape": [3, 1], "data": [1, 2, 3]}), 400,
         "inference request batch-size must be <= 2 for 'm'"),
    Case("batch-zero", "batch 0", body({**A, "shape": [0, 4], "data": []}, {**B, "shape": [0, 1], "data": []}), 400,
         "input 'A' for model 'm' has batch size 0"),
    Case("batch-sizes-disagree", "A with batch 1, B with batch 2",
         body(A, {**B, "shape": [2, 1], "data": [1, 2]}), 400, "inputs of model 'm' have different batch sizes"),
    Case("negative-dim", "shape [-1]", body(tensor("FP32", [-1], [1.0])), 400,
         "shape of input 'IN' for model 'f32' must be a list of non-negative integers", model="f32"),
    Case("non-integer-dim", "shape [2.5]", body(tensor("FP32", [2.5], [1.0, 2.0])), 400,
         "shape of input 'IN' for model 'f32' must be a list of non-negative integers", model="f32"),
    Case("string-dim", "shape [\"2\"]", body(tensor("FP32", ["2"], [1.0, 2.0])), 400,
         "shape of input 'IN' for model 'f32' must be a list of non-negative integers", model="f32"),
    Case("shape-not-a-list", "shape 2", body(tensor("FP32", 2, [1.0, 2.0])), 400,  # type: ignore[arg-type]
         "shape of input 'IN' for model 'f32' must be a list of non-negative integers", model="f32"),
    # -- declared sizes against what is sent (never allocated)
    binary_case("binary-size-too-small", "shape [4] FP32 with binary_data_size 12",
                body(tensor("FP32", [4], binary_data_size=12)), f32_bytes(3), 400,
                "input byte size mismatch for input 'IN' for model 'f32'. Expected 16, got 12", "f32"),
    binary_case("binary-size-too-large", "shape [4] FP32 with binary_data_size 20",
                body(tensor("FP32", [4], binary_data_size=20)), f32_bytes(5), 400,
                "input byte size mismatch for input 'IN' for model 'f32'. Expected 16, got 20", "f32"),
    Case("huge-shape-json", "shape [10^12] with 4 JSON values", body(tensor("FP32", [HUGE], [1, 2, 3, 4])), 400,
         SHAPE_MISMATCH, model="f32"),
    binary_case("huge-shape-binary", "shape [10^12] FP32 with 16 binary bytes",
                body(tensor("FP32", [HUGE], binary_data_size=16)), f32_bytes(4), 400,
                "Expected 4000000000000, got 16 (shape [1000000000000] of FP32; 'binary_data_size' is 16)", "f32"),
    binary_case("huge-shape-bytes", "shape [10^12] BYTES with 16 binary bytes",
                body(tensor("BYTES", [HUGE], binary_data_size=16)), bytes_element(b"abcdefghijkl"), 400,
                "input 'IN' declares 1000000000000 BYTES element(s) but carries only 16 byte(s) of data", "s"),
    binary_case("binary-size-beyond-body", "binary_data_size 16 with 8 bytes sent",
                body(tensor("FP32", [4], binary_data_size=16)), f32_bytes(2), 400,
                "input 'IN': 'binary_data_size' is 16 but only 8 byte(s) of binary data remain in the request", "f32"),
    binary_case("binary-size-negative", "binary_data_size -4",
                body(tensor("FP32", [1], binary_data_size=-4)), f32_bytes(1), 400,
                "input 'IN': 'binary_data_size' must be a non-negative integer", "f32"),
    binary_case("data-and-binary", "both 'data' and binary_data_size",
                body(tensor("FP32", [1], [1.0], binary_data_size=4)), f32_bytes(1), 400,
                "input 'IN' must have exactly one of 'data' or parameter 'binary_data_size'", "f32"),
    Case("neither-data-nor-binary", "no 'data' and no binary_data_size", body(tensor("FP32", [1])), 400,
         "input 'IN' must have exactly one of 'data' or parameter 'binary_data_size'", model="f32"),
    binary_case("truncated-binary-body", "A and B binary; B's bytes cut short",
                body(tensor("INT32", [1, 4], name="A", binary_data_size=16),
                     tensor("FP32", [1, 3], name="B", binary_data_size=12)),
                np.arange(4, dtype="<i4").tobytes() + f32_bytes(2), 400,
                "input 'B': 'binary_data_size' is 12 but only 8 byte(s) of binary data remain in the request", "m"),
    binary_case("leftover-binary", "shape [2] FP32, 8 bytes claimed, 12 sent",
                body(tensor("FP32", [2], binary_data_size=8)), f32_bytes(3), 400,
                "the request carries 4 byte(s) of binary data that no input claims", "f32"),
    binary_case("binary-bytes-overrun", "BYTES element whose length prefix says 100, 3 bytes follow",
                body(tensor("BYTES", [1], binary_data_size=7)), struct.pack("<I", 100) + b"abc", 400,
                "input 'IN': BYTES element 0 declares 100 byte(s) but the data ends first", "s"),
    binary_case("binary-bytes-leftover", "one BYTES element followed by 2 stray bytes",
                body(tensor("BYTES", [1], binary_data_size=9)), bytes_element(b"abc") + b"zz", 400,
                "input 'IN': 2 byte(s) of BYTES data left after the 1 element(s) its shape declares", "s"),
    binary_case("binary-bytes-short", "shape [2] BYTES, one element sent",
                body(tensor("BYTES", [2], binary_data_size=8)), bytes_element(b"abcd"), 400,
                "input 'IN': BYTES data ends inside element 1 of 2", "s"),
    # -- Inference-Header-Content-Length
    Case("header-length-not-a-number", "Inference-Header-Content-Length: abc", GOOD, 400,
         "Inference-Header-Content-Length must be an integer, got 'abc'",
         headers={"Inference-Header-Content-Length": "abc"}),
    Case("header-length-beyond-body", "Inference-Header-Content-Length larger than the body", GOOD, 400,
         f"Inference-Header-Content-Length {len(GOOD) + 1} is outside the request body of {len(GOOD)} byte(s)",
         headers={"Inference-Header-Content-Length": str(len(GOOD) + 1)}),
    Case("header-length-negative", "Inference-Header-Content-Length: -5", GOOD, 400,
         f"Inference-Header-Content-Length -5 is outside the request body of {len(GOOD)} byte(s)",
         headers={"Inference-Header-Content-Length": "-5"}),
    Case("header-length-cuts-json", "Inference-Header-Content-Length ends inside the JSON", GOOD, 400,
         "failed to parse the request JSON buffer", headers={"Inference-Header-Content-Length": "10"}),
    Case("raw-binary-two-inputs", "a raw binary body (header length 0) to a model with two inputs",
         f32_bytes(4), 400, "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'm' model configuration",
         headers={"Inference-Header-Content-Length": "0"}),
    Case("raw-binary-partial-element", "a raw binary body of 5 bytes to an FP32 model", b"12345", 400,
         "raw binary input of 5 byte(s) is not a whole number of FP32 elements", model="f32",
         headers={"Inference-Header-Content-Length": "0"}),
    # -- the JSON itself
    Case("empty-body", "no body at all", b"", 400, "failed to parse the request JSON buffer"),
    Case("malformed-json", "'{\"inputs\": ['", b'{"inputs": [', 400, "failed to parse the request JSON buffer"),
    Case("json-not-object", "a JSON array", b"[1, 2]", 400, "the request body must be a JSON object"),
    Case("deeply-nested-json", "100000 levels of '['", b"[" * 100_000, 400, "failed to parse the request JSON buffer"),
    Case("invalid-utf8", "a JSON string holding byte 0xff", b'{"inputs": [{"name": "\xff"}]}', 400,
         "failed to parse the request JSON buffer"),
    Case("id-not-string", "'id': 5", body(A, B, id=5), 400, "request 'id' must be a string"),
    Case("parameters-not-object", "'parameters': [1]", body(A, B, parameters=[1]), 400,
         "request 'parameters' must be a JSON object"),
    Case("parameters-empty-list", "'parameters': []", body(A, B, parameters=[]), 400,
         "request 'parameters' must be a JSON object"),
    Case("parameters-false", "'parameters': false", body(A, B, parameters=False), 400,
         "request 'parameters' must be a JSON object"),
    # -- JSON tensor data
    Case("data-deeper-than-shape-too-many", "shape [4] with data [[[1,2,3,4,5]]]",
         body(tensor("INT32", [4], [[[1, 2, 3, 4, 5]]])), 400,
         SHAPE_MISMATCH, model="i32"),
    Case("data-nested-200-deep-too-many", "shape [1] with two values nested 200 deep",
         body(tensor("INT32", [1], [1])).replace(b"[1]}", b"[" * 200 + b"1,2" + b"]" * 200 + b"}"), 400,
         SHAPE_MISMATCH, model="i32"),
    Case("data-count-mismatch", "shape [3] with 2 values", body(tensor("INT32", [3], [1, 2])), 400,
         SHAPE_MISMATCH, model="i32"),
    Case("ragged-data", "shape [2,4] with rows of 4 and 2 values",
         body({**A, "shape": [2, 4], "data": [[1, 2, 3, 4], [1, 2]]}, {**B, "shape": [2, 1], "data": [1, 2]}), 400,
         SHAPE_MISMATCH),
    Case("data-count-mismatch-and-missing-input", "A's data has 3 values for shape [1,4], B is missing",
         body({**A, "data": [1, 2, 3]}), 400, SHAPE_MISMATCH),
    Case("data-count-mismatch-and-unknown-input", "a known input with 2 values for shape [3], then an unknown one",
         body(tensor("INT32", [3], [1, 2]), {**tensor("INT32", [1], [1]), "name": "NOPE"}), 400, SHAPE_MISMATCH,
         model="i32"),
    Case("data-not-a-list", "'data': 5", body(tensor("INT32", [1], 5)), 400,
         "'data' of input 'IN' must be a JSON array", model="i32"),
    Case("strings-for-int32", "[\"1\", \"2\"] for INT32", body(tensor("INT32", [2], ["1", "2"])), 400,
         "'data' of INT32 input 'IN' must hold integers", model="i32"),
    Case("floats-for-int32", "[1.5, 2.0] for INT32", body(tensor("INT32", [2], [1.5, 2.0])), 400,
         "'data' of INT32 input 'IN' must hold integers", model="i32"),
    Case("null-for-int32", "[1, null] for INT32", body(tensor("INT32", [2], [1, None])), 400,
         "'data' of INT32 input 'IN' must hold integers", model="i32"),
    Case("booleans-for-int32", "[1, true] for INT32 (numpy would read true as 1)",
         body(tensor("INT32", [2], [1, True])), 400,
         "'data' of INT32 input 'IN' must hold numbers, not true/false", model="i32"),
    Case("booleans-for-fp32", "[1.5, false] for FP32", body(tensor("FP32", [2], [1.5, False])), 400,
         "'data' of FP32 input 'IN' must hold numbers, not true/false", model="f32"),
    Case("nested-booleans-for-fp32", "[[1.5], [true]] for FP32", body(tensor("FP32", [2], [[1.5], [True]])), 400,
         "'data' of FP32 input 'IN' must hold numbers, not true/false", model="f32"),
    Case("only-booleans-for-int32", "[true, false] for INT32", body(tensor("INT32", [2], [True, False])), 400,
         "'data' of INT32 input 'IN' must hold numbers, not true/false", model="i32"),
    Case("out-of-range-int8", "[1, 300] for INT8", body(tensor("INT8", [2], [1, 300])), 400,
         "'data' of input 'IN' has values out of range for INT8", model="i8"),
    Case("below-range-int8", "[-129] for INT8", body(tensor("INT8", [1], [-129])), 400,
         "'data' of input 'IN' has values out of range for INT8", model="i8"),
    Case("beyond-int64", "[2^64] for INT64", body(tensor("INT64", [1], [1])).replace(b"[1]}", b"[18446744073709551616]}"), 400,
         "'data' of INT64 input 'IN' must hold integers", model="i64"),
    Case("bool-for-fp32", "[true, false] for FP32", body(tensor("FP32", [2], [True, False])), 400,
         "'data' of FP32 input 'IN' must hold numbers", model="f32"),
    Case("strings-for-fp32", "[\"a\"] for FP32", body(tensor("FP32", [1], ["a"])), 400,
         "'data' of FP32 input 'IN' must hold numbers", model="f32"),
    Case("numbers-for-bool", "[1, 0] for BOOL", body(tensor("BOOL", [2], [1, 0])), 400,
         "'data' of BOOL input 'IN' must hold true/false values", model="b"),
    Case("numbers-for-bytes", "[1] for BYTES", body(tensor("BYTES", [1], [1])), 400,
         "'data' of BYTES input 'IN' must hold strings", model="s"),
    Case("fp16-via-json", "FP16 data as JSON numbers", body(tensor("FP16", [1], [1.0])), 400,
         "input 'IN': receiving FP16 data via JSON is not supported; send it as binary data", model="f16"),
    # -- outputs
    Case("unknown-output", "requests output NOPE", body(A, B, outputs=[{"name": "NOPE"}]), 400,
         "unexpected inference output 'NOPE' for model 'm'"),
    Case("output-binary-not-bool", "binary_data: \"yes\"",
         body(A, B, outputs=[{"name": "OA", "parameters": {"binary_data": "yes"}}]), 400,
         "output 'OA': 'binary_data' must be a boolean"),
    Case("classification-negative", "classification: -1",
         body(A, B, outputs=[{"name": "OA", "parameters": {"classification": -1}}]), 400,
         "output 'OA': 'classification' must be a non-negative integer"),
    Case("classification-of-bytes", "classification of a BYTES output",
         body(tensor("BYTES", [1], ["x"]), outputs=[{"name": "OUT", "parameters": {"classification": 1}}]), 400,
         "classification is not supported for output 'OUT' of this datatype", model="s"),
    # -- parameters
    Case("sequence-id-negative", "sequence_id: -1", body(A, B, parameters={"sequence_id": -1}), 400,
         "parameter 'sequence_id' must be an unsigned integer or a string"),
    Case("priority-not-int", "priority: \"high\"", body(A, B, parameters={"priority": "high"}), 400,
         "parameter 'priority' must be a non-negative integer"),
    Case("binary-data-output-not-bool", "binary_data_output: 1", body(A, B, parameters={"binary_data_output": 1}), 400,
         "parameter 'binary_data_output' must be a boolean"),
    Case("reserved-triton-parameter", "parameter triton_foo", body(A, B, parameters={"triton_foo": 1}), 400,
         "parameter keys starting with 'triton_' are reserved for Triton usage and should not be specified "
         "(got 'triton_foo')"),
    Case("non-scalar-parameter", "parameter p: [1, 2]", body(A, B, parameters={"p": [1, 2]}), 400,
         "parameter 'p' has invalid type. It should be either 'int', 'bool', or 'string'. (got array)"),
    Case("shared-memory-input", "an input naming an unregistered shared memory region",
         body(tensor("FP32", [1], shared_memory_region="r", shared_memory_byte_size=4)), 404,
         "input 'IN': Unable to find shared memory region: 'r'", model="f32"),
    # -- encodings and size limits
    Case("unsupported-content-encoding", "Content-Encoding: br", GOOD, 501,
         "unsupported Content-Encoding 'br'; use gzip, deflate or identity", headers={"Content-Encoding": "br"}),
    Case("corrupt-gzip", "Content-Encoding: gzip on a plain body", GOOD, 400, "request body is not valid gzip data",
         headers={"Content-Encoding": "gzip"}),
    Case("truncated-gzip", "a gzip body cut in half", gzip.compress(GOOD)[:20], 400,
         "request body is truncated gzip data", headers={"Content-Encoding": "gzip"}),
    Case("body-over-limit", f"a {SMALL_LIMIT + 1000}-byte body to a server with --http-max-input-size {SMALL_LIMIT}",
         body(tensor("FP32", [250], [1.0] * 250)), 400,
         f"request JSON size of {len(body(tensor('FP32', [250], [1.0] * 250)))} bytes exceeds the maximum "
         f"allowed input size of {SMALL_LIMIT} bytes. Use --http-max-input-size to increase the limit.",
         model="f32", server="small"),
    Case("body-far-over-limit", "a 5 MB body to a server with --http-max-input-size 1024 (refused unread)",
         b" " * 5_000_000, 400,
         f"request JSON size of 5000000 bytes exceeds the maximum allowed input size of {SMALL_LIMIT} bytes",
         model="f32", server="small"),
    Case("raw-binary-over-limit", "a 1028-byte raw binary body (Inference-Header-Content-Length: 0), limit 1024",
         np.ones(257, dtype=np.float32).tobytes(), 400,
         f"Raw input has a byte_size (1028 bytes) that exceeds the maximum allowed value of {SMALL_LIMIT} "
         "bytes. Use --http-max-input-size to increase the limit.",
         model="f32", server="small", headers={"Inference-Header-Content-Length": "0"}),
    Case("gzip-bomb", "a ~230-byte gzip body that inflates to 200 KB, limit 1024",
         gzip.compress(b" " * 200_000), 400,
         f"Decompressed data size exceeds the maximum allowed value of {SMALL_LIMIT} bytes. "
         "Use --http-max-input-size to increase the limit.",
         model="f32", server="small", headers={"Content-Encoding": "gzip"}),
    Case("deflate-bomb", "a ~220-byte deflate body that inflates to 200 KB, limit 1024",
         zlib.compress(b" " * 200_000), 400,
         f"Decompressed data size exceeds the maximum allowed value of {SMALL_LIMIT} bytes",
         model="f32", server="small", headers={"Content-Encoding": "deflate"}),
]
# fmt: on


def assert_error_body(response: httpx.Response, status: int, expected: str) -> str:
    """Exactly ``{"error": "<non-empty message>"}`` with a JSON content type; the message."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    payload = orjson.loads(response.content)
    assert isinstance(payload, dict) and list(payload) == ["error"], payload
    message = payload["error"]
    assert isinstance(message, str) and message
    assert expected in message
    return message


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(servers: dict[str, httpx.Client], case: Case) -> None:
    path = case.path or f"/v2/models/{case.model}/infer"
    response = servers[case.server].post(path, content=case.content, headers=case.headers)
    assert_error_body(response, case.status, case.error)


def test_mismatched_data_is_the_whole_triton_body(servers: dict[str, httpx.Client]) -> None:
    """Triton's own HTTP script matches this answer's whole body: JSON data with more values
    than its shape, and the model's second input missing, is answered with the data's error."""
    response = servers["main"].post("/v2/models/m/infer", content=body({**A, "data": list(range(18))}))
    assert response.status_code == 400
    assert response.content == b'{"error":"Unable to parse \'data\': Shape does not match true shape of \'data\' field"}'


def test_case_ids_are_unique() -> None:
    assert len({c.id for c in CASES}) == len(CASES)


def test_bombs_are_small_on_the_wire() -> None:
    """The bombs pass the Content-Length check: only their inflated size is over the limit."""
    bombs = [c for c in CASES if c.id.endswith("-bomb")]
    assert len(bombs) == 2
    assert all(len(c.content) < SMALL_LIMIT // 2 for c in bombs)


def test_chunked_body_over_limit(servers: dict[str, httpx.Client]) -> None:
    """A body without Content-Length is cut off while streaming."""

    def chunks() -> Iterator[bytes]:
        for _ in range(10):
            yield b" " * 512

    response = servers["small"].post("/v2/models/f32/infer", content=chunks())
    assert_error_body(response, 400, f"request JSON size of more than {SMALL_LIMIT} bytes exceeds the maximum "
                                     f"allowed input size of {SMALL_LIMIT} bytes")


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_huge_declared_shapes_are_refused_without_allocating(servers: dict[str, httpx.Client]) -> None:
    """The server runs in this process: its RSS must not jump for a 10^12-element declaration."""
    http = servers["main"]
    huge = [c for c in CASES if c.id.startswith("huge-shape")]
    assert len(huge) == 3
    for case in huge:  # warm up code paths before measuring
        http.post(f"/v2/models/{case.model}/infer", content=case.content, headers=case.headers)
    before = _rss_bytes()
    for _ in range(5):
        for case in huge:
            response = http.post(f"/v2/models/{case.model}/infer", content=case.content, headers=case.headers)
            assert_error_body(response, 400, case.error)
    # also a huge non-batched BYTES shape with JSON data, and a huge batch dimension
    response = http.post("/v2/models/s/infer", content=body(tensor("BYTES", [HUGE], ["a", "b"])))
    assert_error_body(response, 400, SHAPE_MISMATCH)
    assert _rss_bytes() - before < 100 * 1024 * 1024


def test_server_still_healthy_after_the_table(servers: dict[str, httpx.Client]) -> None:
    for http in servers.values():
        assert http.get("/v2/health/live").status_code == 200
        assert http.get("/v2/health/ready").status_code == 200
    response = servers["main"].post("/v2/models/m/infer", content=GOOD)
    assert response.status_code == 200, response.text
    assert response.json() == {
        "model_name": "m",
        "model_version": "1",
        "outputs": [
            {"name": "OA", "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4]},
            {"name": "OB", "datatype": "FP32", "shape": [1, 2], "data": [0.5, 1.5]},
        ],
    }
    small = servers["small"].post("/v2/models/f32/infer", content=body(tensor("FP32", [2], [1.0, 2.0])))
    assert small.status_code == 200
    assert small.json()["outputs"][0]["data"] == [1.0, 2.0]
    # a gzip body under the limit once inflated is accepted
    packed = gzip.compress(body(tensor("FP32", [2], [1.0, 2.0])))
    small = servers["small"].post(
        "/v2/models/f32/infer", content=packed, headers={"Content-Encoding": "gzip"}
    )
    assert small.status_code == 200


def _binary_request(values: np.ndarray, pad: int = 0) -> tuple[bytes, dict[str, str]]:
    """An infer body of ``f32``: a JSON header (padded with ``pad`` spaces), then the binary data."""
    header = orjson.dumps({
        "inputs": [{"name": "IN", "datatype": "FP32", "shape": [values.size],
                    "parameters": {"binary_data_size": values.nbytes}}],
        "outputs": [{"name": "OUT", "parameters": {"binary_data": True}}],
    }) + b" " * pad
    return header + values.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


def _binary_output(response: httpx.Response) -> bytes:
    assert response.status_code == 200, response.text
    return response.content[int(response.headers["inference-header-content-length"]):]


@pytest.mark.parametrize("server", ["small", "small-uvicorn"])
def test_binary_data_past_the_json_limit_is_served(servers: dict[str, httpx.Client], server: str) -> None:
    """As in Triton, --http-max-input-size caps the JSON of an infer request: 4,000 bytes of
    binary tensor data after a small JSON header pass a 1,024-byte limit, whole or chunked."""
    values = np.arange(1000, dtype=np.float32)
    content, headers = _binary_request(values)
    assert len(content) > SMALL_LIMIT
    assert _binary_output(servers[server].post("/v2/models/f32/infer", content=content, headers=headers)) == values.tobytes()

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(content), 512):
            yield content[start:start + 512]

    chunked = servers[server].post("/v2/models/f32/infer", content=chunks(), headers=headers)
    assert _binary_output(chunked) == values.tobytes()


@pytest.mark.parametrize("server", ["small", "small-uvicorn"])
def test_a_raw_binary_body_is_capped_by_the_limit(servers: dict[str, httpx.Client], server: str) -> None:
    """As in Triton, a raw binary body (Inference-Header-Content-Length: 0) is one input: the
    whole of it is capped, in Triton's words, and one at the limit is served."""
    raw = {"Inference-Header-Content-Length": "0"}
    over = np.ones(SMALL_LIMIT // 4 + 1, dtype=np.float32)
    response = servers[server].post("/v2/models/f32/infer", content=over.tobytes(), headers=raw)
    assert_error_body(response, 400, f"Raw input has a byte_size ({over.nbytes} bytes) that exceeds the "
                                     f"maximum allowed value of {SMALL_LIMIT} bytes")
    at = np.arange(SMALL_LIMIT // 4, dtype=np.float32)
    assert _binary_output(servers[server].post("/v2/models/f32/infer", content=at.tobytes(), headers=raw)) == at.tobytes()


@pytest.mark.parametrize("server", ["small", "small-uvicorn"])
def test_a_json_header_over_the_limit_is_refused_unread(servers: dict[str, httpx.Client], server: str) -> None:
    content, headers = _binary_request(np.ones(4, dtype=np.float32), pad=SMALL_LIMIT)
    response = servers[server].post("/v2/models/f32/infer", content=content, headers=headers)
    header_length = int(headers["Inference-Header-Content-Length"])
    assert_error_body(response, 400, f"request JSON size of {header_length} bytes exceeds the maximum allowed "
                                     f"input size of {SMALL_LIMIT} bytes")


def test_binary_data_larger_than_the_machine_is_refused_unread(servers: dict[str, httpx.Client]) -> None:
    """A Content-Length past the machine's memory is answered from the headers alone (the
    client sends no body at all)."""
    import socket

    from pyserve.frontends.http.body import BINARY_DATA_LIMIT

    url = httpx.URL(str(servers["small"].base_url))
    head = (f"POST /v2/models/f32/infer HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length: 100\r\n"
            f"Content-Length: {BINARY_DATA_LIMIT + 1000}\r\n\r\n").encode()
    with socket.create_connection((url.host, url.port), timeout=30) as sock:
        sock.sendall(head)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert b"its binary data may not exceed this machine's memory" in answer
