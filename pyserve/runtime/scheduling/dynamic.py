"""Triton's dynamic batcher (``dynamic_batching { ... }``), shared by every backend.

Requests wait in one queue per priority level. An instance that becomes free calls
``next_batch``, which forms a batch from the head of the queues:

* only requests whose non-batch input shapes agree share a batch (inputs with
  ``allow_ragged_batch`` are exempt);
* as in Triton, the longest run of queued requests whose size is a ``preferred_batch_size``
  (or, when none is, the run just before the largest preferred size would be passed) is
  sent at once; otherwise the batch is sent when it cannot grow (``max_batch_size``
  reached, the next request has another shape, the largest preferred size reached) or
  when its oldest request has waited ``max_queue_delay_microseconds``;
* batch sizes count the batch dimension of each request, not requests.

Queue policies (``default_queue_policy`` / ``priority_queue_policy``) bound each level's
queue (``max_queue_size`` → an UNAVAILABLE "queue full" error at once) and time out queued
requests (``default_timeout_microseconds``, overridable downwards per request with
``allow_timeout_override``): REJECT answers them with an error, DELAY moves them behind
the requests of their own level that have not timed out (still ahead of every lower
priority level), as in Triton. A level's queue exists only while it holds requests, so
``priority_levels`` may be as large as its uint64 field. Cancelled requests are dropped
without reaching execute. With ``preserve_ordering``, responses leave in arrival order whatever instance
finished first.
"""

from __future__ import annotations

import threading
import time
from bisect import insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import InferRequest, InferResponse, ResponseSender
from pyserve.repository.model_config import ModelIO
from pyserve.runtime.scheduling.instance import STOP, Batch


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """One priority level's ``ModelQueuePolicy``."""

    delay_on_timeout: bool = False
    default_timeout_ns: int = 0
    allow_timeout_override: bool = False
    max_queue_size: int = 0

    @classmethod
    def from_config(cls, policy: Any) -> QueuePolicy:
        action = policy.DESCRIPTOR.fields_by_name["timeout_action"].enum_type.values_by_number[
            policy.timeout_action
        ].name
        return cls(
            delay_on_timeout=action == "DELAY",
            default_timeout_ns=int(policy.default_timeout_microseconds) * 1000,
            allow_timeout_override=bool(policy.allow_timeout_override),
            max_queue_size=int(policy.max_queue_size),
        )

    def deadline(self, request: InferRequest) -> int:
        """The monotonic ns after which the request times out in the queue (0 = never).

        As in Triton 2.51, a request's own timeout may only lower a default timeout: with no
        default (0), ``allow_timeout_override`` times nothing out."""
        timeout = self.default_timeout_ns
        if self.allow_timeout_override and request.timeout_us and timeout:
            timeout = min(timeout, request.timeout_us * 1000)
        return request.arrival_ns + timeout if timeout else 0


@dataclass(slots=True)
class _Queued:
    request: InferRequest
    deadline: int
    signature: tuple[Any, ...]


class _Level:
    """One priority level's queue: the requests in arrival order, then those its DELAY policy
    moved behind them when they timed out."""

    __slots__ = ("delayed", "pending", "policy")

    def __init__(self, policy: QueuePolicy) -> None:
        self.policy = policy
        self.pending: deque[_Queued] = deque()
        self.delayed: deque[_Queued] = deque()

    def __len__(self) -> int:
        return len(self.pending) + len(self.delayed)


class _OrderedSender:
    """Holds back a response until every earlier request of the model was answered."""

    __slots__ = ("_gate", "_inner", "_seq")

    def __init__(self, gate: OrderGate, seq: int, inner: ResponseSender) -> None:
        self._gate = gate
        self._seq = seq
        self._inner = inner

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        self._gate.deliver(self._seq, self._inner, response, final)

    def is_cancelled(self) -> bool:
        return self._inner.is_cancelled()


