"""Security and limits: endpoint restriction per API category over HTTP and gRPC
(``--http-restricted-api``, ``--grpc-restricted-protocol``), the request body cap without
memory growth, and the tensor element-count limit."""

from __future__ import annotations

import queue
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from pyserve import InferRequest, InferResponse, InstanceContext
from pyserve.api.backend import Backend
from pyserve.frontends.grpc.server import GrpcOptions
from pyserve.frontends.restricted import (
    CATEGORIES,
    RestrictionError,
    http_category,
    parse_restrictions,
)
from pyserve.server.core import ServerThread

IDENTITY = """
name: "ident"
backend: "ident"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


class Identity(Backend):
    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        return [InferResponse({"OUTPUT0": r.inputs["INPUT0"]}) for r in requests]


def _rules(grpc: bool) -> dict[str, Any]:
    return parse_restrictions([f"{c}:key-{c}=value-{c}" for c in CATEGORIES], grpc=grpc)


@pytest.fixture
def server(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> ServerThread:
    return start_server(
        make_repo({"ident": IDENTITY}),
        backends={"ident": Identity()},
        http_restricted_api=_rules(grpc=False),
        grpc=GrpcOptions(restrictions=_rules(grpc=True)),
    )


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{server.url}", timeout=30) as client:
        yield client


INFER_BODY = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}

HTTP_CALLS: list[tuple[str, str, str, Any]] = [
    ("health", "GET", "/v2/health/live", None),
    ("health", "GET", "/v2/models/ident/ready", None),
    ("metadata", "GET", "/v2", None),
    ("metadata", "GET", "/v2/models/ident", None),
    ("inference", "POST", "/v2/models/ident/infer", INFER_BODY),
    ("inference", "POST", "/v2/models/ident/versions/1/infer", INFER_BODY),
    ("shared-memory", "GET", "/v2/systemsharedmemory/status", None),
    ("shared-memory", "GET", "/v2/cudasharedmemory/status", None),
    ("model-config", "GET", "/v2/models/ident/config", None),
    ("model-repository", "POST", "/v2/repository/index", None),
    ("statistics", "GET", "/v2/models/stats", None),
    ("statistics", "GET", "/v2/models/ident/stats", None),
    ("trace", "GET", "/v2/trace/setting", None),
    ("trace", "GET", "/v2/models/ident/trace/setting", None),
    ("logging", "GET", "/v2/logging", None),
]


@pytest.mark.parametrize(("category", "method", "path", "body"), HTTP_CALLS)
def test_http_restricted(http: httpx.Client, category: str, method: str, path: str, body: Any) -> None:
    denied = http.request(method, path, json=body)
    assert denied.status_code == 403
    assert denied.json() == {"error": f"This API is restricted, expecting header 'key-{category}'"}
    wrong = http.request(method, path, json=body, headers={f"key-{category}": "wrong"})
    assert wrong.status_code == 403
    other = next(c for c in CATEGORIES if c != category)
    assert http.request(method, path, json=body, headers={f"key-{other}": f"value-{other}"}).status_code == 403
    allowed = http.request(method, path, json=body, headers={f"key-{category}": f"value-{category}"})
    assert allowed.status_code != 403
    if category != "statistics":  # statistics may not be served yet: anything but 403 will do
        assert allowed.status_code == 200, allowed.text


def test_unrestricted_paths_stay_open(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> None:
    server = start_server(
        make_repo({"ident": IDENTITY}), backends={"ident": Identity()},
        http_restricted_api=parse_restrictions(["inference:k=v"]),
    )
    with httpx.Client(base_url=f"http://{server.url}", timeout=30) as client:
        assert client.get("/v2/health/ready").status_code == 200
        assert client.get("/v2/models/ident").status_code == 200
        assert client.post("/v2/models/ident/infer", json=INFER_BODY).status_code == 403
        assert client.post("/v2/models/ident/infer", json=INFER_BODY, headers={"K": "v"}).status_code == 200


def _grpc_calls(tensor: grpcclient.InferInput) -> list[tuple[str, Callable[[grpcclient.InferenceServerClient, dict[str, str]], Any]]]:
    return [
        ("health", lambda c, h: c.is_server_live(headers=h)),
        ("health", lambda c, h: c.is_model_ready("ident", headers=h)),
        ("metadata", lambda c, h: c.get_server_metadata(headers=h)),
        ("metadata", lambda c, h: c.get_model_metadata("ident", headers=h)),
        ("inference", lambda c, h: c.infer("ident", [tensor], headers=h)),
        ("shared-memory", lambda c, h: c.get_system_shared_memory_status(headers=h)),
        ("model-config", lambda c, h: c.get_model_config("ident", headers=h)),
        ("model-repository", lambda c, h: c.get_model_repository_index(headers=h)),
        ("statistics", lambda c, h: c.get_inference_statistics(headers=h)),
        ("trace", lambda c, h: c.get_trace_settings(headers=h)),
        ("logging", lambda c, h: c.get_log_settings(headers=h)),
    ]


def test_grpc_restricted(server: ServerThread) -> None:
    tensor = grpcclient.InferInput("INPUT0", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 2), dtype=np.float32))
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        for category, call in _grpc_calls(tensor):
            with pytest.raises(InferenceServerException) as info:
                call(client, {})
            assert info.value.status() == "StatusCode.UNAVAILABLE", category  # Triton 2.51's code and text
            assert info.value.message() == (
                f"This protocol is restricted, expecting header 'triton-grpc-protocol-key-{category}'"
            )
            with pytest.raises(InferenceServerException):
                call(client, {f"triton-grpc-protocol-key-{category}": "wrong"})
            header = {f"triton-grpc-protocol-key-{category}": f"value-{category}"}
            if category == "statistics":
                try:
                    call(client, header)
                except InferenceServerException as exc:
                    assert "restricted" not in str(exc.message())
            else:
                call(client, header)


def test_grpc_stream_restricted(server: ServerThread) -> None:
    tensor = grpcclient.InferInput("INPUT0", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 2), dtype=np.float32))
    for headers, denied in (({}, True), ({"triton-grpc-protocol-key-inference": "value-inference"}, False)):
        results: queue.Queue[Any] = queue.Queue()
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            client.start_stream(lambda result, error, out=results: out.put((result, error)), headers=headers)
            try:
                client.async_stream_infer("ident", [tensor])
            except InferenceServerException:  # the denial may already have closed the stream
                assert denied
            result, error = results.get(timeout=60)
            client.stop_stream()
        if denied:
            assert error is not None and "This protocol is restricted" in str(error)
        else:
            assert error is None
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[1.0, 1.0]])


def test_restriction_parsing() -> None:
    rules = parse_restrictions(["health,metadata:API-Key=s3cret", "inference:other=1"])
    assert rules["health"].key == "api-key" and rules["health"].value == "s3cret"
    assert rules["inference"].key == "other"
    assert parse_restrictions(["trace:k=v"], grpc=True)["trace"].key == "triton-grpc-protocol-k"
    for bad in ("health", "health:k", "nope:k=v", ":k=v", "health:=v"):
        with pytest.raises(RestrictionError):
            parse_restrictions([bad])
    with pytest.raises(RestrictionError, match="restricted api 'health' can not be specified in multiple config groups"):
        parse_restrictions(["health:a=1", "health:b=2"])
    with pytest.raises(RestrictionError, match="unknown restricted api 'nope'"):
        parse_restrictions(["nope:k=v"])
    # the gRPC flag's categories are "protocols" in Triton's words (its L0_grpc script greps them)
    with pytest.raises(RestrictionError, match="restricted protocol 'health' can not be specified in multiple"):
        parse_restrictions(["health:a=1", "health:b=2"], grpc=True)
    with pytest.raises(RestrictionError, match="unknown restricted protocol 'model-reposit'"):
        parse_restrictions(["model-reposit:k=v"], grpc=True)
    assert http_category("GET", "/metrics") is None
    assert http_category("POST", "/v2/repository/models/x/load") == "model-repository"
    assert http_category("POST", "/v2/models/x/versions/2/generate_stream") == "inference"


@pytest.mark.parametrize(("flags", "message"), [
    (["model-repository,health:k1=v1", "metadata,health:k2=v2"],
     "restricted api 'health' can not be specified in multiple config groups"),
    (["model-reposit,health:k1=v1", "metadata,health:k2=v2"], "unknown restricted api 'model-reposit'"),
])
def test_bad_restrictions_stop_the_server_with_tritons_words(tmp_path: Path, flags: list[str], message: str) -> None:
    """As Triton's L0_http script starts it: the server does not start, and says why."""
    command = [sys.executable, "-m", "pyserve", "run", "--model-repository", str(tmp_path), "--http-port", "0",
               "--grpc-port", "0", "--metrics-port", "0", "--http-address", "127.0.0.1"]
    for flag in flags:
        command.append(f"--http-restricted-api={flag}")
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert message in done.stderr


