"""A model that crashes the server process: ``pyserve run``'s keeper (``pyserve.handoff.keeper``)
starts it again, the ports keep taking connections meanwhile, and the log names the model.

Real ``pyserve run`` processes; the crashing ``model.py`` calls ``os._exit(7)`` or dereferences
a null pointer (SIGSEGV) when its input is negative.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from suite_support import RunningServer, wait_for, write_model

from pyserve.handoff import rundir

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the keeper runs on Linux")

CRASH_MODEL = """
import ctypes
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        values = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        for value in values:
            if value[0] < 0:
                HOW
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", v)]) for v in values]
"""

HOW = {"exit": "os._exit(7)", "segfault": "ctypes.string_at(0)"}

CONFIG = """
    backend: "python"
    max_batch_size: 0
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
    output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def _repository(root: Path, how: str) -> Path:
    repo = root / "repo"
    write_model(repo, "crash", CONFIG, {"1/model.py": CRASH_MODEL.replace("HOW", HOW[how])})
    write_model(repo, "calm", CONFIG, {"1/model.py": CRASH_MODEL.replace("HOW", "pass")})
    return repo


def _infer(url: str, model: str, value: float) -> np.ndarray:
    client = httpclient.InferenceServerClient(url, network_timeout=120, connection_timeout=120)
    try:
        tensor = httpclient.InferInput("INPUT0", [1], "FP32")
        tensor.set_data_from_numpy(np.array([value], dtype=np.float32))
        return client.infer(model, [tensor]).as_numpy("OUTPUT0")
    finally:
        client.close()


@pytest.fixture
def servers() -> Iterator[list[RunningServer]]:
    started: list[RunningServer] = []
    yield started
    for server in started:
        server.close()


@pytest.mark.parametrize(("how", "status"), [("exit", "exited with status 7"), ("segfault", "was killed by SIGSEGV")])
def test_a_crashing_model_brings_the_server_back(servers: list[RunningServer], tmp_path: Path, how: str,
                                                  status: str) -> None:
    server = RunningServer(["--model-repository", str(_repository(tmp_path, how)), "--frontend-processes", "0"])
    servers.append(server)
    url = server.wait_started(timeout=120)
    first = server.server_pid
    np.testing.assert_array_equal(_infer(url, "calm", 1.0), [1.0])
    with pytest.raises(Exception):  # noqa: B017 - the connection is reset, however the client words it
        _infer(url, "crash", -1.0)
    # the port never refuses a connection: the keeper holds it, the next server answers
    host, port = url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60):
        pass
    np.testing.assert_array_equal(_infer(url, "calm", 2.0), [2.0])
    np.testing.assert_array_equal(_infer(url, "crash", 3.0), [3.0])
    wait_for(lambda: server.starts == 2, timeout=60, what="the second 'Started HTTPService'")
    assert server.server_pid != first and server.process.poll() is None
    assert (f"the server process (pid {first}) {status}; it was executing model 'crash' version 1 "
            "instance 'crash_0'. Starting it again in 1 s") in server.stderr, server.stderr
    assert server.stop(timeout=60) == 0, server.stderr


def test_a_crash_in_a_frontend_names_the_model(servers: list[RunningServer], tmp_path: Path) -> None:
    server = RunningServer(["--model-repository", str(_repository(tmp_path, "exit")), "--frontend-processes", "1",
                            "--log-verbose", "1"])
    servers.append(server)
    url = server.wait_started(timeout=120)
    owner = server.server_pid
    # the frontend reports its ready replicas just after the start; until then it hands requests
    # to the owner, where the crash would restart the whole server (the verbose log shows the report)
    wait_for(lambda: re.search(r"frontend \d+ answers 2 model version\(s\) with its own replicas", server.stderr)
             is not None, timeout=120, what="the frontend's report of its replicas", detail=lambda: server.stderr)
    clients = [httpclient.InferenceServerClient(url, network_timeout=60) for _ in range(2)]
    try:  # the second connection is the frontend's (the owner wins ties); its replica crashes
        tensor = httpclient.InferInput("INPUT0", [1], "FP32")
        tensor.set_data_from_numpy(np.array([1.0], dtype=np.float32))
        clients[0].infer("crash", [tensor])
        tensor.set_data_from_numpy(np.array([-1.0], dtype=np.float32))
        with pytest.raises(Exception):  # noqa: B017
            clients[1].infer("crash", [tensor])
    finally:
        for client in clients:
            client.close()
    wait_for(lambda: "exited with status 7; it was executing model 'crash' version 1 instance 'crash_0'; "
             "starting it again" in server.stderr, timeout=60, what="the frontend's crash in the log",
             detail=lambda: server.stderr)
    np.testing.assert_array_equal(_infer(url, "crash", 4.0), [4.0])
    assert server.server_pid == owner, "the owner itself was restarted"
    assert server.stop(timeout=60) == 0, server.stderr


