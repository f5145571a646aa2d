"""The dynamic batcher, driven by real concurrent clients against real servers.

A small recording backend (``Recorder``) notes every execute: which instance ran it, which
requests (by request id) it held, their batch sizes and input shapes. Requests ask it to
sleep with the request parameter ``delay_ms`` (the longest in a batch wins), or, with the
request parameter ``hold``, to wait until the test lets go (``Recorder.release``): that is how
the tests keep an instance busy while others queue. No assertion depends on how fast the
machine is: a batch "sent at once" is sent while the queue delay is longer than the test's
generous wait (``RUN_TIMEOUT``), a reply "answered while another runs" comes back while that
other is held, and a wait that must happen is checked from below only.
"""

from __future__ import annotations

import asyncio
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from tritonclient.utils import InferenceServerException

from pyserve import (
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from pyserve.api.backend import Backend
from pyserve.api.errors import ErrorCode
from pyserve.repository.model_config import model_io, parse_config
from pyserve.runtime.scheduling import DynamicBatcher
from pyserve.server.core import ServerThread

StartServer = Callable[..., ServerThread]
MakeRepo = Callable[..., Path]

RUN_TIMEOUT = 60.0
"""Seconds the calls of one ``run`` may take together (generous: a loaded machine is slow)."""
NEVER_US = 600_000_000
"""A queue delay (µs) far beyond ``RUN_TIMEOUT``: a batch sent before it ends was sent early."""


@dataclass(frozen=True)
class Execute:
    model: str
    instance: str
    ids: tuple[str, ...]
    sizes: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    started: float

    @property
    def total(self) -> int:
        return sum(self.sizes)


class Recorder(Backend):
    """Echoes ``INPUT0`` as ``OUTPUT0`` and records every execute."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.executes: list[Execute] = []
        self.running = 0  # executes under way
        self.most_running = 0  # the most that were under way at once
        self.release = threading.Event()  # lets executes holding a ``hold`` request return

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        record = Execute(
            instance.model.name,
            instance.name,
            tuple(r.id for r in requests),
            tuple(r.batch_size for r in requests),
            tuple(r.inputs["INPUT0"].shape for r in requests),
            time.monotonic(),
        )
        with self.lock:
            self.executes.append(record)
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            delay = max(float(r.parameters.get("delay_ms", 0)) for r in requests)
            if delay:
                time.sleep(delay / 1000)
            if any(r.parameters.get("hold") for r in requests):
                self.release.wait(RUN_TIMEOUT)
        finally:
            with self.lock:
                self.running -= 1
        params = {"batch_size": record.total, "instance": instance.name}
        return [InferResponse({"OUTPUT0": r.inputs["INPUT0"]}, params) for r in requests]

    def of(self, model: str) -> list[Execute]:
        with self.lock:
            return [e for e in self.executes if e.model == model]

    def order(self, model: str) -> list[str]:
        return [i for e in self.of(model) for i in e.ids]

    def executed(self, model: str, rid: str) -> Callable[[], bool]:
        """A condition: request ``rid`` of ``model`` has reached execute."""
        return lambda: rid in self.order(model)


def config(max_batch_size: int, batching: str, instances: int = 1, dims: str = "[ -1 ]", extra_input: str = "") -> str:
    return textwrap.dedent(
        f"""
        backend: "recorder"
        max_batch_size: {max_batch_size}
        input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: {dims} {extra_input} }} ]
        output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: {dims} }} ]
        instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
        dynamic_batching {{ {batching} }}
        """
    )


def serve(start_server: StartServer, make_repo: MakeRepo, models: dict[str, str]) -> tuple[ServerThread, Recorder]:
    recorder = Recorder()
    server = start_server(make_repo(models), backends={"recorder": recorder})
    return server, recorder


def tensor(rows: int = 1, cols: int = 2, value: float = 0.0) -> list[httpclient.InferInput]:
    data = np.full((rows, cols), value, dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
    inp.set_data_from_numpy(data)
    return [inp]


@dataclass
class Outcome:
    id: str
    done: float
    result: Any = None
    error: InferenceServerException | None = None

    @property
    def status(self) -> str | None:
        return None if self.error is None else str(self.error.status())

    @property
    def message(self) -> str:
        return "" if self.error is None else str(self.error.message())


async def call(
    client: aioclient.InferenceServerClient,
    model: str,
    rid: str,
    *,
    after: float = 0.0,
    until: Callable[[], bool] | None = None,
    rows: int = 1,
    cols: int = 2,
    delay_ms: int = 0,
    hold: bool = False,
    value: float = 0.0,
    **kwargs: Any,
) -> Outcome:
    """Send one request once ``until`` holds (polled), then ``after`` seconds more; record when
    its answer came back. ``hold``: its execute waits for ``Recorder.release``."""
    if until is not None:
        await wait_until(until)
    if after:
        await asyncio.sleep(after)
    params: dict[str, Any] = {"delay_ms": delay_ms} if delay_ms else {}
    if hold:
        params["hold"] = True
    try:
        result = await client.infer(model, tensor(rows, cols, value), request_id=rid, parameters=params or None,
                                    **kwargs)
        return Outcome(rid, time.monotonic(), result=result)
    except InferenceServerException as exc:
        return Outcome(rid, time.monotonic(), error=exc)


async def wait_until(condition: Callable[[], bool], timeout: float = RUN_TIMEOUT) -> None:
    """Poll ``condition`` every 10 ms; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for a condition"
        await asyncio.sleep(0.01)


