"""Triton's sequence batcher (``sequence_batching { ... }``), shared by every backend.

Every request names a sequence by correlation id (``sequence_id``: uint64 or string) and
flags its first and last request (``sequence_start`` / ``sequence_end``). A sequence is
pinned to one model instance from START to END, and each execute carries at most one
request per sequence, so a sequence's requests run strictly one after another on the
instance that holds its state.

* ``direct``: an instance holds ``max(max_batch_size, 1)`` sequences at once, each in a batch
  slot of its own (the lowest free slot index, across instances) from START to END; sequences
  beyond that wait in a backlog until a slot frees. A batch holds slots ``0..k``, where ``k``
  is the highest slot with a queued request, and element ``i`` of the batch is slot ``i``: a
  slot with nothing queued (or whose request's shapes differ from the lowest ready slot's) gets
  a null request, as in Triton, so a model that keeps state per batch slot sees every sequence
  in its place. A null request has the inputs of the lowest ready slot's request filled with
  zeros (empty BYTES), READY (and START/END) false, CORRID 0, the initial state, no requested
  outputs; its response is dropped and it is counted nowhere. A batch goes as soon as one slot
  is ready, unless ``minimum_slot_utilization`` and ``max_queue_delay_microseconds`` are both
  set: then it waits until that fraction of ``max_batch_size`` slots is ready or its oldest
  request waited that long (Triton ignores the delay otherwise).
* ``oldest``: an instance holds up to ``max_candidate_sequences`` sequences; batches take
  the oldest requests across them, honouring ``preferred_batch_size`` and
  ``max_queue_delay_microseconds`` like the dynamic batcher; with ``preserve_ordering``
  responses leave in the order their requests arrived, whichever instance ran them.

Control inputs (``control_input``: START, READY, END, CORRID) are added to each request's
inputs as tensors with the configured datatype and false/true values. Implicit state
(``state``) is kept per sequence: the backend receives it as ``input_name`` and returns the
next value as ``output_name``; START resets it to ``initial_state`` (or zeros). A sequence
that sees no request for ``max_sequence_idle_microseconds`` is released with its state.
A sequence whose next request was cancelled while it queued ends there, as in Triton: that
request and every one queued behind it are answered CANCELLED, and the sequence's slot and
state are released (a later request must START it again).

``iterative_sequence: true``: every request is a sequence of its own (START on its first
execute; a correlation id is assigned when the client gave none), which the backend
reschedules (``InferRequest.reschedule()``) until an execute answers it; rescheduled requests
go back to the head of their sequence, so in-flight requests are batched together iteration
after iteration and finish at different iterations. The sequence holds its slot until then.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pyserve.api import datatypes
from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import (
    NULL_SENDER,
    SEQUENCE_END,
    SEQUENCE_START,
    InferRequest,
    InferResponse,
)
from pyserve.protocol import data_type_name
from pyserve.repository.model_config import ModelIO, kind_name
from pyserve.runtime.scheduling.dynamic import OrderGate
from pyserve.runtime.scheduling.instance import STOP, Batch, SlotBatch

_CONTROL_FLAG = {"CONTROL_SEQUENCE_START": SEQUENCE_START, "CONTROL_SEQUENCE_END": SEQUENCE_END}


@dataclass(frozen=True, slots=True)
class _Control:
    input_name: str
    kind: str
    false_true: tuple[Any, Any]
    dtype: np.dtype


@dataclass(frozen=True, slots=True)
class _StateSpec:
    input_name: str
    output_name: str
    dtype: np.dtype
    initial: np.ndarray  # without the batch dimension


@dataclass(eq=False)
class _Sequence:
    correlation_id: int | str
    instance: int = -1
    slot: int = -1  # direct strategy: its batch slot on that instance
    pending: deque[InferRequest] = field(default_factory=deque)
    state: dict[str, np.ndarray] = field(default_factory=dict)
    last_active_ns: int = 0
    ended: bool = False
    running: bool = False  # iterative: its request is executing (it may come back)


def _controls(config: Any) -> list[_Control]:
    controls = []
    for control_input in config.sequence_batching.control_input:
        for control in control_input.control:
            kind = kind_name(control)
            if kind == "CONTROL_SEQUENCE_CORRID":
                dtype = datatypes.from_config_name(data_type_name(control.data_type))
                np_dtype = dtype.dtype if dtype is not None else np.dtype(np.uint64)
                controls.append(_Control(control_input.name, kind, (None, None), np_dtype))
            elif len(control.int32_false_true) == 2:
                controls.append(_Control(control_input.name, kind, tuple(control.int32_false_true), np.dtype(np.int32)))
            elif len(control.fp32_false_true) == 2:
                controls.append(_Control(control_input.name, kind, tuple(control.fp32_false_true), np.dtype(np.float32)))
            elif len(control.bool_false_true) == 2:
                controls.append(_Control(control_input.name, kind, tuple(control.bool_false_true), np.dtype(np.bool_)))
            else:
                raise ValueError(
                    f"sequence_batching.control_input '{control_input.name}' ({kind}) must give exactly two "
                    "values in int32_false_true, fp32_false_true or bool_false_true"
                )
    return controls


def _states(config: Any, model_dir: Path) -> list[_StateSpec]:
    specs = []
    for state in config.sequence_batching.state:
        dtype = datatypes.from_config_name(data_type_name(state.data_type))
        if dtype is None or dtype.is_bytes:
            raise ValueError(f"sequence_batching.state '{state.input_name}' needs a fixed-size data_type")
        dims = tuple(1 if d == -1 else int(d) for d in state.dims)
        initial = np.zeros(dims, dtype=dtype.dtype)
        if state.initial_state:
            init = state.initial_state[0]
            init_dims = tuple(int(d) for d in init.dims) or dims
            if init.WhichOneof("state_data") == "data_file":
                path = model_dir / "initial_state" / init.data_file
                try:
                    raw = path.read_bytes()
                except OSError as exc:
                    raise ValueError(f"initial_state file of state '{state.input_name}': {exc}") from None
                count = int(np.prod(init_dims))
                if len(raw) != count * dtype.itemsize:
                    raise ValueError(
                        f"initial_state file '{init.data_file}' holds {len(raw)} bytes; state "
                        f"'{state.input_name}' needs {count * dtype.itemsize}"
                    )
                initial = np.frombuffer(raw, dtype=dtype.dtype).reshape(init_dims).copy()
            else:
                initial = np.zeros(init_dims, dtype=dtype.dtype)
        specs.append(_StateSpec(state.input_name, state.output_name, dtype.dtype, initial))
    return specs


class SequenceBatcher:
    """The sequence batching scheduler of one model version.

    Thread-safety: ``enqueue`` runs on the event loop; each instance's worker calls its own
    ``batch_source(index)``; ``observe`` runs on the worker after execute. All share one
    short-held lock.

    :param config: the normalized ``ModelConfig``.
    :param io: the model's tensor tables.
    :param instances: how many instances serve the model.
    :param model_dir: the model directory (initial state files).
    :raises ValueError: a control input or state cannot be used as configured.
    """

    def __init__(self, config: Any, io: ModelIO, instances: int, model_dir: Path) -> None:
        seq = config.sequence_batching
        self.model_name = config.name
        self._batching = io.batching
        self.max_batch_size = max(int(config.max_batch_size), 1)
        strategy = seq.WhichOneof("strategy_choice") or "direct"
        self.strategy = strategy
        if strategy == "oldest":
            candidates = int(seq.oldest.max_candidate_sequences)
            self.slots = candidates if candidates > 0 else 1 << 30
            self.max_delay_ns = int(seq.oldest.max_queue_delay_microseconds) * 1000
            self.preferred = sorted({int(p) for p in seq.oldest.preferred_batch_size if 0 < p <= self.max_batch_size})
        else:
            self.slots = self.max_batch_size
            self.max_delay_ns = int(seq.direct.max_queue_delay_microseconds) * 1000
            self.preferred = []
        # direct: wait for this share of max_batch_size slots, up to max_delay_ns (0: never wait)
        self.min_utilization = float(seq.direct.minimum_slot_utilization) if strategy == "direct" else 0.0
        self.idle_ns = int(seq.max_sequence_idle_microseconds or 1_000_000) * 1000
        self._controls = _controls(config)
        self._numeric_corrid = next(
            (c for c in self._controls
             if c.kind == "CONTROL_SEQUENCE_CORRID" and c.dtype != np.dtype(object)),
            None,
        )
        self._states = _states(config, model_dir)
        self._instances = max(instances, 1)
        self._sequences: dict[int | str, _Sequence] = {}
        self._per_instance: list[list[_Sequence]] = [[] for _ in range(self._instances)]
        # direct: each instance's batch slots, the sequence seated in each (None: free)
        self._seats: list[list[_Sequence | None]] = (
            [[None] * self.slots for _ in range(self._instances)] if strategy == "direct" else []
        )
        self._backlog: deque[_Sequence] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._stopping = False
        self._stopped_workers = 0
        # oldest.preserve_ordering: responses leave in arrival order, across sequences too
        self._order = OrderGate() if strategy == "oldest" and seq.oldest.preserve_ordering else None
        self.iterative = bool(seq.iterative_sequence)
        self._next_iterative_id = 1 << 63  # ids for iterative requests sent without one

    @property
    def iterations(self) -> SequenceBatcher | None:
        """This scheduler for the instance workers when it runs iterative sequences, else None."""
        return self if self.iterative else None

    # -- event loop side ---------------------------------------------------------------------
    def enqueue(self, request: InferRequest) -> None:
        """Queue a request of a sequence.

        :raises InferError: INVALID_ARG without a correlation id, or for a sequence that was
            never started, already ended, or expired, or with a batch of more than one.
        """
        if request.batch_size > 1:  # as Triton: a sequence's requests are one element each
            raise InferError.invalid(
                f"inference request to model '{self.model_name}' must specify batch-size 1 due to "
                "requirements of sequence batcher"
            )
        if self.iterative:
            self._enqueue_iterative(request)
            return
        cid = request.correlation_id
        if cid == 0 or cid == "":
            raise InferError.invalid(
                f"inference request to model '{self.model_name}' must specify a non-zero or non-empty "
                "correlation ID (parameter 'sequence_id')"
            )
        self._check_id_type(cid)
        now = time.monotonic_ns()
        with self._cond:
            self._expire_idle(now)
            sequence = self._sequences.get(cid)
            if request.flags & SEQUENCE_START:
                if sequence is None or sequence.ended:
                    sequence = _Sequence(cid)
                    self._sequences[cid] = sequence
                    self._assign(sequence)
            elif sequence is None or sequence.ended:
                raise InferError.invalid(
                    f"inference request for sequence {cid} to model '{self.model_name}' must specify the "
                    "START flag on the first request of the sequence (it is unknown, ended or expired)"
                )
            if request.flags & SEQUENCE_END:
                sequence.ended = True
            if self._order is not None:
                self._order.wrap(request)
            sequence.pending.append(request)
            sequence.last_active_ns = now
            self._cond.notify_all()

    def _check_id_type(self, cid: int | str) -> None:
        if isinstance(cid, str) and self._numeric_corrid is not None:
            raise InferError.invalid(
                f"inference request to model '{self.model_name}' has the string correlation ID '{cid}', but "
                f"the model's CONTROL_SEQUENCE_CORRID control input '{self._numeric_corrid.input_name}' is "
                f"{self._numeric_corrid.dtype.name}; use an unsigned integer 'sequence_id'"
            )

    def _enqueue_iterative(self, request: InferRequest) -> None:
        """An iterative request: a new sequence of its own, started by this request."""
        now = time.monotonic_ns()
        with self._cond:
            self._expire_idle(now)
            cid = request.correlation_id
            if cid == 0 or cid == "":
                while self._next_iterative_id in self._sequences:
                    self._next_iterative_id += 1
                cid = request.correlation_id = self._next_iterative_id
                self._next_iterative_id += 1
            else:
                self._check_id_type(cid)
                if cid in self._sequences:
                    raise InferError.invalid(
                        f"inference request for sequence {cid} to model '{self.model_name}': that sequence is "
                        "still running (with iterative_sequence every request is a sequence of its own)"
                    )
            request.flags |= SEQUENCE_START
            sequence = _Sequence(cid)
            self._sequences[cid] = sequence
            self._assign(sequence)
            if self._order is not None:
                self._order.wrap(request)
            sequence.pending.append(request)
            sequence.last_active_ns = now
            self._cond.notify_all()

    def stop(self, workers: int) -> None:
        """Send what is queued, then stop every worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # -- instance thread side: iterative sequences --------------------------------------------
    def reschedule(self, request: InferRequest) -> None:
        """Queue a rescheduled request again at the head of its sequence (next iteration)."""
        with self._cond:
            sequence = self._sequences.get(request.correlation_id)
            if sequence is None:  # cannot happen while it runs; answer rather than lose it
                request.reply(InferError(f"sequence {request.correlation_id} of model '{self.model_name}' "
                                         "was released while its request was rescheduled"))
                return
            request.flags &= ~SEQUENCE_START
            sequence.running = False
            sequence.pending.appendleft(request)
            sequence.last_active_ns = time.monotonic_ns()
            self._cond.notify_all()

    def iteration_done(self, request: InferRequest) -> None:
        """The request of an iterative sequence was answered (or failed): free its slot."""
        with self._cond:
            sequence = self._sequences.get(request.correlation_id)
            if sequence is None:
                return
            sequence.running = False
            sequence.ended = True
            self._release(sequence)

    # -- instance thread side ----------------------------------------------------------------
    def batch_source(self, index: int) -> Any:
        """The blocking ``next_batch`` of instance ``index``."""
        if self.strategy == "direct":
            return lambda: self._next_slot_batch(index)
        return lambda: self._next_batch(index)

    def observe(self, request: InferRequest, response: InferResponse) -> None:
        """Keep the implicit state a response carries for its sequence."""
        if not self._states:
            return
        with self._cond:
            sequence = self._sequences.get(request.correlation_id)
            if sequence is None:
                return
            for spec in self._states:
                value = response.outputs.get(spec.output_name)
                if value is not None:
                    sequence.state[spec.input_name] = np.asarray(value, dtype=spec.dtype)

    def _next_batch(self, index: int) -> Batch | None:
        with self._cond:
            while True:
                now = time.monotonic_ns()
                self._expire_idle(now)
                ready = self._live([s for s in self._per_instance[index] if s.pending])
                if not ready:
                    if self._stopping and not self._backlog_for_pending():
                        return STOP
                    self._cond.wait(self._idle_wait(index, now))
                    continue
                ready.sort(key=lambda s: s.pending[0].arrival_ns)
                chosen, size, full = self._candidate(ready)
                oldest = ready[0].pending[0].arrival_ns
                due = full or self._stopping or self.max_delay_ns == 0 or now >= oldest + self.max_delay_ns
                if not due and self.preferred and any(p <= size for p in self.preferred):
                    target = max(p for p in self.preferred if p <= size)
                    chosen = self._trim(chosen, target)
                    due = True
                if due:
                    return tuple(self._dispatch(s) for s in chosen)
                self._cond.wait(max(oldest + self.max_delay_ns - now, 0) / 1e9)

    def _next_slot_batch(self, index: int) -> Batch | None:
        """The direct strategy's next batch of instance ``index``: slots ``0..k`` in order."""
        seats = self._seats[index]
        with self._cond:
            while True:
                now = time.monotonic_ns()
                self._expire_idle(now)
                ready = self._live([s for s in seats if s is not None and s.pending])
                if not ready:
                    if self._stopping and not self._backlog_for_pending():
                        return STOP
                    self._cond.wait(self._idle_wait(index, now))
                    continue
                wait_ns = self._slot_wait_ns(ready, now)
                if wait_ns <= 0:
                    return self._slot_batch(seats, ready)
                self._cond.wait(wait_ns / 1e9)

    def _slot_wait_ns(self, ready: list[_Sequence], now: int) -> int:
        """How much longer the direct strategy waits for more slots (0 or less: send now)."""
        if self._stopping or self.max_delay_ns == 0 or self.min_utilization == 0.0:
            return 0
        if len(ready) / self.max_batch_size >= self.min_utilization:
            return 0
        oldest = min(s.pending[0].arrival_ns for s in ready)
        return oldest + self.max_delay_ns - now

    def _slot_batch(self, seats: list[_Sequence | None], ready: list[_Sequence]) -> SlotBatch:
        """Slots ``0..k`` (``k`` the highest ready slot): each ready one's next request, a null
        request where a slot has none or its shapes differ from the lowest ready slot's."""
        head = ready[0].pending[0]  # seats are in slot order: the lowest ready slot
        signature = self._signature(head)
        highest = ready[-1].slot
        null_inputs = self._null_inputs(head) if highest + 1 > len(ready) else {}  # before head's controls
        batch: list[InferRequest] = []
        nulls = 0
        for slot in range(highest + 1):
            sequence = seats[slot]
            if sequence is not None and sequence.pending and self._signature(sequence.pending[0]) == signature:
                batch.append(self._dispatch(sequence))
            else:
                null = InferRequest(self.model_name, head.model_version, dict(null_inputs), (),
                                    batch_size=head.batch_size)
                null.attach_sender(NULL_SENDER)
                batch.append(null)
                nulls += 1
        return SlotBatch(batch, nulls)

    def _null_inputs(self, like: InferRequest) -> dict[str, np.ndarray]:
        """The inputs of a batch's null requests (Triton's: a request that holds a batch slot
        without a sequence request in it), shared by them, read-only: ``like``'s inputs as zeros
        (empty BYTES), READY (and START/END) false, CORRID 0, the initial state."""
        inputs = {
            name: (np.full(array.shape, b"", dtype=object) if array.dtype == object
                   else np.zeros(array.shape, dtype=array.dtype))
            for name, array in like.inputs.items()
        }
        batch = (like.batch_size,) if self._batching else ()
        control_shape = (*batch, 1)
        for control in self._controls:
            if control.kind == "CONTROL_SEQUENCE_CORRID":
                value: Any = b"" if control.dtype == np.dtype(object) else 0
            else:
                value = control.false_true[0]
            inputs[control.input_name] = np.full(control_shape, value, dtype=control.dtype)
        for array in inputs.values():
            array.flags.writeable = False
        for spec in self._states:
            inputs[spec.input_name] = np.broadcast_to(spec.initial, (*batch, *spec.initial.shape)) if batch else spec.initial
        return inputs

    def _candidate(self, ready: list[_Sequence]) -> tuple[list[_Sequence], int, bool]:
        chosen: list[_Sequence] = []
        size = 0
        head = ready[0].pending[0]
        signature = self._signature(head)
        for sequence in ready:
            request = sequence.pending[0]
            n = request.batch_size if self._batching else 1
            if size + n > self.max_batch_size or self._signature(request) != signature:
                return chosen, size, True
            chosen.append(sequence)
            size += n
        return chosen, size, size >= self.max_batch_size

    def _trim(self, chosen: list[_Sequence], target: int) -> list[_Sequence]:
        kept, size = [], 0
        for sequence in chosen:
            n = sequence.pending[0].batch_size if self._batching else 1
            if size + n > target:
                break
            kept.append(sequence)
            size += n
        return kept or chosen[:1]

    def _signature(self, request: InferRequest) -> tuple[Any, ...]:
        if not self._batching:
            return ()
        return tuple((n, a.shape[1:]) for n, a in sorted(request.inputs.items()))

    def _live(self, ready: list[_Sequence]) -> list[_Sequence]:
        """``ready`` less the sequences whose next request was cancelled, which end here: that
        request and the rest of their queue are answered CANCELLED and they are released."""
        if self.iterative or not any(s.pending[0].is_cancelled() for s in ready):
            return ready
        live = []
        for sequence in ready:
            if not sequence.pending[0].is_cancelled():
                live.append(sequence)
                continue
            sequence.ended = True
            while sequence.pending:
                sequence.pending.popleft().reply(InferError("request was cancelled", ErrorCode.CANCELLED))
            self._release(sequence)
        return live

    def _dispatch(self, sequence: _Sequence) -> InferRequest:
        """Take the sequence's next request and give it its control and state tensors."""
        request = sequence.pending.popleft()
        if self.iterative:
            request.rescheduled = False
            sequence.running = True
        batch = (request.batch_size,) if self._batching else ()
        control_shape = (*batch, 1)  # a control input's dims are [1], after the batch dim if any (Triton)
        if request.flags & SEQUENCE_START:
            sequence.state = {}
        for control in self._controls:
            if control.kind == "CONTROL_SEQUENCE_CORRID":
                cid = request.correlation_id
                if control.dtype == np.dtype(object):
                    array = np.full(control_shape, str(cid).encode("utf-8"), dtype=object)
                else:  # a uint64 id; narrower CORRID types truncate it, as Triton does
                    array = np.full(control_shape, cid, dtype=np.uint64).astype(control.dtype)
            else:
                flag = _CONTROL_FLAG.get(control.kind)
                on = True if flag is None else bool(request.flags & flag)
                array = np.full(control_shape, control.false_true[1 if on else 0], dtype=control.dtype)
            request.inputs[control.input_name] = array
        for spec in self._states:
            current = sequence.state.get(spec.input_name)
            if current is None:
                current = np.broadcast_to(spec.initial, (*batch, *spec.initial.shape)) if batch else spec.initial
            request.inputs[spec.input_name] = current
        if request.flags & SEQUENCE_END and not self.iterative:
            self._release(sequence, keep_record=True)
        return request

    # -- slots, backlog, expiry --------------------------------------------------------------
    def _assign(self, sequence: _Sequence, front: bool = False) -> None:
        if self._seats:
            self._seat(sequence, front)
            return
        counts = [len(s) for s in self._per_instance]
        index = min(range(self._instances), key=counts.__getitem__)
        if counts[index] >= self.slots:
            if front:
                self._backlog.appendleft(sequence)
            else:
                self._backlog.append(sequence)
            return
        sequence.instance = index
        self._per_instance[index].append(sequence)

    def _seat(self, sequence: _Sequence, front: bool) -> None:
        """Direct strategy: the lowest free slot index of any instance, else the backlog."""
        for slot in range(self.slots):
            for index, seats in enumerate(self._seats):
                if seats[slot] is None:
                    seats[slot] = sequence
                    sequence.instance, sequence.slot = index, slot
                    self._per_instance[index].append(sequence)
                    return
        if front:
            self._backlog.appendleft(sequence)
        else:
            self._backlog.append(sequence)

    def _unseat(self, sequence: _Sequence) -> None:
        """Take the sequence off its instance (and its slot)."""
        self._per_instance[sequence.instance].remove(sequence)
        if self._seats and sequence.slot >= 0:
            self._seats[sequence.instance][sequence.slot] = None
            sequence.slot = -1

    def _release(self, sequence: _Sequence, keep_record: bool = False) -> None:
        if sequence.instance >= 0 and sequence in self._per_instance[sequence.instance]:
            if sequence.pending:
                return  # still has queued requests (after END nothing more can join)
            self._unseat(sequence)
        if not keep_record and self._sequences.get(sequence.correlation_id) is sequence:
            del self._sequences[sequence.correlation_id]
        while self._backlog:
            waiting = self._backlog.popleft()
            self._assign(waiting, front=True)
            if waiting.instance < 0:
                break
        self._cond.notify_all()

    def _expire_idle(self, now: int) -> None:
        for cid, sequence in list(self._sequences.items()):
            if sequence.pending or sequence.running:
                continue
            if sequence.ended or self._stopping or now - sequence.last_active_ns >= self.idle_ns:
                if sequence.instance >= 0 and sequence in self._per_instance[sequence.instance]:
                    self._unseat(sequence)
                if sequence in self._backlog:
                    self._backlog.remove(sequence)
                del self._sequences[cid]
        while self._backlog and min(len(s) for s in self._per_instance) < self.slots:
            self._assign(self._backlog.popleft())

    def _idle_wait(self, index: int, now: int) -> float | None:
        if not self._sequences:
            return None
        soonest = min(s.last_active_ns + self.idle_ns for s in self._sequences.values())
        return max(soonest - now, 0) / 1e9 + 0.001

    def _backlog_for_pending(self) -> bool:
        return any(s.pending for s in self._backlog)