def test_a_startup_failure_is_not_retried(servers: list[RunningServer], tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = RunningServer(["--model-repository", str(_repository(tmp_path, "exit")), "--metrics-port", str(port),
                                "--allow-metrics", "true"])
        servers.append(server)
        assert server.process.wait(60) == 1
    assert "Metrics service cannot listen on 127.0.0.1" in server.stderr and "Starting it again" not in server.stderr


def test_the_server_stops_when_the_keeper_is_killed(servers: list[RunningServer], tmp_path: Path) -> None:
    server = RunningServer(["--model-repository", str(_repository(tmp_path, "exit")), "--frontend-processes", "0"])
    servers.append(server)
    server.wait_started(timeout=120)
    child = server.server_pid
    assert child is not None and child != server.process.pid
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and Path(f"/proc/{child}").exists():
        state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in ("Z", "X"):
            break
        time.sleep(0.1)
    else:
        if Path(f"/proc/{child}").exists():
            os.kill(child, signal.SIGKILL)
            raise AssertionError("the server outlived its keeper")


HANG_MODEL = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(3600)
"""


def test_a_stuck_model_cannot_keep_pyserve_run_from_exiting(servers: list[RunningServer], tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "stuck", CONFIG, {"1/model.py": HANG_MODEL})
    server = RunningServer(["--model-repository", str(repo), "--frontend-processes", "0", "--exit-timeout-secs", "1"])
    servers.append(server)
    url = server.wait_started(timeout=120)
    client = httpclient.InferenceServerClient(url, network_timeout=300)
    tensor = httpclient.InferInput("INPUT0", [1], "FP32")
    tensor.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    pending = client.async_infer("stuck", [tensor])
    wait_for(lambda: Path(f"/proc/{server.server_pid}").exists(), timeout=10, what="the server process")
    time.sleep(0.5)  # the request is inside its execute by now (a missed one just stops sooner)
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(120)  # exit timeout 1 s, then at most 15 s before the keeper kills it
    assert code in (0, 1, 128 + signal.SIGKILL), server.stderr
    with pytest.raises(Exception):  # noqa: B017 - the stuck request is never answered
        pending.get_result(timeout=5)
    client.close()


def test_the_keepers_program_imports_no_server_module() -> None:
    """``python -m pyserve.handoff.keeper`` loads only the standard library and the few pyserve
    modules it names, so that the process that holds the ports stays small."""
    import subprocess

    probe = ("import sys, pyserve.handoff.keeper; "
             "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('pyserve', 'numpy', 'grpc'))))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert set(loaded.stdout.split()) == {
        "pyserve", "pyserve.logs", "pyserve.frontends", "pyserve.frontends.tcp", "pyserve.handoff",
        "pyserve.handoff.forked", "pyserve.handoff.keeper", "pyserve.handoff.rundir", "pyserve.runtime",
        "pyserve.runtime.execution_board", "pyserve.runtime.startup_gc"}, loaded.stdout


def test_the_keeper_is_small_and_starts_the_default_layout_again(servers: list[RunningServer],
                                                                tmp_path: Path) -> None:
    """Under the default layout (owner and a frontend), the keeper is the small program (no
    numpy, no gRPC, no models in its memory); an owner killed with -9 is started again as a
    fresh ``pyserve run`` on the same port, with its frontend; the keeper removes the hand-off
    folder the killed owner left, and the new owner removes its own when it stops."""
    server = RunningServer(["--model-repository", str(_repository(tmp_path, "exit")), "--frontend-processes", "1"])
    servers.append(server)
    url = server.wait_started(timeout=120)
    keeper, owner = server.process.pid, server.server_pid
    assert owner is not None and owner != keeper
    wait_for(lambda: "pyserve.handoff.keeper" in Path(f"/proc/{keeper}/cmdline").read_text(), timeout=60,
             what="the keeper's small program")
    mapped = Path(f"/proc/{keeper}/maps").read_text()
    assert "_multiarray_umath" not in mapped and "cygrpc" not in mapped, "the keeper holds the server's modules"
    np.testing.assert_array_equal(_infer(url, "calm", 1.0), [1.0])
    assert len(_handoff_folders(owner)) == 1
    os.kill(owner, signal.SIGKILL)
    wait_for(lambda: server.starts == 2, timeout=120, what="the second 'Started HTTPService'")
    second = server.server_pid
    assert second is not None and second not in (owner, keeper)
    assert _handoff_folders(owner) == [] and len(_handoff_folders(second)) == 1
    for value in (2.0, 3.0, 4.0):  # new connections, spread over the new owner and its frontend
        np.testing.assert_array_equal(_infer(url, "calm", value), [value])
    assert server.stderr.count("Started 1 frontend process(es)") == 2, server.stderr
    assert (f"the server process (pid {owner}) was killed by SIGKILL; no model was executing. "
            "Starting it again in 1 s") in server.stderr, server.stderr
    assert server.stop(timeout=60) == 0, server.stderr
    assert _handoff_folders(second) == []


def _handoff_folders(pid: int) -> list[Path]:
    """The hand-off folders of the owner ``pid`` (``pyserve.handoff.rundir``)."""
    return sorted(Path(tempfile.gettempdir()).glob(f"{rundir.PREFIX}{pid}-*"))


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]


def _interpreter_options(pid: int) -> str:
    """The options before ``-m`` on ``pid``'s command line, joined (``-W x`` may read ``-Wx``)."""
    line = _cmdline(pid)
    return " ".join(line[1:line.index("-m")]).replace("-W ", "-W")


def test_a_server_started_again_runs_under_the_interpreter_options_pyserve_run_had(
        servers: list[RunningServer], tmp_path: Path) -> None:
    """``python -X faulthandler -W error::SyntaxWarning -m pyserve run``: the keeper's small
    program and the server it starts after a crash run with the same interpreter options. The
    owner is killed as soon as it says it serves: a death from that line on is a crash."""
    options = ["-X", "faulthandler", "-W", "error::SyntaxWarning"]
    server = RunningServer(["--model-repository", str(_repository(tmp_path, "exit")), "--frontend-processes", "1"],
                           command=(sys.executable, *options, "-m", "pyserve"))
    servers.append(server)
    url = server.wait_started(timeout=120)
    keeper, owner = server.process.pid, server.server_pid
    assert owner is not None
    wait_for(lambda: "pyserve.handoff.keeper" in _cmdline(keeper), timeout=60, what="the keeper's small program")
    assert "-X faulthandler" in _interpreter_options(keeper) and "-Werror::SyntaxWarning" in _interpreter_options(keeper)
    os.kill(owner, signal.SIGKILL)
    wait_for(lambda: server.starts == 2, timeout=120, what="the second 'Started HTTPService'")
    restarted = server.server_pid
    assert restarted is not None and restarted not in (owner, keeper)
    again = _cmdline(restarted)
    assert again[again.index("-m") + 1] == "pyserve", again[:8]
    assert "-X faulthandler" in _interpreter_options(restarted), again[:8]
    assert "-Werror::SyntaxWarning" in _interpreter_options(restarted), again[:8]
    np.testing.assert_array_equal(_infer(url, "calm", 1.0), [1.0])
    assert server.stop(timeout=60) == 0, server.stderr


SLOW_MODEL = """
import time


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(120)

    def execute(self, requests):
        return []
"""


def test_a_server_killed_before_it_serves_is_not_started_again_and_the_keeper_says_so(
        servers: list[RunningServer], tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "slow", CONFIG, {"1/model.py": SLOW_MODEL})
    server = RunningServer(["--model-repository", str(repo), "--frontend-processes", "0"])
    servers.append(server)
    keeper = server.process.pid
    children = Path(f"/proc/{keeper}/task/{keeper}/children")
    wait_for(lambda: children.read_text().split(), timeout=60, what="the server process")
    loading = int(children.read_text().split()[0])
    wait_for(lambda: server.lines, timeout=60, what="the server's first log line")
    os.kill(loading, signal.SIGKILL)
    assert server.process.wait(60) == 128 + signal.SIGKILL
    server._reader.join(10)
    assert (f"the server process (pid {loading}) was killed by SIGKILL before it served; "
            "not starting it again") in server.stderr, server.stderr
    assert "Starting it again" not in server.stderr


EMBEDDED = "import sys; from pyserve.cli.main import main; code = main(sys.argv[1:]); print('returned', code, file=sys.stderr)"


def test_a_program_that_calls_main_gets_its_process_back(servers: list[RunningServer], tmp_path: Path) -> None:
    """``pyserve.cli.main.main(["run", ...])`` called by another program keeps the server from that
    program's process (no ``exec`` into the small keeper) and returns the server's status."""
    server = RunningServer(["--model-repository", str(_repository(tmp_path, "exit"))],
                           command=(sys.executable, "-c", EMBEDDED))
    servers.append(server)
    url = server.wait_started(timeout=120)
    np.testing.assert_array_equal(_infer(url, "calm", 1.0), [1.0])
    assert "pyserve.handoff.keeper" not in Path(f"/proc/{server.process.pid}/cmdline").read_text()
    assert server.stop(timeout=60) == 0, server.stderr
    assert "returned 0" in server.stderr, server.stderr


def test_the_keeper_logs_where_and_how_the_server_logs(servers: list[RunningServer], tmp_path: Path) -> None:
    """With --log-file and --log-format, the keeper's line about a crash goes to the same file in
    the same format as the server's lines, also after the keeper became its small program."""
    log_file = tmp_path / "pyserve.log"
    server = RunningServer(["--model-repository", str(_repository(tmp_path, "exit")), "--frontend-processes", "0",
                            "--log-file", str(log_file), "--log-format", "ISO8601"])
    servers.append(server)

    def started() -> list[str]:
        text = log_file.read_text() if log_file.exists() else ""
        return [line for line in text.splitlines() if "Started HTTPService" in line]

    wait_for(lambda: len(started()) == 1, timeout=120, what="'Started HTTPService' in the log file")
    first = int(started()[0].split()[2])  # ISO8601: <time> <level> <pid> <file:line>] <message>
    wait_for(lambda: "pyserve.handoff.keeper" in Path(f"/proc/{server.process.pid}/cmdline").read_text(),
             timeout=60, what="the keeper's small program")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: len(started()) == 2, timeout=120, what="the second 'Started HTTPService' in the log file")
    crash = [line for line in log_file.read_text().splitlines() if "Starting it again" in line]
    assert len(crash) == 1 and crash[0][:4] == started()[0][:4] and crash[0].split()[1] == "E", crash
    assert f" {server.process.pid} keeper.py:" in crash[0] and f"(pid {first}) was killed by SIGKILL" in crash[0]
    assert server.stop(timeout=60) == 0, log_file.read_text()