def run(server: ServerThread, *calls: Callable[[aioclient.InferenceServerClient], Any]) -> list[Outcome]:
    """Run coroutine factories concurrently on one aio client (``RUN_TIMEOUT`` for them all)."""

    async def main() -> list[Outcome]:
        client = aioclient.InferenceServerClient(server.url)
        try:
            return list(await asyncio.wait_for(asyncio.gather(*(c(client) for c in calls)), RUN_TIMEOUT))
        finally:
            await client.close()

    return asyncio.run(main())


def releasing(recorder: Recorder, condition: Callable[[], bool], then_wait: float = 0.0) -> Callable[[Any], Any]:
    """A call for ``run`` that lets held executes go once ``condition`` holds (and ``then_wait``
    seconds more: a wait the queued requests must at least have spent)."""

    async def release(_client: Any) -> None:
        await wait_until(condition)
        if then_wait:
            await asyncio.sleep(then_wait)
        recorder.release.set()

    return release


def in_flight(server: ServerThread, count: int) -> Callable[[], bool]:
    """A condition: ``count`` requests are in the server (executing or queued)."""
    return lambda: server.server.dataplane.in_flight == count


def cancelled(server: ServerThread, rid: str) -> Callable[[], bool]:
    """A condition, once request ``rid`` was seen in the server: the server has marked it
    cancelled (its client went away), or has let it go already (a cancelled request that waited
    in the queue leaves the open requests at once, whichever comes first)."""
    return lambda: not any(r.id == rid and not r.is_cancelled() for r in list(server.server.dataplane._open))


def answered(outcomes: list[str], *ids: str) -> Callable[[], bool]:
    """A condition: every one of ``ids`` is in ``outcomes`` (ids appended as answers come)."""
    return lambda: set(ids) <= set(outcomes)


def req(model: str, rid: str, **kwargs: Any) -> Callable[[aioclient.InferenceServerClient], Any]:
    return lambda client: call(client, model, rid, **kwargs)


def ok(outcomes: list[Outcome]) -> None:
    for o in outcomes:
        assert o.error is None, (o.id, o.status, o.message)


# -- batches form -----------------------------------------------------------------------------
def test_concurrent_requests_are_batched(start_server: StartServer, make_repo: MakeRepo) -> None:
    server, recorder = serve(start_server, make_repo, {"m": config(8, "max_queue_delay_microseconds: 300000")})
    outcomes = run(server, *(req("m", f"r{i}") for i in range(8)))
    ok(outcomes)
    executes = recorder.of("m")
    assert sum(e.total for e in executes) == 8
    assert len(executes) <= 3 and max(e.total for e in executes) >= 4, executes
    reported = {o.id: o.result.get_response()["parameters"]["batch_size"] for o in outcomes}
    assert max(reported.values()) >= 4, reported


