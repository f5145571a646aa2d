"""Schedulers that execute on the event loop when that is the cheaper way.

``pyserve_inline_execute: "auto"``, and the default for a model whose backend declares it
compute-only (``ModelContext.compute_only``: the framework backends) and whose instances are all
``KIND_CPU``. Handing a request to an instance thread and its answer back costs two thread
wake-ups, ~250 µs on a small virtual machine: more than a small model's whole execute. Running
the execute on the loop instead costs the loop that execute's time, which matters only when
someone else is waiting for the loop. So a request executes on the loop (with instance 0) when

* it is enqueued on the event loop (not from another thread, not during warm-up),
* no request of this model is queued or executing on an instance thread,
* the model's recent executes were short: a running estimate below 1 ms (config parameter
  ``pyserve_inline_max_us``, in microseconds, sets another limit). It starts
  unknown (above the limit): the first executes run on the threads and are timed there; one
  slow execute raises the estimate at once, short ones lower it gradually, and
* either every request of the last 10 ms came over one client connection
  (``pyserve.runtime.scheduling.client_activity``: one client talks to the server, request
  after request, and nobody else's request is waiting behind the execute), or, with the
  ``AdaptiveScheduler``, the estimate is below 100 µs (``SHARED_LIMIT_NS``): then the other
  clients' requests wait for the loop less than a hand-off to an instance thread would cost
  (a Python ``model.py`` that echoes a small tensor executes in ~30 µs; with eight or more
  connections the loop answers 10-20% more requests than with the threads).

Otherwise the request goes to the instance threads, as with the scheduler the config names:

* ``AdaptiveScheduler``: no scheduling block (Triton's default scheduler).
* ``AdaptiveBatcher``: ``dynamic_batching`` without ``max_queue_delay_microseconds``, where the
  batcher would send a lone request at once anyway; a request alone in an empty queue may then
  run on the loop, and everything else is the ``DynamicBatcher``'s. The one client must also
  send one request at a time (``client_activity.one_request_at_a_time``): requests that arrive
  together (several gRPC streams of one connection) are worth batching, and executing each
  alone on the loop would lose that (a TensorFlow model at eight streams: half the
  throughput). Requests that do arrive together, from several connections or streams, still
  execute on the loop while the model's batches are estimated under 100 µs: the first of them
  schedules a drain (``loop.call_soon``), the others that the loop reads in the same turn join
  its queue, and the drain executes them as batches, as the threads would have, without the two
  wake-ups per batch (a Python ``model.py`` echoing a small tensor at 32 HTTP connections). With
  a queue delay the batcher should wait for company: it keeps its threads.

While the loop executes, the instance threads do not start another batch, so an instance never
runs two executes at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from pyserve.api.inference import (
    InferRequest,
    RunningLoop,
    enter_inline_delivery,
    exit_inline_delivery,
)
from pyserve.repository.model_config import ModelIO
from pyserve.runtime.scheduling import client_activity
from pyserve.runtime.scheduling.busy_poll import BusyPoll
from pyserve.runtime.scheduling.dynamic import DynamicBatcher
from pyserve.runtime.scheduling.instance import STOP, Batch, InstanceWorker

AUTO_LIMIT_NS = 1_000_000
"""Executes estimated longer than this (1 ms) run on the instance threads (the default of
config parameter ``pyserve_inline_max_us``)."""

LIMIT_PARAMETER = "pyserve_inline_max_us"
"""Config parameter: the longest estimated execute, in microseconds, that runs on the loop."""


def inline_limit_ns(config: Any) -> int:
    """The config's ``pyserve_inline_max_us`` in nanoseconds (``AUTO_LIMIT_NS`` when unset).

    :raises ValueError: the value is not a positive whole number of microseconds.
    """
    parameter = config.parameters.get(LIMIT_PARAMETER)
    if parameter is None:
        return AUTO_LIMIT_NS
    text = parameter.string_value.strip()
    if not (text.isascii() and text.isdigit()) or int(text) <= 0:
        raise ValueError(f"parameter '{LIMIT_PARAMETER}' must be a positive number of microseconds, got '{text}'")
    return int(text) * 1000

SHARED_LIMIT_NS = 100_000
"""``AdaptiveScheduler``: executes estimated shorter than this (100 µs, or the model's
``pyserve_inline_max_us`` if lower) run on the loop even while several clients send."""

_UNKNOWN_NS = 1 << 62
"""The estimate before the first execute was timed."""


class LoopShortcut:
    """What both adaptive schedulers share: the estimate, the choice, the execute on the loop.

    A subclass provides ``_cond`` (its lock) and, to ``_init_shortcut``, ``pending`` (whether
    requests wait for its threads; called with the lock held) and ``alone`` (whether nobody
    else waits for the loop: a ``client_activity`` question). Its threads must not take a
    batch while ``_held`` (the loop executes); ``_timed_source`` counts in ``_executing`` the
    batches they took and did not finish.
    """

    _cond: threading.Condition

    def _init_shortcut(self, limit_ns: int, pending: Callable[[], object], alone: Callable[[], bool],
                       shared_limit_ns: int = 0) -> None:
        self._pending = pending
        self._alone = alone  # whether nobody else waits for the loop (``client_activity``)
        self._shared_limit_ns = min(shared_limit_ns, limit_ns)  # shorter: on the loop even when not alone
        self.workers: Sequence[InstanceWorker] = ()  # set by the model loader; instance 0 executes on the loop
        self._limit_ns = limit_ns
        self._held = False  # the loop executes now: the threads wait
        self._executing = 0  # batches the threads took and did not finish
        self._estimate_ns = _UNKNOWN_NS
        self._running_loop = RunningLoop()
        self._busy_poll = BusyPoll()  # ``--busy-poll-us``: keep the loop polling after an execute

    def attach(self, workers: Sequence[InstanceWorker]) -> None:
        """The model's instance workers, in instance order; call before the first request."""
        self.workers = workers

    @property
    def estimate_ns(self) -> int:
        """The running estimate of one execute's time (very large until one was timed)."""
        return self._estimate_ns

    def _record(self, elapsed_ns: int) -> None:
        """Fold one execute's time into the estimate: up at once, down by an eighth of the gap."""
        estimate = self._estimate_ns
        if elapsed_ns >= estimate or estimate == _UNKNOWN_NS:
            self._estimate_ns = elapsed_ns
        else:
            self._estimate_ns = estimate - ((estimate - elapsed_ns) >> 3)

    def _loop_takes(self) -> bool:
        """With ``_cond`` held: whether the request being enqueued executes on the loop now
        (then ``_held`` is set, and ``_run_on_loop`` must follow)."""
        if (self._executing or self._held or self._estimate_ns >= self._limit_ns or self._pending()
                or (self._estimate_ns >= self._shared_limit_ns and not self._alone())):
            return False
        self._held = True
        return True

    def _run_on_loop(self, loop: asyncio.AbstractEventLoop, request: InferRequest) -> None:
        """Execute ``request`` alone on the loop (``_loop_takes`` said so), time it, let the
        threads go on."""
        self._execute_on_loop(loop, (request,), release=True)
        self._busy_poll.touch(loop)

    def _execute_on_loop(self, loop: asyncio.AbstractEventLoop, batch: Batch, release: bool) -> None:
        """Execute ``batch`` on the loop with instance 0 (``_held`` is set) and time it; with
        ``release``, let the threads go on after it (in the same lock round)."""
        worker = self.workers[0]
        outer = enter_inline_delivery(loop)  # not a context manager: this is the hot path
        try:
            worker.execute_batch(batch)
        finally:
            exit_inline_delivery(outer)
            with self._cond:
                self._record(worker.last_execute_ns)
                if release:
                    self._release_threads()

    def _release_threads(self) -> None:
        """With ``_cond`` held: the loop executes no more; wake the threads if requests wait
        (queued meanwhile from another thread, a nested enqueue, or left by a drain)."""
        self._held = False
        if self._pending():
            self._cond.notify_all()

    def _timed_source(self, index: int, take: Callable[[], Batch | None]) -> Callable[[], Batch | None]:
        """Instance ``index``'s ``next_batch``: ``take`` (called with ``_cond`` held, waiting
        while ``_held``) hands out a batch, which counts in ``_executing`` until the thread asks
        again; then its execute's own time (``InstanceWorker.last_execute_ns``: not the hand-off,
        nor a wait for the GIL around it) goes into the estimate."""
        cond = self._cond
        holding = False  # this thread executes a batch it took

        def next_batch() -> Batch | None:
            nonlocal holding
            with cond:
                if holding:  # the previous batch is done (executed and answered)
                    self._executing -= 1
                    self._record(self.workers[index].last_execute_ns)
                batch = take()
                holding = batch is not STOP
                if holding:
                    self._executing += 1
                return batch

        return next_batch


