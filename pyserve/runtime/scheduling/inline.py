"""Schedulers that execute on the event loop (config parameter ``pyserve_inline_execute``).

For models whose execute takes microseconds (an identity, a small NumPy model): handing a
request to an instance thread and the answer back costs two thread wake-ups and GIL hand-offs,
which on a small machine cost more than such an execute. The price: while an execute runs the
server answers nothing else, so a slow or blocking execute (a sleep, I/O, a BLS call, a large
model) must keep the default instance threads.

* ``InlineScheduler``: each request is its own execute, at once, on the thread that enqueues it.
* ``InlineBatcher``: the dynamic batcher (``dynamic_batching { ... }``) with the same rules as
  ``DynamicBatcher`` (preferred sizes, ``max_queue_delay_microseconds``, shapes, priorities,
  queue policies, ordering); what arrives during one loop turn is batched at the end of it, and
  a queue delay waits on a loop timer, never blocking the loop.

For both, the instance threads only wait for ``stop``; ``worker`` is instance 0's
``InstanceWorker``, whose ``execute_batch`` does the work on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pyserve.api.inference import (
    InferRequest,
    RunningLoop,
    coalesced_delivery,
    enter_inline_delivery,
    exit_inline_delivery,
)
from pyserve.repository.model_config import ModelIO
from pyserve.runtime.scheduling.busy_poll import BusyPoll
from pyserve.runtime.scheduling.dynamic import DynamicBatcher
from pyserve.runtime.scheduling.instance import STOP, Batch, InstanceWorker

log = logging.getLogger("pyserve.execute")

INLINE_PARAMETER = "pyserve_inline_execute"
"""Config parameter (``"true"``) running a model's execute on the event loop thread."""


class LoopScheduler:
    """What both inline schedulers share: the model loader hands them the workers (``attach``;
    instance 0's, ``worker``, executes on the loop) when the instances start, and every
    instance thread only waits until ``_stopped`` is set."""

    observe: None = None

    def _init_on_the_loop(self) -> None:
        self.worker: InstanceWorker | None = None
        self._stopped = threading.Event()
        self._running_loop = RunningLoop()
        self._busy_poll = BusyPoll()  # ``--busy-poll-us``: keep the loop polling after an execute

    def attach(self, workers: Sequence[InstanceWorker]) -> None:
        """The model's instance workers, in instance order; call before the first request."""
        self.worker = workers[0]

    def batch_source(self, index: int) -> Callable[[], Batch | None]:
        return self._idle

    def _idle(self) -> Batch | None:
        self._stopped.wait()
        return STOP


class InlineScheduler(LoopScheduler):
    """Runs each request's execute at once, on the thread that enqueues it (the event loop).

    Off a loop (warm-up), the execute runs on the calling thread and answers go thread-safe.
    """

    def __init__(self) -> None:
        self._init_on_the_loop()

    def enqueue(self, request: InferRequest) -> None:
        worker = self.worker
        assert worker is not None, "InlineScheduler.worker is set when the model's instances start"
        loop = self._running_loop.get()
        if loop is None:  # not on a loop (warm-up): answers go thread-safe
            with coalesced_delivery():
                worker.execute_batch((request,))
            return
        outer = enter_inline_delivery(loop)  # not a context manager: this is the hot path
        try:
            worker.execute_batch((request,))
        finally:
            exit_inline_delivery(outer)
        self._busy_poll.touch(loop)

    def stop(self, workers: int) -> None:
        self._busy_poll.stop()
        self._stopped.set()