def test_identity_reports_the_batch_it_was_in(start_server: StartServer, make_repo: MakeRepo) -> None:
    identity = """
    backend: "identity"
    max_batch_size: 8
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
    output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
    dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: NEVER }
    parameters { key: "report_batch_size" value: { string_value: "true" } }
    parameters { key: "pyserve_replicate" value: { string_value: "false" } }
    """.replace("NEVER", str(NEVER_US))
    # one batcher for the four connections: a frontend's replica (once ready, a moment after the
    # start) would batch only the connections it holds, and never reach the preferred size
    server = start_server(make_repo({"ident": identity}))
    outcomes = run(server, *(req("ident", f"r{i}") for i in range(4)))  # within RUN_TIMEOUT: not the delay
    ok(outcomes)
    assert [o.result.get_response()["parameters"]["batch_size"] for o in outcomes] == [4, 4, 4, 4]


def test_preferred_batch_size_is_sent_without_waiting_the_delay(
    start_server: StartServer, make_repo: MakeRepo
) -> None:
    batching = f"preferred_batch_size: [ 4 ] max_queue_delay_microseconds: {NEVER_US}"
    server, recorder = serve(start_server, make_repo, {"m": config(8, batching)})
    outcomes = run(server, *(req("m", f"r{i}") for i in range(8)))  # within RUN_TIMEOUT: not the delay
    ok(outcomes)
    assert [e.total for e in recorder.of("m")] == [4, 4]


def test_run_that_would_pass_the_largest_preferred_size_is_sent_early(
    start_server: StartServer, make_repo: MakeRepo
) -> None:
    # Triton: with preferred [4], requests of batch 3 + 3 would pass 4, so the first 3 go at
    # once; the second 3 then waits until a request of 1 makes it 4.
    batching = f"preferred_batch_size: [ 4 ] max_queue_delay_microseconds: {NEVER_US}"
    server, recorder = serve(start_server, make_repo, {"m": config(8, batching)})
    # b goes once a waits in the queue (a is not sent alone), c once a has gone (b waits then)
    def a_queued() -> bool:
        return server.server.dataplane.in_flight >= 1

    ok(run(server, req("m", "a", rows=3), req("m", "b", rows=3, until=a_queued),
           req("m", "c", until=recorder.executed("m", "a"))))
    assert [e.ids for e in recorder.of("m")] == [("a",), ("b", "c")]


def test_max_queue_delay_bounds_the_wait(start_server: StartServer, make_repo: MakeRepo) -> None:
    server, recorder = serve(start_server, make_repo, {"m": config(8, "max_queue_delay_microseconds: 200000")})
    start = time.monotonic()
    (outcome,) = run(server, req("m", "lone"))  # answered within RUN_TIMEOUT: the delay ended the wait
    elapsed = time.monotonic() - start
    ok([outcome])
    assert elapsed >= 0.2, elapsed  # it did wait the delay for more requests
    assert recorder.of("m")[-1].ids == ("lone",)


def test_max_batch_size_counts_the_batch_dimension(start_server: StartServer, make_repo: MakeRepo) -> None:
    server, recorder = serve(start_server, make_repo, {"m": config(8, "max_queue_delay_microseconds: 300000")})
    outcomes = run(server, *(req("m", f"r{i}", rows=3) for i in range(6)))
    ok(outcomes)
    for o in outcomes:
        assert o.result.as_numpy("OUTPUT0").shape == (3, 2)
    totals = [e.total for e in recorder.of("m")]
    assert sum(totals) == 18
    assert max(totals) <= 8, totals
    assert 6 in totals, totals  # two requests of 3 did share a batch


def test_different_shapes_never_share_a_batch(start_server: StartServer, make_repo: MakeRepo) -> None:
    batching = "max_queue_delay_microseconds: 300000"
    server, recorder = serve(start_server, make_repo, {"m": config(8, batching)})
    outcomes = run(server, *(req("m", f"r{i}", cols=2 + i % 2, after=0.01 * i) for i in range(8)))
    ok(outcomes)
    executes = recorder.of("m")
    assert sum(e.total for e in executes) == 8
    for e in executes:
        assert len({s[1:] for s in e.shapes}) == 1, e


def test_ragged_inputs_share_a_batch(start_server: StartServer, make_repo: MakeRepo) -> None:
    batching = "max_queue_delay_microseconds: 500000"
    model = config(8, batching, extra_input="allow_ragged_batch: true")
    server, recorder = serve(start_server, make_repo, {"m": model})
    outcomes = run(server, *(req("m", f"r{i}", cols=2 + i % 2, value=i) for i in range(6)))
    ok(outcomes)
    for i, o in enumerate(outcomes):
        assert o.result.as_numpy("OUTPUT0").shape == (1, 2 + i % 2)
    assert any(len({s[1:] for s in e.shapes}) == 2 for e in recorder.of("m")), recorder.of("m")


