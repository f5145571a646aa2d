"""``--pin-processes``: the server's processes each on a CPU of their own.

With ``--frontend-processes``, the owner and its frontends are each bound by their GIL to about
one core, and the scheduler moves them between CPUs as other work comes and goes. Under load,
a process that is moved or made to wait for a CPU answers late: that wait is most of the
tail latency. With pinning, process ``i`` (the owner is 0, frontend ``k`` is ``k + 1``) runs
only on the ``i``-th CPU the server may use (``os.sched_getaffinity``), round robin when there
are more processes than CPUs. Off by default: on a machine shared with other work, a pinned
process cannot move to an idle CPU.

Linux only (``os.sched_setaffinity``).
"""

from __future__ import annotations

import contextlib
import os


def supported() -> bool:
    """Whether this platform can pin processes."""
    return hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")


def allowed_cpus() -> list[int]:
    """The CPUs this process may use now, in order (read it before pinning anything)."""
    return sorted(os.sched_getaffinity(0))


def cpu_for(index: int, cpus: list[int]) -> int:
    """The CPU of server process ``index`` (0: the owner) among ``cpus`` (``allowed_cpus``)."""
    return cpus[index % len(cpus)]


def pin_this_process(cpu: int) -> None:
    """Pin every thread of this process (and the threads it starts later) to ``cpu``."""
    _set_all_threads({cpu})


def restore(cpus: list[int]) -> None:
    """Let every thread of this process use ``cpus`` (``allowed_cpus`` before pinning) again."""
    _set_all_threads(set(cpus))


def pin_child(pid: int, cpu: int) -> None:
    """Pin a child process just started (its threads inherit the setting)."""
    with contextlib.suppress(OSError):  # it exited already
        os.sched_setaffinity(pid, {cpu})


def _set_all_threads(cpus: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)
