"""Frontend processes forked from the owner once it has loaded the models they replicate.

Frontend processes started afresh (``python -m pyserve.handoff.frontend``) each load their own
replicas: N processes hold N copies of every replicated model's weights and pay N loads at
start. ``pyserve run`` instead loads those models once and forks the frontends from that state,
so every process shares one copy of the weights (copy-on-write pages that executes only read):

1. Before the owner starts its event loop or any thread, ``prepare_and_fork`` builds each
   startup model that frontends will replicate, on the main thread: backend, model and
   instances, but no instance threads and no warm-up (``ModelLoader.prepare``). Only models of
   backends that say they can be inherited by a forked process (``pyserve_backend_fork_safe``)
   are built so; the process's threads are counted around each load, and a model whose load
   started one is finalized and left for after the fork.
2. It freezes the garbage collector's view of these objects (``gc.freeze``: a collection
   would otherwise write to every object's page and copy it) and forks the frontends. Each
   child waits on a pipe, holding the prepared models.
3. The owner goes on as always: its ``load_all`` starts the prepared versions
   (``start_prepared``) and loads every other model. Once it listens, its
   ``FrontendSupervisor`` writes each child its settings (``Preforked.release``), and the child
   runs the frontend, whose ``ReplicaSet`` starts its own copies of the prepared versions the
   owner serves with the same config (``adopt_prepared``) instead of loading them.

A frontend that dies later is started afresh (the owner runs threads by then, and a fork of it
would not be safe): that one loads its own replicas. Nothing is forked when a thread runs
before the first load (the server then spawns its frontends as an embedded server does).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyserve.frontends import tcp
from pyserve.handoff.forked import exit_forked
from pyserve.handoff.replicas import ReplicationMode, replicable
from pyserve.runtime import execution_board, startup_gc
from pyserve.runtime.loader import Preparing

if TYPE_CHECKING:
    from pyserve.runtime.manager import ModelManager
    from pyserve.runtime.versions import ModelVersion

log = logging.getLogger("pyserve.handoff")


def os_threads() -> int:
    """The threads of this process as the kernel counts them (native threads too)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # pragma: no cover - not Linux
        return threading.active_count()


def fork_possible() -> str | None:
    """Why this process cannot fork its frontends now, or None when it can.

    Python threads must not run (a fork copies none of them, and what they hold stays held);
    native threads that imports started (OpenBLAS's pool, which stops itself around a fork)
    are taken as they are, and loading a model must not add any.
    """
    if not hasattr(os, "fork") or sys.platform != "linux":
        return "forking needs Linux"
    if threading.active_count() > 1:
        return f"{threading.active_count()} Python threads already run"
    return None


class ForkedProcess:
    """A forked frontend as the supervisor watches it (the part of ``subprocess.Popen`` it uses).

    Thread-safe: ``wait`` may block on a watcher thread while the loop calls ``poll``.

    :ivar board: the execution board it writes (``pyserve.runtime.execution_board``).
    """

    def __init__(self, pid: int, board: Any = None) -> None:
        self.pid = pid
        self.board = board
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _reap(self, flags: int) -> None:
        """``waitpid`` with ``self._lock`` held; records the status once it exited."""
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped elsewhere: gone
            self.returncode = -1
            return
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)

    def poll(self) -> int | None:
        """The exit status, or None while it runs (or while ``wait`` blocks on it)."""
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                if self.returncode is None:
                    self._reap(os.WNOHANG)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self) -> int:
        """Block until it exits; the exit status (negative: the signal that ended it)."""
        with self._lock:
            while self.returncode is None:
                self._reap(0)
            return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Preforked:
    """The frontend processes forked before the owner started, waiting for their settings."""

    def __init__(self, children: list[tuple[int, int, Any]]) -> None:
        self._waiting = list(children)  # (pid, write end of its settings pipe, its execution board)
        self._released: list[ForkedProcess] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def release(self, settings: dict[str, Any]) -> ForkedProcess | None:
        """Start the next waiting child as a frontend with ``settings``; None when none waits
        (or it is gone)."""
        while self._waiting:
            pid, pipe, board = self._waiting.pop(0)
            process = ForkedProcess(pid, board)
            try:
                with os.fdopen(pipe, "wb") as out:
                    out.write(json.dumps(settings).encode() + b"\n")
            except OSError:  # it died meanwhile
                process.wait()
                continue
            self._released.append(process)
            return process
        return None

    def close(self) -> None:
        """Tell the children still waiting to exit (their pipe closes) and reap them."""
        waiting, self._waiting = self._waiting, []
        for pid, pipe, board in waiting:
            with contextlib.suppress(OSError):
                os.close(pipe)
            ForkedProcess(pid).wait()
            execution_board.close(board)


