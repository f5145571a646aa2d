"""Triton's trace extension: sampled per-request timestamps, written as Triton trace JSON or
exported as OpenTelemetry spans.

``--trace-config`` takes Triton's ``[<mode>,]<key>=<value>`` forms: global keys ``level``
(``OFF``/``TIMESTAMPS``/``TENSORS``), ``rate`` (trace 1 request in N), ``count`` (traces
left, -1 = unlimited) and ``mode`` (``triton`` or ``opentelemetry``); ``triton`` keys ``file``
and ``log-frequency``; ``opentelemetry`` keys ``url`` (OTLP/HTTP endpoint), ``resource``
(``key=value`` resource attributes, repeatable) and ``bsp_max_queue_size``,
``bsp_schedule_delay``, ``bsp_max_export_batch_size`` (parsed by ``pyserve.tracing.config``).

Settings can be read and changed at run time, globally or per model
(``/v2/trace/setting``, ``/v2/models/{m}/trace/setting``, gRPC ``TraceSetting``).

Cost when tracing is off: ``DataPlane.submit`` checks ``TraceManager.active`` (and whether the
request already has a trace), the ensemble scheduler whether its request has one, and the
instance workers check ``TRACING.on`` once per batch; nothing else runs.

A sampled request carries a ``RequestTrace`` (``InferRequest.trace``) collecting
``REQUEST_START``, ``QUEUE_START``, ``COMPUTE_START``, ``COMPUTE_INPUT_END``,
``COMPUTE_OUTPUT_START``, ``COMPUTE_END`` and ``REQUEST_END`` (wall-clock ns). In
OpenTelemetry mode each trace becomes an ``InferRequest`` span (child of the client's W3C
``traceparent`` when one was sent) with ``queue`` and ``compute`` children, ``compute`` having
``compute_input``, ``compute_infer`` and ``compute_output`` children. The ``InferRequest`` span's
IDs are chosen when the request is sampled, so that code running for the request (a Python
model's ``request.trace().get_context()``, BLS calls it makes) can name it as a parent while the
request is still running: ``RequestTrace.context``.

The steps of a traced ensemble request, and the BLS calls a Python model makes with
``trace=request.trace()``, are traced as its children (``child_trace``), as Triton traces
composing models: always (whatever the rate), with the parent's trace id as ``parent_id`` in
the trace file, and as ``InferRequest`` spans under the parent's ``InferRequest`` span in
OpenTelemetry mode. An ensemble's own trace has ``COMPUTE_START`` when its first steps start
and ``COMPUTE_END`` when it answers.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pyserve.api.errors import InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.tracing.config import (
    DEFAULT_OTLP_URL,
    TRACE_LEVELS,
    TRACE_MODES,
    TraceConfig,
    TraceConfigError,
    normalize_levels,
    parse_trace_config,
)

__all__ = [
    "DEFAULT_OTLP_URL", "TRACE_LEVELS", "TRACE_MODES", "TRACING", "RequestTrace", "TraceConfig", "TraceConfigError",
    "TraceManager", "child_trace", "mark_batch", "next_trace_id", "parse_trace_config", "traceparent_of",
]

log = logging.getLogger("pyserve.trace")


class _Flag:
    """Process-wide: is any server tracing? (checked once per batch by instance workers)."""

    __slots__ = ("_lock", "_managers", "on")

    def __init__(self) -> None:
        self.on = False
        self._managers: set[int] = set()
        self._lock = threading.Lock()

    def set(self, manager: object, active: bool) -> None:
        """``manager`` (a ``TraceManager``, or any object holding tracing on for requests it
        traces itself) turns tracing on or off for its part. Thread-safe."""
        with self._lock:
            if active:
                self._managers.add(id(manager))
            else:
                self._managers.discard(id(manager))
            self.on = bool(self._managers)


TRACING = _Flag()
"""``TRACING.on`` is False unless some server has a trace level other than OFF."""


_TRACE_IDS = itertools.count(1)


def next_trace_id() -> int:
    """A new trace id, unique in the process (every server's traces and the traces native
    backends create take theirs from here). Thread-safe."""
    return next(_TRACE_IDS)


_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


def traceparent_of(context: str | None) -> str | None:
    """The W3C ``traceparent`` in a trace context string (``RequestTrace.context``), or None."""
    if not context:
        return None
    try:
        value = json.loads(context).get("traceparent")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and _TRACEPARENT.match(value) else None


class RequestTrace:
    """The timestamps of one traced request (wall-clock ns, ``time.time_ns``).

    :ivar context: in OpenTelemetry mode, the request's span as a JSON object string
        ``{"traceparent": "00-<trace id>-<span id>-01"}`` (what Triton's Python backend returns
        from ``InferenceTrace.get_context()``); None in Triton mode.
    """

    __slots__ = ("activities", "context", "export", "id", "manager", "model_name", "model_version", "otel_ids",
                 "parent", "parent_id", "request_id", "scope", "timestamps")

    def __init__(self, trace_id: int, request: InferRequest, parent: str | None, scope: _Scope | None,
                 opentelemetry: bool = False, *, parent_id: int = 0, export: bool = True) -> None:
        self.id = trace_id
        self.model_name = request.model_name
        self.model_version = request.model_version
        self.request_id = request.id
        self.parent = parent
        self.parent_id = parent_id
        """The id of the trace this one is a child of (a native backend's BLS call), or 0."""
        self.scope = scope
        self.manager: TraceManager | None = None
        """The manager recording this trace (set when it begins), which records its children."""
        self.export = export
        """Written to the trace file / exported as spans when done (False: a trace a native
        backend made for its own request, whose activities go to the backend's callbacks)."""
        self.activities: list[tuple[str, int]] = []
        """Custom activities a backend reported (``TRITONSERVER_InferenceTraceReportActivity``),
        in report order: (name, wall-clock ns); a name may repeat."""
        self.otel_ids: tuple[int, int] | None = None
        self.context: str | None = None
        if opentelemetry:
            match = _TRACEPARENT.match(parent) if parent else None
            otel_trace = int(match.group(1), 16) if match else 0
            span = 0
            while not span:
                span = secrets.randbits(64)
            while not otel_trace:
                otel_trace = secrets.randbits(128)
            self.otel_ids = (otel_trace, span)
            self.context = json.dumps({"traceparent": f"00-{otel_trace:032x}-{span:016x}-01"})
        now = time.time_ns()
        waited = time.monotonic_ns() - request.arrival_ns
        self.timestamps: dict[str, int] = {"REQUEST_START": now - max(waited, 0), "QUEUE_START": now}

    def mark(self, name: str, ns: int | None = None) -> None:
        self.timestamps.setdefault(name, ns if ns is not None else time.time_ns())

    def activity(self, name: str, ns: int) -> None:
        """Record a backend's custom activity (any thread)."""
        self.activities.append((name, ns))

    def finish(self) -> None:
        """Stamp the end of the request; its final response is being sent. Once compute began,
        that ends it (``COMPUTE_END``): a backend answering from inside its execute (a response
        sender, a native backend) began its output now unless the execute already returned."""
        now = time.time_ns()
        if "COMPUTE_START" in self.timestamps:
            self.mark("COMPUTE_OUTPUT_START", now)
            self.mark("COMPUTE_END", now)
        self.mark("REQUEST_END", now)

    def to_json(self) -> dict[str, Any]:
        """Triton's trace-file object for this trace."""
        entry: dict[str, Any] = {
            "id": self.id,
            "model_name": self.model_name,
            "model_version": self.model_version,
        }
        if self.request_id:
            entry["request_id"] = self.request_id
        if self.parent_id:
            entry["parent_id"] = self.parent_id
        elif self.parent:
            entry["parent_id"] = self.parent
        stamps = sorted([*self.timestamps.items(), *self.activities], key=lambda i: i[1])
        entry["timestamps"] = [{"name": n, "ns": ns} for n, ns in stamps]
        return entry


def child_trace(parent: RequestTrace, request: InferRequest) -> RequestTrace:
    """A trace for ``request``, made on behalf of the traced request of ``parent`` (an ensemble
    step, a BLS call with the request's trace), as Triton traces composing models: traced
    whatever the sampling, its ``parent_id`` the parent's trace id, recorded with the parent's
    settings, and in OpenTelemetry mode its ``InferRequest`` span a child of the parent's.

    Set it as ``request.trace`` before the request is submitted (``TraceManager.begin`` then
    records it), or use ``TraceManager.trace_step`` for a request that is enqueued directly.
    """
    opentelemetry = parent.context is not None
    return RequestTrace(next_trace_id(), request, traceparent_of(parent.context), parent.scope, opentelemetry,
                        parent_id=parent.id)


def mark_batch(requests: Iterable[InferRequest], name: str) -> None:
    """Stamp ``name`` on the traced requests of a batch (instance threads call this)."""
    now = time.time_ns()
    for request in requests:
        trace = request.trace
        if trace is not None:
            trace.mark(name, now)


class _TracingSender:
    """Wraps a traced request's sender: stamps ``REQUEST_END`` and hands the trace over."""

    __slots__ = ("_inner", "_manager", "_trace")

    def __init__(self, manager: TraceManager, inner: Any, trace: RequestTrace) -> None:
        self._manager = manager
        self._inner = inner
        self._trace = trace

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        if final:
            trace = self._trace
            trace.finish()
            TRACING.set(trace, False)
            try:
                self._manager.complete(trace, isinstance(response, InferError))
            except Exception:  # tracing must never fail a request
                log.exception("failed to record a trace")
        self._inner.send(response, final)

    def is_cancelled(self) -> bool:
        return bool(self._inner.is_cancelled())


_SETTING_KEYS = ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_file")


class _TraceFile:
    """The traces still to be written to one ``trace_file``, and the index of its next
    ``<file>.<index>`` (``log_frequency``). One per path, shared by every scope writing there,
    and kept across settings updates, so an update neither drops the traces collected so far
    nor starts the numbered files again at 0."""

    __slots__ = ("index", "path", "pending")

    def __init__(self, path: str) -> None:
        self.path = path
        self.index = 0
        self.pending: list[dict[str, Any]] = []


class _Scope:
    """Effective settings for the global scope or one model with overrides, plus counters."""

    __slots__ = ("count", "counter", "file", "levels", "log_frequency", "rate", "sink")

    def __init__(self, levels: list[str], rate: int, count: int, log_frequency: int, file: str,
                 sink: _TraceFile | None = None) -> None:
        self.levels = levels
        self.rate = rate
        self.count = count
        self.log_frequency = log_frequency
        self.file = file
        self.counter = 0
        self.sink = sink

    @property
    def on(self) -> bool:
        return self.levels != ["OFF"] and self.count != 0

    def settings(self, mode: str) -> dict[str, Any]:
        return {
            "trace_level": list(self.levels),
            "trace_rate": str(self.rate),
            "trace_count": str(self.count),
            "log_frequency": str(self.log_frequency),
            "trace_file": self.file,
            "trace_mode": mode,
        }


class TraceManager:
    """One server's trace settings, sampling and export. Settings calls run on the event loop;
    ``complete`` runs on whichever thread sent the final response.

    :param config: the parsed ``--trace-config``.
    """

    def __init__(self, config: TraceConfig | None = None) -> None:
        self.config = config or TraceConfig()
        self.mode = self.config.mode
        self._global: dict[str, Any] = _initial_settings(self.config)
        self._overrides: dict[str, dict[str, Any]] = {}
        self._scopes: dict[str, _Scope] = {}
        self._files: dict[str, _TraceFile] = {}
        self._global_scope = self._make_scope(self._global)
        self._lock = threading.Lock()
        self._provider: Any = None
        self._tracer: Any = None
        self.active = False
        self.change_listeners: list[Callable[[], None]] = []
        """Called (under the manager's lock, on the thread that changed them: keep them short)
        whenever which models are traced may have changed: a settings update, or a count that
        ran out. ``traced_models`` says the new state."""
        self._refresh()

    # -- settings ------------------------------------------------------------------------------
    def _make_scope(self, values: Mapping[str, Any]) -> _Scope:
        path = values["trace_file"]
        sink = self._files.setdefault(path, _TraceFile(path)) if path else None
        return _Scope(
            list(values["trace_level"]), values["trace_rate"], values["trace_count"],
            values["log_frequency"], path, sink,
        )

    def _refresh(self) -> None:
        self._scopes = {
            name: self._make_scope({**self._global, **override}) for name, override in self._overrides.items()
        }
        self.active = self._global_scope.on or any(s.on for s in self._scopes.values())
        TRACING.set(self, self.active)
        self._tell_listeners()

    def _tell_listeners(self) -> None:
        for listener in self.change_listeners:
            try:
                listener()
            except Exception:  # a listener's failure is not the update's
                log.exception("a trace-settings listener failed")

    def traced_models(self) -> tuple[bool, list[str], list[str]]:
        """Which requests may be traced now: ``(global, on, off)``, where a model named in
        ``on`` (``off``) has settings of its own that trace (do not trace), and every other
        model follows ``global``."""
        on = sorted(name for name, scope in self._scopes.items() if scope.on)
        off = sorted(name for name, scope in self._scopes.items() if not scope.on)
        return self._global_scope.on, on, off

    def settings(self, model: str | None = None) -> dict[str, Any]:
        """The effective settings (global, or for ``model``) in the extension's JSON form."""
        scope = self._scopes.get(model, self._global_scope) if model else self._global_scope
        return scope.settings(self.mode)

    def update(self, changes: Mapping[str, Any], model: str | None = None) -> dict[str, Any]:
        """Apply a trace-setting update; ``None`` values clear (model: back to global).

        Unknown keys are ignored (logged), as Triton 2.51 ignores them.

        :returns: the effective settings after the update.
        :raises InferError: INVALID_ARG for a read-only key or a bad value.
        """
        if not isinstance(changes, Mapping):
            raise InferError.invalid("the trace settings must be a JSON object")
        staged: dict[str, Any] = {}
        for key, value in changes.items():
            if key not in _SETTING_KEYS:
                if key == "trace_mode":
                    raise InferError.invalid("'trace_mode' can not be updated through network protocol")
                log.warning("ignoring unknown trace setting '%s'", key)
                continue
            if key == "trace_file" and value is not None:
                raise InferError.invalid("trace file location can not be updated through network protocol")
            staged[key] = None if value is None else _check_value(key, value)
        with self._lock:
            if model:
                override = self._overrides.setdefault(model, {})
                for key, value in staged.items():
                    if value is None:
                        override.pop(key, None)
                    else:
                        override[key] = value
                if not override:
                    del self._overrides[model]
            else:
                defaults = _initial_settings(self.config)
                for key, value in staged.items():
                    self._global[key] = defaults[key] if value is None else value
                self._global_scope = self._make_scope(self._global)
            self._refresh()
        return self.settings(model)

    # -- the request path ----------------------------------------------------------------------
    def begin(self, request: InferRequest) -> None:
        """Decide whether to trace ``request`` (sampling by rate and count) and, if so,
        attach its ``RequestTrace`` and wrap its sender. Called only while ``active``;
        ``request.trace_parent`` is the client's W3C ``traceparent``, if any.
        """
        preset = request.trace
        if preset is not None:
            # made by a native backend for its BLS call (a child of a traced request): traced
            # whatever the sampling; one with export=False reports to the backend's callbacks
            preset.model_version = request.model_version  # the serving version, now resolved
            if preset.export:
                if preset.scope is None:  # a child (child_trace) keeps its parent's settings
                    preset.scope = self._scopes.get(request.model_name, self._global_scope)
                self._record(request, preset)
            return
        scope = self._scopes.get(request.model_name, self._global_scope)
        if not scope.on:
            return
        with self._lock:
            scope.counter += 1
            if (scope.counter - 1) % scope.rate:
                return
            if scope.count > 0:
                scope.count -= 1
                if scope.count == 0:
                    self._refresh_after_count()
            trace_id = next_trace_id()
        trace = RequestTrace(trace_id, request, request.trace_parent, scope, self.mode == "opentelemetry")
        request.trace = trace
        self._record(request, trace)

    def _record(self, request: InferRequest, trace: RequestTrace) -> None:
        """Record ``trace`` when ``request`` sends its final response. Instance workers stamp
        traced requests while some trace is on its way (its count may have run out since)."""
        trace.manager = self
        TRACING.set(trace, True)
        request.attach_sender(_TracingSender(self, request.attached_sender(), trace))

    def trace_step(self, parent: RequestTrace, request: InferRequest) -> None:
        """Trace ``request``, which runs on behalf of the traced request of ``parent`` without
        passing through ``begin`` (an ensemble step): a ``child_trace``, recorded when the
        request sends its final response. Call after its sender is attached."""
        trace = child_trace(parent, request)
        request.trace = trace
        self._record(request, trace)

    def _refresh_after_count(self) -> None:
        for key, scope in ((None, self._global_scope), *self._scopes.items()):
            if scope.count == 0:
                target = self._overrides.get(key, {}) if key else self._global
                if key is None or "trace_count" in target:
                    target["trace_count"] = 0
        self.active = self._global_scope.on or any(s.on for s in self._scopes.values())
        TRACING.set(self, self.active)
        self._tell_listeners()

    def complete(self, trace: RequestTrace, failed: bool) -> None:
        """Record a finished trace (file or OpenTelemetry)."""
        if self.mode == "opentelemetry":
            self._export_otel(trace, failed)
            return
        scope = trace.scope
        assert scope is not None  # set when the trace began
        entry = trace.to_json()
        sink = scope.sink
        if sink is None:
            log.debug("trace %s", json.dumps(entry))
            return
        with self._lock:
            sink.pending.append(entry)
            if scope.log_frequency and len(sink.pending) >= scope.log_frequency:
                batch, sink.pending = sink.pending, []
                path = f"{sink.path}.{sink.index}"
                sink.index += 1
            else:
                return
        _write_json(path, batch)

    def flush(self) -> None:
        """Write what is pending (``log_frequency`` 0 writes at shutdown) and flush exporters."""
        with self._lock:
            numbered = {scope.file for scope in (self._global_scope, *self._scopes.values()) if scope.log_frequency}
            work = []
            for sink in self._files.values():
                if sink.pending:
                    work.append((f"{sink.path}.{sink.index}" if sink.path in numbered else sink.path, sink.pending))
                    sink.pending = []
        for path, batch in work:
            _write_json(path, batch)
        if self._provider is not None:
            self._provider.force_flush()

    def shutdown(self) -> None:
        """Flush and stop exporting (server shutdown)."""
        self.flush()
        TRACING.set(self, False)
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None

    # -- OpenTelemetry ---------------------------------------------------------------------------
    def use_span_exporter(self, exporter: Any, *, batch: bool = False) -> None:
        """Export spans with ``exporter`` (e.g. an ``InMemorySpanExporter`` in tests)."""
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        provider = self._make_provider()
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self._install(provider)

    def _make_provider(self) -> Any:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        attributes = {"service.name": "pyserve", **self.config.resource}
        return TracerProvider(resource=Resource.create(attributes), id_generator=_preset_ids())

    def _install(self, provider: Any) -> None:
        old = self._provider
        self._provider = provider
        self._tracer = provider.get_tracer("pyserve")
        if old is not None:
            old.shutdown()

    def _otel_tracer(self) -> Any:
        if self._tracer is None:
            with self._lock:
                if self._tracer is None:
                    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
                    from opentelemetry.sdk.trace.export import BatchSpanProcessor

                    provider = self._make_provider()
                    bsp = self.config.bsp
                    provider.add_span_processor(BatchSpanProcessor(
                        OTLPSpanExporter(endpoint=self.config.url),
                        max_queue_size=bsp.get("bsp_max_queue_size", 2048),
                        schedule_delay_millis=bsp.get("bsp_schedule_delay", 5000),
                        max_export_batch_size=bsp.get("bsp_max_export_batch_size", 512),
                    ))
                    self._install(provider)
        return self._tracer

    def _export_otel(self, trace: RequestTrace, failed: bool) -> None:
        from opentelemetry import trace as otel_trace
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        tracer = self._otel_tracer()
        ts = trace.timestamps
        parent_ctx = None
        if trace.parent:
            parent_ctx = TraceContextTextMapPropagator().extract({"traceparent": trace.parent})
        attributes = {
            "triton.model_name": trace.model_name,
            "triton.model_version": trace.model_version,
            "triton.trace_id": trace.id,
            "triton.trace_parent_id": trace.parent_id,
        }
        if trace.request_id:
            attributes["triton.request_id"] = trace.request_id
        _PRESET.ids = trace.otel_ids  # the root span gets the IDs its context already named
        try:
            root = tracer.start_span(
                "InferRequest", context=parent_ctx, kind=SpanKind.SERVER,
                start_time=ts["REQUEST_START"], attributes=attributes,
            )
        finally:
            _PRESET.ids = None
        for name, ns in sorted(ts.items(), key=lambda i: i[1]):
            root.add_event(name, timestamp=ns)
        ctx = otel_trace.set_span_in_context(root)

        def span(name: str, start: str, end: str, context: Any) -> Any:
            if start in ts and end in ts:
                child = tracer.start_span(name, context=context, start_time=ts[start])
                return child, end
            return None, end

        queue_end = "COMPUTE_START" if "COMPUTE_START" in ts else "REQUEST_END"
        queue, _ = span("queue", "QUEUE_START", queue_end, ctx)
        if queue is not None:
            queue.end(end_time=ts[queue_end])
        compute, _ = span("compute", "COMPUTE_START", "COMPUTE_END", ctx)
        if compute is not None:
            compute_ctx = otel_trace.set_span_in_context(compute)
            for name, start, end in (
                ("compute_input", "COMPUTE_START", "COMPUTE_INPUT_END"),
                ("compute_infer", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START"),
                ("compute_output", "COMPUTE_OUTPUT_START", "COMPUTE_END"),
            ):
                child, _ = span(name, start, end, compute_ctx)
                if child is not None:
                    child.end(end_time=ts[end])
        if trace.activities:
            _export_activities(tracer, trace, root, compute)
        if compute is not None:
            compute.end(end_time=ts["COMPUTE_END"])
        if failed:
            root.set_status(Status(StatusCode.ERROR))
        root.end(end_time=ts["REQUEST_END"])


def _export_activities(tracer: Any, trace: RequestTrace, root: Any, compute: Any) -> None:
    """A backend's custom activities as Triton exports them: ``<name>_START`` opens a span
    ``<name>`` (a child of the innermost open one: the compute span while compute runs, else
    the request's), ``<name>_END`` closes the innermost custom span, and every activity is an
    event on the innermost open span. Spans left open end with the request."""
    from opentelemetry import trace as otel_trace

    ts = trace.timestamps
    compute_start, compute_end = ts.get("COMPUTE_START"), ts.get("COMPUTE_END")
    stack: list[Any] = []  # open custom spans
    for name, ns in sorted(trace.activities, key=lambda a: a[1]):
        if stack:
            outer = stack[-1]
        elif compute is not None and compute_start is not None and compute_end is not None \
                and compute_start <= ns <= compute_end:
            outer = compute
        else:
            outer = root
        if name.endswith("_START") and len(name) > len("_START"):
            span = tracer.start_span(name[: -len("_START")], context=otel_trace.set_span_in_context(outer),
                                     start_time=ns)
            stack.append(span)
            outer = span
        outer.add_event(name, timestamp=ns)
        if name.endswith("_END") and len(name) > len("_END") and stack:
            stack.pop().end(end_time=ns)
    for span in reversed(stack):
        span.end(end_time=ts.get("REQUEST_END", time.time_ns()))


class _Preset(threading.local):
    ids: tuple[int, int] | None = None


_PRESET = _Preset()
"""The (trace id, span id) the next span started on this thread takes (``_export_otel``)."""


def _preset_ids() -> Any:
    """An OpenTelemetry ID generator that hands out ``_PRESET.ids`` once, random IDs otherwise."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class PresetIds(RandomIdGenerator):
        def generate_trace_id(self) -> int:
            ids = _PRESET.ids
            return ids[0] if ids is not None else super().generate_trace_id()

        def generate_span_id(self) -> int:
            ids = _PRESET.ids
            return ids[1] if ids is not None else super().generate_span_id()

    return PresetIds()


def _initial_settings(config: TraceConfig) -> dict[str, Any]:
    return {
        "trace_level": list(config.level), "trace_rate": config.rate, "trace_count": config.count,
        "log_frequency": config.log_frequency, "trace_file": config.file,
    }


def _check_value(key: str, value: Any) -> Any:
    if key == "trace_level":
        values = value if isinstance(value, list) else [value]
        levels = []
        for item in values:
            if not isinstance(item, str) or item.upper() not in TRACE_LEVELS:
                raise InferError.invalid(f"unknown trace level '{item}' (expected OFF, TIMESTAMPS or TENSORS)")
            levels.append(item.upper())
        return normalize_levels(levels) if levels else ["OFF"]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InferError.invalid(f"'{key}' must be a string holding an integer")
    try:
        number = int(value)
    except ValueError:
        raise InferError.invalid(f"'{key}' must be an integer, got '{value}'") from None
    if key == "trace_rate" and number < 1:
        raise InferError.invalid("'trace_rate' must be >= 1")
    if key == "trace_count" and number < -1:
        raise InferError.invalid("'trace_count' must be -1 (unlimited) or >= 0")
    if key == "log_frequency" and number < 0:
        raise InferError.invalid("'log_frequency' must be >= 0")
    return number


def _write_json(path: str, batch: list[dict[str, Any]]) -> None:
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(batch, handle)
    except OSError as exc:
        log.error("failed to write trace file '%s': %s", path, exc)
