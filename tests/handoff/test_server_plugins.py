"""Server plugins under frontend processes.

A plugin object handed to an embedded server (``serve(..., server_plugins=[...])``,
``PluginHost(server_plugins=...)``) exists in that process only: a frontend's replica would
execute past it. While one wraps ``pyserve_execute``, ``--replicate-models auto`` replicates
nothing, the frontends hand their requests to the owner, and the plugin sees every execute.
Plugins read from entry points load in every process and do not hold replication back; they
hear of each model version's load and unload once, from the owner, not again for each
frontend's replica.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from suite_support import ECHO_MODEL_PY, python_echo_config, wait_for

import pyserve
from pyserve.host.plugins import PluginHost
from pyserve.server.core import ServerThread
from pyserve.testing import BatchRecorder, serve, write_model


class ReadyCounter:
    """A server plugin that does not wrap execute."""

    def __init__(self) -> None:
        self.ready: list[str] = []

    @pyserve.hookimpl
    def pyserve_model_ready(self, model: Any) -> None:
        self.ready.append(model.name)


WRAPPER_PLUGIN = '''
import pyserve

class Wrapper:
    @pyserve.hookimpl(wrapper=True)
    def pyserve_execute(self, instance, requests):
        return (yield)

plugin = Wrapper()
'''

OBSERVER_PLUGIN = '''
import os
import pyserve

class Observer:
    """Appends "<hook> <model> <pid>" to the file PROBE_EVENTS names."""

    def _write(self, hook, model):
        with open(os.environ["PROBE_EVENTS"], "a") as events:
            events.write(f"{hook} {model.name} {os.getpid()}\\n")

    @pyserve.hookimpl
    def pyserve_model_ready(self, model):
        self._write("ready", model)

    @pyserve.hookimpl
    def pyserve_model_unloaded(self, model):
        self._write("unloaded", model)

plugin = Observer()
'''


def _install_plugin(site: Path, name: str, source: str) -> None:
    """An installed distribution (``.dist-info`` in ``site``) whose ``pyserve.plugins`` entry
    point ``name`` is the ``plugin`` object of module ``probe_<name>`` (``source``)."""
    (site / f"probe_{name}.py").write_text(source)
    info = site / f"probe_{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: probe-{name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[pyserve.plugins]\n{name} = probe_{name}:plugin\n")


def test_the_host_names_the_execute_wrappers_that_live_in_this_process(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _install_plugin(tmp_path, "probe", WRAPPER_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    host = PluginHost(server_plugins=[BatchRecorder(), ReadyCounter()])
    assert "probe" in {info.name for info in host.installed_server_plugins()}  # loaded, but every process has it
    assert host.in_process_execute_wrappers() == ["BatchRecorder"]
    host.add_server_plugin(BatchRecorder(), name="audit")
    assert host.in_process_execute_wrappers() == ["BatchRecorder", "audit"]
    assert PluginHost(server_plugins=[ReadyCounter()]).in_process_execute_wrappers() == []


def _echo_repo(root: Path) -> Path:
    repo = root / "repo"
    write_model(repo, "pyecho", python_echo_config("pyecho"), {"1/model.py": ECHO_MODEL_PY})
    return repo


def _call(client: httpclient.InferenceServerClient, values: np.ndarray) -> None:
    tensor = httpclient.InferInput("INPUT0", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values)
    assert np.array_equal(client.infer("pyecho", [tensor]).as_numpy("OUTPUT0"), values)


def _calls_from_both_processes(server: ServerThread, rounds: int) -> int:
    """``rounds`` calls from each of four clients that keep their connections: the balancer
    gives two of them to the frontend. Returns how many connections it passed there."""
    balancer = server.server.balancer
    assert balancer is not None
    wait_for(lambda: len(balancer.peers) == 1, what="the frontend is connected")
    passed = balancer.passed
    clients = [httpclient.InferenceServerClient(server.url) for _ in range(4)]
    values = np.arange(3, dtype=np.float32).reshape(1, 3)
    try:
        for _ in range(rounds):
            for client in clients:
                _call(client, values)
    finally:
        for client in clients:
            client.close()
    return balancer.passed - passed


def test_an_execute_wrapper_sees_every_execute_under_frontend_processes(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    recorder = BatchRecorder()
    caplog.set_level(logging.INFO, logger="pyserve.handoff")
    with serve(_echo_repo(tmp_path), frontend_processes=1, replicate_models="auto", frontend_balance="connections",
               server_plugins=[recorder]) as server:
        handoff = server.server._handoff
        assert handoff is not None
        assert _calls_from_both_processes(server, rounds=5) >= 1
        assert sum(recorder.sizes["pyecho"]) == 20  # the frontend's connections were answered here
        assert not any(handoff.replicas.values())
    assert ("model 'pyecho' version 1: served by the owner process only: the in-process server plugin "
            "BatchRecorder wraps pyserve_execute") in caplog.text


def test_a_model_named_for_replication_is_replicated_past_an_execute_wrapper(tmp_path: Path) -> None:
    """``--replicate-models pyecho``: the user asked for the replica; its executes run in the
    frontend, where this process's recorder does not see them."""
    recorder = BatchRecorder()
    with serve(_echo_repo(tmp_path), frontend_processes=1, replicate_models="pyecho", frontend_balance="connections",
               server_plugins=[recorder]) as server:
        handoff = server.server._handoff
        assert handoff is not None
        wait_for(lambda: any(handoff.replicas.values()), what="the frontend's replica is ready")
        assert _calls_from_both_processes(server, rounds=5) >= 1
        assert 0 < sum(recorder.sizes["pyecho"]) < 20  # the owner's connections only


def test_entry_point_plugins_hear_of_a_replicated_model_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed observer is loaded by the owner and by the frontend (started afresh, it
    reads the entry points too), but only the owner tells it that the model became READY and,
    at the stop, that it was unloaded: the frontend's replica stands for the owner's version."""
    site = tmp_path / "site"
    site.mkdir()
    _install_plugin(site, "observer", OBSERVER_PLUGIN)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    events = tmp_path / "events.txt"
    monkeypatch.setenv("PROBE_EVENTS", str(events))
    with serve(_echo_repo(tmp_path), frontend_processes=1, replicate_models="auto") as server:
        handoff = server.server._handoff
        assert handoff is not None
        wait_for(lambda: any(handoff.replicas.values()), what="the frontend's replica is ready")
        assert _calls_from_both_processes(server, rounds=2) >= 1  # the replica answers
        frontends = server.server.frontends
        assert frontends is not None and frontends.pids
    assert events.read_text().splitlines() == [f"ready pyecho {os.getpid()}", f"unloaded pyecho {os.getpid()}"]
