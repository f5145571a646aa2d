"""Per-model statistics: the counters behind Triton's statistics extension and the
``nv_inference_*`` metrics.

Counting rules (Triton's): a request counts once as a success or a failure when its final
response is sent. Success, queue and request duration include response-cache hits; compute
input/infer/output, ``inference_count`` and ``execution_count`` do not.

What each duration covers, so that queue + compute input + infer + output <= request for every
request (gRPC streaming, ensembles and BLS calls included):

* request: from arrival (the frontend has the request and starts decoding it) until its
  response went out. Frontends that encode the response after the core answered
  (HTTP ``/infer``, gRPC ``ModelInfer`` and ``ModelStreamInfer``) report the moment it was
  encoded and handed to the transport (``response_sent``); for others (the in-process API, a
  BLS call, an ensemble step) the request ends when the core answers it.
* queue: arrival until an instance took the request (its execute began).
* compute input / infer / output: the instance's phases. Without a report from the backend the
  execute call is compute infer and compute output runs from its return until the batch's
  responses were checked and ready to send (compute input is 0: the inputs are already
  arrays). A backend that reports where its computation began and ended inside the execute
  (``ModelStats.backend_compute``, e.g. a native backend's ``ModelInstanceReportStatistics``)
  splits the execute call at those points: the part before goes to compute input, the part
  after to compute output.

``batch_stats`` count the same phases per execution. ``response_stats`` count every response
by its index within its request (Triton 24.03+): success / fail / empty (a final flag with no
response) / cancel, with the response's compute infer (from the previous response, or the
execute start, until the backend handed it over) and compute output (until it went to the
frontend). Failures carry a reason: ``REJECTED`` (refused by the scheduler: queue full, queue
timeout), ``CANCELED``, ``BACKEND`` (the request reached execute), ``OTHER``. As Triton
documents for ensembles, an ensemble's failures are ``OTHER`` (cancellations aside), and a
request that failed in a composing model counts twice for the ensemble: the composing
model's failed request (``step_failed``) and the ensemble's own.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyserve.api.errors import ErrorCode, InferError
from pyserve.metrics.latency import LATENCY_BUCKETS, latency_bucket
from pyserve.metrics.summaries import (
    COMPUTE_INFER,
    COMPUTE_INPUT,
    COMPUTE_OUTPUT,
    QUEUE,
    REQUEST,
    LatencySummaries,
)
from pyserve.repository.scan import is_version_number

if TYPE_CHECKING:
    from pyserve.api.inference import InferRequest, InferResponse
    from pyserve.runtime.versions import ModelVersion


FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
"""The ``reason`` label values of ``nv_inference_request_failure`` (all four always shown)."""
_REJECTED, _CANCELED, _BACKEND, _OTHER = range(4)

FIRST_RESPONSE_BUCKETS_MS = (100.0, 500.0, 2000.0, 5000.0)
"""Bucket bounds of ``nv_inference_first_response_histogram_ms`` (Triton's defaults; a model's
config can set its own through ``model_metrics``)."""

MEMORY_TYPES = ("CPU", "CPU_PINNED", "GPU")
"""The ``type`` values of ``memory_usage`` rows."""

RESPONSE_FIELDS = ("success", "fail", "empty_response", "cancel")
"""The outcomes ``response_stats`` counts per response index (each ``[count, ns]``)."""
_R_SUCCESS, _R_FAIL, _R_EMPTY, _R_CANCEL = range(4)
_R_INFER, _R_OUTPUT = 8, 9  # compute infer / output ns; their count is success + fail
_R_SIZE = 10


class ModelStats:
    """The statistics of one model version.

    Thread-safety: counters change under ``lock`` (instance threads, the event loop), except
    ``enqueued`` and ``sent_ns``, which only the event loop writes (``ModelVersion.enqueue``,
    the frontends' ``response_sent``) and so need no lock. Readers take a copy with
    ``snapshot``.

    A request carries its model's ``ModelStats`` in ``request.stats`` from the moment it is
    submitted; ``request.exec_start_ns`` is -1 before it is queued, 0 while it is queued and
    the execute start (``time.monotonic_ns``) once an instance took it.

    :param first_bounds: the bucket bounds (ms) of the first-response histogram.
    """

    __slots__ = (
        "batches", "ensemble", "cache_hit_count", "cache_hit_ns", "cache_miss_count", "cache_miss_ns",
        "compute_count", "dequeued", "enqueued", "execution_count", "fail_count", "fail_ns",
        "failures", "first_bounds", "first_buckets", "first_count", "first_sum_ms", "inference_count",
        "infer_ns", "input_ns", "last_inference_ns", "latency_buckets", "load_duration_s", "lock", "memory_usage",
        "output_ns", "queue_ns", "responses", "sent_ns", "success_count", "success_ns", "summaries",
        "_epoch_offset_ns", "_first_response",
    )

    def __init__(self, first_bounds: Sequence[float] = FIRST_RESPONSE_BUCKETS_MS) -> None:
        self.lock = threading.Lock()
        self.ensemble = False  # an ensemble's: failures are OTHER, a composing failure counts too
        self.success_count = 0
        self.success_ns = 0
        self.fail_count = 0
        self.fail_ns = 0
        self.queue_ns = 0  # queue count == success_count (cache hits included)
        self.compute_count = 0  # successes that were not cache hits
        self.input_ns = 0
        self.infer_ns = 0
        self.output_ns = 0
        self.sent_ns = 0  # answered → response sent, of the successes whose frontend reports it
        self.cache_hit_count = 0
        self.cache_hit_ns = 0
        self.cache_miss_count = 0
        self.cache_miss_ns = 0
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ns = 0  # monotonic; 0 = never
        self.failures = [0, 0, 0, 0]  # by FAILURE_REASONS index
        self.batches: dict[int, list[int]] = {}  # batch size → [count, input_ns, infer_ns, output_ns]
        self.enqueued = 0
        self.dequeued = 0
        self.first_bounds = tuple(float(b) for b in first_bounds)
        self.first_buckets = [0] * len(self.first_bounds)
        self.first_count = 0
        self.first_sum_ms = 0.0
        self._first_response = [0] * _R_SIZE
        self.responses: dict[int, list[int]] = {0: self._first_response}
        """Response index → ``[count, ns]`` of each of ``RESPONSE_FIELDS``, then the compute
        infer and compute output ns (counted for successes and failures)."""
        self.memory_usage: tuple[tuple[str, int, int], ...] = ()
        """What the backend reported holding: ``(type, device id, bytes)`` (``report_memory_usage``)."""
        self.load_duration_s: float | None = None
        """How long the version took to load (``nv_model_load_duration_secs``)."""
        self.latency_buckets = [0] * LATENCY_BUCKETS
        """Successes by request duration (``pyserve.metrics.latency``): the status page's percentiles."""
        self.summaries: LatencySummaries | None = None
        """Set when ``--metrics-config summary_latencies=true``: each success's durations."""
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()

    # -- hot path ------------------------------------------------------------------------------
    def begin(self, requests: Sequence[InferRequest], start_ns: int) -> None:
        """An instance starts executing ``requests`` (they leave the queue)."""
        for request in requests:
            request.exec_start_ns = start_ns
            request.exec_end_ns = 0  # a rescheduled (iterative sequence) request comes back: a new execute
            request.compute_ns = None
        with self.lock:
            self.dequeued += len(requests)

    def executed(
        self,
        requests: Sequence[InferRequest],
        start_ns: int,
        end_ns: int,
        failed: bool = False,
        ready_ns: int = 0,
        executed_size: int = 0,
    ) -> None:
        """The execute call of ``requests`` (started at ``start_ns``) returned at ``end_ns`` and
        their responses were checked and ready to send at ``ready_ns`` (0: at ``end_ns``): one
        execution of their total batch size. Call it before the responses are sent.

        Requests the backend reported no compute for get the execute call as theirs; the batch
        statistics split the execute at the earliest start and latest end its requests report.

        :param failed: the execute raised: as Triton counts it, still an execution (and its
            batch), but no inferences (``inference_count``).
        :param executed_size: the batch size the backend executed when it is larger than that of
            ``requests`` (null requests of the direct sequence strategy: as in Triton, the batch
            statistics count them, ``inference_count`` does not); 0: the requests' total.
        """
        ready_ns = ready_ns or end_ns
        call = (start_ns, end_ns)
        size = 0
        first = last = 0
        for request in requests:
            size += request.batch_size
            compute = request.compute_ns
            if compute is None or not start_ns <= compute[0] <= compute[1] <= end_ns:
                if request.exec_end_ns and request.final_sent:
                    continue  # answered during its execute: counted already
                request.compute_ns = compute = call
            request.exec_end_ns = ready_ns
            if not first or compute[0] < first:  # the batch's compute: earliest start to latest end
                first = compute[0]
            if compute[1] > last:
                last = compute[1]
        if not first:
            first, last = start_ns, end_ns
        before, infer, after = first - start_ns, last - first, ready_ns - last
        with self.lock:
            self.execution_count += 1
            if not failed:
                self.inference_count += size
            size = executed_size or size
            entry = self.batches.get(size)
            if entry is None:
                self.batches[size] = [1, before, infer, after]
            else:
                entry[0] += 1
                entry[1] += before
                entry[2] += infer
                entry[3] += after

    def backend_compute(
        self,
        requests: Sequence[InferRequest],
        exec_start_ns: int,
        compute_start_ns: int,
        compute_end_ns: int,
        exec_end_ns: int,
    ) -> None:
        """A backend reports, from inside its execute, where the computation of ``requests``
        began and ended (``time.monotonic_ns`` clock; Triton's
        ``TRITONBACKEND_ModelInstanceReportStatistics`` timestamps).

        The execute call the core measured is then split at those two points when the
        requests are counted: before ``compute_start_ns`` is compute input, after
        ``compute_end_ns`` compute output, between them compute infer (so nothing is counted
        twice). The batch statistics of the execute split at the earliest start and latest end
        its requests report. A report that is not ordered (``exec_start <= compute_start <=
        compute_end <= exec_end``) or falls outside the measured execute is ignored, leaving
        the core's numbers. Call it before the execute returns: it stores the two timestamps
        on each request; requests already answered (and counted) during the execute have their
        counted execute time moved under the lock instead, clamped to what was counted.
        """
        if not 0 < exec_start_ns <= compute_start_ns <= compute_end_ns <= exec_end_ns:
            return
        compute = (compute_start_ns, compute_end_ns)
        late = None
        for request in requests:
            request.compute_ns = compute
            if request.exec_end_ns and request.exec_start_ns > 0:  # already counted (answered early)
                late = [request] if late is None else [*late, request]
        if late is None:
            return
        with self.lock:  # move the counted execute time of those requests to the split
            for request in late:
                start, end = request.exec_start_ns, request.exec_end_ns
                first = min(max(compute_start_ns, start), end)
                last = min(max(compute_end_ns, first), end)
                self.input_ns += first - start
                self.output_ns += end - last
                self.infer_ns -= (first - start) + (end - last)

    def response(self, request: InferRequest, response: InferResponse | InferError, handed_ns: int = 0) -> None:
        """A non-final response of ``request`` (a decoupled model's) is being sent.

        :param handed_ns: when the backend handed the response over (before it was checked);
            0: now.
        """
        now = time.monotonic_ns()
        if not request.first_response_ns:
            request.first_response_ns = now
        if request.exec_start_ns <= 0:
            return
        with self.lock:
            self._count_response(request, _R_FAIL if isinstance(response, InferError) else _R_SUCCESS,
                                 handed_ns or now, now)

    def _count_response(self, request: InferRequest, outcome: int, handed_ns: int, now: int) -> None:
        """Count response number ``request.responses`` (under the lock) and move to the next."""
        index = request.responses
        request.responses = index + 1
        previous = request.last_response_ns or request.exec_start_ns
        request.last_response_ns = now
        entry = self.responses.get(index)
        if entry is None:
            entry = self.responses[index] = [0] * _R_SIZE
        slot = 2 * outcome
        entry[slot] += 1
        entry[slot + 1] += now - previous
        if outcome <= _R_FAIL:  # a response the backend computed: its infer and output parts
            handed = min(max(handed_ns, previous), now)
            entry[_R_INFER] += handed - previous
            entry[_R_OUTPUT] += now - handed

    def request_done(self, request: InferRequest, response: InferResponse | InferError | None) -> None:
        """The final response of ``request`` is being sent: count a success or a failure."""
        now = time.monotonic_ns()
        total = now - request.arrival_ns
        start = request.exec_start_ns
        deferred = request.reply_ns < 0  # the frontend reports when the response went out
        request.reply_ns = now
        if isinstance(response, InferError):
            self._failed(request, response, start, total, now)
            return
        first = request.first_response_ns or now
        first_ms = (first - request.arrival_ns) / 1e6
        queued = c_in = infer = c_out = -1
        with self.lock:
            self.success_count += 1
            self.success_ns += total
            self.latency_buckets[latency_bucket(total)] += 1
            self.last_inference_ns = now
            if start > 0:
                queued = start - request.arrival_ns
                self.queue_ns += queued
                self.compute_count += 1
                end = request.exec_end_ns
                if not end:  # answered during its execute: backend_compute may split it later
                    end = request.exec_end_ns = now
                compute = request.compute_ns
                if compute is not None and start <= compute[0] <= compute[1] <= end:
                    began, handed = compute
                else:
                    began = start
                    handed = end
                c_in = began - start
                infer = handed - began
                c_out = end - handed
                self.input_ns += c_in
                self.infer_ns += infer
                self.output_ns += c_out
                if request.responses or response is None:  # a decoupled model's
                    self._count_response(request, _R_SUCCESS if response is not None else _R_EMPTY, handed, now)
                else:  # the usual case, inline: its only response
                    entry = self._first_response
                    entry[0] += 1
                    entry[1] += now - start
                    entry[_R_INFER] += handed - start
                    entry[_R_OUTPUT] += now - handed
            elif start == 0:  # queued but answered without an instance (an ensemble)
                self.dequeued += 1
                self.compute_count += 1
            self.first_count += 1
            self.first_sum_ms += first_ms
            index = bisect_left(self.first_bounds, first_ms)  # bounds are inclusive ("le")
            if index < len(self.first_buckets):
                self.first_buckets[index] += 1
        summaries = self.summaries
        if summaries is not None:
            if not deferred:
                summaries.observe(REQUEST, total)
            if queued >= 0:
                summaries.observe(QUEUE, queued)
                summaries.observe(COMPUTE_INPUT, c_in)
                summaries.observe(COMPUTE_INFER, infer)
                summaries.observe(COMPUTE_OUTPUT, c_out)

    def _failed(self, request: InferRequest, error: InferError, start: int, total: int, now: int) -> None:
        code = error.code
        if code is ErrorCode.CANCELLED:
            reason = _CANCELED
        elif self.ensemble:
            reason = _OTHER
        elif start > 0:
            reason = _BACKEND
        elif code is ErrorCode.UNAVAILABLE:
            reason = _REJECTED
        else:
            reason = _OTHER
        with self.lock:
            self.fail_count += 1
            self.fail_ns += total
            self.failures[reason] += 1
            if start > 0:  # it reached an instance: an inference, as Triton's last_inference counts it
                self.last_inference_ns = now
            if start == 0:
                self.dequeued += 1
            if reason == _CANCELED:
                if start <= 0 and not request.last_response_ns:  # cancelled in the queue
                    request.last_response_ns = request.arrival_ns
                self._count_response(request, _R_CANCEL, now, now)
            elif start > 0:
                self._count_response(request, _R_FAIL, now, now)

    def step_failed(self, duration_ns: int) -> None:
        """An ensemble's composing model failed a request of its run (``duration_ns`` after the
        run began): a failure of the ensemble's too, as Triton counts it (reason ``OTHER``)."""
        with self.lock:
            self.fail_count += 1
            self.fail_ns += duration_ns
            self.failures[_OTHER] += 1

    def response_sent(self, request: InferRequest) -> None:
        """A frontend encoded the successful final response of ``request`` and handed it to the
        transport: the request's duration runs until now. Event loop only (the frontends
        encode there): ``sent_ns`` has that single writer, so no lock is taken. A request the
        frontend marked beforehand (``request.reply_ns = -1``) has its request summary
        recorded here instead of when the core answered.
        """
        replied = request.reply_ns
        if replied <= 0:
            return
        now = time.monotonic_ns()
        self.sent_ns += now - replied
        summaries = self.summaries
        if summaries is not None:
            summaries.observe(REQUEST, now - request.arrival_ns)

    def rejected(self, request: InferRequest) -> None:
        """The scheduler refused ``request`` (queue full, bad sequence control): a failure."""
        total = time.monotonic_ns() - request.arrival_ns
        with self.lock:
            self.fail_count += 1
            self.fail_ns += total
            self.failures[_REJECTED] += 1

    # -- set up by the loader, reported by backends ------------------------------------------------
    def use_first_response_buckets(self, bounds: Sequence[float]) -> None:
        """Use ``bounds`` (ms, increasing) for the first-response histogram (a config's
        ``model_metrics``). Call before the version serves: the buckets start empty."""
        with self.lock:
            self.first_bounds = tuple(float(b) for b in bounds)
            self.first_buckets = [0] * len(self.first_bounds)

    def report_memory_usage(self, usage: Iterable[tuple[str, int, int]]) -> None:
        """What the version holds, as ``(type, device id, bytes)`` rows (Triton's
        ``memory_usage``: type ``CPU``, ``CPU_PINNED`` or ``GPU``); replaces an earlier report.
        Any thread.

        :raises ValueError: an unknown type, or a negative id or size.
        """
        rows = tuple((str(kind), int(device), int(size)) for kind, device, size in usage)
        for kind, device, size in rows:
            if kind not in MEMORY_TYPES or device < 0 or size < 0:
                raise ValueError(f"memory usage ({kind!r}, {device}, {size}): the type must be one of "
                                 f"{', '.join(MEMORY_TYPES)} and the id and size non-negative")
        self.memory_usage = rows

    # -- response cache --------------------------------------------------------------------------
    def cache_lookup(self, hit: bool, duration_ns: int) -> None:
        """Count one response-cache lookup: a hit (lookup time) or a miss (lookup + insert time).

        The request itself is counted when its response is sent, like any other.
        """
        with self.lock:
            if hit:
                self.cache_hit_count += 1
                self.cache_hit_ns += duration_ns
            else:
                self.cache_miss_count += 1
                self.cache_miss_ns += duration_ns

    # -- replicas in frontend processes ----------------------------------------------------------
    _ADDITIVE = (
        "success_count", "success_ns", "fail_count", "fail_ns", "queue_ns", "compute_count", "input_ns",
        "infer_ns", "output_ns", "sent_ns", "cache_hit_count", "cache_hit_ns",
        "cache_miss_count", "cache_miss_ns", "inference_count", "execution_count", "enqueued", "dequeued",
        "first_count", "first_sum_ms",
    )

    def counters(self) -> dict[str, Any]:
        """Every counter, copied (for ``counters_delta``: a replica reporting to the owner)."""
        with self.lock:
            values: dict[str, Any] = {name: getattr(self, name) for name in self._ADDITIVE}
            values["failures"] = list(self.failures)
            values["first_buckets"] = list(self.first_buckets)
            values["latency_buckets"] = list(self.latency_buckets)
            values["batches"] = {size: list(entry) for size, entry in self.batches.items()}
            values["responses"] = {index: list(entry) for index, entry in self.responses.items()}
            values["last_inference_ns"] = self.last_inference_ns
        return values

    def absorb(self, delta: Mapping[str, Any]) -> None:
        """Add what a replica of this version counted (a ``counters_delta``) to these counters."""
        with self.lock:
            for name in self._ADDITIVE:
                setattr(self, name, getattr(self, name) + delta.get(name, 0))
            for index, value in enumerate(delta.get("failures", ())):
                self.failures[index] += value
            for index, value in enumerate(delta.get("first_buckets", ())):
                self.first_buckets[index] += value
            latency = self.latency_buckets
            for index, value in enumerate(delta.get("latency_buckets", ())):
                if value:
                    latency[min(index, LATENCY_BUCKETS - 1)] += value
            for size, entry in delta.get("batches", {}).items():
                mine = self.batches.setdefault(int(size), [0, 0, 0, 0])
                for index, value in enumerate(entry):
                    mine[index] += value
            for key, entry in delta.get("responses", {}).items():
                mine = self.responses.setdefault(int(key), [0] * _R_SIZE)
                for index, value in enumerate(entry):
                    mine[index] += value
            self.last_inference_ns = max(self.last_inference_ns, delta.get("last_inference_ns", 0))

    # -- reading -------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Requests queued and not yet taken by an instance (or answered)."""
        return max(self.enqueued - self.dequeued, 0)

    def snapshot(self) -> StatsSnapshot:
        """A consistent copy of the counters."""
        with self.lock:
            return StatsSnapshot(
                success_count=self.success_count,
                success_ns=self.success_ns + self.sent_ns,
                fail_count=self.fail_count,
                fail_ns=self.fail_ns,
                queue_ns=self.queue_ns,
                compute_count=self.compute_count,
                input_ns=self.input_ns,
                infer_ns=self.infer_ns,
                output_ns=self.output_ns,
                cache_hit_count=self.cache_hit_count,
                cache_hit_ns=self.cache_hit_ns,
                cache_miss_count=self.cache_miss_count,
                cache_miss_ns=self.cache_miss_ns,
                inference_count=self.inference_count,
                execution_count=self.execution_count,
                last_inference_ms=(
                    (self.last_inference_ns + self._epoch_offset_ns) // 1_000_000 if self.last_inference_ns else 0
                ),
                failures=tuple(self.failures),
                batches={size: tuple(entry) for size, entry in self.batches.items()},
                pending=self.pending,
                first_buckets=tuple(self.first_buckets),
                first_count=self.first_count,
                first_sum_ms=self.first_sum_ms,
                first_bounds=self.first_bounds,
                responses={index: tuple(entry) for index, entry in self.responses.items()},
                memory_usage=self.memory_usage,
                load_duration_s=self.load_duration_s,
                latency_buckets=tuple(self.latency_buckets),
            )


def counters_delta(now: Mapping[str, Any], before: Mapping[str, Any] | None) -> dict[str, Any]:
    """What was counted between two ``ModelStats.counters`` readings (``before`` None: all)."""
    if before is None:
        return dict(now)
    delta: dict[str, Any] = {name: now[name] - before[name] for name in ModelStats._ADDITIVE}
    delta["failures"] = [a - b for a, b in zip(now["failures"], before["failures"])]
    delta["first_buckets"] = [a - b for a, b in zip(now["first_buckets"], before["first_buckets"])]
    delta["latency_buckets"] = [a - b for a, b in zip(now["latency_buckets"], before["latency_buckets"])]
    old = before["batches"]
    delta["batches"] = {
        size: [a - b for a, b in zip(entry, old.get(size, (0, 0, 0, 0)))] for size, entry in now["batches"].items()
    }
    old = before.get("responses", {})
    delta["responses"] = {
        index: [a - b for a, b in zip(entry, old.get(index, (0,) * _R_SIZE))]
        for index, entry in now.get("responses", {}).items()
    }
    delta["last_inference_ns"] = now["last_inference_ns"]
    return delta


@dataclass(frozen=True)
class StatsSnapshot:
    """A copy of a ``ModelStats`` at one moment (durations in ns)."""

    success_count: int
    success_ns: int
    fail_count: int
    fail_ns: int
    queue_ns: int
    compute_count: int
    input_ns: int
    infer_ns: int
    output_ns: int
    cache_hit_count: int
    cache_hit_ns: int
    cache_miss_count: int
    cache_miss_ns: int
    inference_count: int
    execution_count: int
    last_inference_ms: int
    failures: tuple[int, ...]
    batches: dict[int, tuple[int, ...]]
    pending: int
    first_buckets: tuple[int, ...]
    first_count: int
    first_sum_ms: float
    first_bounds: tuple[float, ...] = FIRST_RESPONSE_BUCKETS_MS
    responses: dict[int, tuple[int, ...]] = field(default_factory=dict)
    memory_usage: tuple[tuple[str, int, int], ...] = ()
    load_duration_s: float | None = None
    latency_buckets: tuple[int, ...] = ()
    """Successes by request duration (``pyserve.metrics.latency`` buckets)."""

    def to_json(self, name: str, version: int) -> dict[str, Any]:
        """Triton's ``ModelStatistics`` JSON object (one entry of ``model_stats``)."""

        def duration(count: int, ns: int) -> dict[str, int]:
            return {"count": count, "ns": ns}

        return {
            "name": name,
            "version": str(version),
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": duration(self.success_count, self.success_ns),
                "fail": duration(self.fail_count, self.fail_ns),
                "queue": duration(self.success_count, self.queue_ns),
                "compute_input": duration(self.compute_count, self.input_ns),
                "compute_infer": duration(self.compute_count, self.infer_ns),
                "compute_output": duration(self.compute_count, self.output_ns),
                "cache_hit": duration(self.cache_hit_count, self.cache_hit_ns),
                "cache_miss": duration(self.cache_miss_count, self.cache_miss_ns),
            },
            "response_stats": {
                str(index): {
                    "compute_infer": duration(entry[0] + entry[2], entry[_R_INFER]),
                    "compute_output": duration(entry[0] + entry[2], entry[_R_OUTPUT]),
                    **{name: duration(entry[2 * i], entry[2 * i + 1]) for i, name in enumerate(RESPONSE_FIELDS)},
                }
                for index, entry in sorted(self.responses.items())
                if entry[0] or entry[2] or entry[4] or entry[6]
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": duration(entry[0], entry[1]),
                    "compute_infer": duration(entry[0], entry[2]),
                    "compute_output": duration(entry[0], entry[3]),
                }
                for size, entry in sorted(self.batches.items())
            ],
            "memory_usage": [
                {"type": kind, "id": device, "byte_size": size} for kind, device, size in self.memory_usage
            ],
        }


