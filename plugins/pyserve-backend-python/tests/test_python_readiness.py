"""A model's ``is_ready()`` answers the ready endpoints, as in Triton's Python backend."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from python_backend_helpers import PROCESS_MODE as PROCESS
from python_backend_helpers import start, write_python_model
from tritonclient.utils import InferenceServerException

from pyserve.server.core import ServerThread

Serve = Callable[[dict[str, tuple[str | None, str]]], ServerThread]

CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# execute(IN) sets the answer of is_ready() to bool(IN) and returns how often is_ready() ran
# (in OUT), or the worker's pid when IN is -1.
FLAG_SOURCE = """
import os
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.ready = True
        self.calls = 0
    {is_ready}
    def execute(self, requests):
        out = []
        for request in requests:
            value = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            answer = os.getpid() if value == -1 else self.calls
            if value != -1:
                self.ready = bool(value)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([answer], dtype=np.int32))]))
        return out
"""
SYNC_READY = """def is_ready(self):
        self.calls += 1
        return self.ready
"""
ASYNC_READY = """async def is_ready(self):
        self.calls += 1
        return self.ready
"""
SLOW_READY = """def is_ready(self):
        self.calls += 1
        time.sleep(1.0)
        return self.ready
"""


def _model(is_ready: str) -> str:
    return FLAG_SOURCE.replace("{is_ready}", is_ready)


def _infer(server: ServerThread, model: str, value: int) -> int:
    item = httpclient.InferInput("IN", [1], "INT32")
    item.set_data_from_numpy(np.array([value], dtype=np.int32))
    return int(httpclient.InferenceServerClient(server.url).infer(model, [item]).as_numpy("OUT")[0])


def _http_ready(server: ServerThread, model: str | None = None) -> int:
    path = "/v2/health/ready" if model is None else f"/v2/models/{model}/ready"
    return httpx.get(f"http://{server.url}{path}", timeout=30).status_code


def _grpc(server: ServerThread) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(f"127.0.0.1:{server.server.grpc_port}")


@pytest.mark.parametrize("mode", ["thread", "process"])
@pytest.mark.parametrize("is_ready", [SYNC_READY, ASYNC_READY], ids=["sync", "async"])
def test_is_ready_answers_the_ready_endpoints(serve: Serve, mode: str, is_ready: str) -> None:
    config = CONFIG + (PROCESS if mode == "process" else "")
    server = serve({"flag": (config, _model(is_ready)), "plain": (CONFIG, _model(""))})
    grpc_client = _grpc(server)
    assert _http_ready(server, "flag") == 200
    assert grpc_client.is_model_ready("flag") and grpc_client.is_server_ready()
    assert _http_ready(server) == 200

    _infer(server, "flag", 0)  # the model now says it is not ready
    assert _http_ready(server, "flag") == 400
    assert httpx.get(f"http://{server.url}/v2/models/flag/versions/1/ready").status_code == 400
    assert not grpc_client.is_model_ready("flag")
    assert _http_ready(server) == 400  # strict readiness: every model must be ready
    assert not grpc_client.is_server_ready()
    assert _http_ready(server, "plain") == 200 and grpc_client.is_model_ready("plain")
    # the model still serves: readiness is what it reports, not a gate on inference
    calls = _infer(server, "flag", 1)
    assert calls >= 6
    assert _http_ready(server, "flag") == 200 and _http_ready(server) == 200
    assert grpc_client.is_model_ready("flag", "1")


def test_is_ready_is_not_asked_for_unknown_or_bad_versions(serve: Serve) -> None:
    server = serve({"flag": (CONFIG, _model(SYNC_READY))})
    assert httpx.get(f"http://{server.url}/v2/models/flag/versions/7/ready").status_code == 400
    assert not _grpc(server).is_model_ready("flag", "7")
    with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT"):  # not a version (as Triton 2.51)
        _grpc(server).is_model_ready("flag", "x")
    assert httpx.get(f"http://{server.url}/v2/models/nope/ready").status_code == 400
    assert _infer(server, "flag", 1) == 0


FAILING = {
    "raises": """def is_ready(self):
        raise ZeroDivisionError("cannot tell")
""",
    "returns_none": """def is_ready(self):
        return None
""",
    "returns_int": """def is_ready(self):
        return 1
""",
}


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_failing_or_non_bool_is_ready_means_not_ready(serve: Serve, mode: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    extra = PROCESS if mode == "process" else ""
    server = serve({name: (CONFIG + extra, _model(source)) for name, source in FAILING.items()})
    with caplog.at_level(logging.WARNING, logger="pyserve.runtime.readiness"):
        for name in FAILING:
            assert _http_ready(server, name) == 400, name
            assert not _grpc(server).is_model_ready(name)
            assert _infer(server, name, 1) == 0  # the model still answers requests
    text = caplog.text
    assert "model 'raises' version 1 instance 'raises_0': readiness check failed" in text
    assert "ZeroDivisionError" in text and "cannot tell" in text
    assert "is_ready() of model 'returns_none' returned NoneType, expected bool" in text
    assert "is_ready() of model 'returns_int' returned int, expected bool" in text


def test_a_slow_check_times_out_and_is_shared_by_concurrent_questions(serve: Serve) -> None:
    server = serve({"slow": (CONFIG, _model(SLOW_READY))})
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _http_ready(server, "slow"), range(8)))
    assert answers == [200] * 8
    assert _infer(server, "slow", 1) == 1  # one check answered all eight questions

    server.server.dataplane.readiness.timeout_s = 0.2
    # the check would answer ready: 400 means the server gave up waiting for it
    assert _http_ready(server, "slow") == 400
    assert _infer(server, "slow", 1) == 2  # that check ran (and finishes on its own)


def test_server_readiness_without_strict_readiness_ignores_the_checks(tmp_path: Path) -> None:
    write_python_model(tmp_path, "flag", CONFIG, _model(SYNC_READY))
    server = start(tmp_path, strict_readiness=False)
    try:
        _infer(server, "flag", 0)
        assert _http_ready(server, "flag") == 400
        assert _http_ready(server) == 200
    finally:
        server.stop()


def test_process_mode_is_not_ready_while_its_worker_is_gone(serve: Serve) -> None:
    server = serve({"flag": (CONFIG + PROCESS, _model(SYNC_READY))})
    pid = _infer(server, "flag", -1)
    assert _http_ready(server, "flag") == 200
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _http_ready(server, "flag") != 400:
        assert time.monotonic() < deadline, "still ready after the worker was killed"
        time.sleep(0.05)
    assert _infer(server, "flag", -1) != pid  # the next batch restarts the worker
    assert _http_ready(server, "flag") == 200