class AdaptiveScheduler(LoopShortcut):
    """Triton's default scheduler (each request its own execute, on the first free instance)
    that executes a request on the event loop when that is the cheaper way (module docstring).

    ``enqueue`` is called on the event loop (or, rarely, from another thread: then the request
    always goes to the threads) and never blocks for long: at most for the lock that the
    instance threads hold while they take a batch.
    """

    observe: None = None

    def __init__(self, limit_ns: int = AUTO_LIMIT_NS) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[Batch | None] = deque()
        self._init_shortcut(limit_ns, pending=self._queue.__len__, alone=client_activity.one_client,
                            shared_limit_ns=SHARED_LIMIT_NS)

    def enqueue(self, request: InferRequest) -> None:
        loop = self._running_loop.get()
        with self._cond:
            if loop is None or not self.workers or not self._loop_takes():
                self._queue.append((request,))
                self._cond.notify()
                return
        self._run_on_loop(loop, request)

    def batch_source(self, index: int) -> Callable[[], Batch | None]:
        return self._timed_source(index, self._take)

    def _take(self) -> Batch | None:
        while not self._queue or self._held:
            self._cond.wait()
        return self._queue.popleft()

    def stop(self, workers: int) -> None:
        """Let the threads finish what is queued, then stop each of them."""
        self._busy_poll.stop()
        with self._cond:
            self._queue.extend([STOP] * workers)
            self._cond.notify_all()


