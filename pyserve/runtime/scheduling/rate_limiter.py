"""Triton's rate limiter (``--rate-limit execution_count``): instances execute only while the
resources their ``instance_group { rate_limiter { resources [...] priority } }`` names are free.

Resources are counted per device (a GPU instance's device, or the host for CPU instances)
unless ``global: true``. How many units of a resource there are: ``--rate-limit-resource
NAME:COUNT[:DEVICE]`` (no device: every device), else the largest count any loaded instance asks
for on that device, so that every instance can run on its own. An instance takes its units when
it has a batch to execute and gives them back when the execute returns; an instance that asks
for nothing is not limited.

When several instances wait, the one that has been granted least, weighted by its ``priority``,
goes first (an instance with priority 2 gets half the turns of one with priority 1 while both
wait); one that does not fit in what is free lets the next one that fits go (backfill).

Thread-safety: every method may be called from any thread; ``acquire`` blocks the caller (an
instance's worker thread, never the event loop).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

GLOBAL = -2
"""The device key of ``global: true`` resources."""
HOST = -1
"""The device key of CPU instances' resources."""

ResourceKey = tuple[str, int]
"""(resource name, device key): a GPU device id, ``HOST`` or ``GLOBAL``."""


class RateLimitError(ValueError):
    """A ``--rate-limit-resource`` value that cannot be parsed, or fewer units than an instance needs."""


@dataclass(eq=False)
class ResourceClaim:
    """What one instance needs to execute: units per resource key, and its priority (weight).

    Compared by identity: one claim per instance.
    """

    instance: str
    needs: Mapping[ResourceKey, int]
    priority: int = 1
    turns: float = field(default=0.0, init=False)
    """The weighted count of grants so far (fair ordering among waiters)."""


def parse_resource(value: str) -> tuple[str, int, int | None]:
    """``NAME:COUNT[:DEVICE]`` → (name, count, device or None for every device).

    :raises RateLimitError: not in that form, or a negative count or device.
    """
    parts = value.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise RateLimitError(f"--rate-limit-resource '{value}': expected NAME:COUNT or NAME:COUNT:DEVICE")
    try:
        count = int(parts[1])
        device = int(parts[2]) if len(parts) == 3 else None
    except ValueError:
        raise RateLimitError(f"--rate-limit-resource '{value}': COUNT and DEVICE must be integers") from None
    if count < 0 or (device is not None and device < 0):
        raise RateLimitError(f"--rate-limit-resource '{value}': COUNT and DEVICE must not be negative")
    return parts[0], count, device


def instance_claim(instance: str, kind: str, device: int, rate_limiter: Any) -> ResourceClaim:
    """The claim of one instance of an instance group whose ``rate_limiter`` message is
    ``rate_limiter`` (``kind`` ``"GPU"`` counts per ``device``, others on the host)."""
    needs: dict[ResourceKey, int] = {}
    for resource in rate_limiter.resources:
        if resource.count <= 0:
            continue
        where = GLOBAL if getattr(resource, "global") else (device if kind == "GPU" else HOST)
        needs[(resource.name, where)] = needs.get((resource.name, where), 0) + resource.count
    return ResourceClaim(instance, needs, max(rate_limiter.priority, 1))


class _Waiter:
    __slots__ = ("claim", "granted", "order")

    def __init__(self, claim: ResourceClaim, order: int) -> None:
        self.claim = claim
        self.order = order
        self.granted = False


class RateLimiter:
    """The server's resource pool (one per server; see the module docstring).

    :param resources: ``--rate-limit-resource`` values (``NAME:COUNT[:DEVICE]``).
    :raises RateLimitError: a value cannot be parsed.
    """

    def __init__(self, resources: Iterable[str] = ()) -> None:
        self._overrides: dict[tuple[str, int | None], int] = {}
        for value in resources:
            name, count, device = parse_resource(value)
            self._overrides[(name, device)] = count
        self._claims: list[ResourceClaim] = []
        self._in_use: dict[ResourceKey, int] = {}
        self._waiting: list[_Waiter] = []
        self._orders = itertools.count()
        self._cond = threading.Condition()

    # -- instances come and go with their models ------------------------------------------------
    def register(self, claims: Iterable[ResourceClaim]) -> None:
        """Add a model version's instances (at load).

        :raises RateLimitError: ``--rate-limit-resource`` gives fewer units than one of them needs.
        """
        claims = [c for c in claims if c.needs]
        for claim in claims:
            for key, count in claim.needs.items():
                given = self._override(key)
                if given is not None and given < count:
                    name, device = key
                    where = "globally" if device == GLOBAL else ("on the host" if device == HOST else f"on device {device}")
                    raise RateLimitError(
                        f"instance '{claim.instance}' needs {count} unit(s) of resource '{name}' {where}, but "
                        f"--rate-limit-resource gives {given}"
                    )
        with self._cond:
            floor = min((c.turns for c in self._claims), default=0.0)
            for claim in claims:
                claim.turns = floor  # a newcomer starts level with the others, not ahead of them
            self._claims.extend(claims)

    def unregister(self, claims: Iterable[ResourceClaim]) -> None:
        """Remove a model version's instances (at unload); their resources' defaults shrink."""
        gone = {id(c) for c in claims}
        with self._cond:
            self._claims = [c for c in self._claims if id(c) not in gone]
            self._dispatch()

    def capacity(self, key: ResourceKey) -> int:
        """How many units of ``key`` there are now."""
        given = self._override(key)
        if given is not None:
            return given
        waiting = [w.claim for w in self._waiting]  # a waiter whose model is unloading still runs
        return max((c.needs.get(key, 0) for c in [*self._claims, *waiting]), default=0)

    def _override(self, key: ResourceKey) -> int | None:
        name, device = key
        if device >= 0 and (name, device) in self._overrides:
            return self._overrides[(name, device)]
        return self._overrides.get((name, None))

    # -- executes --------------------------------------------------------------------------------
    def acquire(self, claim: ResourceClaim) -> None:
        """Block until ``claim``'s units are free, and take them."""
        if not claim.needs:
            return
        with self._cond:
            waiter = _Waiter(claim, next(self._orders))
            self._waiting.append(waiter)
            self._dispatch()
            while not waiter.granted:
                self._cond.wait()

    def release(self, claim: ResourceClaim) -> None:
        """Give ``claim``'s units back (after its execute) and let waiters that now fit go."""
        if not claim.needs:
            return
        with self._cond:
            for key, count in claim.needs.items():
                self._in_use[key] -= count
            self._dispatch()

    def in_use(self, key: ResourceKey) -> int:
        """Units of ``key`` taken now (for tests and diagnostics)."""
        with self._cond:
            return self._in_use.get(key, 0)

    def _dispatch(self) -> None:
        """Grant every waiter that fits, fewest weighted turns first (called under the lock)."""
        if not self._waiting:
            return
        granted = False
        for waiter in sorted(self._waiting, key=lambda w: (w.claim.turns, w.order)):
            needs = waiter.claim.needs
            if all(self._in_use.get(key, 0) + count <= self.capacity(key) for key, count in needs.items()):
                for key, count in needs.items():
                    self._in_use[key] = self._in_use.get(key, 0) + count
                waiter.claim.turns += max(waiter.claim.priority, 1)
                waiter.granted = granted = True
        if granted:
            self._waiting = [w for w in self._waiting if not w.granted]
            self._cond.notify_all()