# -- priorities and queue policies --------------------------------------------------------------
def test_higher_priority_requests_run_first(start_server: StartServer, make_repo: MakeRepo) -> None:
    batching = "priority_levels: 2 default_priority_level: 2"
    server, recorder = serve(start_server, make_repo, {"m": config(1, batching)})
    busy = recorder.executed("m", "busy")
    calls = [req("m", "busy", hold=True)]
    calls += [req("m", f"low{i}", priority=2, until=lambda i=i: busy() and in_flight(server, 1 + i)()) for i in range(3)]
    calls += [req("m", "default", until=in_flight(server, 4))]  # default level 2, queued before the high ones
    calls += [req("m", f"high{i}", priority=1, until=in_flight(server, 5 + i)) for i in range(3)]
    calls.append(releasing(recorder, lambda: busy() and in_flight(server, 8)()))  # all queued behind busy
    ok([o for o in run(server, *calls) if o is not None])
    order = recorder.order("m")
    assert order[0] == "busy"
    assert sorted(order[1:4]) == ["high0", "high1", "high2"], order
    assert set(order[4:]) == {"low0", "low1", "low2", "default"}, order


def test_full_queue_rejects_at_once(start_server: StartServer, make_repo: MakeRepo) -> None:
    batching = "default_queue_policy { max_queue_size: 2 }"
    server, recorder = serve(start_server, make_repo, {"m": config(1, batching)})
    answered: list[str] = []

    async def queued(client: Any, i: int) -> Outcome:
        # one at a time, in order, once busy executes: q0, q1 and q2 each once the one before
        # is queued, q3 and q4 each once the one before is answered (refused)
        dataplane = server.server.dataplane
        await wait_until(lambda: recorder.executed("m", "busy")() and (
            dataplane.in_flight == 1 + i if i <= 2 else len(answered) == i - 2))
        outcome = await call(client, "m", f"q{i}")
        answered.append(outcome.id)
        return outcome

    calls = [req("m", "busy", hold=True)]
    calls += [lambda client, i=i: queued(client, i) for i in range(5)]
    calls.append(releasing(recorder, lambda: len(answered) == 3))  # busy runs until the refusals are back
    outcomes = [o for o in run(server, *calls) if o is not None]
    rejected = [o for o in outcomes if o.error is not None]
    assert [o.id for o in rejected] == ["q2", "q3", "q4"]
    for o in rejected:
        assert o.status == "503"
        assert "Exceeds maximum queue size" in o.message
    assert answered[:3] == ["q2", "q3", "q4"]  # answered at once, while "busy" still ran
    assert recorder.order("m") == ["busy", "q0", "q1"]


def test_queue_timeout_rejects(start_server: StartServer, make_repo: MakeRepo) -> None:
    batching = "default_queue_policy { default_timeout_microseconds: 100000 }"
    server, recorder = serve(start_server, make_repo, {"m": config(1, batching)})
    busy = recorder.executed("m", "busy")
    outcomes = run(server, req("m", "busy", hold=True), req("m", "late0", until=busy), req("m", "late1", until=busy),
                   releasing(recorder, in_flight(server, 3), then_wait=0.3))  # queued past their 100 ms
    outcomes = outcomes[:3]
    assert outcomes[0].error is None
    for o in outcomes[1:]:
        assert o.error is not None and "timeout" in o.message.lower(), o
    assert recorder.order("m") == ["busy"]


def test_request_timeout_overrides_downwards(start_server: StartServer, make_repo: MakeRepo) -> None:
    batching = "default_queue_policy { default_timeout_microseconds: 10000000 allow_timeout_override: true }"
    server, recorder = serve(start_server, make_repo, {"m": config(1, batching)})
    busy = recorder.executed("m", "busy")
    outcomes = run(
        server,
        req("m", "busy", hold=True),
        req("m", "short", until=busy, timeout=100_000),
        req("m", "default", until=busy),
        req("m", "longer", until=busy, timeout=60_000_000),  # may only lower: stays 10 s
        releasing(recorder, in_flight(server, 4), then_wait=0.3),  # queued past the 100 ms of "short"
    )
    by_id = {o.id: o for o in outcomes if o is not None}
    assert by_id["short"].error is not None and "timeout" in by_id["short"].message.lower()
    ok([by_id["busy"], by_id["default"], by_id["longer"]])
    assert "short" not in recorder.order("m")