class OrderGate:
    """Releases responses in sequence-number order (``preserve_ordering``).

    ``wrap`` (under the scheduler's lock, in arrival order) numbers a request; its responses
    are held until every earlier request got its final response. Any thread may deliver.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_seq = 0
        self._assigned = 0
        self._held: dict[int, list[tuple[ResponseSender, Any, bool]]] = {}

    def wrap(self, request: InferRequest) -> None:
        seq = self._assigned
        self._assigned += 1
        request.attach_sender(_OrderedSender(self, seq, request.attached_sender()))

    def deliver(self, seq: int, sender: ResponseSender, response: Any, final: bool) -> None:
        ready: list[tuple[ResponseSender, Any, bool]] = []
        with self._lock:
            self._held.setdefault(seq, []).append((sender, response, final))
            while self._next_seq in self._held:
                entries = self._held[self._next_seq]
                if not entries[-1][2]:
                    break  # the request has more responses to come
                ready.extend(entries)
                del self._held[self._next_seq]
                self._next_seq += 1
        for target, item, is_final in ready:
            target.send(item, is_final)


class DynamicBatcher:
    """The dynamic batching scheduler of one model version.

    Thread-safety: ``enqueue`` runs on the event loop; ``next_batch`` runs on the instance
    threads (one of them gathers at a time); both take the same short-held lock.

    :param config: the normalized ``ModelConfig``.
    :param io: the model's tensor tables (for shape compatibility).
    """

    def __init__(self, config: Any, io: ModelIO) -> None:
        batching = config.dynamic_batching
        self.max_batch_size = max(int(config.max_batch_size), 1)
        self.preferred = sorted({int(s) for s in batching.preferred_batch_size if 0 < s <= self.max_batch_size})
        self._preferred = frozenset(self.preferred)
        self._max_preferred = self.preferred[-1] if self.preferred else self.max_batch_size
        self.max_delay_ns = int(batching.max_queue_delay_microseconds) * 1000
        self.levels = int(batching.priority_levels) or 1
        self.default_level = int(batching.default_priority_level) or 1
        if not 1 <= self.default_level <= self.levels:
            self.default_level = 1
        default_policy = (
            QueuePolicy.from_config(batching.default_queue_policy)
            if batching.HasField("default_queue_policy") else QueuePolicy()
        )
        self._default_policy = default_policy
        self._level_policies = {
            int(level): QueuePolicy.from_config(policy)
            for level, policy in batching.priority_queue_policy.items() if 1 <= level <= self.levels
        }
        self._ragged = frozenset(n for n, s in io.inputs.items() if s.allow_ragged_batch)
        self._batching = io.batching
        self._queues: dict[int, _Level] = {}  # the levels holding requests
        self._level_order: list[int] = []  # their numbers, highest priority (lowest number) first
        self._cond = threading.Condition(threading.Lock())
        self._stopping = False
        self._held = False  # the event loop executes a request (``AdaptiveBatcher``): threads wait
        self._order = OrderGate() if batching.preserve_ordering else None

    # -- event loop side ---------------------------------------------------------------------
    def enqueue(self, request: InferRequest) -> None:
        """Queue a request at its priority level.

        :raises InferError: UNAVAILABLE when the level's ``max_queue_size`` is reached.
        """
        level, item = self._item(request)
        with self._cond:
            self._append(level, item)
            self._cond.notify()

    def _item(self, request: InferRequest) -> tuple[int, _Queued]:
        """The priority level ``request`` queues at, and its queue entry."""
        level = request.priority if 1 <= request.priority <= self.levels else self.default_level
        return level, _Queued(request, self.policy(level).deadline(request), self._signature(request))

    def policy(self, level: int) -> QueuePolicy:
        """The queue policy of priority ``level``."""
        return self._level_policies.get(level, self._default_policy)

    def _append(self, level: int, item: _Queued) -> None:
        """Queue ``item`` at ``level`` (with the lock held; waking a thread is the caller's).

        :raises InferError: UNAVAILABLE when the level's ``max_queue_size`` is reached.
        """
        queue = self._queues.get(level)
        if queue is None:
            queue = self._queues[level] = _Level(self.policy(level))
            insort(self._level_order, level)
        policy = queue.policy
        if policy.max_queue_size and len(queue) >= policy.max_queue_size:
            raise InferError(
                f"Exceeds maximum queue size ({policy.max_queue_size}) of model "
                f"'{item.request.model_name}' at priority level {level}",
                ErrorCode.UNAVAILABLE,
            )
        if self._order is not None:
            self._order.wrap(item.request)
        queue.pending.append(item)

    def stop(self, workers: int) -> None:
        """Send what is queued, then stop every worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    observe: None = None  # no response hook (the sequence batcher has one)

    # -- instance thread side ----------------------------------------------------------------
    def batch_source(self, index: int) -> Callable[[], Batch | None]:
        """Every instance gathers from the same queues."""
        return self.next_batch

    def next_batch(self) -> Batch | None:
        """Block until a batch is due; ``STOP`` once stopping and nothing is left.

        Mirrors Triton's ``GetDynamicBatch``: the largest prefix of the queue whose size is a
        preferred batch size goes at once (before the delay runs out); otherwise the whole
        candidate goes when it cannot grow (``max_batch_size``, a request of another shape,
        or the largest preferred size reached) or when its oldest request has waited
        ``max_queue_delay_microseconds``.
        """
        with self._cond:
            return self._take_batch()

    def _take_batch(self) -> Batch | None:
        """``next_batch``, with the lock held."""
        while True:
            if self._held:  # the event loop executes (``AdaptiveBatcher``): wait for it
                self._cond.wait()
                continue
            now = time.monotonic_ns()
            batch, wake_at = self.due(now)
            if batch is not None:
                if self._head() is not None:
                    self._cond.notify()  # another free instance can start gathering
                return batch
            if self._stopping and self._head() is None:
                self._cond.notify_all()
                return STOP
            self._wait(wake_at, now)

    def due(self, now: int, force: bool = False) -> tuple[Batch | None, int]:
        """The batch due at ``now`` (taken off the queues), or ``(None, wake_at)``: the
        monotonic ns at which to look again (0: when a request arrives). Drops cancelled and
        answers timed-out requests on the way. ``force`` sends the candidate without waiting
        for the queue delay. Call with the scheduler's lock held (``next_batch`` does).
        """
        wake_at = self._expire(now)
        head = self._head()
        if head is None:
            return None, wake_at
        batch, size, blocked, preferred = self._candidate(head)
        oldest = min(q.request.arrival_ns for q in batch)
        expired = self.max_delay_ns != 0 and now >= oldest + self.max_delay_ns
        if preferred and not expired:
            batch = batch[:preferred]
        elif not (
            blocked or expired or size >= self._max_preferred
            or self.max_delay_ns == 0 or self._stopping or force
        ):
            deadline = oldest + self.max_delay_ns
            return None, deadline if not wake_at else min(deadline, wake_at)
        self._remove(batch)
        return tuple(q.request for q in batch), 0

    def _wait(self, wake_at: int, now: int) -> None:
        self._cond.wait(None if not wake_at else max(wake_at - now, 0) / 1e9)

    def _signature(self, request: InferRequest) -> tuple[Any, ...]:
        if not self._batching:
            return ()
        return tuple(
            (name, array.shape[1:]) for name, array in sorted(request.inputs.items()) if name not in self._ragged
        )

    def _head(self) -> _Queued | None:
        for level in self._level_order:
            queue = self._queues[level]
            if queue.pending:
                return queue.pending[0]
            if queue.delayed:
                return queue.delayed[0]
        return None

    def _ordered(self) -> Any:
        for level in self._level_order:
            queue = self._queues[level]
            yield from queue.pending
            yield from queue.delayed

    def _drop_empty_levels(self) -> None:
        if any(not self._queues[level] for level in self._level_order):
            self._level_order = [level for level in self._level_order if self._queues[level]]
            self._queues = {level: self._queues[level] for level in self._level_order}

    def _candidate(self, head: _Queued) -> tuple[list[_Queued], int, bool, int]:
        """The requests that could form the next batch (up to ``max_batch_size``, all of the
        head's shape), their total size, whether the request after them cannot join (so
        waiting cannot grow the batch), and how many of them make the best preferred batch
        (0 = none): the longest prefix whose size is a preferred size, else the prefix before
        the size first passes the largest preferred size."""
        batch: list[_Queued] = []
        size = 0
        best = 0
        preferred = self._preferred
        for item in self._ordered():
            n = item.request.batch_size if self._batching else 1
            if batch:
                if size + n > self._max_preferred and not best:
                    best = len(batch)
                if item.signature != head.signature or size + n > self.max_batch_size:
                    return batch, size, True, best
            batch.append(item)
            size += n
            if size in preferred:
                best = len(batch)
        return batch, size, False, best

    def _remove(self, batch: list[_Queued]) -> None:
        chosen = {id(q) for q in batch}
        for level in self._level_order:
            queue = self._queues[level]
            for part in (queue.pending, queue.delayed):
                while part and id(part[0]) in chosen:
                    part.popleft()
        # Members always come from the heads of the queues in order, so popping heads suffices.
        self._drop_empty_levels()

    def _expire(self, now: int) -> int:
        """Drop cancelled requests, time out expired ones; return the next deadline (0 = none)."""
        next_deadline = 0
        for level in self._level_order:
            queue = self._queues[level]
            delay = queue.policy.delay_on_timeout
            keep: deque[_Queued] = deque()
            changed = False
            for item in queue.pending:
                request = item.request
                if request.is_cancelled():
                    request.reply(InferError("request was cancelled", ErrorCode.CANCELLED))
                    changed = True
                elif item.deadline and now >= item.deadline:
                    changed = True
                    if delay:
                        item.deadline = 0
                        queue.delayed.append(item)
                    else:
                        request.reply(
                            InferError(f"Request timeout expired for model '{request.model_name}'", ErrorCode.UNAVAILABLE)
                        )
                else:
                    keep.append(item)
                    if item.deadline and (not next_deadline or item.deadline < next_deadline):
                        next_deadline = item.deadline
            if changed:
                queue.pending = keep
            if queue.delayed and any(q.request.is_cancelled() for q in queue.delayed):
                live: deque[_Queued] = deque()
                for item in queue.delayed:
                    if item.request.is_cancelled():
                        item.request.reply(InferError("request was cancelled", ErrorCode.CANCELLED))
                    else:
                        live.append(item)
                queue.delayed = live
        self._drop_empty_levels()
        return next_deadline