# -- limits ------------------------------------------------------------------------------------


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _raw_post(port: int, head: bytes, chunks: Iterator[bytes]) -> bytes:
    """Send a request piece by piece until the server answers or closes; return its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        sock.settimeout(0.05)
        answer = b""
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break
            try:
                answer += sock.recv(65536)
                if answer:
                    break
            except TimeoutError:
                continue
            except ConnectionResetError:
                break
        sock.settimeout(10)
        try:
            while b"\r\n\r\n" not in answer:
                data = sock.recv(65536)
                if not data:
                    break
                answer += data
        except (ConnectionResetError, TimeoutError):
            pass
        return answer


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_oversize_body_rejected_without_memory_growth(
    start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]
) -> None:
    server = start_server(make_repo({"ident": IDENTITY}), backends={"ident": Identity()},
                          http_max_input_size=1 << 20)
    port = server.server.http_port
    assert port is not None
    block = b"0" * (1 << 20)
    before = _rss_kib()

    declared = (b"POST /v2/models/ident/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % (512 << 20))
    answer = _raw_post(port, declared, iter([block] * 64))
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]

    chunked = (b"POST /v2/models/ident/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    frame = b"%x\r\n" % len(block) + block + b"\r\n"
    answer = _raw_post(port, chunked, iter([frame] * 64))
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]

    growth_mib = (_rss_kib() - before) / 1024
    assert growth_mib < 32, f"RSS grew by {growth_mib:.0f} MiB"
    with httpx.Client(base_url=f"http://{server.url}", timeout=30) as client:
        assert client.post("/v2/models/ident/infer", json=INFER_BODY).status_code == 200


def test_tensor_element_limit(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> None:
    from pyserve.repository import tensor_checks

    server = start_server(make_repo({"ident": IDENTITY}), backends={"ident": Identity()}, max_tensor_elements=1000)
    big = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 10**12],
                       "parameters": {"binary_data_size": 4}}]}
    with httpx.Client(base_url=f"http://{server.url}", timeout=30) as client:
        response = client.post("/v2/models/ident/infer", json=big)
        assert response.status_code == 400
        assert "more than the server's limit of 1000 elements" in response.json()["error"]
        ok = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1000], "data": [0.0] * 1000}]}
        assert client.post("/v2/models/ident/infer", json=ok).status_code == 200
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        tensor = grpcclient.InferInput("INPUT0", [1, 1001], "FP32")
        tensor.set_data_from_numpy(np.zeros((1, 1001), dtype=np.float32))
        with pytest.raises(InferenceServerException, match="limit of 1000 elements"):
            client.infer("ident", [tensor])
    server.stop()
    assert tensor_checks.LIMITS.max_tensor_elements == 0