@pytest.mark.parametrize("policy", [
    "default_timeout_microseconds: 10000000",  # no override allowed
    "allow_timeout_override: true",  # no default timeout to lower: as Triton 2.51 (checked side by side)
])
def test_request_timeout_is_ignored(start_server: StartServer, make_repo: MakeRepo, policy: str) -> None:
    """A request's timeout may only lower the queue policy's default timeout, and only where the
    policy allows an override."""
    server, recorder = serve(start_server, make_repo, {"m": config(1, f"default_queue_policy {{ {policy} }}")})
    outcomes = run(server, req("m", "busy", hold=True),
                   req("m", "short", until=recorder.executed("m", "busy"), timeout=50_000),
                   releasing(recorder, in_flight(server, 2), then_wait=0.2))  # queued past its 50 ms
    ok(outcomes[:2])
    assert recorder.order("m") == ["busy", "short"]


def test_timeout_action_delay_runs_timed_out_requests_last(start_server: StartServer, make_repo: MakeRepo) -> None:
    batching = ("default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 60000000 "
                "allow_timeout_override: true }")
    server, recorder = serve(start_server, make_repo, {"m": config(1, batching)})
    busy = recorder.executed("m", "busy")
    outcomes = run(
        server,
        req("m", "busy", hold=True),
        req("m", "d0", until=busy, timeout=50_000),
        req("m", "d1", until=busy, timeout=50_000),
        req("m", "n0", until=in_flight(server, 3)),  # after the d's are queued
        req("m", "n1", until=in_flight(server, 3)),
        releasing(recorder, in_flight(server, 5), then_wait=0.2),  # the d's have waited past their 50 ms
    )
    ok(outcomes[:5])
    order = recorder.order("m")
    assert order[0] == "busy"
    assert set(order[1:3]) == {"n0", "n1"}, order
    assert set(order[3:]) == {"d0", "d1"}, order


def test_priority_queue_policy_applies_per_level(start_server: StartServer, make_repo: MakeRepo) -> None:
    batching = """
    priority_levels: 2 default_priority_level: 1
    priority_queue_policy { key: 2 value: { max_queue_size: 1 } }
    """
    server, recorder = serve(start_server, make_repo, {"m": config(1, batching)})
    busy = recorder.executed("m", "busy")
    done: list[str] = []

    async def low1(client: Any) -> Outcome:
        outcome = await call(client, "m", "low1", priority=2, until=in_flight(server, 2))  # once low0 is queued
        done.append("low1")
        return outcome

    outcomes = run(
        server,
        req("m", "busy", hold=True),
        req("m", "low0", priority=2, until=busy),
        low1,
        req("m", "high0", priority=1, until=answered(done, "low1")),
        req("m", "high1", priority=1, until=answered(done, "low1")),
        releasing(recorder, lambda: answered(done, "low1")() and in_flight(server, 4)()),
    )
    by_id = {o.id: o for o in outcomes if o is not None}
    assert by_id["low1"].status == "503" and "Exceeds maximum queue size" in by_id["low1"].message
    ok([by_id[k] for k in ("busy", "low0", "high0", "high1")])


# -- instances and ordering -----------------------------------------------------------------------
def test_preserve_ordering(start_server: StartServer, make_repo: MakeRepo) -> None:
    models = {
        "ordered": config(1, "preserve_ordering: true", instances=2),
        "unordered": config(1, "", instances=2),
    }
    server, recorder = serve(start_server, make_repo, models)
    for model, expect_in_order in (("ordered", True), ("unordered", False)):
        recorder.release.clear()
        done: list[str] = []

        async def fast(client: Any, model: str = model, done: list[str] = done) -> Outcome:
            outcome = await call(client, model, "fast", until=recorder.executed(model, "slow"))
            done.append("fast")
            return outcome

        # slow runs until fast has executed on the other instance (ordered: fast's answer then
        # waits for slow's) or until fast's answer is back (unordered)
        fast_through = recorder.executed(model, "fast") if expect_in_order else answered(done, "fast")
        outcomes = run(server, req(model, "slow", hold=True), fast, releasing(recorder, fast_through))
        slow, fast_outcome = outcomes[:2]
        ok([slow, fast_outcome])
        assert len({e.instance for e in recorder.of(model)}) == 2
        if expect_in_order:
            assert fast_outcome.done >= slow.done, (fast_outcome.done - slow.done)
        else:
            assert fast_outcome.done < slow.done, (fast_outcome.done - slow.done)


