"""The sequence batcher (strategies ``direct`` and ``oldest``) against real servers and clients.

The test backend ``Accumulator`` adds ``INPUT`` to the implicit state ``STATE_IN`` and returns
the sum as ``OUTPUT`` and as the next state ``STATE_OUT``; it records, per request, the
instance that ran it and the control tensors (START / READY / END / CORRID) it received. Like a
Triton sequence model it reads READY: a request whose READY is false (a null request holding an
empty batch slot) is recorded apart, in ``batches``, which keeps every execute's slots in order.
"""

from __future__ import annotations

import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from suite_support import wait_for
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from pyserve import InferRequest, InferResponse, InstanceContext
from pyserve.api.backend import Backend
from pyserve.server.core import ServerThread

StartServer = Callable[..., ServerThread]
MakeRepo = Callable[..., Path]


@dataclass(frozen=True)
class Seen:
    model: str
    instance: str
    correlation_id: int | str
    value: int
    controls: dict[str, np.ndarray]
    at: float


class Accumulator(Backend):
    """Request parameters: ``delay_ms`` sleeps that long first, ``hold`` waits for ``release``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[Seen] = []
        self.batches: list[list[int | str | None]] = []  # per execute, each slot's id (None: not ready)
        self.nulls: list[dict[str, np.ndarray]] = []  # the inputs of every request whose READY was false
        self.release = threading.Event()
        self.holding = threading.Event()  # set once a held request is executing

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        responses = []
        slots: list[int | str | None] = []
        for r in requests:
            if "READY" in r.inputs and not r.inputs["READY"].any():
                slots.append(None)
                with self.lock:
                    self.nulls.append({name: np.array(value) for name, value in r.inputs.items()})
                responses.append(InferResponse({"OUTPUT": r.inputs["INPUT"], "STATE_OUT": r.inputs["STATE_IN"]}))
                continue
            slots.append(r.correlation_id)
            delay = float(r.parameters.get("delay_ms", 0))
            if delay:
                time.sleep(delay / 1000)
            if r.parameters.get("hold"):
                self.holding.set()
                self.release.wait(60)
            total = r.inputs["STATE_IN"] + r.inputs["INPUT"]
            controls = {k: np.array(r.inputs[k]) for k in ("START", "READY", "END", "CORRID") if k in r.inputs}
            with self.lock:
                self.seen.append(
                    Seen(instance.model.name, instance.name, r.correlation_id, int(r.inputs["INPUT"].flat[0]),
                         controls, time.monotonic())
                )
            responses.append(InferResponse({"OUTPUT": total, "STATE_OUT": total}))
        with self.lock:
            self.batches.append(slots)
        return responses

    def of(self, model: str) -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if s.model == model]


def config(
    strategy: str = "direct { }",
    max_batch_size: int = 0,
    instances: int = 1,
    corrid_type: str = "TYPE_UINT64",
    idle_us: int = 5_000_000,
    dims: str = "1",
) -> str:
    return textwrap.dedent(
        f"""
        backend: "accum"
        max_batch_size: {max_batch_size}
        input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ {dims} ] }} ]
        output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ {dims} ] }} ]
        instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
        sequence_batching {{
          max_sequence_idle_microseconds: {idle_us}
          {strategy}
          control_input [
            {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
            {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] }} ] }},
            {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] }} ] }},
            {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: {corrid_type} }} ] }}
          ]
          state [ {{ input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        }}
        """
    )


STRATEGIES = {
    "direct": "direct { }",
    "oldest": "oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 0 }",
}


def serve(start_server: StartServer, make_repo: MakeRepo, models: dict[str, str]) -> tuple[ServerThread, Accumulator]:
    backend = Accumulator()
    return start_server(make_repo(models), backends={"accum": backend}), backend


class Client:
    """A sync client that knows whether the model batches."""

    def __init__(self, server: ServerThread, model: str, batching: bool) -> None:
        self.client = httpclient.InferenceServerClient(server.url)
        self.model = model
        self.batching = batching

    def send(self, sequence_id: int | str, value: int, start: bool = False, end: bool = False, **kw: Any) -> int:
        data = np.array([[value]] if self.batching else [value], dtype=np.int32)
        inp = httpclient.InferInput("INPUT", list(data.shape), "INT32")
        inp.set_data_from_numpy(data)
        result = self.client.infer(
            self.model, [inp], sequence_id=sequence_id, sequence_start=start, sequence_end=end, **kw
        )
        out = result.as_numpy("OUTPUT")
        assert out.shape == data.shape
        assert result.as_numpy("STATE_OUT") is None  # implicit state never reaches the client
        return int(out.flat[0])

    def error(self, sequence_id: int | str, value: int = 1, **kw: Any) -> InferenceServerException:
        with pytest.raises(InferenceServerException) as info:
            self.send(sequence_id, value, **kw)
        return info.value

    def close(self) -> None:
        self.client.close()


# -- state and correlation ids --------------------------------------------------------------------
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize(("id_kind", "max_batch_size"), [("uint64", 0), ("uint64", 4), ("string", 4)])
def test_interleaved_sequences_keep_separate_state(
    start_server: StartServer, make_repo: MakeRepo, strategy: str, id_kind: str, max_batch_size: int
) -> None:
    corrid = "TYPE_STRING" if id_kind == "string" else "TYPE_UINT64"
    # Two sequences at once need two slots: a non-batching model gets them from 2 instances.
    model = config(STRATEGIES[strategy], max_batch_size, instances=2 if max_batch_size == 0 else 1, corrid_type=corrid)
    server, backend = serve(start_server, make_repo, {"m": model})
    client = Client(server, "m", max_batch_size > 0)
    a, b = ("seq-a", "seq-b") if id_kind == "string" else (2**63 + 5, 17)
    try:
        assert client.send(a, 1, start=True) == 1
        assert client.send(b, 10, start=True) == 10
        assert client.send(a, 2) == 3
        assert client.send(b, 20) == 30
        assert client.send(b, 30, end=True) == 60
        assert client.send(a, 3, end=True) == 6
    finally:
        client.close()
    corrids = [s.controls["CORRID"] for s in backend.of("m")]
    if id_kind == "string":
        assert all(c.dtype == np.dtype(object) for c in corrids)
        assert [c.flat[0] for c in corrids[:2]] == [b"seq-a", b"seq-b"]
    else:
        assert all(c.dtype == np.uint64 for c in corrids)
        assert [int(c.flat[0]) for c in corrids[:2]] == [a, b]


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_concurrent_sequences_keep_separate_state(
    start_server: StartServer, make_repo: MakeRepo, strategy: str
) -> None:
    server, _ = serve(start_server, make_repo, {"m": config(STRATEGIES[strategy], 4, instances=2)})
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def sequence(cid: int) -> None:
        client = Client(server, "m", True)
        try:
            values = [cid * 100 + k for k in range(5)]
            results[cid] = [
                client.send(cid, v, start=k == 0, end=k == 4) for k, v in enumerate(values)
            ]
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=sequence, args=(cid,)) for cid in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for cid, got in results.items():
        assert got == list(np.cumsum([cid * 100 + k for k in range(5)])), (cid, got)
    assert len(results) == 6


def test_state_resets_on_start(start_server: StartServer, make_repo: MakeRepo) -> None:
    server, _ = serve(start_server, make_repo, {"m": config()})
    client = Client(server, "m", False)
    try:
        assert client.send(7, 5, start=True) == 5
        assert client.send(7, 1) == 6
        assert client.send(7, 1, end=True) == 7
        assert client.send(7, 2, start=True) == 2  # a new sequence with the same id
        assert client.send(7, 3) == 5
        assert client.send(7, 4, start=True) == 4  # START again mid-sequence restarts it
        assert client.send(7, 1, start=True, end=True) == 1
    finally:
        client.close()


def test_control_inputs_have_configured_types_and_values(start_server: StartServer, make_repo: MakeRepo) -> None:
    server, backend = serve(start_server, make_repo, {"m": config(max_batch_size=2)})
    client = Client(server, "m", True)
    try:
        client.send(42, 1, start=True)
        client.send(42, 1)
        client.send(42, 1, end=True)
        client.send(43, 1, start=True, end=True)
    finally:
        client.close()
    seen = backend.of("m")
    assert len(seen) == 4
    for s in seen:
        assert s.controls["START"].dtype == np.int32
        assert s.controls["READY"].dtype == np.float32
        assert s.controls["END"].dtype == np.bool_
        assert s.controls["CORRID"].dtype == np.uint64
        assert all(c.shape[0] == 1 for c in s.controls.values())  # one value per batch row
        assert all(c.shape == (1, 1) for c in s.controls.values())  # dims [1] after the batch dim, as Triton
    flags = [
        (int(s.controls["START"].flat[0]), float(s.controls["READY"].flat[0]), bool(s.controls["END"].flat[0]),
         int(s.controls["CORRID"].flat[0]))
        for s in seen
    ]
    assert flags == [(1, 1.0, False, 42), (0, 1.0, False, 42), (0, 1.0, True, 42), (1, 1.0, True, 43)]


def test_control_inputs_of_a_non_batching_model_have_shape_1(start_server: StartServer, make_repo: MakeRepo) -> None:
    server, backend = serve(start_server, make_repo, {"m": config(max_batch_size=0)})
    client = Client(server, "m", False)
    try:
        client.send(42, 1, start=True, end=True)
    finally:
        client.close()
    [seen] = backend.of("m")
    assert all(c.shape == (1,) for c in seen.controls.values())


# -- errors -----------------------------------------------------------------------------------------
def test_missing_correlation_id_is_rejected(start_server: StartServer, make_repo: MakeRepo) -> None:
    server, backend = serve(start_server, make_repo, {"m": config()})
    client = Client(server, "m", False)
    try:
        error = client.error(0)
        assert error.status() == "400"
        assert "correlation ID" in str(error.message())
    finally:
        client.close()
    assert backend.of("m") == []


def test_sequence_flags_without_an_id_are_refused_by_the_sequence_batcher_only(
    start_server: StartServer, make_repo: MakeRepo
) -> None:
    """As Triton 2.51 answers it (checked side by side): ``sequence_start`` with no
    ``sequence_id`` is refused, in Triton's words, by a model with a sequence batcher; a model
    without one serves the request (HTTP and gRPC)."""
    plain = ('backend: "identity"\nmax_batch_size: 0\n'
             'input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
             'output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n')
    server, backend = serve(start_server, make_repo, {"m": config(), "plain": plain})
    body = {"inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1], "data": [5]}],
            "parameters": {"sequence_start": True}}
    refused = httpx.post(f"http://{server.url}/v2/models/m/infer", json=body, timeout=30)
    assert refused.status_code == 400
    assert ("inference request to model 'm' must specify a non-zero or non-empty correlation ID"
            in refused.json()["error"])
    served = httpx.post(f"http://{server.url}/v2/models/plain/infer", json=body, timeout=30)
    assert served.status_code == 200, served.text
    assert served.json()["outputs"][0]["data"] == [5]
    with grpc.insecure_channel(server.grpc_url) as channel:  # tritonclient sends no flags without an id
        request = service_pb2.ModelInferRequest(model_name="plain")
        request.parameters["sequence_start"].bool_param = True
        request.inputs.add(name="INPUT", datatype="INT32", shape=[1]).contents.int_contents.append(5)
        answer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
        assert answer.raw_output_contents[0] == np.array([5], np.int32).tobytes()
    assert backend.of("m") == []


def test_request_after_end_needs_start(start_server: StartServer, make_repo: MakeRepo) -> None:
    server, _ = serve(start_server, make_repo, {"m": config()})
    client = Client(server, "m", False)
    try:
        error = client.error(9)  # never started
        assert error.status() == "400" and "START" in str(error.message())
        client.send(9, 1, start=True)
        client.send(9, 1, end=True)
        error = client.error(9)
        assert error.status() == "400" and "START" in str(error.message())
        assert client.send(9, 3, start=True, end=True) == 3
    finally:
        client.close()


def test_idle_sequence_expires(start_server: StartServer, make_repo: MakeRepo) -> None:
    server, _ = serve(start_server, make_repo, {"m": config(idle_us=200_000)})
    client = Client(server, "m", False)
    try:
        assert client.send(5, 1, start=True) == 1
        assert client.send(5, 1) == 2  # within the idle time
        time.sleep(0.5)
        error = client.error(5)
        assert error.status() == "400"
        message = str(error.message())
        assert "5" in message and "START" in message, message
        assert client.send(5, 4, start=True) == 4  # state was released with the sequence
    finally:
        client.close()


def test_string_id_for_a_numeric_corrid_is_rejected(start_server: StartServer, make_repo: MakeRepo) -> None:
    server, backend = serve(start_server, make_repo, {"m": config()})
    client = Client(server, "m", False)
    try:
        error = client.error("text-id", start=True)
        assert error.status() == "400" and "CORRID" in str(error.message())
        assert client.send(3, 2, start=True, end=True) == 2  # the model still serves
    finally:
        client.close()
    assert [s.correlation_id for s in backend.of("m")] == [3]


# -- instances and slots ---------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_sequence_stays_on_one_instance(start_server: StartServer, make_repo: MakeRepo, strategy: str) -> None:
    server, backend = serve(start_server, make_repo, {"m": config(STRATEGIES[strategy], 2, instances=2)})
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def sequence(cid: int) -> None:
        client = Client(server, "m", True)
        try:
            barrier.wait(5)
            for k in range(4):
                client.send(cid, 1, start=k == 0, end=k == 3, parameters={"delay_ms": 20})
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=sequence, args=(cid,)) for cid in (11, 12, 13, 14)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    placement: dict[int | str, set[str]] = {}
    for s in backend.of("m"):
        placement.setdefault(s.correlation_id, set()).add(s.instance)
    assert all(len(instances) == 1 for instances in placement.values()), placement
    assert len(set().union(*placement.values())) == 2, placement


def test_extra_sequence_waits_in_the_backlog(start_server: StartServer, make_repo: MakeRepo) -> None:
    server, backend = serve(start_server, make_repo, {"m": config("direct { }", 1)})
    first = Client(server, "m", True)
    waited: dict[str, Any] = {}

    def second_sequence() -> None:
        client = Client(server, "m", True)
        try:
            waited["result"] = client.send(2, 10, start=True)
            waited["at"] = time.monotonic()
            waited["end"] = client.send(2, 5, end=True)
        except BaseException as exc:
            waited["error"] = exc
        finally:
            client.close()

    try:
        assert first.send(1, 1, start=True) == 1
        thread = threading.Thread(target=second_sequence)
        thread.start()
        time.sleep(0.4)
        assert "result" not in waited and "error" not in waited  # no slot: it waits
        assert first.send(1, 2) == 3  # the slot holder keeps going meanwhile
        ended_at = time.monotonic()
        assert first.send(1, 3, end=True) == 6
        thread.join(60)
    finally:
        first.close()
    assert "error" not in waited, waited.get("error")
    assert waited["result"] == 10 and waited["end"] == 15
    assert waited["at"] >= ended_at
    order = [s.correlation_id for s in backend.of("m")]
    assert order == [1, 1, 1, 2, 2], order


def statistics(server: ServerThread, model: str) -> dict[str, Any]:
    response = httpx.get(f"http://{server.url}/v2/models/{model}/stats", timeout=30)
    assert response.status_code == 200, response.text
    stats: dict[str, Any] = response.json()["model_stats"][0]
    return stats


def test_direct_strategy_keeps_each_sequence_in_its_batch_slot(start_server: StartServer, make_repo: MakeRepo) -> None:
    """As Triton 2.51 does (checked side by side): batch element i is slot i, empty slots below
    the highest ready one hold null requests, and a new sequence takes the lowest free slot."""
    server, backend = serve(start_server, make_repo, {"m": config("direct { }", 4)})
    client = Client(server, "m", True)
    try:
        answers = [client.send(101, 1, start=True), client.send(102, 2, start=True),
                   client.send(103, 3, start=True), client.send(103, 4), client.send(101, 5, end=True),
                   client.send(104, 6, start=True), client.send(102, 7), client.send(104, 8)]
    finally:
        client.close()
    assert answers == [1, 2, 3, 7, 6, 6, 9, 14]  # each sequence's own sum: null requests touch no state
    assert backend.batches == [[101], [None, 102], [None, None, 103], [None, None, 103], [101],
                               [104], [None, 102], [104]]  # 104 took slot 0, freed by 101's END
    assert len(backend.nulls) == 6
    for null in backend.nulls:  # READY, START and END false, CORRID 0, zero inputs, initial state
        assert {name: value.tolist() for name, value in null.items()} == {
            "INPUT": [[0]], "START": [[0]], "READY": [[0.0]], "END": [[False]], "CORRID": [[0]], "STATE_IN": [[0]]}
        assert null["INPUT"].dtype == np.int32 and null["CORRID"].dtype == np.uint64
    stats = statistics(server, "m")
    assert (stats["inference_count"], stats["execution_count"]) == (8, 8)  # null requests are not inferences
    assert stats["inference_stats"]["success"]["count"] == 8
    # ... but the batch statistics count the batch the model executed, null requests included
    assert {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]} == {1: 4, 2: 2, 3: 2}


def test_direct_strategy_batches_waiting_slots_of_one_shape(start_server: StartServer, make_repo: MakeRepo) -> None:
    """Requests of busy slots wait for the instance and go together, each in its slot; a slot
    whose request has other shapes than the lowest ready slot's holds a null request instead and
    goes in the next batch."""
    text = config("direct { }", 4, dims="-1")
    server, backend = serve(start_server, make_repo, {"m": text})
    client = httpclient.InferenceServerClient(server.url, concurrency=4)

    def request(cid: int, values: list[int], start: bool = False, **kw: Any) -> Any:
        data = np.array([values], dtype=np.int32)
        inp = httpclient.InferInput("INPUT", list(data.shape), "INT32")
        inp.set_data_from_numpy(data)
        return client.async_infer("m", [inp], sequence_id=cid, sequence_start=start, **kw)

    try:
        for cid in (1, 2, 3):
            request(cid, [0], start=True).get_result(timeout=60)
        held = request(1, [0], parameters={"hold": True})  # slot 0 keeps the instance busy
        assert backend.holding.wait(60), "the held request did not execute"
        later = [request(2, [5, 5]), request(3, [7])]  # slot 1 and slot 2, two shapes
        wait_for(lambda: server.server.dataplane.in_flight == 3, timeout=60, what="both to queue")
        backend.release.set()
        results = [r.get_result(timeout=60).as_numpy("OUTPUT").tolist() for r in (held, *later)]
    finally:
        client.close()
    assert results == [[[0]], [[5, 5]], [[7]]]
    assert backend.batches[3:] == [[1], [None, 2, None], [None, None, 3]]


@pytest.mark.parametrize(
    ("direct", "waits"),
    [
        ("max_queue_delay_microseconds: 120000000", False),  # no slot utilization: Triton ignores the delay
        ("max_queue_delay_microseconds: 120000000 minimum_slot_utilization: 0.5", True),
    ],
)
def test_direct_strategy_waits_only_for_a_slot_utilization(
    start_server: StartServer, make_repo: MakeRepo, direct: str, waits: bool
) -> None:
    server, backend = serve(start_server, make_repo, {"m": config(f"direct {{ {direct} }}", 4)})
    answers: dict[int, int] = {}

    def sequence(cid: int) -> None:
        client = Client(server, "m", True)
        try:
            answers[cid] = client.send(cid, cid, start=True)
        finally:
            client.close()

    first = threading.Thread(target=sequence, args=(11,))
    first.start()
    if waits:  # 1 of 4 slots is under 0.5: it waits (up to the 120 s delay) for a second slot
        wait_for(lambda: server.server.dataplane.in_flight == 1, timeout=60, what="the first request to arrive")
        time.sleep(0.3)
        assert backend.batches == [] and not answers
        sequence(12)
    first.join(60)
    assert answers[11] == 11
    if waits:
        assert answers[12] == 12
        assert [sorted(b, key=str) for b in backend.batches] == [[11, 12]]  # 2 of 4 slots ready: both go
    else:
        assert backend.batches == [[11]]


def test_direct_strategy_sends_a_lone_slot_after_the_delay(start_server: StartServer, make_repo: MakeRepo) -> None:
    direct = "direct { max_queue_delay_microseconds: 200000 minimum_slot_utilization: 1.0 }"
    server, backend = serve(start_server, make_repo, {"m": config(direct, 4)})
    client = Client(server, "m", True)
    try:
        begun = time.monotonic()
        assert client.send(5, 3, start=True) == 3
        waited = time.monotonic() - begun
    finally:
        client.close()
    assert backend.batches == [[5]]
    assert waited >= 0.2  # it waited for the delay: a lower bound, which a busy machine only raises


@pytest.mark.parametrize("preserve", [True, False])
def test_oldest_preserve_ordering(start_server: StartServer, make_repo: MakeRepo, preserve: bool) -> None:
    """``oldest { preserve_ordering }``: a fast request of one sequence is answered only after a
    slow, earlier request of another sequence on another instance; without it, at once."""
    strategy = f"oldest {{ max_candidate_sequences: 1 max_queue_delay_microseconds: 0 preserve_ordering: {str(preserve).lower()} }}"
    server, backend = serve(start_server, make_repo, {"m": config(strategy, instances=2)})
    done: list[str] = []

    def send(name: str, sequence_id: int, parameters: dict[str, Any]) -> None:
        client = Client(server, "m", batching=False)
        try:
            client.send(sequence_id, 1, start=True, parameters=parameters)
        finally:
            client.close()
        done.append(name)

    def executed(sequence_id: int) -> bool:
        return any(s.correlation_id == sequence_id for s in backend.of("m"))

    slow = threading.Thread(target=send, args=("slow", 11, {"hold": True}))  # runs until released
    slow.start()
    wait_for(lambda: server.server.dataplane.in_flight == 1, timeout=60, what="the slow request to arrive")
    fast = threading.Thread(target=send, args=("fast", 12, {}))
    fast.start()
    wait_for(lambda: executed(12), timeout=60, what="the fast request to execute")
    if preserve:  # the fast answer waits for the slow one (given time to come back, it does not)
        time.sleep(0.3)
        assert not done, done
    else:  # the fast answer comes back while the slow request is held
        wait_for(lambda: "fast" in done, timeout=60, what="the fast answer")
        assert done == ["fast"]
    backend.release.set()
    for thread in (slow, fast):
        thread.join(60)
    assert sorted(done) == ["fast", "slow"]
    assert len({s.instance for s in backend.of("m")}) == 2  # the two sequences ran on different instances


# --------------------------------------------------------------------------- iterative sequences


class Countdown(Backend):
    """Answers a request after ``INPUT`` executes (``reschedule()`` until then), with the
    START control value and batch size each execute saw; with ``reschedule_always`` set on
    a non-iterative model it asks for rescheduling there too."""

    def __init__(self) -> None:
        self.runs: dict[int | str, list[tuple[int, int]]] = {}

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse | None]:
        out: list[InferResponse | None] = []
        for r in requests:
            runs = self.runs.setdefault(r.correlation_id, [])
            runs.append((int(r.inputs["START"].flat[0]), len(requests)))
            if len(runs) < int(r.inputs["INPUT"].flat[0]):
                r.reschedule()
                out.append(None)
            else:
                value = np.array([[len(runs)]], dtype=np.int32)
                out.append(InferResponse({"OUTPUT": value, "STATE_OUT": value}))
        return out


def test_iterative_sequences_reschedule_requests_until_answered(start_server: StartServer, make_repo: MakeRepo) -> None:
    text = config("oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 100000 }", max_batch_size=4)
    text = text.replace("sequence_batching {", "sequence_batching {\n  iterative_sequence: true")
    backend = Countdown()
    server = start_server(make_repo({"countdown": text}), backends={"accum": backend}, use_entry_points=False)

    def ask(steps: int, sequence_id: int = 0) -> int:  # a client per call: one per thread
        client = httpclient.InferenceServerClient(server.url, network_timeout=60)
        tensor = httpclient.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[steps]], dtype=np.int32))
        return int(client.infer("countdown", [tensor], sequence_id=sequence_id).as_numpy("OUTPUT")[0, 0])

    assert ask(3, sequence_id=42) == 3  # a client id is used as given
    assert backend.runs[42] == [(1, 1), (0, 1), (0, 1)]  # START on the first iteration only
    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(ask, [1, 2, 3])) == [1, 2, 3]
    assigned = [runs for cid, runs in backend.runs.items() if cid != 42]
    assert sorted(len(r) for r in assigned) == [1, 2, 3]
    assert all(runs[0] == (1, 3) for runs in assigned)  # started together, in one batch of three
    longest = max(assigned, key=len)
    assert [size for _, size in longest] == [3, 2, 1]  # finished ones leave the batch
    with pytest.raises(InferenceServerException, match="string correlation ID 'abc'"):
        ask(1, sequence_id="abc")  # type: ignore[arg-type]  # the CORRID control input is UINT64

    plain = config("oldest { max_candidate_sequences: 4 }", max_batch_size=4)
    server = start_server(make_repo({"plain": plain}), backends={"accum": Countdown()}, use_entry_points=False)
    tensor = httpclient.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[2]], dtype=np.int32))
    with pytest.raises(InferenceServerException, match="iterative_sequence"):
        httpclient.InferenceServerClient(server.url).infer("plain", [tensor], sequence_id=7, sequence_start=True)


class AnswersAndReschedules(Countdown):
    """Asks for rescheduling and answers the request in the same execute."""

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse | None]:
        for r in requests:
            self.runs.setdefault(r.correlation_id, []).append((0, len(requests)))
            r.reschedule()
        value = np.array([[1]], dtype=np.int32)
        return [InferResponse({"OUTPUT": value, "STATE_OUT": value}) for _ in requests]


def test_a_request_both_rescheduled_and_answered_fails_once(start_server: StartServer, make_repo: MakeRepo) -> None:
    """It is not run again in every later iteration (it used to loop for ever)."""
    text = config("oldest { max_candidate_sequences: 4 }", max_batch_size=4)
    text = text.replace("sequence_batching {", "sequence_batching {\n  iterative_sequence: true")
    backend = AnswersAndReschedules()
    server = start_server(make_repo({"both": text}), backends={"accum": backend}, use_entry_points=False)
    tensor = httpclient.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[2]], dtype=np.int32))
    client = httpclient.InferenceServerClient(server.url, network_timeout=60)
    with pytest.raises(InferenceServerException, match="returned a response for a request of model 'both' it rescheduled"):
        client.infer("both", [tensor], sequence_id=9, sequence_start=True, sequence_end=True)
    assert backend.runs[9] == [(0, 1)]


# -- cancellation, at the scheduler ----------------------------------------------------------------
class _Kept:
    """A response sender that keeps what it is sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, bool]] = []

    def send(self, response: Any, final: bool) -> None:
        self.sent.append((response, final))

    def is_cancelled(self) -> bool:
        return False


