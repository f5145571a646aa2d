"""Keeping the server up when a model crashes it: ``pyserve run``'s parent process.

Models run inside the server process (threads, or the event loop for cheap ones), so a model
that crashes the process — a segfault in native code, ``os._exit`` in a ``model.py``, the
kernel's OOM killer — would take every model and both ports down with it. ``pyserve run``
therefore serves from a child of a small parent, the *keeper*, which

* binds the listening sockets first and keeps them open: the server uses them
  (``pyserve.frontends.tcp.inherit``), and while a new server starts, clients that connect wait in the
  listen backlog instead of being refused;
* forks the first server from the process that parsed the flags (it has imported the server
  already, so the start costs nothing more), then replaces its own program with this module
  alone (``python -m pyserve.handoff.keeper``): the keeper then holds no numpy, no models and
  no HTTP or gRPC stack, a few MiB instead of a server's worth of memory. The sockets and the
  execution board pass through that ``exec``, and so do the signals sent meanwhile (blocked
  until the small program handles them);
* waits for the server; when it dies after it had started serving, logs how (the exit
  status or signal) and which model instances were executing at that moment (read from the
  ``pyserve.runtime.execution_board`` page they share), then starts a new server 1 s later,
  doubling up to 30 s while the new one keeps dying within a minute. A new server is a fresh
  ``python -m pyserve run`` with the same arguments: it loads every model again and forks its
  frontends, and takes the sockets and the board from the keeper (``adopt``) instead of
  binding its own;
* passes SIGTERM and SIGINT on and exits with the server's status; a server that stops by
  itself (status 0) or fails before it serves (a startup error) is not restarted; a server
  still running ``stop_timeout`` seconds after the signal is killed (SIGKILL), so that a stuck
  model cannot keep ``pyserve run`` from exiting.

The server notices a keeper that died (``PR_SET_PDEATHSIG``) and stops. The keeper becomes the
child subreaper of the processes below it, so frontends orphaned by a crash are reaped here.
Linux only; elsewhere ``pyserve run`` is the server itself.

A server that dies cannot remove its hand-off folder (the Unix sockets of its frontends); the
keeper removes it once it has reaped that server (``pyserve.handoff.rundir``).

This module imports nothing of the server (only ``pyserve.logs``, ``pyserve.frontends.tcp``,
``pyserve.handoff.rundir`` and ``pyserve.runtime.execution_board``, which are standard-library
only), so that the small keeper stays small.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pyserve import logs
from pyserve.frontends import tcp
from pyserve.handoff import rundir
from pyserve.handoff.forked import exit_forked, flush_output, python_command
from pyserve.runtime import execution_board, startup_gc

log = logging.getLogger("pyserve.keeper")

RESTART_DELAY_S = 1.0
RESTART_DELAY_MAX_S = 30.0
STABLE_AFTER_S = 60.0

HANDOFF_ENV = "PYSERVE_KEEPER_HANDOFF"
"""Set in the environment of a server the keeper starts again: the sockets and board it takes."""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGALRM}


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


def _die_with_keeper(keeper: int) -> None:
    """In a server process: stop (SIGTERM) when the keeper ``keeper`` goes away."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != keeper:  # the keeper died before prctl took hold
        os._exit(1)


def adopt() -> bool:
    """In ``pyserve run``: whether this process is a server the keeper started again (then the
    keeper's sockets are recorded for the services, ``pyserve.frontends.tcp.inherit``, and its
    board is attached); False in any other process. Removes the hand-off from the environment,
    so that processes this server starts do not see it.

    :raises SystemExit: the keeper is gone already (status 1).
    """
    raw = os.environ.pop(HANDOFF_ENV, None)
    if raw is None:
        return False
    handoff = json.loads(raw)
    _die_with_keeper(int(handoff["keeper"]))
    for service, descriptor in handoff["listeners"].items():
        os.set_inheritable(descriptor, False)
        tcp.inherit(service, socket.socket(fileno=descriptor))
    board = handoff.get("board")
    if board is not None:
        os.set_inheritable(board, False)
        execution_board.attach(execution_board.open_fd(board))
    return True