def _config_refusal(mode: ReplicationMode) -> Any:
    def refuse(name: str, config: Any) -> str | None:
        from pyserve.runtime.versions import ModelVersion

        chosen, _ = replicable(ModelVersion(name, 0, config=config), mode)
        return None if chosen else ""  # "": not replicated (the owner alone loads it), quietly

    return refuse


def _refusal(mode: ReplicationMode, repositories: list[Path]) -> Any:
    def refuse(version: ModelVersion) -> str | None:
        chosen, reason = replicable(version, mode, repositories)
        if not chosen:
            return ""  # not replicated: the owner alone loads it, after the fork
        if any(group.kind == 1 for group in version.config.instance_group):  # KIND_GPU
            return "it has GPU instances"
        if version.context is not None and not version.context.fork_safe:
            return "its backend says it cannot be inherited by a forked process"
        return None

    return refuse


def prepare_and_fork(models: ModelManager, count: int, mode: ReplicationMode | None,
                     serve_child: Any) -> Preforked | None:
    """Load the models frontends will replicate, then fork ``count`` frontend processes.

    :param mode: which models frontends replicate (None: a bad ``--replicate-models``, which the
        normal start reports; nothing is prepared).
    :param serve_child: called in each child with its settings (a dict) once the owner sends
        them; returns the child's exit status. The child never returns from here.
    :returns: the waiting children, or None when nothing was forked (the reason is logged).
    """
    reason = fork_possible()
    if reason is not None:
        log.info("frontend processes are started afresh, each loading its own replicas: %s", reason)
        return None
    try:
        if mode is None:
            raise ValueError("--replicate-models")
        rules = Preparing(_refusal(mode, models.repositories), _config_refusal(mode), os_threads)
        sources = models.startup_sources()
    except Exception as exc:  # a bad --replicate-models or repository: the normal start says so
        log.debug("nothing prepared before the fork: %s", exc)
        sources, rules = {}, Preparing(lambda version: "", lambda name, config: "", os_threads)
    for name in sorted(sources):
        if models.ensemble_steps(sources[name]) is not None:
            continue
        refused = models.prepare(name, sources[name], rules)
        if refused is None and os_threads() > rules.threads:
            models.discard_prepared(models.prepared.pop(name))
            refused = "loading it started threads"
        if refused:  # "": not replicated, or it failed (the owner's load says why)
            log.info("model '%s': each process loads its own replica: %s", name, refused)
        elif refused is None:
            log.info("model '%s': loaded once, its replicas share the weights (forked processes)", name)
        if os_threads() > rules.threads or threading.active_count() > 1:
            log.info("frontend processes are started afresh: threads that loading '%s' started still run", name)
            return None
    # No full collection: it walks every object the imports made (tens of ms at each start)
    # to free almost nothing (what it would free stays frozen, a few pages). While
    # ``pyserve run`` starts the collector is paused (``startup_gc``) and the young
    # generations hold everything, so there is nothing cheap to collect either.
    if gc.isenabled():
        gc.collect(1)
    gc.freeze()  # a collection in a child would write to every object's page (and copy it)
    children: list[tuple[int, int, Any]] = []
    for _ in range(count):
        read_end, write_end = os.pipe()
        board = execution_board.create()  # what the child executes, for the owner to read if it dies
        pid = os.fork()
        if pid == 0:  # the child
            os.close(write_end)
            for _, other, _ in children:
                os.close(other)
            _child(read_end, board, serve_child)
        os.close(read_end)
        children.append((pid, write_end, board))
    return Preforked(children)


def _child(pipe: int, board: Any, serve_child: Any) -> None:
    """A forked frontend: wait for the owner's settings, serve, exit (never returns)."""
    code = 1
    try:
        execution_board.attach(board)  # its own executes, for the owner to read if it dies
        tcp.forget_inherited()  # a frontend binds (or is passed) its own sockets
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the owner decides
        data = b""
        with os.fdopen(pipe, "rb") as settings_in:
            data = settings_in.readline()
        startup_gc.resume()
        code = serve_child(json.loads(data)) if data else 0  # no settings: the owner did not start
    except BaseException:  # noqa: BLE001 - whatever happens, never return into the owner's code
        log.exception("frontend process failed")
    finally:
        exit_forked(code)

