"""``--http-header-forward-pattern`` / ``--grpc-header-forward-pattern``: matching headers reach a
Triton Python-backend model as request parameters, over HTTP, unary gRPC and gRPC streams, in one
process and through frontend processes (replica and hand-off)."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from suite_support import write_model
from tritonclient.utils import InferenceServerException

from pyserve.dataplane.header_forwarding import HeaderForwarding
from pyserve.frontends.grpc.server import GRPC_SERVERS, GrpcOptions
from pyserve.server.core import ServerThread, StartupError
from pyserve.testing import serve

PATTERN = "my_header.*|priority"  # priority: a reserved name, to see it refused

PARAMS_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("PARAMS", np.array([r.parameters().encode()], dtype=object))]
            )
            for r in requests
        ]
'''
PARAMS_CONFIG = """
    backend: "python"
    max_batch_size: 0
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "PARAMS" data_type: TYPE_STRING dims: [ 1 ] } ]
"""
HEADERS = {"my_header_1": "value 1", "My_Header_2": 'a "quoted" \\ value', "other_header": "not forwarded"}
GRPC_HEADERS = {name.lower(): value for name, value in HEADERS.items()}  # gRPC metadata keys are lower case
EXPECTED = {"my_header_1": "value 1", "my_header_2": 'a "quoted" \\ value'}


def _repository(root: Path) -> Path:
    write_model(root, "params", PARAMS_CONFIG)
    (root / "params" / "1" / "model.py").write_text(PARAMS_PY)
    return root


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repo = _repository(tmp_path_factory.mktemp("forwarding"))
    grpc = GrpcOptions(implementation=request.param, header_forward_pattern=PATTERN)
    with serve(repo, http_header_forward_pattern=PATTERN, grpc=grpc) as thread:
        yield thread


def _params(result: Any) -> dict[str, Any]:
    return json.loads(result.as_numpy("PARAMS")[0])  # type: ignore[no-any-return]


def _input(module: Any) -> Any:
    tensor = module.InferInput("INPUT0", [1], "FP32")
    tensor.set_data_from_numpy(np.ones(1, np.float32))
    return tensor


def check_every_protocol(http_url: str, grpc_url: str) -> None:
    with httpclient.InferenceServerClient(http_url) as http:
        result = http.infer("params", [_input(httpclient)], headers=dict(HEADERS), parameters={"body_key": 7})
        assert _params(result) == {"body_key": 7, **EXPECTED}
    grpc = grpcclient.InferenceServerClient(grpc_url)
    try:
        result = grpc.infer("params", [_input(grpcclient)], headers=dict(GRPC_HEADERS), parameters={"body_key": 7})
        assert _params(result) == {"body_key": 7, **EXPECTED}
        answers: queue.Queue[Any] = queue.Queue()
        grpc.start_stream(callback=lambda result, error: answers.put(error or result), headers=dict(GRPC_HEADERS))
        for _ in range(2):
            grpc.async_stream_infer("params", [_input(grpcclient)])
        for _ in range(2):
            assert _params(answers.get(timeout=30)) == EXPECTED
        grpc.stop_stream()
    finally:
        grpc.close()


def test_matching_headers_become_parameters(server: ServerThread) -> None:
    check_every_protocol(server.url, server.grpc_url)


def test_a_reserved_header_name_is_refused(server: ServerThread) -> None:
    with httpclient.InferenceServerClient(server.url) as http:
        with pytest.raises(InferenceServerException, match="reserved for Triton usage") as refused:
            http.infer("params", [_input(httpclient)], headers={"priority": "1"})
        assert refused.value.status() == "400"
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match="reserved for Triton usage") as error:
            grpc.infer("params", [_input(grpcclient)], headers={"priority": "1"})
        assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        grpc.close()


def test_without_a_pattern_nothing_is_forwarded(tmp_path: Path) -> None:
    with serve(_repository(tmp_path / "repo")) as thread:
        with httpclient.InferenceServerClient(thread.url) as http:
            assert _params(http.infer("params", [_input(httpclient)], headers=dict(HEADERS))) == {}


def test_pattern_semantics() -> None:
    insensitive = HeaderForwarding("MY_HEADER")
    assert insensitive.select([("x-my_header-y", "1"), ("other", "2")]) == [("x-my_header-y", "1")]  # search
    assert HeaderForwarding("(?-i)MY_HEADER").select([("my_header_1", "1")]) == []  # case-sensitive
    assert HeaderForwarding("^token-bin$").select([("token-bin", b"\xff")]) == [("token-bin", "\xff")]


def test_an_invalid_pattern_stops_startup(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match=r"--grpc-header-forward-pattern: header forward pattern '\(' is not"):
        with serve(_repository(tmp_path / "repo"), grpc=GrpcOptions(header_forward_pattern="(")):
            pass


def test_frontend_processes_forward_too(tmp_path: Path) -> None:
    """Replica and hand-off paths: ``params`` is replicated (auto), ``owner_params`` is not."""
    repo = _repository(tmp_path / "repo")
    write_model(repo, "owner_params", PARAMS_CONFIG)
    (repo / "owner_params" / "1" / "model.py").write_text(PARAMS_PY)
    grpc = GrpcOptions(header_forward_pattern=PATTERN)
    with serve(repo, frontend_processes=1, replicate_models="params", http_header_forward_pattern=PATTERN,
               grpc=grpc) as thread:
        for _ in range(8):  # new connections land on the owner and on the frontend
            check_every_protocol(thread.url, thread.grpc_url)
            with httpclient.InferenceServerClient(thread.url) as http:
                assert _params(http.infer("owner_params", [_input(httpclient)], headers=dict(HEADERS))) == EXPECTED
            grpc_client = grpcclient.InferenceServerClient(thread.grpc_url)
            try:
                answer = grpc_client.infer("owner_params", [_input(grpcclient)], headers=dict(GRPC_HEADERS))
                assert _params(answer) == EXPECTED
            finally:
                grpc_client.close()