def test_batches_go_to_whichever_instance_is_free(start_server: StartServer, make_repo: MakeRepo) -> None:
    server, recorder = serve(start_server, make_repo, {"m": config(1, "", instances=3)})
    calls = [req("m", f"r{i}", hold=True) for i in range(6)]
    calls.append(releasing(recorder, lambda: recorder.running == 3))  # three at once, one per instance
    outcomes = [o for o in run(server, *calls) if o is not None]
    ok(outcomes)
    used = {e.instance for e in recorder.of("m")}
    assert len(used) == 3, used
    assert recorder.most_running == 3
    per_reply = {o.result.get_response()["parameters"]["instance"] for o in outcomes}
    assert per_reply == used


# -- cancellation ------------------------------------------------------------------------------------
def test_client_that_goes_away_is_never_executed(start_server: StartServer, make_repo: MakeRepo) -> None:
    server, recorder = serve(start_server, make_repo, {"m": config(1, "")})

    async def main() -> None:
        clients = [aioclient.InferenceServerClient(server.url) for _ in range(3)]
        try:
            busy = asyncio.create_task(call(clients[0], "m", "busy", hold=True))
            victim = asyncio.create_task(call(clients[1], "m", "victim", until=recorder.executed("m", "busy")))
            control = asyncio.create_task(call(clients[2], "m", "control", until=in_flight(server, 2)))
            await wait_until(in_flight(server, 3))
            victim.cancel()  # the client gives up while the request waits in the queue
            await clients[1].close()
            await wait_until(cancelled(server, "victim"))  # the server saw it go
            recorder.release.set()
            ok([await busy, await control])
        finally:
            for client in clients:
                await client.close()

    asyncio.run(main())
    assert recorder.order("m") == ["busy", "control"]


