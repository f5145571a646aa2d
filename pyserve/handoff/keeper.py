"""Keeping the server up when a model crashes it: ``pyserve run``'s parent process.

Models run inside the server process (threads, or the event loop for cheap ones), so a model
that crashes the process — a segfault in native code, ``os._exit`` in a ``model.py``, the
kernel's OOM killer — would take every model and both ports down with it. ``pyserve run``
therefore forks the server from a small parent, the *keeper*, which

* binds the listening sockets first and keeps them open: the server uses them
  (``pyserve.frontends.tcp.inherited``), and while a new server starts, clients that connect wait in the
  listen backlog instead of being refused;
* waits for the server; when it dies after it had started serving, logs how (the exit
  status or signal) and which model instances were executing at that moment (read from the
  ``pyserve.runtime.scheduling.execution_board`` page they share), then starts a new server from its
  own state — it loads every model again and forks its frontends — 1 s later, doubling up to
  30 s while the new one keeps dying within a minute;
* passes SIGTERM and SIGINT on and exits with the server's status; a server that stops by
  itself (status 0) or fails before it serves (a startup error) is not restarted; a server
  still running ``stop_timeout`` seconds after the signal is killed (SIGKILL), so that a stuck
  model cannot keep ``pyserve run`` from exiting.

The server notices a keeper that died (``PR_SET_PDEATHSIG``) and stops. The keeper becomes the
child subreaper of the processes below it, so frontends orphaned by a crash are reaped here.
Linux only; elsewhere ``pyserve run`` is the server itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

from pyserve.handoff.prefork import exit_forked
from pyserve.runtime import startup_gc
from pyserve.runtime.scheduling import execution_board

log = logging.getLogger("pyserve.keeper")

RESTART_DELAY_S = 1.0
RESTART_DELAY_MAX_S = 30.0
STABLE_AFTER_S = 60.0

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def supported() -> bool:
    """Whether this platform can keep a server (Linux: fork and prctl)."""
    return sys.platform == "linux" and hasattr(os, "fork")


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def describe_status(code: int) -> str:
    """An exit status in words: ``exited with status 7`` or ``was killed by SIGSEGV``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


class Keeper:
    """Runs ``serve`` (the server, returning its exit status) in a child process, again after
    a crash. Main thread only.

    :param serve: called in each child; returns the exit status.
    :param stop_timeout: seconds the server gets to stop after SIGTERM/SIGINT before it is
        killed (its ``--exit-timeout-secs`` and some time to unload).
    """

    def __init__(self, serve: Callable[[], int], stop_timeout: float = 60.0) -> None:
        self.serve = serve
        self.stop_timeout = stop_timeout
        self.board = execution_board.create()
        self.child = 0
        self.stopping = False
        self.restarts = 0

    def run(self) -> int:
        """Serve until the server stops for good; its exit status."""
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._kill)
        delay = RESTART_DELAY_S
        try:
            while True:
                started = time.monotonic()
                self.child = self._start()
                code = self._wait(self.child)
                ready, busy = execution_board.read(self.board)
                if self.stopping or code == 0 or not ready:
                    return code if code >= 0 else 128 - code  # a signal, as a shell reports it
                if time.monotonic() - started > STABLE_AFTER_S:
                    delay = RESTART_DELAY_S
                executing = "; it was executing " + ", ".join(busy) if busy else "; no model was executing"
                log.error("the server process (pid %d) %s%s. Starting it again in %.0f s", self.child,
                          describe_status(code), executing, delay)
                self.restarts += 1
                if self._sleep(delay):
                    return code if code >= 0 else 128 - code
                delay = min(delay * 2, RESTART_DELAY_MAX_S)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start(self) -> int:
        pid = os.fork()
        if pid:
            startup_gc.resume()  # the keeper's own collector (the server resumes its own)
            return pid
        code = 1
        try:  # the server: stop when the keeper goes away, write the board, serve
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
                signal.signal(sig, signal.SIG_DFL)
            _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() == 1:  # the keeper died before prctl took hold
                os._exit(1)
            execution_board.attach(self.board)
            code = self.serve()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - never return into the keeper's loop in the child
            log.exception("the server process failed")
        finally:
            exit_forked(code)

    def _wait(self, pid: int) -> int:
        """Wait for ``pid``, reaping orphans meanwhile; its exit status."""
        while True:
            try:
                done, status = os.waitpid(-1, 0)
            except ChildProcessError:
                return 1
            if done == pid:
                return os.waitstatus_to_exitcode(status)

    def _forward(self, signum: int, frame: object) -> None:
        if not self.stopping:
            signal.setitimer(signal.ITIMER_REAL, max(self.stop_timeout, 0.1))
        self.stopping = True
        if self.child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, signum)

    def _kill(self, signum: int, frame: object) -> None:
        if self.child:
            log.error("the server process (pid %d) did not stop within %.0f s; killing it", self.child,
                      self.stop_timeout)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, signal.SIGKILL)

    def _sleep(self, seconds: float) -> bool:
        """Sleep (orphans reaped); True when a stop was asked meanwhile."""
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
        return self.stopping
