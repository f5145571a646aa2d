"""The repository's root ``conftest.py``: a run whose test left a thread blocked for ever still
ends, naming the thread, instead of holding CI until its limit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HELD = """
import threading

def test_leaves_a_thread_blocked() -> None:
    threading.Thread(target=threading.Event().wait, name="stuck-server-thread").start()
"""

CLEAN = """
def test_passes() -> None:
    pass
"""


def _run(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_case.py").write_text(source)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYSERVE_TEST_EXIT_GRACE_S": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_case.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_thread_that_never_ends_fails_the_run_instead_of_holding_it(tmp_path: Path) -> None:
    run = _run(tmp_path, HELD)
    assert "1 passed" in run.stdout
    assert run.returncode == 1
    assert "threads that are not daemons still hold the process: stuck-server-thread" in run.stderr
    assert "Thread 0x" in run.stderr  # the stacks, to find where it waits


def test_a_clean_run_exits_with_its_status(tmp_path: Path) -> None:
    run = _run(tmp_path, CLEAN)
    assert run.returncode == 0 and "1 passed" in run.stdout
    assert "still hold the process" not in run.stderr
