"""TLS on the gRPC port (``--grpc-use-ssl``, ``--grpc-use-ssl-mutual``) on both gRPC servers,
with certificates made by ``openssl`` for the test and tritonclient as the client."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from suite_support import FP32_ECHO_CONFIG, write_model
from tritonclient.utils import InferenceServerException

from pyserve.frontends.grpc.server import GRPC_SERVERS, GrpcOptions
from pyserve.server.core import StartupError
from pyserve.testing import serve

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, all signed by it."""
    root = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "2", "-subj", "/CN=pyserve test CA", cwd=root)
    (root / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, extra in (("server", ["-extfile", "san.cnf"]), ("client", [])):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=root)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", *extra, cwd=root)
    return root


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tls_repo")
    write_model(path, "echo", FP32_ECHO_CONFIG)
    return path


def _options(pki: Path, implementation: str, mutual: bool) -> GrpcOptions:
    return GrpcOptions(implementation=implementation, use_ssl=not mutual, use_ssl_mutual=mutual,
                       server_cert=str(pki / "server.pem"), server_key=str(pki / "server.key"),
                       root_cert=str(pki / "ca.pem"))


def _echo(client: grpcclient.InferenceServerClient) -> list[float]:
    tensor = grpcclient.InferInput("INPUT0", [3], "FP32")
    tensor.set_data_from_numpy(np.array([1.0, 2.0, 3.0], np.float32))
    return client.infer("echo", [tensor]).as_numpy("OUTPUT0").tolist()


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def tls_server(request: pytest.FixtureRequest, pki: Path, repo: Path) -> Iterator[int]:
    with serve(repo, grpc=_options(pki, request.param, mutual=False)) as thread:
        yield thread.server.grpc_port


def test_tls_calls_work_and_plaintext_is_refused(tls_server: int, pki: Path) -> None:
    secure = grpcclient.InferenceServerClient(f"localhost:{tls_server}", ssl=True,
                                              root_certificates=str(pki / "ca.pem"))
    plain = grpcclient.InferenceServerClient(f"localhost:{tls_server}")
    try:
        assert secure.is_server_ready()
        assert _echo(secure) == [1.0, 2.0, 3.0]
        with pytest.raises(InferenceServerException):
            plain.is_server_ready(client_timeout=5)
    finally:
        secure.close()
        plain.close()


@pytest.mark.parametrize("implementation", GRPC_SERVERS)
def test_mutual_tls_needs_a_client_certificate(pki: Path, repo: Path, implementation: str) -> None:
    with serve(repo, grpc=_options(pki, implementation, mutual=True)) as thread:
        url = f"localhost:{thread.server.grpc_port}"
        with_cert = grpcclient.InferenceServerClient(
            url, ssl=True, root_certificates=str(pki / "ca.pem"), private_key=str(pki / "client.key"),
            certificate_chain=str(pki / "client.pem"))
        without = grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(pki / "ca.pem"))
        try:
            assert _echo(with_cert) == [1.0, 2.0, 3.0]
            with pytest.raises(InferenceServerException):
                without.is_server_ready(client_timeout=5)
        finally:
            with_cert.close()
            without.close()


def test_missing_tls_files_stop_startup_with_the_flag_named(pki: Path, repo: Path, tmp_path: Path) -> None:
    options = GrpcOptions(use_ssl=True, server_cert=str(pki / "server.pem"), server_key=str(tmp_path / "nope.key"))
    with pytest.raises(StartupError, match="--grpc-server-key '.*nope.key': No such file"):
        with serve(repo, grpc=options):
            pass
    with pytest.raises(StartupError, match="--grpc-root-cert is required with --grpc-use-ssl-mutual"):
        with serve(repo, grpc=GrpcOptions(use_ssl_mutual=True, server_cert=str(pki / "server.pem"),
                                          server_key=str(pki / "server.key"))):
            pass


def test_frontend_processes_serve_tls_too(pki: Path, repo: Path) -> None:
    with serve(repo, frontend_processes=1, grpc=_options(pki, "pyserve", mutual=False)) as thread:
        for _ in range(4):  # two connections at once: the owner's and (passed to it) the frontend's
            clients = [grpcclient.InferenceServerClient(f"localhost:{thread.server.grpc_port}", ssl=True,
                                                        root_certificates=str(pki / "ca.pem")) for _ in range(2)]
            try:
                for client in clients:
                    assert _echo(client) == [1.0, 2.0, 3.0]
            finally:
                for client in clients:
                    client.close()
        balancer = thread.server.balancer
        assert balancer is not None and balancer.passed > 0  # the frontend did TLS on passed connections