# scheduler level: requests cancelled while queued
class Collect:
    """A response sender that keeps what it is sent."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        self.sent.append((response, final))

    def is_cancelled(self) -> bool:
        return False


def batcher(text: str) -> DynamicBatcher:
    parsed = parse_config(textwrap.dedent(text), Path("config.pbtxt"))
    return DynamicBatcher(parsed, model_io(parsed, Path(".")))


def make_request(rid: str, rows: int = 1) -> tuple[InferRequest, Collect]:
    request = InferRequest("m", 1, {"INPUT0": np.zeros((rows, 2), np.float32)}, ("OUTPUT0",), id=rid, batch_size=rows)
    sender = Collect()
    request.attach_sender(sender)
    return request, sender


def test_cancelled_queued_request_never_reaches_execute() -> None:
    scheduler = batcher(config(8, "max_queue_delay_microseconds: 0"))
    (a, _), (b, b_sender), (c, _) = make_request("a"), make_request("b"), make_request("c")
    for r in (a, b, c):
        scheduler.enqueue(r)
    b.cancel()
    batch = scheduler.next_batch()
    assert batch is not None and [r.id for r in batch] == ["a", "c"]
    assert len(b_sender.sent) == 1
    error, final = b_sender.sent[0]
    assert final and isinstance(error, InferError) and error.code is ErrorCode.CANCELLED


def test_cancelled_head_is_skipped_while_waiting_for_the_delay() -> None:
    scheduler = batcher(config(8, "max_queue_delay_microseconds: 100000"))
    first, sender = make_request("first")
    scheduler.enqueue(first)
    first.cancel()
    second, _ = make_request("second")
    scheduler.enqueue(second)
    batch = scheduler.next_batch()  # returns once the delay of "second" ends: the cancelled head holds nothing
    assert batch is not None and [r.id for r in batch] == ["second"]
    assert sender.sent and sender.sent[0][0].code is ErrorCode.CANCELLED


def _drain(scheduler: DynamicBatcher, now: int) -> list[str]:
    """The ids of every batch due at the monotonic ``now``, in the order they are sent."""
    order: list[str] = []
    while True:
        batch, _ = scheduler.due(now)
        if batch is None:
            return order
        order += [r.id for r in batch]


def test_a_delayed_request_stays_ahead_of_lower_priority_levels() -> None:
    """As in Triton, a request its DELAY policy timed out goes behind its own level's requests,
    not behind every level: a timed-out priority-1 request still runs before priority 2."""
    scheduler = batcher(config(1, """
        max_queue_delay_microseconds: 0 priority_levels: 2 default_priority_level: 2
        priority_queue_policy { key: 1 value: { timeout_action: DELAY default_timeout_microseconds: 1000 } }
    """))
    requests = {}
    for rid, priority in (("high-late", 1), ("high", 1), ("low", 2)):
        requests[rid], _ = make_request(rid)
        requests[rid].priority = priority
    requests["high"].arrival_ns = requests["high-late"].arrival_ns + 10**9  # not timed out yet
    for rid in ("high-late", "high", "low"):
        scheduler.enqueue(requests[rid])
    assert _drain(scheduler, requests["high-late"].arrival_ns + 10**6) == ["high", "high-late", "low"]


def test_priority_levels_may_be_as_many_as_the_field_holds() -> None:
    """``priority_levels`` is a uint64: its largest value loads, and requests at far-apart
    levels run in level order; queues exist only for levels that hold requests."""
    scheduler = batcher(config(1, """
        max_queue_delay_microseconds: 0 priority_levels: 18446744073709551615 default_priority_level: 4294967296
        priority_queue_policy { key: 9223372036854775808 value: { max_queue_size: 1 } }
    """))
    made = [make_request(rid)[0] for rid in ("default", "lowest", "first", "far")]
    for request, priority in zip(made, (0, 18446744073709551615, 1, 9223372036854775808)):
        request.priority = priority
        scheduler.enqueue(request)
    extra, _ = make_request("one-too-many")
    extra.priority = 9223372036854775808
    with pytest.raises(InferError, match="Exceeds maximum queue size"):
        scheduler.enqueue(extra)
    assert _drain(scheduler, time.monotonic_ns()) == ["first", "default", "far", "lowest"]
    assert scheduler._head() is None


def test_stop_sends_what_is_queued_then_stops() -> None:
    scheduler = batcher(config(8, "max_queue_delay_microseconds: 10000000"))
    request, _ = make_request("a", rows=2)
    scheduler.enqueue(request)
    scheduler.stop(1)
    batch = scheduler.next_batch()
    assert batch is not None and [r.id for r in batch] == ["a"]
    assert scheduler.next_batch() is None


@pytest.mark.parametrize(
    ("preferred", "rows", "expected"),
    [
        ("[ 4 ]", [1, 1, 1, 1, 1, 1], ["4"]),  # exactly a preferred size
        ("[ 2, 4 ]", [1, 1, 1], ["2"]),  # the largest preferred size reached so far
        ("[ 4 ]", [3, 3], ["3"]),  # the next request would pass the largest preferred size
        ("[ 4, 8 ]", [3, 3], []),  # neither: wait for more or for the delay
    ],
)
def test_preferred_batch_selection(preferred: str, rows: list[int], expected: list[str]) -> None:
    # a preferred batch must go at once: then the delay is one the test would never see end
    delay_us = NEVER_US if expected else 300_000
    batching = f"preferred_batch_size: {preferred} max_queue_delay_microseconds: {delay_us}"
    scheduler = batcher(config(8, batching))
    start = time.monotonic()  # before the first request: its delay starts after this
    for i, n in enumerate(rows):
        scheduler.enqueue(make_request(f"r{i}", n)[0])
    got: list[str] = []

    def take() -> None:
        batch = scheduler.next_batch()
        assert batch is not None
        got.append(str(sum(r.batch_size for r in batch)))

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    taker.join(RUN_TIMEOUT)
    sent = not taker.is_alive()
    if not sent:  # let the thread go
        scheduler.stop(1)
        taker.join(RUN_TIMEOUT)
    assert sent, "no batch was sent"
    waited = time.monotonic() - start
    if expected:
        assert got == expected, got
    else:
        assert waited >= 0.25, waited  # nothing preferred: sent only when the delay ran out
        assert got == [str(sum(rows))]
