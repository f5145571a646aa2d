"""The logging and trace extensions under frontend processes: an update applies to every process.

``POST /v2/logging`` is answered by the owner, which passes the new settings on to its frontend
processes, and to a frontend that starts later (a restart after a crash), so a replica's log
lines follow them as the owner's do. While the trace settings may trace a model, frontends hand
its requests to the owner, which samples them as one process would, so every request that
should be traced is. The ``talker said`` lines come from a Python model's ``pb_utils.Logger``
executing in the process that answered; each carries the writer's pid.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from geventhttpclient.response import HTTPConnectionClosed
from suite_support import RunningServer, python_echo_config, wait_for, write_model

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="frontend processes run on Linux")

TALKER_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            pb_utils.Logger.log_info(f"talker said {int(values[0][0])}")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", values)]))
        return responses
'''

SAID = re.compile(r'^(?P<head>.*?)(?P<pid>\d+) \S+\] "talker said (?P<value>\d+)"$')
ISO8601 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ I $")


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., RunningServer]]:
    """``start(*flags)``: ``pyserve run`` with one frontend process on a repository of ``talker``."""
    repo = tmp_path / "repo"
    write_model(repo, "talker", python_echo_config("talker"), {"1/model.py": TALKER_PY})
    started: list[RunningServer] = []

    def run(*flags: str) -> RunningServer:
        started.append(RunningServer(["--model-repository", str(repo), "--frontend-processes", "1", *flags]))
        started[-1].wait_started(timeout=120)
        return started[-1]

    yield run
    for running in started:
        running.close()


def _said(server: RunningServer) -> dict[int, tuple[str, int]]:
    """Value → (the line's head before the pid, the pid) of every ``talker said`` line."""
    found = {}
    for line in list(server.lines):
        match = SAID.match(line.rstrip("\n"))
        if match:
            found[int(match["value"])] = (match["head"], int(match["pid"]))
    return found


def _post(url: str, path: str, settings: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(f"http://{url}{path}", data=json.dumps(settings).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def _post_logging(url: str, settings: dict[str, object]) -> dict[str, object]:
    return _post(url, "/v2/logging", settings)


def _say(url: str, values: range) -> None:
    """Each value from a client of its own, four connections open at a time (the balancer
    gives every other one to the frontend)."""
    values = list(values)
    for start in range(0, len(values), 4):
        clients = [httpclient.InferenceServerClient(url) for _ in values[start:start + 4]]
        try:
            for client, value in zip(clients, values[start:start + 4]):
                tensor = httpclient.InferInput("INPUT0", [1, 1], "FP32")
                tensor.set_data_from_numpy(np.array([[value]], dtype=np.float32))
                client.infer("talker", [tensor])
        finally:
            for client in clients:
                client.close()


def _writers(server: RunningServer, values: range) -> set[int]:
    """The pids that said ``values`` (every one of them must have been said)."""
    wait_for(lambda: all(v in _said(server) for v in values), what=f"the lines of {values}")
    said = _said(server)
    return {said[v][1] for v in values}


def test_a_logging_update_reaches_the_frontend_and_its_restart(start: Callable[..., RunningServer]) -> None:
    server = start()
    url = f"127.0.0.1:{server.port}"
    owner = server.server_pid
    _say(url, range(0, 8))
    wait_for(lambda: len(_said(server)) == 8, what="eight lines")
    writers = {pid for _, pid in _said(server).values()}
    assert owner in writers and len(writers) == 2, server.stderr  # the replica in the frontend said some
    [frontend] = writers - {owner}

    assert _post_logging(url, {"log_info": False})["log_info"] is False
    _say(url, range(100, 108))
    assert _post_logging(url, {"log_info": True, "log_format": "ISO8601"})["log_format"] == "ISO8601"
    _say(url, range(200, 208))
    wait_for(lambda: sum(v >= 200 for v in _said(server)) == 8, what="the lines said after log_info came back")
    said = _said(server)
    assert not [v for v in said if 100 <= v < 108], server.stderr  # neither process logged INFO meanwhile
    assert {pid for v, (_, pid) in said.items() if v >= 200} == {owner, frontend}
    assert all(ISO8601.match(head) for v, (head, _) in said.items() if v >= 200), server.stderr

    os.kill(frontend, signal.SIGKILL)  # the owner starts another, with the settings of its start
    value = 300

    def a_new_frontend_said() -> bool:
        nonlocal value
        value += 4
        try:
            _say(url, range(value - 4, value))
        except (OSError, HTTPConnectionClosed):  # a connection passed before the owner saw the frontend die
            return False
        return any(pid not in (owner, frontend) for v, (_, pid) in _said(server).items() if v >= 300)

    wait_for(a_new_frontend_said, timeout=120, what="the restarted frontend's replica answers")
    assert all(ISO8601.match(head) for v, (head, _) in _said(server).items() if v >= 300), server.stderr
    assert server.stop(timeout=60) == 0, server.stderr


def test_traced_models_are_answered_by_the_owner_which_samples_them(start: Callable[..., RunningServer],
                                                                    tmp_path: Path) -> None:
    """Trace settings that trace ``talker`` send its requests to the owner: every one is traced
    (rate 1), and a count that runs out gives them back to the replicas, as does a model's own
    ``OFF``; the trace file has exactly the requests that were to be traced."""
    trace_file = tmp_path / "trace.json"
    server = start("--trace-config", f"triton,file={trace_file}")
    url, owner = f"127.0.0.1:{server.port}", server.server_pid
    _say(url, range(0, 8))
    assert len(_writers(server, range(0, 8))) == 2  # level OFF: the replica answers its connections

    _post(url, "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    _say(url, range(100, 108))
    assert _writers(server, range(100, 108)) == {owner}
    _post(url, "/v2/models/talker/trace/setting", {"trace_level": ["OFF"]})
    _say(url, range(200, 208))
    assert len(_writers(server, range(200, 208))) == 2

    _post(url, "/v2/models/talker/trace/setting", {"trace_level": None})  # the global settings again
    _post(url, "/v2/trace/setting", {"trace_count": "2"})
    value = 300

    def the_replica_answers_again() -> bool:
        nonlocal value
        _say(url, range(value, value + 4))
        value += 4
        return _writers(server, range(value - 4, value)) != {owner}

    wait_for(the_replica_answers_again, timeout=120, what="the replica answers once the count ran out")
    assert server.stop(timeout=60) == 0, server.stderr
    traces = json.loads(trace_file.read_text())
    assert sum(1 for trace in traces if trace.get("model_name") == "talker") == 8 + 2
