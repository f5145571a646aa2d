"""Ensembles (``platform: "ensemble"``): a DAG of steps run by the core, not by a backend.

``build_plan`` checks an ensemble's ``ensemble_scheduling`` against the models it names
(unknown models, unmapped or unknown tensors, tensors written twice, cycles, datatype
mismatches, unused inputs, outputs nothing produces, a step or the outputs fed from different
decoupled steps) with messages naming the step and tensor, and, as Triton does, makes the
ensemble decoupled exactly when one of its steps is.

``EnsembleScheduler`` runs one request on the event loop, with no task of its own: a step
starts as soon as all its input tensors exist, independent steps run concurrently on their
models' own instances, and tensors pass between steps as the very arrays the previous step
produced (no copies, no host round trip for device arrays). Only the steps the requested
outputs need run. As in Triton, an optional ensemble input the request leaves out, and a step
output its step does not produce, are there but empty (``ABSENT``): the steps reading them run
without them (they must be optional there), and an empty requested output is left out.

Decoupled steps (Triton's semantics): each response of a decoupled step starts a *wave*, its own
copy of the tensors, that runs the steps downstream of it; every wave that completes the
requested outputs becomes one response of the (decoupled) ensemble, sent as it completes; the
final flag follows when no step of any wave is left running (it rides on the last response when
that one ends the run). An error in any wave fails that request at once, as Triton 2.51 does:
its steps still in flight are cancelled and whatever they send later is dropped.

Statistics (Triton's rules): a successful ensemble request counts one execution of its batch
size; its queue time is the wait until the scheduler took it and its compute input / infer /
output times are the sums of those of its steps' requests. A step's request arrives when the
response of the step before it was sent (not when the event loop took that response up), so the
hand-off between steps is that step's queue time, as it is in Triton.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from pyserve.api import datatypes
from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import (
    SEQUENCE_END,
    SEQUENCE_START,
    FutureSender,
    InferRequest,
    InferResponse,
    RunningLoop,
    read_only,
)
from pyserve.repository.ensemble_plan import ModelLookup, Step
from pyserve.repository.model_config import ModelIO
from pyserve.repository.tensor_checks import check_input, missing_inputs
from pyserve.runtime.scheduling.instance import STOP, Batch, check_outputs

log = logging.getLogger("pyserve.runtime.scheduling")

ABSENT: Any = type("Absent", (), {"__repr__": lambda self: "ABSENT", "__slots__": ()})()
"""The value in a wave of a tensor that is there but empty (Triton's placeholder): an optional
ensemble input the request left out, or a step output its step did not produce. A step that
reads it runs without that input; a requested output that is ABSENT is left out of the
response."""

class EnsembleScheduler:
    """Runs an ensemble's requests on the server's event loop.

    :param name: the ensemble's model name.
    :param steps: the validated plan.
    :param io: the ensemble's own tensor tables.
    :param lookup: resolves step models at run time (they may be reloaded).
    """

    observe = None

    def __init__(self, name: str, steps: list[Step], io: ModelIO, lookup: ModelLookup) -> None:
        self.name = name
        self.steps = steps
        self.io = io
        self.lookup = lookup
        self._plans: dict[tuple[str, ...], tuple[Step, ...]] = {}  # requested outputs -> steps to run
        self.optional_inputs = tuple(name for name, spec in io.inputs.items() if spec.optional)
        self._running_loop = RunningLoop()  # no getpid system call per request

    def _loop(self) -> asyncio.AbstractEventLoop:
        loop = self._running_loop.get()
        if loop is None:
            raise RuntimeError(f"ensemble '{self.name}': requests are enqueued on the server's event loop")
        return loop

    def enqueue(self, request: InferRequest) -> None:
        """Start ``request`` on the next turn of the loop (event loop only; never raises
        ``InferError``: errors are answered through the request's sender)."""
        loop = self._loop()
        loop.call_soon(_Run(self, request, loop, self._plan(request.requested_outputs)).start)

    def batch_source(self, index: int) -> Callable[[], Batch | None]:
        return lambda: STOP  # an ensemble has no instances

    def stop(self, workers: int) -> None:
        """In-flight ensemble requests finish on their own (the server drains them first)."""

    def _plan(self, requested: tuple[str, ...]) -> tuple[Step, ...]:
        """The steps the requested outputs need, in config order (as Triton prunes the others)."""
        plan = self._plans.get(requested)
        if plan is None:
            plan = needed_steps(self.steps, requested)
            if len(self._plans) < 64:
                self._plans[requested] = plan
        return plan


def needed_steps(steps: Sequence[Step], outputs: Iterable[str]) -> tuple[Step, ...]:
    """The steps that ``outputs`` depend on, in plan order."""
    producers = {tensor: step for step in steps for tensor in step.outputs.values()}
    needed: set[int] = set()
    todo = list(outputs)
    while todo:
        step = producers.get(todo.pop())
        if step is not None and step.index not in needed:
            needed.add(step.index)
            todo.extend(step.inputs.values())
    return tuple(s for s in steps if s.index in needed)


class _Wave:
    """The tensors of one flow through the graph: the request's inputs and the outputs of the
    steps that ran in it; a decoupled step's every response forks a new wave."""

    __slots__ = ("emitted", "pool", "ready_ns", "started")

    def __init__(self, pool: dict[str, Any], started: set[int], ready_ns: int = 0) -> None:
        self.pool = pool
        self.started = started  # indexes of the steps started in this wave (or the one it forked from)
        self.emitted = False
        self.ready_ns = ready_ns  # when the step response that last updated the pool was sent (0: none)

    def fork(self) -> _Wave:
        return _Wave(dict(self.pool), set(self.started), self.ready_ns)


def sequence_parameters(request: InferRequest) -> dict[str, bool | int | str]:
    """The parameters every ensemble response carries in Triton (checked side by side with
    2.51): the request's sequence id (0 when none) and START / END flags."""
    return {
        "sequence_end": bool(request.flags & SEQUENCE_END),
        "sequence_id": request.correlation_id,
        "sequence_start": bool(request.flags & SEQUENCE_START),
    }


class _Call:
    """One step request of a run: which step, in which wave, and how its responses come back."""

    __slots__ = ("child", "decoupled", "future", "run", "step", "wave")

    def __init__(self, run: _Run, step: Step, wave: _Wave, child: InferRequest, decoupled: bool) -> None:
        self.run = run
        self.step = step
        self.wave = wave
        self.child = child
        self.decoupled = decoupled
        self.future: asyncio.Future[InferResponse | InferError] | None = None

    def resolved(self, future: asyncio.Future[InferResponse | InferError]) -> None:
        """Done callback of a non-decoupled step's future (event loop)."""
        if not future.cancelled():
            self.run.on_step_response(self, future.result(), True)


class _StepSender:
    """The ``ResponseSender`` of a decoupled step's request: hands each response to the run on
    the event loop, in the order sent (any thread)."""

    __slots__ = ("_call", "_loop")

    def __init__(self, call: _Call, loop: asyncio.AbstractEventLoop) -> None:
        self._call = call
        self._loop = loop

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        try:
            self._loop.call_soon_threadsafe(self._call.run.on_step_response, self._call, response, final)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    def is_cancelled(self) -> bool:
        run = self._call.run
        return run.closed or run.request.is_cancelled()


class _Run:
    """One ensemble request on its way through the steps. Event loop only, except
    ``closed``, which step senders read from any thread.

    Ends exactly once (``closed``): with the final response (success; counted in the
    ensemble's statistics as one execution), or with an error (in-flight steps cancelled).
    """

    __slots__ = ("calls", "closed", "durations", "loop", "needed", "plan", "request", "root", "scheduler",
                 "start_ns", "streaming")

    def __init__(self, scheduler: EnsembleScheduler, request: InferRequest, loop: asyncio.AbstractEventLoop,
                 plan: tuple[Step, ...]) -> None:
        self.scheduler = scheduler
        self.request = request
        self.loop = loop
        self.plan = plan
        self.needed = frozenset(request.requested_outputs)
        self.calls: set[_Call] = set()  # step requests without their final response yet
        self.closed = False
        self.streaming = False  # a decoupled step took part: responses are streamed
        self.durations = [0, 0, 0]  # the steps' compute input / infer / output ns
        self.start_ns = 0
        pool: dict[str, Any] = dict(request.inputs)
        for name in scheduler.optional_inputs:  # as Triton: a left-out optional input is there, empty
            pool.setdefault(name, ABSENT)
        self.root = _Wave(pool, set())

    def start(self) -> None:
        """Start the steps the request's inputs feed (a loop callback)."""
        try:
            self.start_ns = time.monotonic_ns()
            if self.request.trace is not None:  # the steps are the ensemble's compute
                self.request.trace.mark("COMPUTE_START")
            self._advance(self.root)
            if not self.closed:
                self._settle(None, ())
        except Exception as exc:  # a bug must still answer the request
            self._bug(exc)

    def on_step_response(self, call: _Call, response: InferResponse | InferError | None, final: bool) -> None:
        """One response of a step request (event loop): record its outputs, start what they
        make ready, send what is complete."""
        if self.closed:
            return
        try:
            if final:
                self.calls.discard(call)
                self._add_durations(call.child)
            if isinstance(response, InferError):
                self._step_failed(call.step, response)
            elif self.request.is_cancelled():
                self._fail(InferError("request was cancelled", ErrorCode.CANCELLED))
            elif response is None:
                self._settle(None, ())
            else:
                wave = call.wave.fork() if call.decoupled else call.wave
                child = call.child  # its steps arrive when this response was sent, not when the loop got it
                wave.ready_ns = (child.reply_ns if final else child.last_response_ns) or time.monotonic_ns()
                updated = []
                for step_output, tensor in call.step.outputs.items():
                    value = response.outputs.get(step_output)
                    # an output the step did not produce is there, empty (Triton): a step reading
                    # it as an optional input runs without it
                    wave.pool[tensor] = ABSENT if value is None else value
                    updated.append(tensor)
                self._advance(wave)
                if not self.closed:
                    self._settle(wave, updated)
        except Exception as exc:
            self._bug(exc)

    # -- moving on ------------------------------------------------------------------------------
    def _advance(self, wave: _Wave) -> None:
        """Start every step of the plan whose inputs ``wave`` now holds (once per wave)."""
        pool, started = wave.pool, wave.started
        for step in self.plan:
            if step.index not in started and all(t in pool for t in step.inputs.values()):
                started.add(step.index)
                self._launch(step, wave)
                if self.closed:
                    return

    def _settle(self, wave: _Wave | None, updated: Sequence[str]) -> None:
        """After an update of ``wave`` (None: a step only ended): send the response the update
        completed, the final flag once nothing runs, or the error of a run that cannot finish."""
        response = None
        if wave is not None and not wave.emitted and self.needed.issubset(wave.pool) \
                and not self.needed.isdisjoint(updated):
            wave.emitted = True
            pool = wave.pool
            request = self.request
            response = InferResponse({name: pool[name] for name in request.requested_outputs
                                      if pool[name] is not ABSENT}, sequence_parameters(request))
        if response is not None:
            if self.calls and self.streaming:
                checked = check_outputs(self.request, response, self.scheduler.io, self.scheduler.name)
                if isinstance(checked, InferError):
                    self._fail(checked)
                else:
                    self.request.reply(checked, final=False)
            else:  # the last response (a non-decoupled run needs nothing more)
                self._succeed(response)
        elif not self.calls:
            if self.streaming:
                self._succeed(None)  # a decoupled ensemble may answer with the final flag alone
            else:
                missing = sorted(self.needed - set(self.root.pool))
                self._fail(InferError(f"ensemble '{self.scheduler.name}' cannot produce {missing}",
                                      ErrorCode.INTERNAL))

    def _launch(self, step: Step, wave: _Wave) -> None:
        """Send ``step`` its request for ``wave``; a refusal fails the run."""
        try:
            model = self.scheduler.lookup(step.model_name, step.version)
            child = self._step_request(step, model, wave.pool)
        except InferError as exc:
            self._step_failed(step, exc, composing=False)
            return
        if wave.ready_ns:  # the hand-off from the step before is this step's queue time
            child.arrival_ns = wave.ready_ns
        call = _Call(self, step, wave, child, model.decoupled)
        if call.decoupled:
            self.streaming = True
            child.attach_sender(_StepSender(call, self.loop))
        else:
            future: asyncio.Future[InferResponse | InferError] = self.loop.create_future()
            future.add_done_callback(call.resolved)
            call.future = future
            child.attach_sender(FutureSender(self.loop, future))
        trace = self.request.trace
        if trace is not None and trace.manager is not None:  # each step is a child of the ensemble's trace
            trace.manager.trace_step(trace, child)
        self.calls.add(call)
        try:
            model.enqueue(child)
        except InferError as exc:
            self.calls.discard(call)
            self._step_failed(step, exc)

    def _step_request(self, step: Step, model: Any, pool: dict[str, Any]) -> InferRequest:
        """The request of one step: its inputs from ``pool``, checked against the step model as
        it is now; the rest from the ensemble's request.

        :raises InferError: an input does not fit the step model.
        """
        io: ModelIO = model.io
        inputs = {}
        parent = self.request
        batch = parent.batch_size if io.batching else 1
        for step_input, tensor in step.inputs.items():
            array = pool[tensor]
            if array is ABSENT:  # left out, as Triton does; the step model must take it as optional
                continue
            _, shape = check_input(step.model_name, io, step_input, _datatype(array, io, step_input),
                                   list(array.shape))
            inputs[step_input] = read_only(array)  # a tensor may feed several steps
            if io.batching:
                batch = shape[0]
        if len(inputs) != len(io.inputs):
            missing = [name for name, spec in io.inputs.items() if name not in inputs and not spec.optional]
            if missing:
                raise missing_inputs(step.model_name, io, inputs, missing)
        return InferRequest(
            step.model_name,
            model.version,
            inputs,
            tuple(step.outputs),
            id=parent.id,
            parameters=parent.parameters,
            flags=parent.flags,
            correlation_id=parent.correlation_id,
            priority=parent.priority,
            timeout_us=parent.timeout_us,
            batch_size=batch,
        )

    def _add_durations(self, child: InferRequest) -> None:
        """Add a finished step request's compute input / infer / output time, as its model's
        statistics counted them (0 for a request that never reached an execute)."""
        start, end = child.exec_start_ns, child.exec_end_ns
        if start <= 0 or end < start:
            return
        compute = child.compute_ns
        durations = self.durations
        if compute is not None and start <= compute[0] <= compute[1] <= end:
            durations[0] += compute[0] - start
            durations[1] += compute[1] - compute[0]
            durations[2] += end - compute[1]
        else:
            durations[1] += end - start

    # -- ending ---------------------------------------------------------------------------------
    def _succeed(self, response: InferResponse | None) -> None:
        """Send the final response (None: the final flag alone) and count the execution."""
        request = self.request
        if response is not None:
            checked = check_outputs(request, response, self.scheduler.io, self.scheduler.name)
            if isinstance(checked, InferError):
                self._fail(checked)
                return
            response = checked
        self._close()
        self._count_execution()
        request.reply(response, final=True)

    def _count_execution(self) -> None:
        """Count the request as one execution: queued until ``start_ns``, computing for the
        steps' summed durations. The window is recorded on the request (exec start and end,
        compute) as an instance's execute would be, so that the statistics count it when the
        final response goes out and an enclosing ensemble can sum it in turn."""
        request = self.request
        start = self.start_ns
        before, infer, after = self.durations
        stats = request.stats
        if stats is not None:
            stats.begin((request,), start)
        request.exec_start_ns = start
        request.compute_ns = (start + before, start + before + infer)
        if stats is not None:
            stats.executed((request,), start, start + before + infer, ready_ns=start + before + infer + after)
        else:
            request.exec_end_ns = start + before + infer + after

    def _step_failed(self, step: Step, error: InferError, composing: bool = True) -> None:
        """A step failed: the run fails with the step's error in Triton 2.51's words, ``in
        ensemble '<name>', <the step's message>`` (the step is logged at debug level).
        ``composing``: the step model refused or answered the request with ``error`` (so it
        counted a failure, which counts for the ensemble too); False: no request reached it."""
        log.debug("ensemble '%s': step %d (model '%s') failed: %s", self.scheduler.name, step.index,
                  step.model_name, error.message)
        stats = self.request.stats
        if composing and stats is not None and not self.closed and error.code is not ErrorCode.CANCELLED:
            stats.step_failed(time.monotonic_ns() - self.request.arrival_ns)
        self._fail(InferError(f"in ensemble '{self.scheduler.name}', {error.message}", error.code))

    def _bug(self, exc: Exception) -> None:
        log.exception("ensemble '%s' failed", self.scheduler.name)
        self._fail(InferError(f"ensemble '{self.scheduler.name}' failed: {type(exc).__name__}: {exc}",
                              ErrorCode.INTERNAL))

    def _fail(self, error: InferError) -> None:
        """End the run with ``error`` (once): cancel the steps still running, answer the request."""
        if self.closed:
            return
        self._close()
        self.request.reply(error)

    def _close(self) -> None:
        self.closed = True
        for call in self.calls:
            call.child.cancel()
            if call.future is not None:
                call.future.cancel()
        self.calls.clear()


def _datatype(array: Any, io: ModelIO, name: str) -> str:
    """The datatype of a tensor an ensemble passes on, checked against the step model's current
    config (the model may have been reloaded with other types since the plan was built).

    numpy arrays are checked by their own dtype; other DLPack-capable arrays (torch, cupy...)
    come from a backend that already checked them against its model's declared outputs.
    """
    if isinstance(array, np.ndarray):
        found = datatypes.from_numpy(array.dtype)
        if found is not None:
            return found.name
    spec = io.inputs.get(name)
    return spec.datatype.name if spec is not None else ""

