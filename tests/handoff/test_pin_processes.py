"""``--pin-processes``: the owner and each frontend process on a CPU of their own.

A real server with one frontend process. The server runs in this test process (``serve``), so
the owner's pinning applies to this process while it runs and must be undone after.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from suite_support import echo_config

from pyserve.handoff import affinity
from pyserve.testing import serve, write_model

pytestmark = pytest.mark.skipif(not affinity.supported(), reason="needs sched_setaffinity (Linux)")


def _affinity_of_a_new_thread() -> set[int]:
    seen: list[set[int]] = []
    thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    thread.start()
    thread.join()
    return seen[0]


def test_owner_and_frontend_each_get_a_cpu_and_the_owner_is_unpinned_after(tmp_path: Path) -> None:
    write_model(tmp_path / "repo", "echo", echo_config())
    before = os.sched_getaffinity(0)
    cpus = sorted(before)
    with serve(tmp_path / "repo", frontend_processes=1, pin_processes=True) as thread:
        assert os.sched_getaffinity(0) == {cpus[0]}  # every thread of the owner, this one included
        assert _affinity_of_a_new_thread() == {cpus[0]}  # and the threads it starts later
        supervisor = thread.server.frontends
        assert supervisor is not None
        [frontend] = supervisor.pids
        assert os.sched_getaffinity(frontend) == {cpus[1 % len(cpus)]}
        with httpclient.InferenceServerClient(thread.url) as client:  # both processes serve
            for _ in range(4):
                values = np.ones((1, 2), dtype=np.float32)
                tensor = httpclient.InferInput("INPUT0", [1, 2], "FP32")
                tensor.set_data_from_numpy(values)
                assert np.array_equal(client.infer("echo", [tensor]).as_numpy("OUTPUT0"), values)
    assert os.sched_getaffinity(0) == before
    assert _affinity_of_a_new_thread() == before


def test_off_by_default(tmp_path: Path) -> None:
    write_model(tmp_path / "repo", "echo", echo_config())
    before = os.sched_getaffinity(0)
    with serve(tmp_path / "repo", frontend_processes=1) as thread:
        assert os.sched_getaffinity(0) == before
        supervisor = thread.server.frontends
        assert supervisor is not None
        [frontend] = supervisor.pids
        assert os.sched_getaffinity(frontend) == before


def test_the_flag() -> None:
    from pyserve.cli.main import build_parser

    parser = build_parser()
    base = ["run", "--model-repository", "repo"]
    assert parser.parse_args(base).pin_processes == "auto"  # pyserve.handoff.layout decides
    assert parser.parse_args([*base, "--pin-processes", "true"]).pin_processes is True
    assert parser.parse_args([*base, "--pin-processes", "false"]).pin_processes is False
