"""``pyserve.runtime.startup_gc``: the collector paused while ``pyserve run`` starts.

Each case runs in a fresh interpreter, so that the test process's own collector is untouched.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_pause_then_resume_turns_collection_back_on_with_the_start_frozen() -> None:
    assert _run("""
        import gc
        from pyserve.runtime import startup_gc
        startup_gc.pause()
        paused = gc.isenabled()
        startup_gc.resume()
        print(paused, gc.isenabled(), gc.get_freeze_count() > 0)
    """) == "False True True"


def test_resume_leaves_a_collector_it_did_not_pause_alone() -> None:
    """An application that turned collection off itself keeps it off; one that never paused
    gets nothing frozen."""
    assert _run("""
        import gc
        from pyserve.runtime import startup_gc
        startup_gc.resume()
        untouched = (gc.isenabled(), gc.get_freeze_count())
        gc.disable()
        startup_gc.pause()
        startup_gc.resume()
        print(untouched, gc.isenabled(), gc.get_freeze_count())
    """) == "(True, 0) False 0"


def test_a_forked_child_resumes_what_its_parent_paused() -> None:
    assert _run("""
        import gc, os
        from pyserve.runtime import startup_gc
        startup_gc.pause()
        pid = os.fork()
        if pid == 0:
            startup_gc.resume()
            os._exit(0 if gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), gc.isenabled())
    """) == "0 False"
