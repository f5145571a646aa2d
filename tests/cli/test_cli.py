"""The ``pyserve`` command, run as a real subprocess (``python -m pyserve``)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import tritonclient.http as httpclient
from suite_support import EXAMPLE_REPOSITORY, REPO_ROOT, RunningServer, wait_for, write_model

README = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
EXAMPLE_MODELS = ("add_sub", "classifier", "identity_bytes", "identity_fp32", "sentiment", "simple", "square", "tiny_lm")
EXIT_TIMEOUT = 10


def pyserve(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pyserve", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )


@pytest.fixture
def run_server() -> Iterator[Any]:
    started: list[RunningServer] = []

    def start(*args: str) -> RunningServer:
        server = RunningServer(args)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def _infer_fp32(url: str, model: str, values: Sequence[float]) -> np.ndarray:
    client = httpclient.InferenceServerClient(url, network_timeout=30)
    try:
        tensor = httpclient.InferInput("INPUT0", [1, len(values)], "FP32")
        tensor.set_data_from_numpy(np.asarray([values], dtype=np.float32))
        output = client.infer(model, [tensor]).as_numpy("OUTPUT0")
        assert output is not None
        return output
    finally:
        client.close()


HELD_MODEL = """
backend: "python"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
parameters { key: "marks" value: { string_value: "MARKS" } }
"""
HELD_MODEL_PY = """
import json
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marks = Path(json.loads(args["model_config"])["parameters"]["marks"]["string_value"])

    def execute(self, requests):
        (self.marks / "executing").touch()
        for _ in range(6000):  # until the test creates "release" (60 s at most)
            if (self.marks / "release").exists():
                break
            time.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(
            r, "INPUT0").as_numpy())]) for r in requests]
"""
"""Echoes; an execute marks the file ``executing`` in the folder of parameter ``marks``, then
waits until the file ``release`` is there."""
SLOW_MODEL = """
backend: "identity"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
parameters { key: "execute_delay_ms" value: { string_value: "1500" } }
"""
DRAIN_EXIT_TIMEOUT = 600
"""Far beyond the test's waits: a server that exits in time exits because it drained."""


def test_run_serves_and_drains_on_sigterm(run_server: Any, tmp_path: Path) -> None:
    slow_repo, marks = tmp_path / "slow_repo", tmp_path / "marks"
    marks.mkdir()
    write_model(slow_repo, "slow", HELD_MODEL.replace("MARKS", str(marks)), {"1/model.py": HELD_MODEL_PY})
    server = run_server("--model-repository", "examples/model_repository", "--model-repository", str(slow_repo),
                        "--exit-timeout-secs", str(DRAIN_EXIT_TIMEOUT))
    url = server.wait_started(60)

    for model in (*EXAMPLE_MODELS, "slow"):
        assert re.search(rf"\|\s*{model}\s*\|\s*1\s*\|\s*READY\s*\|", server.stderr), server.stderr
    np.testing.assert_array_equal(_infer_fp32(url, "identity_fp32", [1.5, 2.5]), [[1.5, 2.5]])

    outcome: dict[str, Any] = {}

    def slow_request() -> None:
        try:
            outcome["result"] = _infer_fp32(url, "slow", [7.0])
        except Exception as exc:  # reported by the assertions below
            outcome["error"] = exc

    client_thread = threading.Thread(target=slow_request)
    client_thread.start()
    wait_for((marks / "executing").exists, 60, "the request to execute")
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert server.process.poll() is None, "the server exited before its request was answered"
    assert not outcome
    (marks / "release").touch()  # the execute returns: the drained server exits
    code = server.process.wait(120)
    client_thread.join(60)
    server.close()  # the log read to its end
    assert code == 0, server.stderr
    assert "error" not in outcome, outcome
    np.testing.assert_array_equal(outcome["result"], [[7.0]])
    assert "Server stopped" in server.stderr


