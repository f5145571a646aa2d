"""Process limits the server sets at start and the connection caps derived from them.

``raise_descriptor_limit`` lifts the soft ``RLIMIT_NOFILE`` to the hard one (as most servers
do: the soft default of 1024 is too few for many clients); ``connection_limit`` is the default of
``--http-max-connections`` and ``--grpc-max-connections``: each port may take half of the
descriptors left after a reserve for model files, logs and the server's own sockets, at most
``MAX_DEFAULT_CONNECTIONS``. ``RefusalLog`` writes one warning when a cap is first hit and then
at most one a minute, with the count refused since.
"""

from __future__ import annotations

import logging
import time

try:
    import resource
except ImportError:  # not on this platform: limits are left as they are
    resource = None  # type: ignore[assignment]

RESERVED_DESCRIPTORS = 256
"""Descriptors kept out of the connection caps (models, files, pipes, listening sockets)."""
MAX_DEFAULT_CONNECTIONS = 16_384
"""The default connection cap of one port never goes above this (memory, not descriptors)."""
MIN_DEFAULT_CONNECTIONS = 64


def descriptor_limit() -> int:
    """The soft limit on open descriptors (0: unknown)."""
    if resource is None:
        return 0
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 0 if soft == resource.RLIM_INFINITY else int(soft)


def raise_descriptor_limit() -> int:
    """Raise the soft descriptor limit to the hard one; the soft limit in force afterwards.

    Never raises: a platform or sandbox that refuses leaves the limit as it was.
    """
    if resource is None:
        return 0
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        pass
    return descriptor_limit()


def connection_limit(configured: int) -> int:
    """The connection cap of one port: ``configured`` when above 0, else the default from the
    descriptor limit in force now (see the module docstring)."""
    if configured > 0:
        return configured
    descriptors = descriptor_limit()
    if descriptors <= 0:
        return MAX_DEFAULT_CONNECTIONS
    return max(MIN_DEFAULT_CONNECTIONS, min(MAX_DEFAULT_CONNECTIONS, (descriptors - RESERVED_DESCRIPTORS) // 2))


class RefusalLog:
    """Warns that connections are being refused: at the first refusal, then at most once a minute.

    :param logger: where the warning goes.
    :param what: names the port and the flag in the message.
    """

    INTERVAL_S = 60.0

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._log = logger
        self._what = what
        self._refused = 0
        self._last = -self.INTERVAL_S

    def refused(self, limit: int) -> None:
        """One connection was refused at ``limit`` open connections."""
        self._refused += 1
        now = time.monotonic()
        if now - self._last >= self.INTERVAL_S:
            self._log.warning("%s: %d open connections, the limit: refused %d new connection(s)",
                              self._what, limit, self._refused)
            self._refused = 0
            self._last = now
