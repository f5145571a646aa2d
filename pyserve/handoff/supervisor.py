"""Starts, watches and stops the frontend processes of ``pyserve run --frontend-processes N``.

A frontend that dies is started again (after 1 s, doubling up to 30 s while it keeps dying
within a minute of starting), with its exit status in the owner's log; the owner itself
keeps serving on its own listeners meanwhile. On shutdown the frontends get SIGTERM first and
finish what they have in flight while the owner still executes it; any still running after
the exit timeout are killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from pyserve.handoff import affinity
from pyserve.handoff.forked import python_command
from pyserve.handoff.owner import HandoffServer
from pyserve.handoff.prefork import ForkedProcess, Preforked
from pyserve.runtime import execution_board
from pyserve_hookspecs import hookimpl

log = logging.getLogger("pyserve.handoff")

MAX_FRONTEND_PROCESSES = 64
_RESTART_DELAY = 1.0
_RESTART_DELAY_MAX = 30.0
_STABLE_AFTER = 60.0


ChildProcess = subprocess.Popen[bytes] | ForkedProcess
"""A frontend process: spawned, or forked before the owner started."""


class FrontendStartError(RuntimeError):
    """A frontend process exited or did not report ready in time while the server started."""


class ModelChangeObserver:
    """A server plugin telling the hand-off server that the READY models changed."""

    def __init__(self, handoff: HandoffServer) -> None:
        self.handoff = handoff

    @hookimpl
    def pyserve_model_ready(self, model: Any) -> None:
        self.handoff.models_changed()

    @hookimpl
    def pyserve_model_unloaded(self, model: Any) -> None:
        self.handoff.models_changed()


class _Slot:
    """One frontend position: its current process and restart bookkeeping."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: ChildProcess | None = None
        self.started_at = 0.0
        self.board: Any = None  # the execution board its process writes
        self.delay = _RESTART_DELAY
        self.restart: asyncio.TimerHandle | None = None


