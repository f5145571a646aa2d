"""Triton's default scheduler that executes on the event loop when that is the cheaper way.

``pyserve_inline_execute: "auto"``, and the default for a model whose backend declares it
compute-only (``ModelContext.compute_only``: the framework backends) and whose instances are all
``KIND_CPU``. Handing a request to an instance thread and its answer back costs two thread
wake-ups, ~250 µs on a small virtual machine: more than a small model's whole execute. Running
the execute on the loop instead costs the loop that execute's time, which matters only when
someone else is waiting for the loop. So a request executes on the loop (with instance 0) when

* it is enqueued on the event loop (not from another thread, not during warm-up),
* no request of this model is queued or executing on an instance thread,
* every request of the last 10 ms came over one client connection (``pyserve.client_activity``):
  one client talks to the server, request after request, and nobody else's request is
  waiting behind the execute, and
* the model's recent executes were short: a running estimate below ``AUTO_LIMIT_NS``. It starts
  unknown (above the limit): the first executes run on the threads and are timed there; one
  slow execute raises the estimate at once, short ones lower it gradually.

Otherwise the request is queued for the instance threads, exactly as ``DefaultScheduler`` does.
While the loop executes, the instance threads do not start another batch, so an instance never
runs two executes at once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from pyserve import client_activity
from pyserve.busy_poll import BusyPoll
from pyserve.inference import InferRequest, RunningLoop, enter_inline_delivery, exit_inline_delivery
from pyserve.scheduling.instance import STOP, Batch, InstanceWorker

AUTO_LIMIT_NS = 1_000_000
"""Executes estimated longer than this (1 ms) always run on the instance threads."""

_UNKNOWN_NS = 1 << 62
"""The estimate before the first execute was timed."""


class AdaptiveScheduler:
    """Each request is its own execute: on the event loop when the model is idle, one client
    connection alone sends requests and the model's executes are short; otherwise on the first
    free instance thread.

    ``enqueue`` is called on the event loop (or, rarely, from another thread: then the request
    always goes to the threads) and never blocks for long: at most for the lock that the
    instance threads hold while they take a batch. The model loader sets ``worker`` (instance
    0's ``InstanceWorker``) before the first request.
    """

    observe: None = None

    def __init__(self, limit_ns: int = AUTO_LIMIT_NS) -> None:
        self.worker: InstanceWorker | None = None
        self._limit_ns = limit_ns
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[Batch | None] = deque()
        self._busy = 0  # requests queued for, or executing on, the instance threads
        self._on_loop = False  # the loop executes now: the threads wait
        self._estimate_ns = _UNKNOWN_NS
        self._running_loop = RunningLoop()
        self._busy_poll = BusyPoll()  # ``--busy-poll-us``: keep the loop polling after an execute

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

    def enqueue(self, request: InferRequest) -> None:
        worker = self.worker
        loop = self._running_loop.get()
        cond = self._cond
        with cond:
            on_loop = (loop is not None and worker is not None and not self._busy and not self._on_loop
                       and self._estimate_ns < self._limit_ns and client_activity.one_client())
            if on_loop:
                self._on_loop = True
            else:
                self._busy += 1
                self._queue.append((request,))
                cond.notify()
                return
        assert worker is not None and loop is not None
        outer = enter_inline_delivery(loop)  # not a context manager: this is the hot path
        start = time.monotonic_ns()
        try:
            worker.execute_batch((request,))
        finally:
            elapsed = time.monotonic_ns() - start
            exit_inline_delivery(outer)
            with cond:
                self._on_loop = False
                self._record(elapsed)
                if self._queue:  # queued from another thread meanwhile
                    cond.notify()
        self._busy_poll.touch(loop)

    def batch_source(self, index: int) -> Callable[[], Batch | None]:
        cond = self._cond
        queue = self._queue
        started = 0  # when this thread took its current batch (0: none)

        def next_batch() -> Batch | None:
            nonlocal started
            with cond:
                if started:  # the previous batch is done (executed and answered)
                    self._busy -= 1
                    self._record(time.monotonic_ns() - started)
                    started = 0
                while not queue or self._on_loop:
                    cond.wait()
                batch = queue.popleft()
                if batch is not STOP:
                    started = time.monotonic_ns()
                return batch

        return next_batch

    def stop(self, workers: int) -> None:
        """Let the threads finish what is queued, then stop each of them."""
        self._busy_poll.stop()
        with self._cond:
            self._queue.extend([STOP] * workers)
            self._cond.notify_all()
