"""Ensembles follow their step models: a change of a step model re-checks the ensembles using it."""

from __future__ import annotations

import logging

from pyserve.repository import model_config
from pyserve.repository.ensemble_plan import build_plan
from pyserve.runtime.event_loop import LoopRunner
from pyserve.runtime.registry import ModelRegistry
from pyserve.runtime.versions import ModelState, ModelVersion

log = logging.getLogger("pyserve.runtime.versions")

STEPS_UNAVAILABLE = "ensemble contains models that are not available or no longer fit: "
"""How the reason of an ensemble version made UNAVAILABLE by a change of its step models starts."""


def _ready_again(version: ModelVersion) -> None:
    version.state = ModelState.READY
    version.reason = ""


def _uses(version: ModelVersion, changed: str) -> bool:
    """Whether ``version`` is a built ensemble (READY, or UNAVAILABLE by its steps) using ``changed``."""
    config = version.config
    return not (config is None or version.io is None or version.scheduler is None
                or config.platform != model_config.ENSEMBLE_PLATFORM
                or all(step.model_name != changed for step in config.ensemble_scheduling.step)
                or not (version.ready or version.reason.startswith(STEPS_UNAVAILABLE)))


class EnsembleChecks:
    """Keeps the ensembles' states in line with their step models (``recheck``), until ``stop``.

    :param registry: the models; ensemble versions in it change state on ``loop``.
    :param loop: where the state changes are made.
    """

    def __init__(self, registry: ModelRegistry, loop: LoopRunner) -> None:
        self._registry = registry
        self._loop = loop
        self._stopped = False

    def stop(self) -> None:
        """No more re-checks (shutdown began: the step models go one by one)."""
        self._stopped = True

    def recheck(self, changed: str, seen: frozenset[str] = frozenset()) -> None:
        """Check the ensembles that use ``changed`` against the step models as they are now.

        As Triton: an ensemble whose step model was unloaded, or reloaded with other tensors,
        becomes UNAVAILABLE (reason ``STEPS_UNAVAILABLE`` + the problems); one that became
        UNAVAILABLE this way is READY again once its step models fit. An ensemble that changed
        state has the ensembles using it checked in turn. Not after ``stop``.
        """
        if self._stopped:
            return
        seen = seen | {changed}
        flipped: set[str] = set()
        for name, record in sorted(list(self._registry.records.items())):
            for version in list(record.versions.values()):
                if _uses(version, changed) and self._check(name, version):
                    flipped.add(name)
        for name in sorted(flipped - seen):  # ensembles of ensembles
            self.recheck(name, seen)

    def _check(self, name: str, version: ModelVersion) -> bool:
        """Fail or restore one ensemble version. :returns: whether it changed state."""
        assert version.io is not None
        try:
            build_plan(version.config, version.io, self._registry.get)
        except ValueError as exc:
            reason = STEPS_UNAVAILABLE + "; ".join(str(exc).splitlines())
            was_ready = version.ready
            if was_ready:
                log.error("ensemble '%s' version %d is UNAVAILABLE: %s", name, version.version, reason)
            self._loop.call(lambda: version.fail(reason))
            return was_ready
        if version.ready:
            return False
        log.info("ensemble '%s' version %d is READY again: its step models fit", name, version.version)
        self._loop.call(lambda: _ready_again(version))
        return True