def _alive_with(text: str) -> list[int]:
    """The running processes (not zombies) whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_text() and "Z" not in (entry / "stat").read_text().rsplit(")", 1)[1][:3]:
                    found.append(int(entry.name))
            except (OSError, IndexError):
                continue
    return found


@pytest.mark.parametrize("after", ["start", "ready"])
def test_a_stop_asked_at_once_is_honoured(servers: list[RunningServer], tmp_path: Path, after: str) -> None:
    """SIGTERM sent while ``pyserve run`` starts (before, during or after the keeper becomes
    its small program), or once it serves, stops it, and no process of it is left."""
    repo = _repository(tmp_path, "exit")
    server = RunningServer(["--model-repository", str(repo)])
    servers.append(server)
    if after == "ready":
        server.wait_started(timeout=120)
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(120)
    assert code in (0, 128 + signal.SIGTERM, -signal.SIGTERM), server.stderr
    wait_for(lambda: not _alive_with(str(repo)), timeout=60, what="every process of pyserve run to exit")


def test_only_the_folders_of_the_exited_process_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = Path(rundir.make())
    assert mine.parent == tmp_path and mine.name.startswith(f"{rundir.PREFIX}{os.getpid()}-")
    (mine / "handoff.sock").write_bytes(b"")
    other = tmp_path / f"{rundir.PREFIX}{os.getpid()}1-abc"  # another pid with the same digits first
    other.mkdir()
    stray = tmp_path / f"{rundir.PREFIX}{os.getpid()}-file"  # not a folder
    stray.write_bytes(b"")
    assert rundir.remove_left_by(os.getpid() + 7) == []
    assert rundir.remove_left_by(os.getpid()) == [str(mine)]
    assert not mine.exists() and other.is_dir() and stray.is_file()
