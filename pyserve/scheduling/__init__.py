"""Schedulers: how queued requests become batches for a model's instances.

The model's ``InstanceWorker`` threads call the scheduler's ``next_batch`` whenever they are
free. ``enqueue`` is called on the event loop and must not block.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Protocol

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyserve.inference import InferRequest, InferResponse, coalesced_delivery, enter_inline_delivery, exit_inline_delivery
from pyserve.model_config import ModelIO
from pyserve.scheduling.dynamic import DynamicBatcher
from pyserve.scheduling.instance import STOP, Batch, InstanceWorker
from pyserve.scheduling.sequence import SequenceBatcher

__all__ = [
    "STOP", "Batch", "DefaultScheduler", "DynamicBatcher", "InlineScheduler", "InstanceWorker", "Scheduler",
    "SequenceBatcher", "scheduler_for",
]


class Scheduler(Protocol):
    """What the data plane and the instance workers need from a scheduler."""

    def enqueue(self, request: InferRequest) -> None:
        """Queue one request; never blocks; called on the event loop.

        :raises InferError: the request is refused (e.g. the queue is full).
        """

    def batch_source(self, index: int) -> Callable[[], Batch | None]:
        """Instance ``index``'s blocking "next batch" call; ``STOP`` ends the worker."""

    observe: Callable[[InferRequest, InferResponse], None] | None
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


INLINE_PARAMETER = "pyserve_inline_execute"
"""Config parameter (``"true"``) running a model's execute on the event loop thread."""


class InlineScheduler:
    """Runs each request's execute at once, on the thread that enqueues it (the event loop).

    For models whose execute takes microseconds (an identity or a small NumPy model): it saves
    the two thread wake-ups of handing the request to an instance thread and the answer back,
    which on a small machine cost more than such an execute. The price: while the execute runs,
    the server answers nothing else, so a slow or blocking execute (a sleep, I/O, a BLS call,
    a large model) must keep the default instance threads. Chosen with config parameter
    ``pyserve_inline_execute: "true"``; refused for batching, sequence, ensemble and decoupled
    models (they need their queues and threads).

    The instance thread of instance 0 only waits for ``stop``; ``worker`` is that instance's
    ``InstanceWorker``, whose ``execute_batch`` does the work.
    """

    observe = None

    def __init__(self) -> None:
        self.worker: InstanceWorker | None = None
        self._stopped = threading.Event()

    def batch_source(self, index: int) -> Callable[[], Batch | None]:
        return self._idle

    def _idle(self) -> Batch | None:
        self._stopped.wait()
        return STOP

    def enqueue(self, request: InferRequest) -> None:
        worker = self.worker
        assert worker is not None, "InlineScheduler.worker is set when the model's instances start"
        loop = asyncio._get_running_loop()
        if loop is None:  # not on a loop (warm-up): answers go thread-safe
            with coalesced_delivery():
                worker.execute_batch((request,))
            return
        outer = enter_inline_delivery(loop)  # not a context manager: this is the hot path
        try:
            worker.execute_batch((request,))
        finally:
            exit_inline_delivery(outer)

    def stop(self, workers: int) -> None:
        self._stopped.set()


def _inline_requested(config: Any) -> bool:
    parameter = config.parameters.get(INLINE_PARAMETER)
    value = parameter.string_value.strip().lower() if parameter is not None else ""
    if value in ("", "false"):
        return False
    if value != "true":
        raise ValueError(f"parameter '{INLINE_PARAMETER}' must be \"true\" or \"false\", got '{value}'")
    for field, what in (("dynamic_batching", "dynamic batching"), ("sequence_batching", "the sequence batcher"),
                        ("ensemble_scheduling", "an ensemble")):
        if config.HasField(field):
            raise ValueError(f"parameter '{INLINE_PARAMETER}' cannot be combined with {what}")
    if config.model_transaction_policy.decoupled:
        raise ValueError(f"parameter '{INLINE_PARAMETER}' cannot be used by a decoupled model")
    return True


def scheduler_for(config: Any, io: ModelIO, instances: int, model_dir: Path) -> Scheduler:
    """The scheduler a model's config asks for.

    :raises ValueError: the scheduling block cannot be used as configured.
    """
    if _inline_requested(config):
        return InlineScheduler()
    if config.HasField("sequence_batching"):
        return SequenceBatcher(config, io, instances, model_dir)
    if config.HasField("dynamic_batching"):
        return DynamicBatcher(config, io)
    return DefaultScheduler()