class Keeper:
    """Runs the server in a child process, again after a crash. Main thread only.

    :param argv: the arguments of ``pyserve`` (``run ...``) that start the server again.
    :param stop_timeout: seconds the server gets to stop after SIGTERM/SIGINT before it is
        killed (its ``--exit-timeout-secs`` and some time to unload).
    :param board: the execution board the servers write (a new one by default).
    :param listeners: the services' bound sockets (``tcp.inherit``'s), by descriptor.
    """

    def __init__(self, argv: Sequence[str], stop_timeout: float = 60.0, *, board: mmap.mmap | None = None,
                 board_fd: int | None = None, listeners: Mapping[str, int] | None = None) -> None:
        self.argv = list(argv)
        self.stop_timeout = stop_timeout
        self.board = execution_board.create() if board is None else board
        self.board_fd = execution_board.fd(self.board) if board is None else board_fd
        self.listeners = dict(tcp.inherited_descriptors() if listeners is None else listeners)
        self.child = 0
        self.started = 0.0
        self.stopping = False
        self.restarts = 0
        self.delay = RESTART_DELAY_S

    def run(self, serve: Callable[[], int], small: bool = True) -> int:
        """Serve until the server stops for good; its exit status. The first server runs
        ``serve`` in a fork of this process; then this process becomes the small keeper
        (``exec``: it never returns here) where it can and ``small`` allows it (``pyserve run``
        as a command, not a caller of ``pyserve.cli.main.main`` in its own program), and keeps
        the server from here otherwise."""
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        previous = self._handle_signals()
        try:
            self.started = time.monotonic()
            self.child = self._fork(serve)
            startup_gc.resume()  # the keeper's own collector (the server resumes its own)
            if small:
                self._become_small()
            return self.keep()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def keep(self) -> int:
        """Wait for the server and start it again after each crash; its final exit status."""
        try:
            while True:
                code = self._wait(self.child)
                for folder in rundir.remove_left_by(self.child):  # a server that stops removes its own
                    log.debug("removed the hand-off folder %s of the server process (pid %d)", folder, self.child)
                ready, busy = execution_board.read(self.board)
                if self.stopping or code == 0 or not ready:
                    if code < 0 and not ready and not self.stopping:  # an exit says why itself; a signal does not
                        log.error("the server process (pid %d) %s before it served; not starting it again",
                                  self.child, describe_status(code))
                    return code if code >= 0 else 128 - code  # a signal, as a shell reports it
                if time.monotonic() - self.started > STABLE_AFTER_S:
                    self.delay = RESTART_DELAY_S
                executing = "; it was executing " + ", ".join(busy) if busy else "; no model was executing"
                log.error("the server process (pid %d) %s%s. Starting it again in %.0f s", self.child,
                          describe_status(code), executing, self.delay)
                self.restarts += 1
                if self._sleep(self.delay):
                    return code if code >= 0 else 128 - code
                self.delay = min(self.delay * 2, RESTART_DELAY_MAX_S)
                self.started = time.monotonic()
                self.child = self._spawn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def _handle_signals(self) -> dict[int, Any]:
        """Forward SIGTERM/SIGINT to the server, kill it on SIGALRM; the handlers replaced."""
        previous: dict[int, Any] = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._kill)
        return previous

    def _fork(self, serve: Callable[[], int]) -> int:
        keeper = os.getpid()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:  # the server: stop when the keeper goes away, write the board, serve
            for sig in _SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            _die_with_keeper(keeper)
            execution_board.attach(self.board)
            code = serve()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - never return into the keeper's loop in the child
            log.exception("the server process failed")
        finally:
            exit_forked(code)

    def _spawn(self) -> int:
        """A new server: ``python -m pyserve <argv>``, given the sockets and the board."""
        keeper = os.getpid()
        handoff = {"keeper": keeper, "listeners": self.listeners, "board": self.board_fd}
        env = {**os.environ, HANDOFF_ENV: json.dumps(handoff)}
        command = python_command("-m", "pyserve", *self.argv)
        pid = os.fork()
        if pid:
            return pid
        try:
            for sig in _SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            _die_with_keeper(keeper)
            self._pass_descriptors(True)
            os.execve(sys.executable, command, env)
        except BaseException:  # noqa: BLE001 - never return into the keeper's loop in the child
            log.exception("the server process could not be started")
        exit_forked(127)

    def _state(self) -> dict[str, Any]:
        return {"argv": self.argv, "stop_timeout": self.stop_timeout, "board": self.board_fd,
                "listeners": self.listeners, "child": self.child, "started": self.started,
                "stopping": self.stopping, "restarts": self.restarts, "delay": self.delay,
                "log": logs.configuration()}

    def _become_small(self) -> None:
        """Replace this process's program with the small keeper (``main``), keeping its pid,
        its child, the sockets and the board; returns only where that cannot be done."""
        if self.board_fd is None:
            return
        signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)  # delivered to the small keeper
        try:
            self._pass_descriptors(True)
            flush_output()
            os.execv(sys.executable, python_command("-m", "pyserve.handoff.keeper", json.dumps(self._state())))
        except OSError as exc:
            log.warning("the keeper keeps its full memory: it could not start its small program: %s", exc)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)

    def _pass_descriptors(self, inheritable: bool) -> None:
        """Let the board's and the sockets' descriptors pass an ``exec`` (or not)."""
        for descriptor in (self.board_fd, *self.listeners.values()):
            if descriptor is not None:
                os.set_inheritable(descriptor, inheritable)

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


def main(argv: Sequence[str]) -> int:
    """The small keeper (``python -m pyserve.handoff.keeper STATE``): go on keeping the server
    that the full process forked, from the state it passed (JSON)."""
    state = json.loads(argv[0])
    logs.configure(**state["log"])
    board_fd = state["board"]
    keeper = Keeper(state["argv"], state["stop_timeout"], board=execution_board.open_fd(board_fd),
                    board_fd=board_fd, listeners=state["listeners"])
    keeper.child, keeper.started, keeper.stopping = state["child"], state["started"], state["stopping"]
    keeper.restarts, keeper.delay = state["restarts"], state["delay"]
    keeper._pass_descriptors(False)  # each new server is given them explicitly
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    keeper._handle_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)  # signals sent during the exec arrive now
    return keeper.keep()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