class InlineBatcher(LoopScheduler, DynamicBatcher):
    """The dynamic batcher, executing its batches on the event loop.

    ``enqueue`` (on the loop) queues the request as ``DynamicBatcher`` does (a full queue raises
    the same UNAVAILABLE error) and makes sure a drain runs once the loop turn's other events are
    handled; the drain executes every batch that is due and, when the head of the queue waits for
    its ``max_queue_delay_microseconds``, sets a loop timer for that moment. ``stop`` (on the loop
    when a model unloads) executes whatever is still queued before the instance threads stop.
    Off a loop (warm-up), a request is executed at once with whatever is queued beside it.
    """

    def __init__(self, config: Any, io: ModelIO) -> None:
        DynamicBatcher.__init__(self, config, io)
        self._init_on_the_loop()
        self._handle: asyncio.Handle | None = None  # the drain scheduled on the loop
        self._soon = False  # ``_handle`` runs this loop turn (not a delay timer)

    def enqueue(self, request: InferRequest) -> None:
        DynamicBatcher.enqueue(self, request)
        loop = self._running_loop.get()
        if loop is None:  # warm-up: nothing would drain later
            self._drain(None, force=True)
        elif not self._soon:  # a pending delay timer is replaced: this request may fill the batch
            if self._handle is not None:
                self._handle.cancel()
            self._handle = loop.call_soon(self._drain, loop)
            self._soon = True

    def _drain(self, loop: asyncio.AbstractEventLoop | None, force: bool = False) -> None:
        """Execute every batch due now; then arm a timer for the next deadline, if any."""
        self._handle = None
        self._soon = False
        worker = self.worker
        if worker is None or self._stopped.is_set():
            return
        wake_at = 0
        executed = False
        outer = enter_inline_delivery(loop) if loop is not None else None
        try:
            with coalesced_delivery() if loop is None else contextlib.nullcontext():
                while True:
                    with self._cond:
                        batch, wake_at = self.due(time.monotonic_ns(), force)
                    if batch is None:
                        break
                    worker.execute_batch(batch)
                    executed = True
        except Exception:  # a scheduler bug: logged; the next request arriving drains again
            log.exception("model '%s': the inline batcher failed", worker.instance.model.name)
        finally:
            if loop is not None:
                exit_inline_delivery(outer)
        if wake_at and loop is not None and self._handle is None:
            delay = max(wake_at - time.monotonic_ns(), 0) / 1e9
            self._handle = loop.call_later(delay, self._drain, loop)
        if executed and loop is not None and not self._stopped.is_set():
            self._busy_poll.touch(loop)

    def stop(self, workers: int) -> None:
        """Execute what is queued (everything is due once stopping), then stop the threads."""
        with self._cond:
            self._stopping = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            self._soon = False
        self._drain(asyncio._get_running_loop())  # ``_stopping``: every queued request is due
        self._busy_poll.stop()
        self._stopped.set()


def inline_mode(config: Any) -> str:
    """The config's ``pyserve_inline_execute``: ``"true"``, ``"false"``, ``"auto"``, or ``""`` when unset.

    ``"true"`` runs every execute on the event loop (this module); ``"auto"`` runs it there when
    that is the cheaper way (``pyserve.runtime.scheduling.adaptive``).

    :raises ValueError: another value, or ``"true"``/``"auto"`` on a model that cannot run inline
        (a sequence batcher, an ensemble, a decoupled model).
    """
    parameter = config.parameters.get(INLINE_PARAMETER)
    value = parameter.string_value.strip().lower() if parameter is not None else ""
    if value in ("", "false"):
        return value
    if value not in ("true", "auto"):
        raise ValueError(f"parameter '{INLINE_PARAMETER}' must be \"true\", \"auto\" or \"false\", got '{value}'")
    blocker = inline_blocker(config)
    if blocker:
        raise ValueError(f"parameter '{INLINE_PARAMETER}' cannot be {blocker}")
    return value


def inline_blocker(config: Any) -> str:
    """Why no execute of this model may run on the event loop (as the end of a sentence), or ``""``."""
    for field, what in (("sequence_batching", "the sequence batcher"), ("ensemble_scheduling", "an ensemble")):
        if config.HasField(field):
            return f"combined with {what}"
    if config.model_transaction_policy.decoupled:
        return "used by a decoupled model"
    return ""
