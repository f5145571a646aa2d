"""Backend readiness checks behind the ready endpoints (``pyserve_instance_ready``).

A READY model version is ready for a client only when every one of its instances passes its
backend's check (Triton asks ``TRITONBACKEND_ModelInstanceReady``; its Python backend calls the
model's ``is_ready()``). Checks run on a few threads of their own, never on the event loop;
each is bounded by ``timeout_s`` (5 s, as Triton's Python backend), and a question that comes
while an instance's check still runs waits for that check rather than starting another.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyserve.api.backend import InstanceContext
    from pyserve.runtime.versions import ModelVersion

log = logging.getLogger("pyserve.runtime.readiness")

CHECK_TIMEOUT_S = 5.0
"""How long a ready endpoint waits for one instance's check before it answers "not ready"."""


class ReadinessChecks:
    """Runs the instances' readiness checks for the ready endpoints.

    Thread-safety: ``version_ready`` runs on the server's event loop (one loop per server);
    the checks themselves run on this object's threads.

    :param timeout_s: the longest wait for one check.
    """

    def __init__(self, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._pool: ThreadPoolExecutor | None = None
        self._running: dict[InstanceContext, asyncio.Future[Any]] = {}  # instance → its check in progress

    async def version_ready(self, version: ModelVersion) -> bool:
        """Whether a version is READY and every instance's check says it can serve."""
        if not version.ready:
            return False
        backend = version.backend
        if backend is None or not backend.hooks.checks_ready:
            return True
        checks = [self._check(version, instance, backend.hooks.instance_ready) for instance in list(version.instances)]
        return all(await asyncio.gather(*checks))

    async def _check(self, version: ModelVersion, instance: InstanceContext, hook: Callable[..., Any]) -> bool:
        future = self._running.get(instance)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pyserve-ready")
            future = asyncio.get_running_loop().run_in_executor(self._pool, lambda: hook(instance=instance))
            self._running[instance] = future
            future.add_done_callback(lambda done: self._forget(instance, done))
        name = f"model '{version.name}' version {version.version} instance '{instance.name}'"
        try:
            answer = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            log.warning("%s: readiness check still running after %.1f s: not ready", name, self.timeout_s)
            return False
        except Exception as exc:
            log.warning("%s: readiness check failed: %s: %s", name, type(exc).__name__, exc)
            return False
        if answer is None or answer is True:
            return True
        if answer is not False:
            log.warning("%s: readiness check returned %s, not a bool: not ready", name, type(answer).__name__)
        return False

    def _forget(self, instance: InstanceContext, done: asyncio.Future[Any]) -> None:
        if self._running.get(instance) is done:
            del self._running[instance]
        if not done.cancelled():
            done.exception()  # a check that finished after its waiters gave up: mark its error as seen

    def close(self) -> None:
        """Stop the check threads (a check still running is left to finish on its own)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