def _sequence_request(cid: int, value: int, flags: int = 0) -> tuple[InferRequest, _Kept]:
    request = InferRequest("m", 1, {"INPUT": np.array([value], np.int32)}, ("OUTPUT",), id=f"{cid}-{value}",
                           correlation_id=cid, flags=flags)
    kept = _Kept()
    request.attach_sender(kept)
    return request, kept


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_cancelled_queued_request_ends_its_sequence(strategy: str) -> None:
    """As in Triton: the cancelled request and every one queued behind it in its sequence are
    answered CANCELLED when the sequence's turn comes, the sequence is released (a request
    without START is then refused), and other sequences go on."""
    from pyserve.api.errors import ErrorCode, InferError
    from pyserve.api.inference import SEQUENCE_START
    from pyserve.repository.model_config import model_io, parse_config
    from pyserve.runtime.scheduling.sequence import SequenceBatcher

    parsed = parse_config(config(STRATEGIES[strategy]), Path("config.pbtxt"))
    scheduler = SequenceBatcher(parsed, model_io(parsed, Path(".")), 1, Path("."))
    next_batch = scheduler.batch_source(0)
    (first, _), (cancelled, cancelled_kept), (behind, behind_kept) = (
        _sequence_request(7, 1, SEQUENCE_START), _sequence_request(7, 2), _sequence_request(7, 3))
    for request in (first, cancelled, behind):
        scheduler.enqueue(request)
    assert [r.id for r in next_batch()] == ["7-1"]
    cancelled.cancel()
    other, _ = _sequence_request(8, 5, SEQUENCE_START)
    scheduler.enqueue(other)
    assert [r.id for r in next_batch()] == ["8-5"]
    for kept in (cancelled_kept, behind_kept):
        [(error, final)] = kept.sent
        assert final and isinstance(error, InferError) and error.code is ErrorCode.CANCELLED
    late, _ = _sequence_request(7, 4)
    with pytest.raises(InferError, match="must specify the START flag"):
        scheduler.enqueue(late)
    scheduler.stop(1)
