"""A model instance's execution thread: takes batches, calls the backend, delivers results.

Every instance has one worker thread, so a backend's ``pyserve_execute`` never blocks the
event loop and never runs twice at once for the same instance. Workers of one model ask the
same scheduler for their next batch, so a batch goes to whichever instance is free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pyserve.api import datatypes
from pyserve.api.backend import InstanceContext
from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import (
    InferRequest,
    InferResponse,
    coalesced_delivery,
    error_response,
)
from pyserve.host.plugins import LoadedBackend
from pyserve.repository.model_config import ModelIO
from pyserve.runtime import execution_board
from pyserve.runtime.scheduling.rate_limiter import RateLimiter, ResourceClaim
from pyserve.tracing import TRACING, mark_batch

if TYPE_CHECKING:
    from pyserve.metrics import ModelStats

log = logging.getLogger("pyserve.execute")

STOP = None
"""Put on a work queue once per worker to stop it after the work queued before it."""

Batch = Sequence[InferRequest]


class SlotBatch(tuple[InferRequest, ...]):
    """A batch in which some requests are null requests (``InferRequest.is_null``: the
    direct sequence strategy's empty slots). The backend executes all of them; statistics count
    only the others.

    :ivar nulls: how many of its requests are null requests.
    """

    nulls: int

    def __new__(cls, requests: Sequence[InferRequest], nulls: int) -> SlotBatch:
        batch = super().__new__(cls, requests)
        batch.nulls = nulls
        return batch


class Iterations(Protocol):
    """A scheduler of iterative sequences (``SequenceBatcher`` with ``iterative_sequence``);
    both calls come from the instance's worker thread after each execute."""

    def reschedule(self, request: InferRequest) -> None:
        """Queue ``request`` again at the head of its sequence."""

    def iteration_done(self, request: InferRequest) -> None:
        """``request`` was answered (or failed): its sequence ends and frees its slot."""


class InstanceWorker:
    """Runs the executes of one instance on a dedicated thread.

    :param instance: the instance's context, passed to every execute.
    :param backend: the owning backend; its scoped ``pyserve_execute`` caller is looked up per
        batch, because the host rebuilds scoped callers whenever another backend registers.
    :param next_batch: the scheduler's blocking ``next_batch``; returns a batch or ``STOP``.
    :param io: the model's tensor tables, to check what the backend returns.
    :param observe: called with each successful raw response before it is filtered (the
        sequence batcher keeps implicit state this way).
    :param iterations: for iterative sequences, the scheduler told after each execute which
        requests go back to it (``reschedule``) and which are done (``iteration_done``).
    :param rate: ``--rate-limit execution_count``: the server's rate limiter and this instance's
        claim, taken before each execute and given back when it returns; None: not limited.
    """

    def __init__(
        self,
        instance: InstanceContext,
        backend: LoadedBackend,
        next_batch: Callable[[], Batch | None],
        io: ModelIO,
        observe: Callable[[InferRequest, InferResponse], None] | None = None,
        iterations: Iterations | None = None,
        rate: tuple[RateLimiter, ResourceClaim] | None = None,
    ) -> None:
        self.instance = instance
        self._backend = backend
        self._next_batch = next_batch
        self._io = io
        self._observe = observe
        self._iterations = iterations
        self._rate = rate
        self._model_name = instance.model.name
        self._slot = -1  # its slot on this process's execution board, once started
        self.last_execute_ns = 0
        """How long the backend's last execute took, returned or raised (for ``pyserve.runtime.scheduling.adaptive``)."""
        self._thread = threading.Thread(
            target=self._run, name=f"pyserve-instance-{instance.name}", daemon=True
        )

    def start(self) -> None:
        """Start the instance's thread (in the process that serves it: its executes are marked on
        this process's execution board)."""
        model = self.instance.model
        self._slot = execution_board.claim(f"model '{model.name}' version {model.version} instance '{self.instance.name}'")
        self._thread.start()

    def started(self) -> bool:
        """Whether ``start`` succeeded (a thread the system refused is never joined)."""
        return self._thread.ident is not None

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        next_batch = self._next_batch
        while True:
            try:
                batch = next_batch()
            except Exception:  # a scheduler bug must not silently leave the model without a worker
                log.exception("model '%s': the scheduler failed to form a batch", self._model_name)
                continue
            if batch is STOP:
                return
            rate = self._rate
            if rate is not None:
                rate[0].acquire(rate[1])
            try:
                with coalesced_delivery():  # one loop wake-up for the whole batch's replies
                    if self._iterations is None:
                        self.execute_batch(batch)
                    else:
                        self._execute_iteration(batch, self._iterations)
            except BaseException:  # never let one batch kill the instance
                log.exception("model '%s': unexpected failure while delivering a batch", self._model_name)
            finally:
                if rate is not None:
                    rate[0].release(rate[1])
            # let the batch go now: kept until the next one arrives, an idle instance would hold
            # the last requests' inputs (a 1 GiB tensor) for as long as it stays idle
            batch = None

    def _execute_iteration(self, batch: Batch, iterations: Iterations) -> None:
        """One iteration of iterative sequences: requests the backend rescheduled (and left
        unanswered) go back to the scheduler, the others are done."""
        try:
            self.execute_batch(batch)
        finally:
            for request in batch:
                if request.rescheduled and not request.final_sent:
                    if not request.is_cancelled():
                        iterations.reschedule(request)
                        continue
                    request.reply(InferError("request was cancelled", ErrorCode.CANCELLED))
                iterations.iteration_done(request)

    def execute_batch(self, batch: Batch) -> None:
        """Execute one batch and send every request its response or error."""
        live: list[InferRequest] = []
        for request in batch:
            if request.is_cancelled():
                request.reply(InferError("request was cancelled", ErrorCode.CANCELLED))
            else:
                live.append(request)
        if not live:
            return
        for request in live:
            request.finish = self._finish_response
        counted = live
        executed_size = 0  # the batch the backend sees, when it holds null requests
        if type(batch) is SlotBatch and batch.nulls:
            counted = [request for request in live if not request.is_null]
            executed_size = sum(request.batch_size for request in live)
        # one model version per batch; None for uncounted (warmup) requests
        stats = counted[0].stats if counted else None
        start_ns = time.monotonic_ns()
        if stats is not None:
            stats.begin(counted, start_ns)
        tracing = TRACING.on
        if tracing:
            mark_batch(live, "COMPUTE_START")
            mark_batch(live, "COMPUTE_INPUT_END")
        execution_board.enter(self._slot)
        try:
            hooks = self._backend.hooks
            direct = hooks.execute_direct
            if direct is not None:
                results = direct(self.instance, live)
            else:
                results = hooks.execute(instance=self.instance, requests=live)
            execution_board.leave(self._slot)
            end_ns = time.monotonic_ns()
            self.last_execute_ns = end_ns - start_ns
        except Exception as exc:
            execution_board.leave(self._slot)
            self._execute_failed(live, counted, executed_size, stats, start_ns, exc)
            return
        if tracing:
            mark_batch(live, "COMPUTE_OUTPUT_START")
        if results is None or len(results) != len(live):
            self._results_missing(live, counted, executed_size, results, stats, start_ns, end_ns)
            return
        # compute output: the responses are checked first, counted, then sent
        finished = self._answers(live, results)
        if stats is not None:
            stats.executed(counted, start_ns, end_ns, ready_ns=time.monotonic_ns(), executed_size=executed_size)
        for request, answer in finished:
            request.reply(answer)

    def _answers(
        self, live: list[InferRequest], results: Sequence[object]
    ) -> list[tuple[InferRequest, InferResponse | InferError]]:
        """Each request's checked response or error, in batch order; a request the backend
        rescheduled without answering it has none (it comes back in a later iteration)."""
        finished: list[tuple[InferRequest, InferResponse | InferError]] = []
        for request, result in zip(live, results):
            if not request.rescheduled:
                finished.append((request, self._finish(request, result)))
            elif result is not None:
                finished.append((request, self._answered_rescheduled()))
        return finished

    def _answered_rescheduled(self) -> InferError:
        """The error for a request the backend both rescheduled and answered: it is not run again
        (it would come back, answered, in every later iteration)."""
        return InferError(
            f"backend '{self.instance.model.backend.name}' returned a response for a request of model "
            f"'{self._model_name}' it rescheduled; a rescheduled request is answered in a later iteration",
            ErrorCode.INTERNAL,
        )

    def _execute_failed(
        self, live: list[InferRequest], counted: list[InferRequest], executed_size: int,
        stats: ModelStats | None, start_ns: int, exc: Exception,
    ) -> None:
        """Execute raised: count the execution (failed), answer every request with the error.
        ``counted``: the requests statistics count; ``executed_size``: the batch size the backend
        executed when it held null requests (0: that of ``counted``)."""
        end_ns = time.monotonic_ns()
        self.last_execute_ns = end_ns - start_ns  # a slow failure is slow too
        if stats is not None:  # an execution all the same (Triton counts it and its batch)
            stats.executed(counted, start_ns, end_ns, failed=True, executed_size=executed_size)
        # One record per failed execute: with the traceback of what the model raised (a
        # backend's InferError carries it as its cause), none for an InferError of its own.
        cause = exc.__cause__ if isinstance(exc, InferError) else exc
        log.error("model '%s' instance '%s': execute failed: %s: %s",
                  self._model_name, self.instance.name, type(exc).__name__, exc, exc_info=cause)
        error = error_response(exc, self._model_name)
        for request in live:
            if not request.final_sent:
                request.reply(error)

    def _results_missing(
        self, live: list[InferRequest], counted: list[InferRequest], executed_size: int,
        results: Sequence[object] | None, stats: ModelStats | None, start_ns: int, end_ns: int,
    ) -> None:
        """Execute returned None (answers sent, or to come) or a result count that does not
        match the batch (every request fails). ``counted``, ``executed_size``: as for
        ``_execute_failed``."""
        if stats is not None:
            stats.executed(counted, start_ns, end_ns, executed_size=executed_size)
        if results is None:
            self._check_senders(live)
            return
        error = InferError(
            f"backend '{self.instance.model.backend.name}' returned {len(results)} "
            f"response(s) for {len(live)} request(s) of model '{self._model_name}'",
            ErrorCode.INTERNAL,
        )
        log.error("%s", error.message)
        for request in live:
            request.reply(error)

    def _check_senders(self, requests: list[InferRequest]) -> None:
        """``None`` from execute: decoupled models answer later; others must have answered,
        or have taken the request's response sender (they may answer later, as Triton
        lets a backend release a request and respond from another thread)."""
        if self.instance.model.config.model_transaction_policy.decoupled:
            return
        for request in requests:
            if not request.final_sent and not request.rescheduled and not request.sender_taken:
                request.reply(InferError(
                    f"backend '{self.instance.model.backend.name}' returned no response for a request of "
                    f"model '{self._model_name}' and sent none through its response sender",
                    ErrorCode.INTERNAL,
                ))

    def _finish_response(self, request: InferRequest, response: InferResponse) -> InferResponse | InferError:
        if self._observe is not None:
            self._observe(request, response)
        return check_outputs(request, response, self._io, self._model_name)

    def _finish(self, request: InferRequest, result: object) -> InferResponse | InferError:
        """Check a backend's result for one request and keep only the requested outputs."""
        if isinstance(result, InferResponse):
            if result.error is not None:
                return result.error
            return self._finish_response(request, result)
        if isinstance(result, BaseException):
            return error_response(result, self._model_name)
        return InferError(
            f"backend '{self.instance.model.backend.name}' returned {type(result).__name__} for a "
            f"request of model '{self._model_name}'; expected InferResponse or InferError",
            ErrorCode.INTERNAL,
        )


def check_outputs(
    request: InferRequest, response: InferResponse, io: ModelIO, model_name: str
) -> InferResponse | InferError:
    """Keep the requested outputs, as numpy arrays; lenient where Triton is.

    A requested output the model did not produce is left out of the response. An output of
    another numeric datatype than its config declares is converted to the declared one when
    numpy casts it within its kind without wrapping (e.g. float64 to FP32), as is an empty one
    of any datatype (Triton's generate test model answers ``np.array([])`` for a BYTES output);
    any other is sent as the model produced it (FP32 values for an INT32 output, text for a
    number), as Triton's Python backend sends it. Each is logged once per model and output. Only
    an array whose numpy dtype has no tensor datatype (complex, datetime...) fails the request.
    """
    outputs: dict[str, np.ndarray] = {}
    produced = response.outputs
    for name in request.requested_outputs:
        value = produced.get(name)
        if value is None:
            _warn_once(model_name, name, "did not produce the requested output '%s' (left out of the response)")
            continue
        array = value if isinstance(value, np.ndarray) else np.asarray(value)
        spec = io.outputs.get(name)
        if spec is not None:
            actual = datatypes.from_numpy(array.dtype)
            if actual is None:
                return InferError(
                    f"model '{model_name}' produced output '{name}' of numpy dtype {array.dtype}, which "
                    f"is no tensor datatype (its config declares {spec.datatype.name})",
                    ErrorCode.INTERNAL,
                )
            if actual.name != spec.datatype.name:
                converted = _converted(array, spec.datatype)
                if converted is None:
                    _warn_once(model_name, name, f"produced output '%s' as {actual.name}; sent as it is, "
                               f"as Triton sends it (its config declares {spec.datatype.name})")
                else:
                    _warn_once(model_name, name, f"produced output '%s' as {actual.name}; "
                               f"converted to {spec.datatype.name} as its config declares")
                    array = converted
        outputs[name] = array
    response.outputs = outputs
    return response


def _converted(array: np.ndarray, datatype: datatypes.DataType) -> np.ndarray | None:
    target = datatype.dtype
    if array.size == 0:  # no element to convert: an empty output of any type (e.g. np.array([]))
        return np.empty(array.shape, dtype=target)
    if datatype.is_bytes or array.dtype == object or not np.can_cast(array.dtype, target, casting="same_kind"):
        return None
    if target.kind in "iu" and array.dtype.kind in "iu" and array.size:  # narrowing must not wrap
        info = np.iinfo(target)
        if array.min() < info.min or array.max() > info.max:
            return None
    return array.astype(target)


_warned: set[tuple[str, str, str]] = set()


def _warn_once(model_name: str, output: str, what: str) -> None:
    key = (model_name, output, what)
    if key not in _warned:
        _warned.add(key)
        log.warning("model '%s' " + what, model_name, output)
