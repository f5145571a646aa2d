"""Python models that fail: at import, in initialize, in execute, with malformed results."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from python_backend_helpers import ADD_100_CONFIG, ADD_100_SOURCE, start, write_python_model
from tritonclient.utils import InferenceServerException

from pyserve.server.core import ServerThread

CONFIG = """
    backend: "python"
    max_batch_size: 0
    input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
    output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""

HEADER = """
import numpy as np
import triton_python_backend_utils as pb_utils

def ok(request):
    values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", values)])
"""

MODELS = {
    "import_error": CONFIG, "no_class": CONFIG, "init_error": CONFIG, "exec_error": CONFIG,
    "wrong_length": CONFIG, "not_a_list": CONFIG, "per_request_error": CONFIG, "sender_and_none": CONFIG,
    "unanswered_none": CONFIG, "auto_complete_conflict": CONFIG.replace("max_batch_size: 0", "max_batch_size: 8"),
    "bad_mode": CONFIG + 'parameters { key: "execution_mode" value { string_value: "fibers" } }',
}

SOURCES = {
    "import_error": "import numpy\nimport not_a_module_pyserve_test  # noqa\n",
    "no_class": HEADER + "class SomethingElse:\n    pass\n",
    "init_error": HEADER + """
class TritonPythonModel:
    def initialize(self, args):
        raise ValueError("bad weights file for " + args["model_name"])
    def execute(self, requests):
        return [ok(r) for r in requests]
""",
    "exec_error": HEADER + """
class TritonPythonModel:
    def execute(self, requests):
        raise pb_utils.TritonModelException("execute exploded")
""",
    "wrong_length": HEADER + """
class TritonPythonModel:
    def execute(self, requests):
        return [ok(r) for r in requests] * 2
""",
    "not_a_list": HEADER + """
class TritonPythonModel:
    def execute(self, requests):
        return ok(requests[0])
""",
    "per_request_error": HEADER + """
class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if (values < 0).any():
                error = pb_utils.TritonError("negative input", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
            else:
                responses.append(ok(request))
        return responses
""",
    "sender_and_none": HEADER + """
class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            request.get_response_sender().send(ok(request), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            out.append(None)
        return out
""",
    "unanswered_none": HEADER + """
class TritonPythonModel:
    def execute(self, requests):
        return [None for _ in requests]
""",
    "auto_complete_conflict": HEADER + """
class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.set_max_batch_size(2)
        return config
    def execute(self, requests):
        return [ok(r) for r in requests]
""",
    "bad_mode": HEADER + """
class TritonPythonModel:
    def execute(self, requests):
        return [ok(r) for r in requests]
""",
}


@pytest.fixture(scope="module")
def broken_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repo = Path(tmp_path_factory.mktemp("broken"))
    for name, config in MODELS.items():
        write_python_model(repo, name, config, SOURCES[name])
    thread = start(repo)
    yield thread
    thread.stop()


def _reasons(server: ServerThread) -> dict[str, tuple[str, str]]:
    index = httpx.post(f"http://{server.url}/v2/repository/index", json={}).json()
    return {entry["name"]: (entry["state"], entry.get("reason", "")) for entry in index}


def _infer(server: ServerThread, model: str, values: list[int]) -> np.ndarray:
    item = httpclient.InferInput("IN", [len(values)], "INT32")
    item.set_data_from_numpy(np.array(values, dtype=np.int32))
    return httpclient.InferenceServerClient(server.url).infer(model, [item]).as_numpy("OUT")


def test_import_error_makes_the_model_unavailable_with_the_place_in_model_py(broken_server: ServerThread) -> None:
    """Clients get the exception and where in model.py it happened; the traceback stays in the
    server's log."""
    state, reason = _reasons(broken_server)["import_error"]
    assert state == "UNAVAILABLE"
    assert reason == ("failed to load 'model.py' of model 'import_error' version 1: ModuleNotFoundError: "
                      "No module named 'not_a_module_pyserve_test' (at import_error/1/model.py:2)")