class AdaptiveBatcher(LoopShortcut, DynamicBatcher):
    """The dynamic batcher (``max_queue_delay_microseconds`` 0) that executes on the event loop
    when that is the cheaper way (module docstring): a request alone in an empty queue at once,
    and, while its batches execute in under 100 µs, what several clients send in one turn of
    the loop as one batch (a drain scheduled with ``call_soon`` after the first of them).

    Everything else is ``DynamicBatcher``'s: preferred sizes, shapes, priorities, queue
    policies, ordering; its instance threads wait while the loop executes or a drain is
    scheduled (``_held``).
    """

    def __init__(self, config: Any, io: ModelIO, limit_ns: int = AUTO_LIMIT_NS) -> None:
        DynamicBatcher.__init__(self, config, io)
        # requests that arrive together should be batched: only one request at a time runs on the loop
        self._init_shortcut(limit_ns, pending=self._head, alone=client_activity.one_request_at_a_time)
        self._drain_limit_ns = min(SHARED_LIMIT_NS, limit_ns)  # batches estimated shorter: drained on the loop
        self._drain_scheduled = False  # a drain waits in the loop's ready queue: enqueues join it

    def enqueue(self, request: InferRequest) -> None:
        loop = self._running_loop.get()
        # unlocked look first: under load a batch is executing, and one lock round is enough
        if loop is None or not self.workers or self._executing or (self._held and not self._drain_scheduled):
            DynamicBatcher.enqueue(self, request)
            return
        with self._cond:
            if self._drain_scheduled:  # the scheduled drain takes it, with the others of this turn
                self._append(*self._item(request))
                return
            if not self._loop_takes():
                drains = self._loop_drains()  # before the request is queued: whether others wait
                self._append(*self._item(request))
                if drains:
                    self._held = self._drain_scheduled = True
                    loop.call_soon(self._drain, loop)
                else:
                    self._cond.notify()
                return
            if self._order is not None:  # numbered in arrival order, as queued ones are
                self._order.wrap(request)
        self._run_on_loop(loop, request)

    def _loop_drains(self) -> bool:
        """With ``_cond`` held: whether a drain on the loop should batch this turn's requests
        (nobody executes or waits, and batches are estimated under the drain limit)."""
        return not (self._executing or self._held or self._pending() or self._estimate_ns >= self._drain_limit_ns)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: execute what was queued since the drain was scheduled, batch after
        batch with instance 0, then let the threads go on (also with what is left, once a batch
        was estimated over the drain limit)."""
        cond = self._cond
        with cond:
            if not self._drain_scheduled:  # ``stop`` gave the queue to the threads
                return
            self._drain_scheduled = False
        try:
            while self._estimate_ns < self._drain_limit_ns:
                with cond:
                    batch, _ = self.due(time.monotonic_ns(), force=True)
                if batch is None:
                    break
                self._execute_on_loop(loop, batch, release=False)
        finally:
            with cond:
                self._release_threads()
        self._busy_poll.touch(loop)

    def batch_source(self, index: int) -> Callable[[], Batch | None]:
        return self._timed_source(index, self._take_batch)

    def stop(self, workers: int) -> None:
        """Send what is queued (on the threads, also what a scheduled drain would have taken:
        the loop may stop before it runs), then stop every worker."""
        self._busy_poll.stop()
        with self._cond:
            if self._drain_scheduled:
                self._drain_scheduled = self._held = False
        DynamicBatcher.stop(self, workers)