def test_run_without_repository_serves_the_bundled_examples(run_server: Any) -> None:
    server = run_server("--exit-timeout-secs", "5")
    url = server.wait_started()
    client = httpclient.InferenceServerClient(url)
    try:
        names = sorted({e["name"] for e in client.get_model_repository_index()})
        assert client.is_server_ready()
    finally:
        client.close()
    assert names == sorted(EXAMPLE_MODELS)
    # the README's openai call: the bundled tiny_lm answers on the OpenAI-compatible routes
    with openai.OpenAI(base_url=f"http://{url}/v1", api_key="unused", max_retries=0, timeout=30) as llm:
        answer = llm.chat.completions.create(model="tiny_lm", messages=[{"role": "user", "content": "Hello"}],
                                             temperature=0)
    assert answer.usage is not None and answer.usage.completion_tokens == len(answer.choices[0].message.content or "")
    assert answer.choices[0].finish_reason in ("stop", "length")
    snippet = README.split("## Use it with the openai client", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(snippet.replace("localhost:8000", url), {})  # the README's three lines, as written
    assert printed.getvalue().endswith("\n")
    # the README's tritonclient call, as written: identity_fp32 echoes 0..3
    snippet = README.split("## Use it with tritonclient", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(snippet.replace("localhost:8000", url), {})
    assert printed.getvalue() == "[[0. 1. 2. 3.]]\n"
    assert server.stop(timeout=20) == 0, server.stderr
    assert not [line for line in server.lines if line.startswith(("E", "W"))], server.stderr  # a clean start


def test_run_with_bad_repository_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "repo"
    result = pyserve("run", "--http-port", "0", "--model-repository", str(missing))
    assert result.returncode == 2
    assert str(missing) in result.stderr


@pytest.mark.parametrize(
    ("value", "message"),
    [("foo", "'foo' must be <backend>,<key>=<value> or <key>=<value>"),
     ("identity,k", "'identity,k' must be"),
     (",k=v", "names no backend")],
)
def test_backend_config_errors_are_clear(value: str, message: str) -> None:
    result = pyserve("run", "--http-port", "0", "--backend-config", value)
    assert result.returncode == 2
    assert "argument --backend-config" in result.stderr and message in result.stderr


@pytest.mark.parametrize("value", ["0", "-1024"])
def test_a_max_input_size_that_is_not_positive_stops_the_start(value: str) -> None:
    """As Triton, whose own HTTP script looks for its words in the server's output."""
    result = pyserve("run", "--http-port", "0", f"--http-max-input-size={value}")
    assert result.returncode == 2
    assert "Error: --http-max-input-size must be greater than 0." in result.stderr


def test_backend_config_is_parsed() -> None:
    from pyserve.cli.main import _backend_config, build_parser

    args = build_parser().parse_args(
        ["run", "--backend-config", "identity,k=v", "--backend-config", "shared=1,2",
         "--backend-config", "identity,eq=a=b"]
    )
    assert _backend_config(args.backend_config) == {"identity": {"k": "v", "eq": "a=b"}, "": {"shared": "1,2"}}


def test_validate_example_repository() -> None:
    result = pyserve("validate", str(EXAMPLE_REPOSITORY))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("OK")


def test_validate_reports_every_problem(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "syntax", 'backend: "identity"\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 1 }\n')
    write_model(repo, "dims", """
        backend: "identity"
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 0 ] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ -2 ] } ]
        """)
    write_model(repo, "labels", """
        backend: "identity"
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] label_filename: "labels.txt" } ]
        """)
    write_model(repo, "ghost", """
        backend: "nosuch"
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]
        """)
    result = pyserve("validate", str(repo))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    by_model: dict[str, list[str]] = {}
    for line in lines:
        by_model.setdefault(line.split(":", 1)[0], []).append(line)
    assert sorted(by_model) == ["dims", "ghost", "labels", "syntax"], result.stdout
    assert re.search(r"syntax/config\.pbtxt:2:\d+: ", by_model["syntax"][0])
    dims = "\n".join(by_model["dims"])
    assert "input[0] 'x': field 'dims': dimension 0" in dims
    assert "output[0] 'y': field 'dims': dimension -2" in dims
    assert "label_filename 'labels.txt' does not exist" in by_model["labels"][0]
    assert "backend 'nosuch' is not installed" in by_model["ghost"][0]
    assert "pip install pyserve-backend-nosuch" in by_model["ghost"][0]
    assert f"{len(lines)} problem(s) found" in result.stderr


def test_validate_checks_ensembles_against_their_step_configs(tmp_path: Path) -> None:
    """The plan check the server runs when it loads an ensemble, run on the configs alone."""
    repo = tmp_path / "repo"
    step_config = """
        backend: "identity"
        input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
        """
    write_model(repo, "ident", step_config, versions=(1, 2))
    write_model(repo, "ident_int", step_config.replace("TYPE_FP32", "TYPE_INT32"))
    write_model(repo, "broken", step_config.replace("dims: [ 2 ] } ]\n        output", "dims: [ 0 ] } ]\n        output"))
    write_model(repo, "completed", 'backend: "python"\n',  # the Python backend auto-completes configs
                {"1/model.py": "class TritonPythonModel:\n    pass\n"})
    write_model(repo, "bare", 'backend: "identity"\n')  # no tensors at all is allowed, as in Triton

    def ensemble(name: str, steps: str) -> None:
        write_model(repo, name, f"""
            platform: "ensemble"
            input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 2 ] }} ]
            output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] }} ]
            ensemble_scheduling {{ step [ {steps} ] }}
            """)

    def step(model: str, version: int, imap: str, omap: str) -> str:
        return (f'{{ model_name: "{model}" model_version: {version} '
                f'input_map {{ key: "{imap}" value: "IN" }} output_map {{ key: "{omap}" value: "OUT" }} }}')

    ensemble("good", step("ident", -1, "INPUT0", "OUTPUT0"))
    ensemble("pinned", step("ident", 2, "INPUT0", "OUTPUT0"))
    ensemble("unchecked", step("broken", -1, "INPUT0", "OUTPUT0"))  # reported under 'broken' only
    ensemble("unknowable", step("completed", -1, "X", "Y"))  # tensors known only once loaded
    ensemble("no_tensors", step("bare", -1, "X", "Y"))  # a config without tensors, and no auto-complete
    ensemble("wrong_names", step("ident", -1, "INPUT9", "OUTPUT0"))
    ensemble("wrong_type", step("ident_int", -1, "INPUT0", "OUTPUT0"))
    ensemble("old_version", step("ident", 1, "INPUT0", "OUTPUT0"))
    result = pyserve("validate", str(repo))
    assert result.returncode == 1, result.stdout + result.stderr
    by_model: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        by_model.setdefault(line.split(":", 1)[0], []).append(line)
    assert sorted(by_model) == ["broken", "no_tensors", "old_version", "wrong_names", "wrong_type"], result.stdout
    assert "field 'dims': dimension 0" in by_model["broken"][0]
    assert "step 0 (model 'bare'): input_map names 'X', which is not an input of the model" in by_model["no_tensors"][0]
    names = "\n".join(by_model["wrong_names"])
    assert "wrong_names/config.pbtxt: invalid ensemble: step 0 (model 'ident'): input_map names 'INPUT9'" in names
    assert "the model's input 'INPUT0' is not mapped in input_map" in names
    assert "input 'INPUT0' is INT32 but ensemble tensor 'IN' is FP32" in "\n".join(by_model["wrong_type"])
    assert "version 1 of model 'ident' is not served (its version policy serves: 2)" in by_model["old_version"][0]
    strict = pyserve("validate", "--disable-auto-complete-config", str(repo))  # nothing will add tensors
    unknowable = [line for line in strict.stdout.splitlines() if line.startswith("unknowable:")]
    assert unknowable and "input_map names 'X', which is not an input of the model" in unknowable[0], strict.stdout


def test_validate_reports_missing_model_files_and_syntax_errors(tmp_path: Path) -> None:
    """What ``pyserve run`` would find only when loading: a model file the backend needs that is
    not there (each framework backend says which), and a model.py that does not compile (file
    and line). Nothing is imported or loaded: the syntax check compiles, the framework backends
    only look for their files."""
    repo = tmp_path / "repo"
    tensors = """
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
        """
    write_model(repo, "py_syntax", 'backend: "python"' + tensors,
                {"1/model.py": "import numpy\n\ndef broken(:\n    pass\n"})
    write_model(repo, "py_indent", 'backend: "python"' + tensors, {"1/model.py": "def f():\nreturn 1\n"})
    write_model(repo, "py_missing", 'backend: "python"' + tensors)
    write_model(repo, "py_fine", 'backend: "python"' + tensors, {"1/model.py": "class TritonPythonModel:\n    pass\n"})
    checked = ["py_syntax", "py_indent", "py_missing"]
    if pyserve("backends", "--json").stdout.count('"pyserve-backend-onnxruntime"'):
        write_model(repo, "onnx_missing", 'platform: "onnxruntime_onnx"\n')  # a config to complete: no tensors
        write_model(repo, "onnx_here", 'platform: "onnxruntime_onnx"\n', {"1/model.onnx": "not checked here"})
        checked.append("onnx_missing")
    if pyserve("backends", "--json").stdout.count('"pyserve-backend-pytorch"'):
        write_model(repo, "torch_missing", 'platform: "pytorch_libtorch"' + tensors)
        checked.append("torch_missing")
    result = pyserve("validate", str(repo))
    assert result.returncode == 1, result.stdout + result.stderr
    by_model: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        by_model.setdefault(line.split(":", 1)[0], []).append(line)
    assert sorted(by_model) == sorted(checked), result.stdout
    model_py = repo / "py_syntax" / "1" / "model.py"
    assert by_model["py_syntax"] == [f"py_syntax: version 1: {model_py}:3: SyntaxError: invalid syntax"]
    assert by_model["py_indent"] == [
        f"py_indent: version 1: {repo / 'py_indent' / '1' / 'model.py'}:2: IndentationError: "
        "expected an indented block after function definition on line 1"]
    assert by_model["py_missing"] == [
        f"py_missing: version 1: model file '{repo / 'py_missing' / '1' / 'model.py'}' not found"]
    if "onnx_missing" in by_model:
        assert by_model["onnx_missing"] == [
            f"onnx_missing: version 1: model file '{repo / 'onnx_missing' / '1' / 'model.onnx'}' not found "
            "for ONNX model 'onnx_missing' version 1"]
    if "torch_missing" in by_model:
        assert "torch_missing: version 1: model file '" in by_model["torch_missing"][0]
        assert "model.pt' not found for PyTorch model 'torch_missing' version 1" in by_model["torch_missing"][0]
    assert f"{len(result.stdout.splitlines())} problem(s) found" in result.stderr


def test_validate_missing_repository(tmp_path: Path) -> None:
    result = pyserve("validate", str(tmp_path / "nothing"))
    assert result.returncode == 1
    assert str(tmp_path / "nothing") in result.stdout


def test_backends_table_and_json() -> None:
    table = pyserve("backends")
    assert table.returncode == 0, table.stderr
    for name, dist in (("identity", "pyserve-backend-identity"), ("string_processor", "pyserve-backend-string-processor")):
        assert re.search(rf"\|\s*{name}\s*\|\s*{dist}\s*\|\s*\d+\.\d+", table.stdout), table.stdout

    as_json = pyserve("backends", "--json")
    assert as_json.returncode == 0, as_json.stderr
    infos = {info["name"]: info for info in json.loads(as_json.stdout)}
    assert infos["identity"]["distribution"] == "pyserve-backend-identity"
    assert infos["identity"]["entry_point"] == "pyserve_backend_identity"
    assert infos["string_processor"]["distribution"] == "pyserve-backend-string-processor"
    for info in infos.values():
        assert re.fullmatch(r"\d+(\.\d+)+.*", info["version"])
        assert isinstance(info["platforms"], list)
    assert infos["identity"]["kind"] == "backend"


def test_backends_lists_the_native_backend_plugin() -> None:
    """pyserve-backend-native is a server plugin (it supplies the backend of models whose
    libtriton_<name>.so it finds), not a named backend: it is listed, marked as such."""
    pytest.importorskip("pyserve_backend_native", reason="pyserve-backend-native is not installed")
    table = pyserve("backends")
    assert table.returncode == 0, table.stderr
    assert re.search(r"\|\s*native \*\s*\|\s*pyserve-backend-native\s*\|\s*\d+\.\d+", table.stdout), table.stdout
    assert re.search(r"^\* native: .*libtriton_<name>\.so.*asked first", table.stdout, re.M), table.stdout
    native = [i for i in json.loads(pyserve("backends", "--json").stdout) if i["name"] == "native"]
    assert native == [{
        "kind": "server_plugin", "name": "native", "distribution": "pyserve-backend-native",
        "version": native[0]["version"], "platforms": [], "entry_point": "pyserve_backend_native:resolver",
        "resolves_backends": True, "summary": native[0]["summary"],
    }]
    assert "libtriton_<name>.so" in native[0]["summary"]


def test_run_with_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = pyserve("run", "--http-address", "127.0.0.1", "--http-port", str(port),
                         "--grpc-port", "0", "--metrics-port", "0", "--exit-timeout-secs", "1")
    assert result.returncode == 1, result.stderr
    assert f"pyserve: error: HTTP service cannot listen on 127.0.0.1:{port}" in result.stderr


def test_run_rejects_equal_ports() -> None:
    result = pyserve("run", "--http-port", "9100", "--grpc-port", "9100")
    assert result.returncode == 2
    assert "must differ" in result.stderr


STUCK_PY = """
import os
import pathlib
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        marker = pathlib.Path(args["model_repository"]) / "initialize.started"
        if pathlib.Path(args["model_repository"], "hang_in_initialize").exists():
            marker.touch()
            time.sleep(3600)

    def execute(self, requests):
        model = pathlib.Path(__file__).parent.parent
        if (model / "hang_in_finalize").exists():  # answers; its finalize is what hangs
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", r.inputs()[0].as_numpy())])
                    for r in requests]
        (model / "execute.started").write_text(str(os.getpid()))
        time.sleep(3600)

    def finalize(self):
        model = pathlib.Path(__file__).parent.parent
        if (model / "hang_in_finalize").exists():
            (model / "finalize.started").touch()
            time.sleep(3600)
"""
STUCK_CONFIG = """
backend: "python"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def _stuck_repo(tmp_path: Path, hang_in_initialize: bool = False, hang_in_finalize: bool = False) -> Path:
    repo = tmp_path / "stuck_repo"
    model = write_model(repo, "stuck", STUCK_CONFIG, files={"1/model.py": STUCK_PY})
    if hang_in_initialize:
        (model / "hang_in_initialize").touch()
    if hang_in_finalize:
        (model / "hang_in_finalize").touch()
    return repo


def _owner_connection(url: str) -> Any:
    """A keep-alive HTTP connection, answered once: the first one opened is the owner's (it
    holds the fewest), so the next one goes to the frontend."""
    import http.client

    host, port = url.split(":")
    held = http.client.HTTPConnection(host, int(port), timeout=120)
    held.request("GET", "/v2/health/ready")
    assert held.getresponse().read() == b""
    return held


def _send_in_background(url: str, model: str) -> dict[str, Any]:
    outcome: dict[str, Any] = {}

    def request() -> None:
        try:
            outcome["result"] = _infer_fp32(url, model, [1.0])
        except Exception as exc:  # expected: the server gives up on it
            outcome["error"] = exc

    threading.Thread(target=request, daemon=True).start()
    return outcome


def test_exit_timeout_bounds_shutdown_with_a_stuck_execute(run_server: Any, tmp_path: Path) -> None:
    repo = _stuck_repo(tmp_path)
    server = run_server("--model-repository", str(repo), "--exit-timeout-secs", "1")
    url = server.wait_started()
    _send_in_background(url, "stuck")
    wait_for(lambda: (repo / "stuck" / "execute.started").exists(), what="the execute to begin")
    code = server.stop(timeout=60)  # not the hour the execute takes
    assert code == 1, server.stderr  # as Triton: "Exit timeout expired. Exiting immediately."
    assert "Exit timeout expired. Exiting immediately." in server.stderr
    assert "exit timeout reached with 1 request(s) still in flight" in server.stderr
    assert "still executing at the exit timeout; not finalized" in server.stderr


def test_exit_timeout_bounds_shutdown_with_a_finalize_that_never_returns(run_server: Any, tmp_path: Path) -> None:
    """A model whose ``finalize`` waits for threads that died (Triton's ``decoupled_bls`` on a
    machine without CUDA) no longer holds the process after "Shutting down" for ever."""
    repo = _stuck_repo(tmp_path, hang_in_finalize=True)
    server = run_server("--model-repository", str(repo), "--exit-timeout-secs", "1")
    url = server.wait_started()
    assert _infer_fp32(url, "stuck", [3.0]).tolist() == [[3.0]]  # idle when the shutdown begins
    code = server.stop(timeout=120)
    assert (repo / "stuck" / "finalize.started").exists()
    assert code == 1, server.stderr
    assert "model 'stuck' version 1: finalize still running at the exit timeout" in server.stderr
    assert "still running at the exit timeout: model 'stuck' version 1" in server.stderr
    assert "backend 'python' not finalized" in server.stderr
    assert "Exit timeout expired. Exiting immediately." in server.stderr


def test_exit_timeout_with_a_stuck_execute_in_a_frontend_process(run_server: Any, tmp_path: Path) -> None:
    """The default layout on more than one CPU: the stuck execute runs in the frontend (its
    replica of the model, on the second connection); the exit status is still 1."""
    repo = _stuck_repo(tmp_path)
    server = run_server("--model-repository", str(repo), "--exit-timeout-secs", "1",
                        "--frontend-processes", "1", "--replicate-models", "auto")
    url = server.wait_started()
    held = _owner_connection(url)  # the owner's: it holds the fewest
    try:
        _send_in_background(url, "stuck")  # a second connection: the frontend's
        started = repo / "stuck" / "execute.started"
        wait_for(lambda: started.exists() and started.read_text() != "", what="the execute to begin")
        frontend = re.search(r"Started 1 frontend process\(es\): pids (\d+)", server.stderr)
        assert frontend is not None and started.read_text() == frontend.group(1), server.stderr
        code = server.stop(timeout=60)
    finally:
        held.close()
    assert code == 1, server.stderr
    assert "did not stop within the exit timeout" in server.stderr
    assert "Exit timeout expired. Exiting immediately." in server.stderr


def test_sigterm_ends_the_process_while_a_load_hangs_in_initialize(run_server: Any, tmp_path: Path) -> None:
    """Explicit mode: a repository load whose ``initialize`` never returns; SIGTERM still ends
    the process (it used to log "Server stopped" and never exit)."""
    repo = _stuck_repo(tmp_path, hang_in_initialize=True)
    server = run_server("--model-repository", str(repo), "--model-control-mode", "explicit",
                        "--exit-timeout-secs", "1")
    url = server.wait_started()
    def load() -> None:
        with contextlib.suppress(OSError):  # the server exits before it answers
            _request(url, "POST", "/v2/repository/models/stuck/load")

    threading.Thread(target=load, daemon=True).start()
    wait_for(lambda: (repo / "stuck" / "initialize.started").exists(), what="initialize to begin")
    assert server.stop(timeout=60) == 1, server.stderr
    assert "1 model load(s)/unload(s)" in server.stderr and "Exit timeout expired" in server.stderr


def test_an_unload_returns_while_an_execute_hangs_and_other_calls_go_on(run_server: Any, tmp_path: Path) -> None:
    repo = _stuck_repo(tmp_path)
    write_model(repo, "slow", SLOW_MODEL)
    server = run_server("--model-repository", str(repo), "--model-control-mode", "explicit",
                        "--load-model", "stuck", "--load-model", "slow", "--exit-timeout-secs", "1")
    url = server.wait_started()
    _send_in_background(url, "stuck")
    wait_for(lambda: (repo / "stuck" / "execute.started").exists(), what="the execute to begin")
    assert _request(url, "POST", "/v2/repository/models/stuck/unload")[0] == 200  # returns, not blocks
    index = json.loads(_request(url, "POST", "/v2/repository/index")[1])
    assert {"name": "stuck", "version": "1", "state": "UNLOADING"} in index
    assert _request(url, "POST", "/v2/repository/models/slow/unload")[0] == 200  # another model's call
    assert _request(url, "POST", "/v2/repository/models/slow/load")[0] == 200
    (repo / "stuck" / "execute.started").unlink()
    assert _request(url, "POST", "/v2/repository/models/stuck/load")[0] == 200  # a reload is not blocked
    assert _request(url, "GET", "/v2/models/stuck/ready")[0] == 200
    assert server.stop(timeout=60) == 1, server.stderr  # the old version still executes at exit
    assert "model 'stuck' version 1" in server.stderr


GATED_PY = """
import os
import pathlib
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        folder = pathlib.Path(__file__).parent.parent
        (folder / "execute.started").write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not (folder / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(
            request, "INPUT0").as_numpy())]) for request in requests]
