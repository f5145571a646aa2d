"""Schedulers: how queued requests become batches for a model's instances.

The model's ``InstanceWorker`` threads call the scheduler's ``next_batch`` whenever they are
free. ``enqueue`` is called on the event loop and must not block.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pyserve.api.inference import InferRequest, InferResponse
from pyserve.repository.model_config import ModelIO
from pyserve.runtime.scheduling.adaptive import (
    AdaptiveBatcher,
    AdaptiveScheduler,
    LoopShortcut,
    inline_limit_ns,
)
from pyserve.runtime.scheduling.dynamic import DynamicBatcher
from pyserve.runtime.scheduling.inline import (
    INLINE_PARAMETER,
    InlineBatcher,
    InlineScheduler,
    LoopScheduler,
    inline_blocker,
    inline_mode,
)
from pyserve.runtime.scheduling.instance import STOP, Batch, InstanceWorker
from pyserve.runtime.scheduling.sequence import SequenceBatcher

log = logging.getLogger("pyserve.runtime.scheduling")

__all__ = [
    "INLINE_PARAMETER", "STOP", "AdaptiveBatcher", "AdaptiveScheduler", "Batch", "DefaultScheduler",
    "DynamicBatcher", "InlineBatcher", "InlineScheduler", "InstanceWorker", "LoopScheduler", "LoopShortcut",
    "Scheduler", "SequenceBatcher", "scheduler_for",
]


class Scheduler(Protocol):
    """What the data plane and the instance workers need from a scheduler."""

    def enqueue(self, request: InferRequest) -> None:
        """Queue one request; never blocks; called on the event loop.

        :raises InferError: the request is refused (e.g. the queue is full).
        """

    def batch_source(self, index: int) -> Callable[[], Batch | None]:
        """Instance ``index``'s blocking "next batch" call; ``STOP`` ends the worker."""

    @property
    def observe(self) -> Callable[[InferRequest, InferResponse], None] | None:
        """Called with each successful raw response, or None."""

    def stop(self, workers: int) -> None:
        """Let the workers finish what is queued, then stop them."""


class DefaultScheduler:
    """Triton's default scheduler: each request is its own execute, on the first free instance."""

    observe = None

    def __init__(self) -> None:
        self.work: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()

    def batch_source(self, index: int) -> Callable[[], Batch | None]:
        return self.work.get

    def enqueue(self, request: InferRequest) -> None:
        self.work.put((request,))

    def stop(self, workers: int) -> None:
        for _ in range(workers):
            self.work.put(STOP)


def scheduler_for(config: Any, io: ModelIO, instances: int, model_dir: Path, inline_allowed: bool = True,
                  adaptive_default: bool = False) -> Scheduler:
    """The scheduler a model's config asks for.

    :param inline_allowed: False when the instances take rate-limiter resources, which they may
        have to wait for: never on the event loop (``pyserve_inline_execute`` is then ignored).
    :param adaptive_default: the model may execute on the event loop when that is cheaper
        (its backend declares it compute-only and its instances are CPU instances): without
        ``pyserve_inline_execute`` in the config, a model without a scheduling block gets the
        ``AdaptiveScheduler`` and one with ``dynamic_batching`` and no queue delay the
        ``AdaptiveBatcher``, as with ``"auto"``.
    :raises ValueError: the scheduling block cannot be used as configured.
    """
    mode = inline_mode(config)
    limit = inline_limit_ns(config)  # checked whenever it is set
    if mode in ("true", "auto") and not inline_allowed:
        log.warning("model '%s': pyserve_inline_execute is ignored: its instances wait for rate-limiter "
                    "resources, which the event loop must not", config.name)
    elif mode == "true":
        return InlineBatcher(config, io) if config.HasField("dynamic_batching") else InlineScheduler()
    elif mode == "auto" or (mode == "" and adaptive_default and inline_allowed and not inline_blocker(config)):
        if not config.HasField("dynamic_batching"):
            return AdaptiveScheduler(limit)
        if not config.dynamic_batching.max_queue_delay_microseconds:  # a queue delay waits for company
            return AdaptiveBatcher(config, io, limit)
    if config.HasField("sequence_batching"):
        return SequenceBatcher(config, io, instances, model_dir)
    if config.HasField("dynamic_batching"):
        return DynamicBatcher(config, io)
    return DefaultScheduler()