def loaded_versions(records: Mapping[str, Any]) -> list[ModelVersion]:
    """The READY versions of every model, sorted by name then version.

    :param records: ``ModelManager.records`` (name → ``ModelRecord``).
    """
    found: list[ModelVersion] = []
    for name in sorted(list(records)):
        record = records.get(name)
        if record is not None:
            found.extend(v for _, v in sorted(list(record.versions.items())) if v.ready)
    return found


def statistics_json(rows: Iterable[ModelVersion]) -> dict[str, Any]:
    """Triton's statistics response ``{"model_stats": [...]}`` for the given versions."""
    return {"model_stats": [v.stats.snapshot().to_json(v.name, v.version) for v in rows]}


def select_versions(records: Mapping[str, Any], name: str, version: str | None) -> list[ModelVersion]:
    """The versions a statistics request names, as Triton picks them.

    :param name: a model name, or ``""`` for every model.
    :param version: a version number, or None / ``""`` for every READY version of the model.
    :raises InferError: INVALID_ARG for a model or version that is not loaded (Triton's code).
    """
    if not name:
        return loaded_versions(records)
    record = records.get(name)
    ready = [] if record is None else [v for _, v in sorted(list(record.versions.items())) if v.ready]
    if not ready:
        raise InferError.invalid(f"requested model '{name}' is not available")
    if not version:
        return ready
    if not is_version_number(version):
        raise InferError.invalid(f"failed to get statistics: model version '{version}' is not a number")
    chosen = [v for v in ready if v.version == int(version)]
    if not chosen:
        raise InferError.invalid(f"requested model version is not available for model '{name}'")
    return chosen