"""


def test_an_unload_while_a_frontend_replica_executes_lists_it_unloading(run_server: Any, tmp_path: Path) -> None:
    """The execute runs in the frontend's replica (the second connection): the unload returns
    after the exit timeout, the index says UNLOADING until that execute ends, then UNAVAILABLE,
    and the request is answered."""
    repo = tmp_path / "repo"
    model = write_model(repo, "gated", STUCK_CONFIG, files={"1/model.py": GATED_PY})
    server = run_server("--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", "gated",
                        "--exit-timeout-secs", "1", "--frontend-processes", "1", "--replicate-models", "auto")
    url = server.wait_started()
    held = _owner_connection(url)  # the owner's: it holds the fewest
    try:
        frontend = re.search(r"Started 1 frontend process\(es\): pids (\d+)", server.stderr)
        assert frontend is not None, server.stderr
        replicated = "model 'gated' version 1: replicated in frontend processes"
        wait_for(lambda: replicated in server.stderr, what="the replica decision")
        outcome = _send_in_background(url, "gated")  # a second connection: the frontend's
        started = model / "execute.started"
        wait_for(lambda: started.exists() and started.read_text() != "", what="the execute to begin")
        assert started.read_text() == frontend.group(1)
        assert _request(url, "POST", "/v2/repository/models/gated/unload")[0] == 200
        index = json.loads(_request(url, "POST", "/v2/repository/index")[1])
        assert index == [{"name": "gated", "version": "1", "state": "UNLOADING"}]
        (model / "release").touch()
        wait_for(lambda: "result" in outcome or "error" in outcome, what="the request's answer")
        assert "result" in outcome and outcome["result"].tolist() == [[1.0]], outcome

        def unloaded() -> bool:
            index = json.loads(_request(url, "POST", "/v2/repository/index")[1])
            return index == [{"name": "gated", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]

        wait_for(unloaded, what="the replica's unload to end")
    finally:
        held.close()
    assert server.stop(timeout=60) == 0, server.stderr


def _request(url: str, method: str, path: str) -> tuple[int, bytes]:
    import http.client

    host, port = url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        connection.request(method, path, body=b"" if method == "POST" else None)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize("implementation", ["pyserve", "grpcio"])
def test_run_grpc_server_choice_and_port_reuse_flags(run_server: Any, implementation: str) -> None:
    import tritonclient.grpc as grpcclient

    server = run_server("--grpc-server", implementation, "--reuse-grpc-port", "true", "--reuse-http-port", "true",
                        "--grpc-address", "127.0.0.1")
    server.wait_started()
    deadline = time.monotonic() + 30
    while not (match := re.search(r"Started GRPCInferenceService at \S+:(\d+)", server.stderr)):
        assert time.monotonic() < deadline, server.stderr
        time.sleep(0.05)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{match.group(1)}")
    try:
        assert client.is_server_ready()
    finally:
        client.close()
    assert server.stop(timeout=20) == 0, server.stderr


def test_tritonserver_tuning_flags_are_accepted_and_reported(run_server: Any) -> None:
    server = run_server("--http-thread-count", "16", "--pinned-memory-pool-byte-size", "268435456",
                        "--cuda-memory-pool-byte-size", "0:67108864", "--cuda-memory-pool-byte-size", "1:67108864",
                        "--rate-limit", "off", "--model-namespacing", "false", "--strict-readiness", "true")
    url = server.wait_started()
    with httpclient.InferenceServerClient(url) as client:
        assert client.is_server_ready()
    assert server.stop(timeout=20) == 0, server.stderr
    assert "--http-thread-count is accepted for Triton compatibility and has no effect" in server.stderr
    assert "--cuda-memory-pool-byte-size is accepted" in server.stderr


@pytest.mark.parametrize("flag, value", [("--model-namespacing", "true"), ("--allow-sagemaker", "true")])
def test_tritonserver_features_pyserve_lacks_are_refused_by_name(flag: str, value: str) -> None:
    done = pyserve("run", flag, value, "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0")
    assert done.returncode == 2
    assert f"pyserve: {flag} '{value}' is not supported by pyserve" in done.stderr


def test_rate_limit_flags_reach_the_server(tmp_path: Path) -> None:
    done = pyserve("run", "--model-repository", str(tmp_path), "--rate-limit", "execution_count",
                   "--rate-limit-resource", "R1", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0")
    assert done.returncode != 0
    assert "--rate-limit-resource 'R1': expected NAME:COUNT or NAME:COUNT:DEVICE" in done.stderr
    done = pyserve("run", "--model-repository", str(tmp_path), "--rate-limit", "sometimes")
    assert done.returncode == 2 and "--rate-limit: invalid choice: 'sometimes'" in done.stderr


def test_model_config_name_picks_each_models_named_config(run_server: Any, tmp_path: Path) -> None:
    from pyserve.testing import write_model

    config = ('backend: "identity"\nmax_batch_size: 4\n'
              'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
              'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n')
    model = write_model(tmp_path / "repo", "echo", config)
    (model / "configs").mkdir()
    (model / "configs" / "h100.pbtxt").write_text(config.replace("max_batch_size: 4", "max_batch_size: 16"))
    server = run_server("--model-repository", str(tmp_path / "repo"), "--model-config-name", "h100")
    url = server.wait_started()
    with httpclient.InferenceServerClient(url) as client:
        assert client.get_model_config("echo")["max_batch_size"] == 16
        np.testing.assert_array_equal(_infer_fp32(url, "echo", [1.0, 2.0]), [[1.0, 2.0]])
    assert server.stop(timeout=20) == 0, server.stderr
    done = pyserve("validate", "--model-config-name", "h100", str(tmp_path / "repo"))
    assert done.returncode == 0, done.stdout + done.stderr
    for command in ("run", "validate"):
        done = pyserve(command, "--model-config-name", "../h100", str(tmp_path / "repo"))
        assert done.returncode == 2
        assert "--model-config-name must be a file name without '.pbtxt' (got '../h100')" in done.stderr


FAILING_INIT = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("weights file is corrupt")

    def execute(self, requests):
        return []
"""