class FrontendSupervisor:
    """Runs ``count`` frontend processes with ``settings`` (see ``pyserve.handoff.frontend``).

    Event loop only, except the per-process watcher threads, which only post to the loop.
    """

    def __init__(self, count: int, settings: dict[str, Any], handoff: HandoffServer,
                 cpus: list[int] | None = None, preforked: Preforked | None = None) -> None:
        self.settings = settings
        self.preforked = preforked
        """Frontends forked before the owner started (``pyserve.handoff.prefork``): each slot
        takes one of them first; later starts spawn a fresh process."""
        self.cpus = cpus
        """``--pin-processes``: frontend ``i`` runs on ``cpus[(i + 1) % len(cpus)]`` (None: anywhere)."""
        self.handoff = handoff
        self.slots = [_Slot(i) for i in range(count)]
        self.stopping = False
        self.restarts = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def pids(self) -> list[int]:
        """The process ids of the running frontends."""
        return [s.process.pid for s in self.slots if s.process is not None and s.process.poll() is None]

    async def start(self, timeout: float = 60.0, replicas_timeout: float = 60.0) -> None:
        """Start every frontend and wait until each listens and its model replicas are loaded.

        A frontend whose replicas are still loading after another ``replicas_timeout`` s serves
        anyway, handing those models' requests to the owner until they are (a warning says so).

        :raises FrontendStartError: one exited, or did not report listening within ``timeout``.
        """
        self._loop = asyncio.get_running_loop()
        for slot in self.slots:
            self._spawn(slot)
        handoff = self.handoff
        if not await self._wait_all(lambda pid: pid in handoff.ready_pids, timeout):
            raise FrontendStartError(f"frontend processes did not report ready within {timeout:.0f} s")
        if not await self._wait_all(handoff.replicas_placed, replicas_timeout):
            log.warning("frontend processes still load model replicas after %.0f s; they hand those models' "
                        "requests to the model owner until the replicas are ready", replicas_timeout)

    async def _wait_all(self, done: Callable[[int], bool], timeout: float) -> bool:
        """Wait until ``done(pid)`` holds for every frontend; False: ``timeout`` passed first.

        :raises FrontendStartError: a frontend exited meanwhile.
        """
        hello = self.handoff.hello

        def settled() -> bool:
            if any(s.process is not None and s.process.poll() is not None for s in self.slots):
                return True
            return all(s.process is not None and done(s.process.pid) for s in self.slots)

        try:
            async with hello:
                await asyncio.wait_for(hello.wait_for(settled), timeout)
        except asyncio.TimeoutError:
            return False
        for slot in self.slots:
            assert slot.process is not None
            status = slot.process.poll()
            if status is not None:
                raise FrontendStartError(
                    f"frontend process {slot.index} exited with status {status} while starting (see its log above)"
                )
        return True

    def _spawn(self, slot: _Slot) -> None:
        slot.restart = None
        if self.stopping:
            return
        process: ChildProcess | None = None
        if slot.board is not None:
            execution_board.close(slot.board)
            slot.board = None
        if self.preforked is not None:
            forked = self.preforked.release(self.settings)
            if forked is not None:
                process, slot.board = forked, forked.board
        if process is None:
            slot.board = execution_board.create()
            settings = dict(self.settings)
            descriptor = execution_board.fd(slot.board)
            settings["board_fd"] = descriptor
            command = python_command("-m", "pyserve.handoff.frontend", json.dumps(settings))
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, close_fds=True,
                                       pass_fds=() if descriptor is None else (descriptor,))
        if self.cpus:  # before the new interpreter starts threads: they inherit it
            affinity.pin_child(process.pid, affinity.cpu_for(slot.index + 1, self.cpus))
        slot.process = process
        slot.started_at = time.monotonic()
        loop = self._loop
        assert loop is not None

        def watch() -> None:
            status = process.wait()
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone
                loop.call_soon_threadsafe(self._exited, slot, process, status)

        threading.Thread(target=watch, name=f"pyserve-frontend-{slot.index}", daemon=True).start()

    def _exited(self, slot: _Slot, process: ChildProcess, status: int) -> None:
        if self.stopping or slot.process is not process:
            return
        if time.monotonic() - slot.started_at > _STABLE_AFTER:
            slot.delay = _RESTART_DELAY
        busy = execution_board.read(slot.board)[1] if slot.board is not None else []
        log.error(
            "frontend process %d (pid %d) exited with status %d%s; starting it again in %.0f s",
            slot.index, process.pid, status, "; it was executing " + ", ".join(busy) if busy else "", slot.delay,
        )
        self.restarts += 1
        assert self._loop is not None
        slot.restart = self._loop.call_later(slot.delay, self._spawn, slot)
        slot.delay = min(slot.delay * 2, _RESTART_DELAY_MAX)

    async def stop(self, timeout: float) -> bool:
        """SIGTERM every frontend, wait up to ``timeout`` s for them to finish, kill the rest.

        :returns: whether every frontend finished its in-flight requests and exited with status
            0 in time (False: one was killed at the exit timeout, or failed as it stopped).
        """
        clean = True
        self.stopping = True
        processes = []
        for slot in self.slots:
            if slot.restart is not None:
                slot.restart.cancel()
            if slot.process is not None and slot.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.process.terminate()
                processes.append(slot.process)
        deadline = time.monotonic() + max(timeout, 0.0)
        for process in processes:
            while process.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if process.poll() is None:
                log.warning("frontend process %d did not stop within the exit timeout; killing it", process.pid)
                process.kill()
                await asyncio.get_running_loop().run_in_executor(None, process.wait)
                clean = False
            elif process.returncode != 0:
                clean = False
        for slot in self.slots:
            if slot.board is not None:
                execution_board.close(slot.board)
                slot.board = None
        return clean