def test_model_file_without_the_class_is_unavailable(broken_server: ServerThread) -> None:
    state, reason = _reasons(broken_server)["no_class"]
    assert state == "UNAVAILABLE" and "TritonPythonModel" in reason


def test_initialize_raising_makes_the_model_unavailable(broken_server: ServerThread) -> None:
    state, reason = _reasons(broken_server)["init_error"]
    assert state == "UNAVAILABLE"
    assert "initialize() failed" in reason
    assert "ValueError: bad weights file for init_error (at init_error/1/model.py:" in reason
    assert "Traceback" not in reason


def test_auto_complete_contradicting_the_config_is_reported(broken_server: ServerThread) -> None:
    state, reason = _reasons(broken_server)["auto_complete_conflict"]
    assert state == "UNAVAILABLE"
    assert "configuration specified max_batch_size 8" in reason and "auto_complete_conflict" in reason


def test_unsupported_execution_mode_is_reported(broken_server: ServerThread) -> None:
    state, reason = _reasons(broken_server)["bad_mode"]
    assert state == "UNAVAILABLE" and "execution_mode 'fibers' is not supported" in reason


def test_execute_raising_fails_the_request_and_names_the_model(broken_server: ServerThread) -> None:
    with pytest.raises(InferenceServerException, match="exec_error.*execute exploded") as caught:
        _infer(broken_server, "exec_error", [1])
    assert caught.value.status() == "500"
    assert ("Failed to process the request(s) for model 'exec_error_0', message: "
            "TritonModelException: execute exploded") in caught.value.message()  # Triton 2.51's words
    with grpcclient.InferenceServerClient(broken_server.grpc_url) as client:
        item = grpcclient.InferInput("IN", [1], "INT32")
        item.set_data_from_numpy(np.array([1], dtype=np.int32))
        with pytest.raises(InferenceServerException, match="execute exploded"):
            client.infer("exec_error", [item])
    assert _reasons(broken_server)["exec_error"][0] == "READY"  # the instance keeps serving