def test_a_model_that_fails_to_load_stops_the_server_by_default(tmp_path: Path, run_server: Any) -> None:
    """``--exit-on-error`` defaults to true, as Triton's: the server exits non-zero with the
    model's error; ``--exit-on-error false`` serves the other models."""
    repo = tmp_path / "repo"
    write_model(repo, "broken", 'backend: "python"\nmax_batch_size: 0\n'
                'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\n', files={"1/model.py": FAILING_INIT})
    write_model(repo, "fine", 'backend: "identity"\nmax_batch_size: 0\n'
                'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
    stopped = run_server("--model-repository", str(repo))
    assert stopped.process.wait(120) == 1
    stopped._reader.join(60)
    assert "failed to load all models" in stopped.stderr
    assert "'broken' version 1" in stopped.stderr and "weights file is corrupt" in stopped.stderr
    assert stopped.port is None  # it never listened
    serving = run_server("--model-repository", str(repo), "--exit-on-error", "false")
    url = serving.wait_started(120)
    with httpclient.InferenceServerClient(url) as client:
        assert client.is_model_ready("fine") and not client.is_model_ready("broken")
    assert serving.stop(EXIT_TIMEOUT + 30) == 0


def test_id_names_the_server_in_metadata_for_clients_that_check_for_triton(run_server: Any) -> None:
    """Triton's client examples check ``server_metadata.name == "triton"``: ``--id triton``
    makes pyserve answer so over HTTP and gRPC (the default name is ``pyserve``)."""
    import tritonclient.grpc as grpcclient

    server = run_server("--id", "triton", "--grpc-port", "0")
    url = server.wait_started(120)
    with httpclient.InferenceServerClient(url) as client:
        assert client.get_server_metadata()["name"] == "triton"
    grpc_port = next(int(m.group(1)) for line in server.lines
                     if (m := re.search(r"Started GRPCInferenceService at \S+:(\d+)", line)))
    with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
        assert client.get_server_metadata().name == "triton"
    assert server.stop(EXIT_TIMEOUT + 30) == 0


def test_strict_readiness_off_is_ready_with_a_failed_model(tmp_path: Path) -> None:
    from pyserve.testing import serve, write_model

    write_model(tmp_path / "repo", "broken", 'backend: "no_such_backend"\nmax_batch_size: 0\n')
    write_model(tmp_path / "repo", "fine", 'backend: "identity"\nmax_batch_size: 0\n'
                'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
    for strict, expected in ((True, False), (False, True)):
        with serve(tmp_path / "repo", strict_readiness=strict) as thread:
            assert thread.server.dataplane.model_ready("fine")
            with httpclient.InferenceServerClient(thread.url) as client:
                assert client.is_server_live()
                assert client.is_server_ready() is expected


def test_model_load_retry_count_retries_a_failed_load(tmp_path: Path) -> None:
    from pyserve import Backend
    from pyserve.testing import serve, write_model

    class FlakyBackend(Backend):
        """``create_model`` fails the first ``failures`` times it is called."""

        def __init__(self, failures: int) -> None:
            self.failures = failures
            self.calls = 0

        def create_model(self, model: Any) -> Any:
            self.calls += 1
            if self.calls <= self.failures:
                raise RuntimeError(f"transient failure {self.calls}")
            return None

        def execute(self, instance: Any, requests: Any) -> Any:
            raise AssertionError("no request reaches this model")

    write_model(tmp_path / "repo", "flaky", 'backend: "flaky"\nmax_batch_size: 0\n'
                'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
    for retries, ready in ((0, False), (1, False), (2, True)):
        backend = FlakyBackend(failures=2)
        with serve(tmp_path / "repo", backends={"flaky": backend}, model_load_retry_count=retries) as thread:
            assert thread.server.dataplane.model_ready("flaky") is ready
            assert backend.calls == min(retries + 1, 3)


@pytest.mark.parametrize("value", ["nan", "inf", "-5"])
def test_exit_timeout_must_be_a_number_of_seconds(value: str) -> None:
    result = pyserve("run", "--http-port", "0", f"--exit-timeout-secs={value}")
    assert result.returncode == 2
    assert "--exit-timeout-secs must be a number of seconds >= 0" in result.stderr


SLOW_READY_PY = """
import os
import pathlib
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model = pathlib.Path(args["model_repository"])

    def is_ready(self):
        (self.model / f"ready.{os.getpid()}").touch()
        for _ in range(1200):  # until the test releases it (60 s at most)
            if (self.model / "release").exists():
                break
            time.sleep(0.05)
        return True

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", r.inputs()[0].as_numpy())]) for r in requests]
"""


def test_a_model_ready_question_checks_the_owner_and_its_replicas_at_once(run_server: Any, tmp_path: Path) -> None:
    """A slow ``is_ready()`` in a model replicated in a frontend process: the owner's check and
    the replica's run at the same time (Triton's test_is_ready_takes_long_time: one after the
    other, a later question found no check in flight in the replica and waited for a new one)."""
    repo = tmp_path / "repo"
    model = write_model(repo, "slow_ready", STUCK_CONFIG, files={"1/model.py": SLOW_READY_PY})
    server = run_server("--model-repository", str(repo), "--frontend-processes", "1", "--replicate-models", "auto")
    url = server.wait_started()
    answers: list[int] = []
    asked = threading.Thread(target=lambda: answers.append(_request(url, "GET", "/v2/models/slow_ready/ready")[0]),
                             daemon=True)
    asked.start()
    try:
        wait_for(lambda: len(list(model.glob("ready.*"))) == 2, what="is_ready() running in both processes",
                 detail=lambda: server.stderr)
    finally:
        (model / "release").touch()
    asked.join(60)
    assert answers == [200]  # both checks passed within the readiness timeout
