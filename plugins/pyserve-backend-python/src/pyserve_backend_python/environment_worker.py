"""Workers started with an ``EXECUTION_ENV_PATH`` environment's interpreter.

``execution_mode: "process"`` workers of a model with its own Python environment (see
``pyserve_backend_python.environment``) are not started by ``multiprocessing``: the
environment's interpreter runs a small bootstrap that receives, over an inherited socket, the
server's import paths (searched after the environment's own) and ``worker.main``'s arguments.
``auto_complete_in_environment`` uses such a worker, short-lived, for the model's
``auto_complete_config`` (model.py is never imported by the server).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import site
import socket
import subprocess
import sys
import sysconfig
from multiprocessing.connection import Connection
from typing import Any

from pyserve_backend_python.environment import ExecutionEnvironment
from pyserve_backend_python.loader import PythonModelError
from pyserve_backend_python.segments import SHM_PREFIX

STOP_TIMEOUT_S = 10.0
"""Seconds ``finalize()`` in the worker and the worker's exit may take before it is killed."""


class EnvironmentWorker:
    """A worker started with an ``EXECUTION_ENV_PATH`` environment's interpreter: the
    ``multiprocessing.Process`` methods ``ProcessRunner`` uses, over ``subprocess.Popen``."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; negative: the signal that ended it (as ``multiprocessing``)."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._popen.kill()


_ENVIRONMENT_BOOTSTRAP = """\
import site, sys
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
del sys.argv[1:]  # model code sees no arguments, as in Triton's stub
site_dirs, paths, spec, prefix = conn.recv()
for directory in site_dirs:  # after the environment's own packages, with their .pth files
    if directory not in sys.path:
        site.addsitedir(directory)
sys.path.extend(p for p in paths if p not in sys.path)
from pyserve_backend_python import worker
worker.main(conn, spec, prefix)
"""
"""How a worker starts in another environment: its own ``sys.path`` first, then the server's."""


def _server_import_paths() -> tuple[list[str], list[str]]:
    """The server's site directories, and its other ``sys.path`` entries (not the standard
    library), for a worker in another environment to search after its own."""
    sites = [d for d in [*site.getsitepackages(), site.getusersitepackages()] if os.path.isdir(d)]
    stdlib = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib")}
    others = [p for p in sys.path if p and p not in sites and os.path.isdir(p)
              and not any(p == lib or p.startswith(lib + os.sep) for lib in stdlib)]
    return sites, others


def start_in_environment(environment: ExecutionEnvironment, spec: dict[str, Any],
                         out_prefix: str) -> tuple[EnvironmentWorker, Any]:
    """Start ``worker.main`` with the environment's interpreter; (the process, the parent's end
    of its connection).

    :raises PythonModelError: the interpreter cannot be started.
    """
    parent, child = socket.socketpair()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join([str(environment.root / "bin"), env.get("PATH", "")])
    try:
        popen = subprocess.Popen(
            [str(environment.python), "-c", _ENVIRONMENT_BOOTSTRAP, str(child.fileno())],
            pass_fds=(child.fileno(),), env=env,
        )
    except OSError as exc:
        parent.close()
        raise PythonModelError(
            f"model '{spec['name']}': the worker cannot be started with {environment.python}: {exc}") from None
    finally:
        child.close()
    conn = Connection(parent.detach())
    conn.send((*_server_import_paths(), spec, out_prefix))
    return EnvironmentWorker(popen), conn


def auto_complete_in_environment(environment: ExecutionEnvironment, spec: dict[str, Any],
                                 config: dict[str, Any]) -> dict[str, Any] | None:
    """Run the model's ``auto_complete_config`` in a short-lived worker in ``environment``
    (where model.py's imports resolve); the completed config, or None if it has none.

    :raises PythonModelError: the worker could not start, or model.py or its
        ``auto_complete_config`` failed (traceback in the message).
    """
    process, conn = start_in_environment(environment, spec, f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(4)}_ac")
    try:
        conn.send(("auto_complete", config))
        reply = conn.recv()
        with contextlib.suppress(OSError):
            conn.send(("stop",))
    except (EOFError, OSError):
        process.join(STOP_TIMEOUT_S)
        raise PythonModelError(f"model '{spec['name']}': the worker in {environment.described} "
                               f"exited with code {process.exitcode} before auto_complete_config answered") from None
    finally:
        conn.close()
        process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(STOP_TIMEOUT_S)
    if reply[0] != "ok":
        raise PythonModelError(reply[1])
    result: dict[str, Any] | None = reply[1]
    return result