def test_a_failed_execute_is_logged_once_with_the_models_traceback(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """One error record per failed execute (as Triton's one line), whose traceback reaches the
    line of model.py that raised."""
    repo = tmp_path / "repo"
    write_python_model(repo, "exec_error", CONFIG, SOURCES["exec_error"])
    caplog.set_level("ERROR")
    server = start(repo, frontend_processes=0)
    try:
        with pytest.raises(InferenceServerException, match="execute exploded"):
            _infer(server, "exec_error", [1])
    finally:
        server.stop()
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "execute failed" in record.getMessage() and "execute exploded" in record.getMessage()
    assert record.exc_info is not None and type(record.exc_info[1]).__name__ == "TritonModelException"
    assert 'exec_error/1/model.py", line ' in caplog.text

def test_wrong_length_list_fails_the_batch_with_a_clear_error(broken_server: ServerThread) -> None:
    with pytest.raises(InferenceServerException, match=r"returned 2 response\(s\) for 1 request\(s\)"):
        _infer(broken_server, "wrong_length", [1])
    with pytest.raises(InferenceServerException, match="must return a list"):
        _infer(broken_server, "not_a_list", [1])


def test_triton_error_fails_only_its_request(broken_server: ServerThread) -> None:
    np.testing.assert_array_equal(_infer(broken_server, "per_request_error", [1, 2]), [1, 2])
    with pytest.raises(InferenceServerException, match="negative input") as caught:
        _infer(broken_server, "per_request_error", [-1])
    assert caught.value.status() == "400"  # INVALID_ARG


def test_none_entries_are_fine_only_for_requests_answered_through_the_sender(broken_server: ServerThread) -> None:
    np.testing.assert_array_equal(_infer(broken_server, "sender_and_none", [3]), [3])
    with pytest.raises(InferenceServerException, match="returned None for a request"):
        _infer(broken_server, "unanswered_none", [3])


def test_two_models_named_model_py_do_not_share_module_state(tmp_path: Path) -> None:
    source = HEADER + """
COUNT = []

class TritonPythonModel:
    def execute(self, requests):
        COUNT.append(1)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([len(COUNT)], dtype=np.int32))])
                for _ in requests]
"""
    for name in ("first", "second"):
        write_python_model(tmp_path, name, CONFIG, source)
    server = start(tmp_path)
    try:
        assert _infer(server, "first", [0]).tolist() == [1]
        assert _infer(server, "first", [0]).tolist() == [2]
        assert _infer(server, "second", [0]).tolist() == [1]
    finally:
        server.stop()


def test_helpers_next_to_model_py_import_relatively_and_absolutely(tmp_path: Path) -> None:
    """As under Triton, which imports model.py as ``<version>.model``: ``from .x import`` and
    ``from . import x`` find files in the version directory, ``import x`` finds them in the
    version or the model directory, and each model gets its own files of the same names."""
    source = HEADER + """
from . import scale
from .offset import OFFSET
import shared

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            result = values * scale.FACTOR + OFFSET + shared.BASE
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", result.astype(np.int32))]))
        return out
"""
    for name, factor, offset, base in (("first", 2, 1, 100), ("second", 3, 5, 200)):
        model_dir = write_python_model(tmp_path, name, CONFIG, source)
        (model_dir / "1" / "scale.py").write_text(f"FACTOR = {factor}\n")
        (model_dir / "1" / "offset.py").write_text(f"OFFSET = {offset}\n")
        (model_dir / "shared.py").write_text(f"BASE = {base}\n")  # in the model directory
    server = start(tmp_path)
    try:
        assert _infer(server, "first", [1, 2]).tolist() == [103, 105]
        assert _infer(server, "second", [1, 2]).tolist() == [208, 211]
    finally:
        server.stop()
    left = [n for n in sys.modules if re.match(r"_pyserve_python_model_\d+_(first|second)_1(\.|$)", n)]
    assert not left  # unloaded with their helper modules


@pytest.mark.parametrize("name", ["model(test)", "model;test", "model$test", 'model"test', "model!test"])
def test_a_name_triton_refuses_for_a_python_model_is_refused(tmp_path: Path, name: str) -> None:
    """Triton's Python backend refuses model names with shell characters; so does this one,
    so that a repository loading here loads under Triton too (its model_control QA test)."""
    repo = tmp_path / "repo"
    write_python_model(repo, name, ADD_100_CONFIG, ADD_100_SOURCE)
    write_python_model(repo, "fine", ADD_100_CONFIG, ADD_100_SOURCE)
    server = start(repo)
    try:
        reasons = _reasons(server)
    finally:
        server.stop()
    assert reasons["fine"][0] == "READY"
    state, reason = reasons[name]
    assert state == "UNAVAILABLE" and "Invalid stub name: contains invalid characters" in reason, reason


def test_tritons_stub_settings_are_named_as_without_effect(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Triton's L0_backend_python passes ``--backend-config=python,shm-default-byte-size=...``:
    accepted, and the log says once that it changes nothing here."""
    repo = tmp_path / "repo"
    write_python_model(repo, "fine", ADD_100_CONFIG, ADD_100_SOURCE)
    with caplog.at_level("INFO", logger="pyserve.python_backend"):
        server = start(repo, backend_config={"python": {"shm-default-byte-size": "5242880", "other": "1"}})
        try:
            assert _reasons(server)["fine"][0] == "READY"
        finally:
            server.stop()
    notes = [r.getMessage() for r in caplog.records if "no effect in pyserve" in r.getMessage()]
    assert notes == ["python backend: --backend-config python,shm-default-byte-size=5242880: no effect in pyserve "
                     "(models use no stub shared-memory pool)"]
