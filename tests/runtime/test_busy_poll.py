"""``--busy-poll-us``: after an inline execute answers, the loop polls instead of sleeping.

Checked on real servers by what the loop did (``busy_poll.COUNTS``: windows started, loop turns
spent polling, windows not over yet), never by how much time or CPU it took: after an inline
model answered, a window starts and the loop turns over polling until it ends; a model on
instance threads, a server without the option, or requests from several clients at once start
no window. The setting reaches frontend processes (their replicas
execute on their own loops), is restored when the server stops, and bad values are refused by
name. A client's first request on a new connection counts as another client's
(``pyserve.runtime.scheduling.client_activity``), so each check sends one request first and waits out that window.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from suite_support import ECHO_MODEL_PY, python_echo_config, wait_for

from pyserve.runtime.scheduling import busy_poll, client_activity
from pyserve.server.core import StartupError
from pyserve.testing import serve, write_model

INLINE = 'parameters { key: "pyserve_inline_execute" value { string_value: "true" } }'

WINDOW_US = 400_000
"""Long enough to tell polling (a busy core) from sleeping on a loaded 2-core machine."""



def _repository(root: Path, batching: bool = False) -> Path:
    repo = root / "repo"
    write_model(repo, "inline", python_echo_config("inline", INLINE + ("\ndynamic_batching { }" if batching else "")),
                {"1/model.py": ECHO_MODEL_PY})
    write_model(repo, "threaded", python_echo_config("threaded"), {"1/model.py": ECHO_MODEL_PY})
    return repo


def _infer(client: httpclient.InferenceServerClient, model: str) -> None:
    values = np.arange(4, dtype=np.float32).reshape(1, 4)
    tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    tensor.set_data_from_numpy(values)
    assert np.array_equal(client.infer(model, [tensor]).as_numpy("OUTPUT0"), values)


def _back_to_back(client: httpclient.InferenceServerClient, model: str) -> None:
    """Requests sent at once after each answer, until the answer to one that came within the
    window of the previous answer has started a window (the first after a pause starts none)."""
    for _ in range(3):
        _infer(client, model)


def _client(url: str) -> httpclient.InferenceServerClient:
    """A client whose connection has sent a request, and the client window since passed."""
    client = httpclient.InferenceServerClient(url)
    _infer(client, "threaded")
    time.sleep(2 * client_activity.WINDOW_NS / 1e9)
    return client


def _window_after(action: Callable[[], None]) -> tuple[int, int]:
    """Windows started and polling turns taken by ``action`` and the windows it started (waited
    for to end)."""
    wait_for(lambda: busy_poll.COUNTS.active == 0, what="earlier windows to end")
    windows, turns = busy_poll.COUNTS.windows, busy_poll.COUNTS.turns
    action()
    wait_for(lambda: busy_poll.COUNTS.active == 0, what="the window to end")
    return busy_poll.COUNTS.windows - windows, busy_poll.COUNTS.turns - turns


@pytest.mark.parametrize("batching", [False, True], ids=["inline", "inline-batcher"])
def test_the_loop_polls_for_the_window_after_an_inline_answer(tmp_path: Path, batching: bool) -> None:
    with serve(_repository(tmp_path, batching), busy_poll_us=WINDOW_US, frontend_processes=0) as server, \
            _client(server.url) as client:
        assert busy_poll.window_us() == WINDOW_US
        windows, turns = _window_after(lambda: _back_to_back(client, "inline"))
        assert windows >= 1 and turns >= 2, (windows, turns)  # polled over several loop turns, then stopped
        assert busy_poll.COUNTS.active == 0, "polling did not stop"
        assert _window_after(lambda: _infer(client, "threaded")) == (0, 0), "a threaded model made the loop poll"
    assert busy_poll.window_us() == 0, "the setting outlived the server"


def test_no_polling_while_several_clients_send_requests(tmp_path: Path) -> None:
    """Requests over two connections: the loop is seldom idle then, and polling would only take
    CPU from the clients and other processes. One client alone again: polling comes back."""
    with serve(_repository(tmp_path), busy_poll_us=WINDOW_US, frontend_processes=0) as server, \
            _client(server.url) as first, _client(server.url) as second:

        def both() -> None:
            for _ in range(3):
                _infer(first, "inline")
                _infer(second, "inline")

        windows, _ = _window_after(both)
        assert windows == 0, "the loop polled for two clients"
        time.sleep(2 * client_activity.WINDOW_NS / 1e9)  # the two-client window passes
        windows, turns = _window_after(lambda: _back_to_back(second, "inline"))
        assert windows >= 1 and turns >= 2, "one client again, yet the loop did not poll"


def test_off_by_default(tmp_path: Path) -> None:
    with serve(_repository(tmp_path), frontend_processes=0) as server, _client(server.url) as client:
        assert _window_after(lambda: _infer(client, "inline")) == (0, 0)


def test_frontend_processes_get_the_window(tmp_path: Path) -> None:
    """A frontend's replicas execute on its own loop, which polls as the owner's does: the
    window reaches every frontend process with its settings (``busy_poll.configure`` there; the
    polling itself is what the tests above check, per process)."""
    with serve(_repository(tmp_path), frontend_processes=1, replicate_models="auto",
               busy_poll_us=WINDOW_US) as server:
        assert server.server.frontends is not None
        [frontend] = server.server.frontends.pids
        arguments = Path(f"/proc/{frontend}/cmdline").read_bytes().split(b"\0")
        settings = json.loads(arguments[arguments.index(b"pyserve.handoff.frontend") + 1])
        assert settings["busy_poll_us"] == WINDOW_US


@pytest.mark.parametrize("value", [-1, 1_000_001])
def test_bad_windows_are_refused(tmp_path: Path, value: int) -> None:
    with pytest.raises(StartupError, match="--busy-poll-us must be between 0 and 1000000"):
        with serve(_repository(tmp_path), busy_poll_us=value):
            pass
    assert busy_poll.window_us() == 0


@pytest.mark.parametrize("value", ["-5", "fast", "2000000"])
def test_the_cli_names_the_flag(tmp_path: Path, value: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pyserve", "run", "--model-repository", str(tmp_path), "--busy-poll-us", value],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "--busy-poll-us" in result.stderr and value in result.stderr
