"""Hooks for every test folder of this repository (``tests``, ``plugins``, ``examples``).

A test that times out (``pytest-timeout``) or fails inside another plugin's machinery can leave
a server thread that is not a daemon blocked for ever; Python then waits for it at exit and the
run never ends, so CI waits out its whole limit. After the session, a daemon watchdog gives the
interpreter ``PYSERVE_TEST_EXIT_GRACE_S`` seconds (120) to exit; past that it prints the threads
that hold it, with their stacks, and ends the process with the session's status (1 if the
session had passed: a thread that never ends is a bug too).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

import pytest

_DEFAULT_GRACE_S = 120.0

_STATUS = pytest.StashKey[int]()
"""The session's exit status, kept from ``pytest_sessionfinish`` for the watchdog."""


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_STATUS] = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    grace = float(os.environ.get("PYSERVE_TEST_EXIT_GRACE_S", _DEFAULT_GRACE_S))
    status = config.stash.get(_STATUS, 1)
    threading.Thread(target=_exit_if_held, args=(grace, status), name="pyserve-test-exit-watchdog",
                     daemon=True).start()


def _exit_if_held(grace: float, status: int) -> None:
    time.sleep(grace)
    held = [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    sys.stderr.write(f"\npytest finished, but after {grace:g} s threads that are not daemons still hold the "
                     f"process: {', '.join(held) or '(none named)'}; their stacks:\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(status or 1)
