"""The adaptive scheduler: a compute-only model executes on the event loop when that is cheaper.

With a real server and tritonclient: a model whose backend declares it compute-only
(``ModelContext.compute_only``) executes on the server's loop thread once one client alone sends
requests and its executes are known to be short, and on its instance threads otherwise: while
requests come over two connections, after a slow execute (until short ones bring the estimate
down again), during warm-up, and before any execute was timed. ``pyserve_inline_execute``
``"false"`` keeps the threads, ``"auto"`` asks for the scheduler on any backend; models with a
batcher, a rate limiter or GPU instances keep their schedulers. Directly on the scheduler: an
instance thread never starts a batch while the loop executes. The servers that must execute on
their loop run in one process (``frontend_processes=0``): a frontend process's link to the owner
counts as many clients, so a connection it took would never see the loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from suite_support import pair_config
from tritonclient.utils import InferenceServerException

from pyserve import (
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelContext,
)
from pyserve.api.backend import Backend
from pyserve.repository.model_config import model_io, parse_config
from pyserve.runtime.scheduling import (
    AdaptiveBatcher,
    AdaptiveScheduler,
    DefaultScheduler,
    DynamicBatcher,
    client_activity,
)
from pyserve.runtime.scheduling.adaptive import AUTO_LIMIT_NS

LOOP_THREAD = "pyserve-server"  # ServerThread's event loop thread


def config(extra: str = "", limit_us: int = 100_000) -> str:
    """A model of the compute backend; ``limit_us``: its ``pyserve_inline_max_us``, generous by
    default, so that a slow test machine's executes still count as short."""
    return pair_config("compute", f'parameters {{ key: "pyserve_inline_max_us" value {{ string_value: "{limit_us}" }} }}\n'
                                  + extra)


def auto(value: str) -> str:
    return f'parameters {{ key: "pyserve_inline_execute" value {{ string_value: "{value}" }} }}'


class Compute(Backend):
    """Doubles IN; records each execute's thread; request parameter ``sleep_ms`` makes one slow,
    ``fail`` makes it raise (after the sleep)."""

    def __init__(self, compute_only: bool = True) -> None:
        self.compute_only = compute_only
        self.threads: list[str] = []
        self.alone: list[bool] = []  # whether one client alone was sending, at each execute
        self.sizes: list[int] = []

    def create_model(self, model: ModelContext) -> None:
        model.compute_only = self.compute_only

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        self.threads.append(threading.current_thread().name)
        self.alone.append(client_activity.one_client())
        self.sizes.append(len(requests))
        for request in requests:
            pause = request.parameters.get("sleep_ms")
            if pause:
                time.sleep(float(pause) / 1000)
            if request.parameters.get("fail"):
                raise RuntimeError("asked to fail")
        return [InferResponse({"OUT": request.inputs["IN"] * 2}) for request in requests]


VALUES = np.array([[1, 2]], dtype=np.float32)


def _input(module: Any = httpclient) -> Any:
    tensor = module.InferInput("IN", [1, 2], "FP32")
    tensor.set_data_from_numpy(VALUES)
    return tensor


def _call(client: Any, model: str, module: Any = httpclient, **parameters: Any) -> None:
    answer = client.infer(model, [_input(module)], parameters=parameters or None)
    assert np.array_equal(answer.as_numpy("OUT"), VALUES * 2)


def _settle() -> None:
    """Let the client-activity window of requests from other connections pass."""
    time.sleep(client_activity.WINDOW_NS / 1e9 * 2)


def _reach_the_loop(backend: Compute, client: Any, module: Any = httpclient) -> None:
    """A first call on a new connection, the activity window, then calls to model ``m`` until
    one executes on the loop."""
    _call(client, "m", module)
    _settle()
    _until_on_the_loop(backend, lambda: _call(client, "m", module))


def _until_on_the_loop(backend: Compute, call: Callable[[], None], tries: int = 40) -> int:
    """Call until an execute runs on the loop thread; the number of calls it took."""
    for attempt in range(1, tries + 1):
        call()
        if backend.threads[-1] == LOOP_THREAD:
            return attempt
    raise AssertionError(f"no execute ran on the event loop in {tries} calls: {backend.threads[-tries:]}")


def test_one_client_gets_its_executes_on_the_event_loop(start_server, make_repo) -> None:  # type: ignore[no-untyped-def]
    backend = Compute()
    server = start_server(make_repo({"m": config()}), backends={"compute": backend}, frontend_processes=0)
    assert isinstance(server.server.models.get("m").scheduler, AdaptiveScheduler)
    with httpclient.InferenceServerClient(server.url) as client:
        _reach_the_loop(backend, client)
        for _ in range(5):
            _call(client, "m")
        assert backend.threads[-5:] == [LOOP_THREAD] * 5
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        _reach_the_loop(backend, grpc, grpcclient)
    finally:
        grpc.close()
    with httpclient.InferenceServerClient(server.url) as client:
        stats = client.get_inference_statistics("m")["model_stats"][0]
    count = len(backend.threads)
    assert stats["inference_count"] == count and stats["execution_count"] == count


def test_two_clients_keep_the_instance_threads_for_executes_over_100_us(  # type: ignore[no-untyped-def]
    start_server, make_repo
) -> None:
    backend = Compute()
    server = start_server(make_repo({"m": config()}), backends={"compute": backend}, frontend_processes=0)
    with httpclient.InferenceServerClient(server.url) as one, httpclient.InferenceServerClient(server.url) as two:
        _reach_the_loop(backend, one)
        _call(one, "m", sleep_ms=1)  # alone: on the loop, and the estimate is now over 1 ms
        before = len(backend.threads)
        for _ in range(10):  # requests alternate between two connections, each execute over 1 ms
            _call(two, "m", sleep_ms=1)
            _call(one, "m", sleep_ms=1)
        assert all(name.startswith("pyserve-instance-") for name in backend.threads[before:])
        _settle()  # one client alone again
        _until_on_the_loop(backend, lambda: _call(one, "m", sleep_ms=1))


def test_two_clients_share_the_loop_for_executes_under_100_us(  # type: ignore[no-untyped-def]
    start_server, make_repo
) -> None:
    """An execute estimated under 100 µs (``SHARED_LIMIT_NS``) runs on the loop also while
    several clients send: cheaper for everyone than two thread wake-ups."""
    backend = Compute()
    server = start_server(make_repo({"m": config()}), backends={"compute": backend}, frontend_processes=0)
    scheduler = server.server.models.get("m").scheduler
    with httpclient.InferenceServerClient(server.url) as one, httpclient.InferenceServerClient(server.url) as two:
        _reach_the_loop(backend, one)
        for _ in range(200):  # alternating connections; a slow moment on this machine may raise the estimate
            before = len(backend.threads)
            _call(two, "m")
            _call(one, "m")
            shared = [alone for name, alone in zip(backend.threads[before:], backend.alone[before:])
                      if name == LOOP_THREAD and not alone]
            if shared:
                break
        assert shared, (scheduler.estimate_ns, backend.threads[-10:])


def test_the_batcher_executes_several_clients_cheap_batches_on_the_loop(  # type: ignore[no-untyped-def]
    start_server, make_repo
) -> None:
    """With a dynamic batcher, batches estimated under 100 µs execute on the loop also while
    several clients send: what the loop reads in one turn is one batch (a drain); executes over
    100 µs go back to the instance threads."""
    backend = Compute()
    server = start_server(make_repo({"m": config("dynamic_batching { }")}), backends={"compute": backend},
                          frontend_processes=0)
    scheduler = server.server.models.get("m").scheduler
    assert isinstance(scheduler, AdaptiveBatcher)
    with httpclient.InferenceServerClient(server.url) as client:
        _reach_the_loop(backend, client)

    async def together(clients: list[Any], first: int) -> list[float]:
        answers = await asyncio.gather(*(
            clients[i % len(clients)].infer("m", [_aio_input(first + i)]) for i in range(32)))
        return [float(a.as_numpy("OUT")[0, 0]) for a in answers]

    async def rounds() -> None:
        clients = [aioclient.InferenceServerClient(server.url) for _ in range(8)]
        try:
            for attempt in range(50):  # a slow moment on this machine may raise the estimate
                before = len(backend.threads)
                assert await together(clients, attempt * 32) == [2.0 * (attempt * 32 + i) for i in range(32)]
                shared = [size for name, alone, size in zip(backend.threads[before:], backend.alone[before:],
                                                             backend.sizes[before:])
                          if name == LOOP_THREAD and not alone and size > 1]
                if shared:
                    break
            assert shared, (scheduler.estimate_ns, backend.threads[-10:], backend.sizes[-10:])
            assert sum(backend.sizes[before:]) == 32  # every request once
            # over 100 µs a batch: the drain that times it hands the rest to the threads
            with_sleep = [clients[i % 8].infer("m", [_aio_input(i)], parameters={"sleep_ms": 1}) for i in range(32)]
            await asyncio.gather(*with_sleep)
            assert scheduler.estimate_ns >= 100_000
            before = len(backend.threads)
            await asyncio.gather(*(clients[i % 8].infer("m", [_aio_input(i)], parameters={"sleep_ms": 1})
                                   for i in range(32)))
            # only a drain executes more than one request on the loop; a lone request may still
            # take it (a straggler of the gather, alone for 10 ms on a busy machine)
            assert not [size for name, size in zip(backend.threads[before:], backend.sizes[before:])
                        if name == LOOP_THREAD and size > 1], (backend.threads[before:], backend.sizes[before:])
            assert sum(backend.sizes[before:]) == 32
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    asyncio.run(rounds())


def test_a_drain_scheduled_when_the_batcher_stops_goes_to_the_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests a drain would have taken are executed by the instance threads when the
    scheduler stops before the loop ran the drain (the loop may never run it)."""
    monkeypatch.setattr(client_activity, "one_request_at_a_time", lambda: False)
    scheduler = _scheduler("dynamic_batching")
    assert isinstance(scheduler, AdaptiveBatcher)
    worker = _Worker()
    scheduler.attach([worker])  # type: ignore[list-item]
    scheduler._record(1_000)
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        requests = [_request() for _ in range(3)]

        async def enqueue_and_stop() -> None:  # one turn of the loop: the drain has not run yet
            for request in requests:
                scheduler.enqueue(request)
            scheduler.stop(1)

        loop.run_until_complete(enqueue_and_stop())
        next_batch = scheduler.batch_source(0)
        batch = next_batch()
        assert batch is not None and list(batch) == requests  # one batch, on this (instance) thread
        assert next_batch() is None
        loop.run_until_complete(asyncio.sleep(0))  # the drain runs and finds nothing to do
        assert worker.log == []
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def test_a_slow_execute_goes_back_to_the_threads(start_server, make_repo) -> None:  # type: ignore[no-untyped-def]
    backend = Compute()
    server = start_server(make_repo({"m": config(limit_us=20_000)}), backends={"compute": backend},
                          frontend_processes=0)
    scheduler = server.server.models.get("m").scheduler
    with httpclient.InferenceServerClient(server.url) as client:
        _reach_the_loop(backend, client)
        _call(client, "m", sleep_ms=60)  # above the 20 ms limit: runs on the loop once, timed there
        assert backend.threads[-1] == LOOP_THREAD
        assert scheduler.estimate_ns >= 20_000_000
        _call(client, "m")
        assert backend.threads[-1].startswith("pyserve-instance-")
        calls = _until_on_the_loop(backend, lambda: _call(client, "m"))  # short executes: back
        assert calls > 1


def test_a_slow_execute_that_raises_also_sends_the_next_request_to_the_threads(  # type: ignore[no-untyped-def]
    start_server, make_repo
) -> None:
    backend = Compute()
    server = start_server(make_repo({"m": config(limit_us=20_000)}), backends={"compute": backend},
                          frontend_processes=0)
    scheduler = server.server.models.get("m").scheduler
    with httpclient.InferenceServerClient(server.url) as client:
        _reach_the_loop(backend, client)
        with pytest.raises(InferenceServerException, match="asked to fail"):
            client.infer("m", [_input()], parameters={"sleep_ms": 60, "fail": True})
        assert backend.threads[-1] == LOOP_THREAD
        assert scheduler.estimate_ns >= 20_000_000  # its time counted although it raised
        _call(client, "m")
        assert backend.threads[-1].startswith("pyserve-instance-")


def test_the_batcher_executes_one_clients_requests_on_the_loop_and_batches_others(  # type: ignore[no-untyped-def]
    start_server, make_repo
) -> None:
    backend = Compute()
    server = start_server(make_repo({"m": config("dynamic_batching { preserve_ordering: true }")}),
                          backends={"compute": backend}, frontend_processes=0)
    assert isinstance(server.server.models.get("m").scheduler, AdaptiveBatcher)
    with httpclient.InferenceServerClient(server.url) as client:
        _reach_the_loop(backend, client)
        _call(client, "m", sleep_ms=5)  # alone, on the loop: the estimate is now over 100 µs a batch
    before = len(backend.threads)

    async def many() -> list[np.ndarray]:  # many connections, requests together, slow executes
        clients = [aioclient.InferenceServerClient(server.url) for _ in range(8)]
        try:
            answers = await asyncio.gather(*(
                clients[i % 8].infer("m", [_aio_input(i)], parameters={"sleep_ms": 5}) for i in range(32)
            ))
        finally:
            await asyncio.gather(*(c.close() for c in clients))
        return [a.as_numpy("OUT") for a in answers]

    results = asyncio.run(many())
    assert [float(r[0, 0]) for r in results] == [2.0 * i for i in range(32)]
    assert all(name.startswith("pyserve-instance-") for name in backend.threads[before:])
    assert max(backend.sizes[before:]) > 1  # the batcher gathered what waited
    assert sum(backend.sizes[before:]) == 32


def _aio_input(value: int) -> Any:
    tensor = aioclient.InferInput("IN", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.full((1, 2), value, dtype=np.float32))
    return tensor


def test_many_streams_of_one_grpc_connection_keep_the_batcher_gathering(  # type: ignore[no-untyped-def]
    start_server, make_repo
) -> None:
    backend = Compute()
    server = start_server(make_repo({"m": config("dynamic_batching { }")}), backends={"compute": backend},
                          frontend_processes=0)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        _reach_the_loop(backend, grpc, grpcclient)
    finally:
        grpc.close()
    before = len(backend.threads)

    async def together() -> list[np.ndarray]:  # one channel: one connection, 24 streams at once
        client = grpcaio.InferenceServerClient(server.grpc_url)
        try:
            tensors = []
            for i in range(24):
                tensor = grpcaio.InferInput("IN", [1, 2], "FP32")
                tensor.set_data_from_numpy(np.full((1, 2), i, dtype=np.float32))
                tensors.append(tensor)
            answers = await asyncio.gather(*(
                client.infer("m", [tensor], parameters={"sleep_ms": 2}) for tensor in tensors
            ))
        finally:
            await client.close()
        return [a.as_numpy("OUT") for a in answers]

    results = asyncio.run(together())
    assert [float(r[0, 0]) for r in results] == [2.0 * i for i in range(24)]
    assert max(backend.sizes[before:]) > 1, backend.sizes[before:]  # requests that came together were batched
    assert sum(backend.sizes[before:]) == 24


def test_client_activity_answers_from_the_requests_it_was_told_of(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("_last_connection", "_mixed_at_ns", "_together_at_ns", "_untracked"):  # restored afterwards
        monkeypatch.setattr(client_activity, name, 0)
    now = [time.monotonic_ns()]
    monkeypatch.setattr(client_activity, "_now", lambda: now[0])
    first, second = client_activity.connection_key(), client_activity.connection_key()
    client_activity.request_from(first)
    client_activity.request_from(second)  # another connection: not alone for a window
    assert not client_activity.one_client() and client_activity.several_clients()
    now[0] += client_activity.WINDOW_NS + 1
    client_activity.request_from(second)
    assert client_activity.one_client() and client_activity.one_request_at_a_time()
    assert not client_activity.several_clients()
    client_activity.request_from(second, together=True)  # pipelined, or streams at once
    assert client_activity.one_client() and not client_activity.one_request_at_a_time()
    now[0] += client_activity.WINDOW_NS + 1
    assert client_activity.one_request_at_a_time()
    client_activity.request_mixed()  # a frontend process's link: any client
    assert not client_activity.one_client() and not client_activity.one_request_at_a_time()
    now[0] += client_activity.WINDOW_NS + 1
    client_activity.untracked_server(True)  # uvicorn: its requests are not told
    assert not client_activity.one_client() and not client_activity.several_clients()
    client_activity.untracked_server(False)
    assert client_activity.one_client()


def test_warmup_runs_on_the_instance_threads(start_server, make_repo) -> None:  # type: ignore[no-untyped-def]
    warmup = """
    model_warmup [ { name: "w" batch_size: 1 inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } } ]
    """
    backend = Compute()
    start_server(make_repo({"m": config(warmup)}), backends={"compute": backend})
    assert backend.threads and backend.threads[0].startswith("pyserve-instance-")


@pytest.mark.parametrize(
    ("compute_only", "extra", "expected"),
    [
        (True, "", AdaptiveScheduler),
        (True, auto("false"), DefaultScheduler),
        (False, "", DefaultScheduler),
        (False, auto("auto"), AdaptiveScheduler),
        (True, "dynamic_batching { }", AdaptiveBatcher),
        (True, auto("auto") + " dynamic_batching { preserve_ordering: true }", AdaptiveBatcher),
        (True, auto("false") + " dynamic_batching { }", DynamicBatcher),
        # a queue delay waits for company: the batcher keeps its instance threads
        (True, "dynamic_batching { max_queue_delay_microseconds: 100 }", DynamicBatcher),
        (True, auto("auto") + " dynamic_batching { max_queue_delay_microseconds: 100 }", DynamicBatcher),
        # instances that wait for rate-limiter resources never execute on the loop
        (True, "instance_group [ { count: 1 kind: KIND_CPU rate_limiter { resources [ { name: \"R\" count: 1 } ] } } ]",
         DefaultScheduler),
    ],
)
def test_which_models_get_the_adaptive_scheduler(  # type: ignore[no-untyped-def]
    start_server, make_repo, compute_only: bool, extra: str, expected: type
) -> None:
    server = start_server(make_repo({"m": config(extra)}), backends={"compute": Compute(compute_only)},
                          rate_limit="execution_count")
    assert type(server.server.models.get("m").scheduler) is expected


def test_the_limit_comes_from_the_config(start_server, make_repo) -> None:  # type: ignore[no-untyped-def]
    server = start_server(make_repo({"m": pair_config("compute"), "wide": config(limit_us=2500)}),
                          backends={"compute": Compute()})
    assert server.server.models.get("m").scheduler._limit_ns == AUTO_LIMIT_NS
    assert server.server.models.get("wide").scheduler._limit_ns == 2_500_000


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('parameters { key: "pyserve_inline_max_us" value { string_value: "0" } }',
         "parameter 'pyserve_inline_max_us' must be a positive number of microseconds, got '0'"),
        ('parameters { key: "pyserve_inline_max_us" value { string_value: "1ms" } }',
         "parameter 'pyserve_inline_max_us' must be a positive number of microseconds, got '1ms'"),
        (auto("auto") + " sequence_batching { }", "cannot be combined with the sequence batcher"),
        (auto("auto") + " model_transaction_policy { decoupled: true }", "cannot be used by a decoupled model"),
    ],
)
def test_bad_settings_are_refused(  # type: ignore[no-untyped-def]
    start_server, make_repo, extra: str, message: str
) -> None:
    """A bad limit, or "auto" where no execute may run on the loop."""
    server = start_server(make_repo({"m": pair_config("compute", extra)}), backends={"compute": Compute(False)})
    with httpclient.InferenceServerClient(server.url) as client:
        index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["m"]["state"] == "UNAVAILABLE" and message in index["m"]["reason"]


def test_a_compute_only_sequence_model_keeps_its_batcher(start_server, make_repo) -> None:  # type: ignore[no-untyped-def]
    server = start_server(make_repo({"m": config("sequence_batching { }")}), backends={"compute": Compute()})
    assert type(server.server.models.get("m").scheduler).__name__ == "SequenceBatcher"


class _Worker:
    """Stands in for an ``InstanceWorker``: ``execute_batch`` and ``last_execute_ns`` are all the
    scheduler uses of it."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.log: list[str] = []
        self.last_execute_ns = 0  # as InstanceWorker keeps it


    def execute_batch(self, batch: Sequence[Any]) -> None:
        where = "loop" if threading.current_thread().name == "adaptive-loop" else "thread"
        start = time.monotonic_ns()
        self.log.append(f"{where} start")
        if where == "loop":
            self.started.set()
            assert self.release.wait(60)
        self.log.append(f"{where} end")
        self.last_execute_ns = time.monotonic_ns() - start


def _scheduler(kind: str) -> AdaptiveScheduler | AdaptiveBatcher:
    if kind == "default":
        return AdaptiveScheduler()
    parsed = parse_config(config("dynamic_batching { }"), Path("config.pbtxt"))
    return AdaptiveBatcher(parsed, model_io(parsed, Path(".")))


def _request() -> InferRequest:
    return InferRequest("m", 1, {"IN": np.zeros((1, 2), np.float32)}, ("OUT",))


@pytest.mark.parametrize("kind", ["default", "dynamic_batching"])
def test_an_instance_thread_waits_while_the_loop_executes(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    monkeypatch.setattr(client_activity, "one_client", lambda: True)
    monkeypatch.setattr(client_activity, "one_request_at_a_time", lambda: True)
    scheduler = _scheduler(kind)
    worker = _Worker()
    scheduler.attach([worker])  # type: ignore[list-item]
    scheduler._record(1_000)  # a short execute was timed
    next_batch = scheduler.batch_source(0)

    def instance_thread() -> None:
        while (batch := next_batch()) is not None:
            worker.execute_batch(batch)

    thread = threading.Thread(target=instance_thread)
    thread.start()
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, name="adaptive-loop")
    loop_thread.start()
    try:
        loop.call_soon_threadsafe(scheduler.enqueue, _request())
        assert worker.started.wait(60)
        scheduler.enqueue(_request())  # from another thread: queued
        time.sleep(0.1)
        assert worker.log == ["loop start"]  # the instance thread waits for the loop's execute
        worker.release.set()
        deadline = time.monotonic() + 60
        while len(worker.log) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.log == ["loop start", "loop end", "thread start", "thread end"]
        # the loop's execute took 0.1 s: the next request, although enqueued on the loop, goes
        # to the instance thread
        assert scheduler.estimate_ns >= AUTO_LIMIT_NS
        loop.call_soon_threadsafe(scheduler.enqueue, _request())
        deadline = time.monotonic() + 60
        while len(worker.log) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.log[4:] == ["thread start", "thread end"]
    finally:
        worker.release.set()
        scheduler.stop(1)
        thread.join(60)
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(60)
        loop.close()
    assert not thread.is_alive()


def test_the_estimate_rises_at_once_and_falls_gradually() -> None:
    scheduler = AdaptiveScheduler()
    assert scheduler.estimate_ns > AUTO_LIMIT_NS  # unknown until timed
    scheduler._record(100_000)
    assert scheduler.estimate_ns == 100_000
    scheduler._record(900_000)
    assert scheduler.estimate_ns == 900_000
    scheduler._record(100_000)
    assert scheduler.estimate_ns == 800_000  # an eighth of the way down


# -- Python models: compute-only unless they call the server (pyserve_backend_python.compute) ------

PY_BLS_HELPER = '''
import triton_python_backend_utils as pb_utils


def ask(name, tensor):
    return pb_utils.InferenceRequest(model_name=name, requested_output_names=["OUTPUT0"], inputs=[tensor]).exec()
'''

PY_ASYNC = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
                for r in requests]
'''


def _python_repo(tmp_path: Path) -> Path:
    from suite_support import ECHO_MODEL_PY, python_echo_config, write_model

    repo = tmp_path / "repo"
    write_model(repo, "py", python_echo_config("py"), {"1/model.py": ECHO_MODEL_PY})
    # BLS named only in a helper file beside model.py: still never on the loop
    write_model(repo, "py_bls", python_echo_config("py_bls"), {"1/model.py": ECHO_MODEL_PY, "1/helper.py": PY_BLS_HELPER})
    write_model(repo, "py_async", python_echo_config("py_async"), {"1/model.py": PY_ASYNC})
    write_model(repo, "py_threads", python_echo_config("py_threads", auto("false")), {"1/model.py": ECHO_MODEL_PY})
    return repo


def _python_input() -> Any:
    tensor = httpclient.InferInput("INPUT0", [1, 2], "FP32")
    tensor.set_data_from_numpy(VALUES)
    return tensor


def test_a_python_model_that_only_computes_executes_on_the_loop(start_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pyserve.testing import BatchRecorder

    recorder = BatchRecorder()
    server = start_server(_python_repo(tmp_path), server_plugins=[recorder], frontend_processes=0)
    calls = recorder.until_on_the_loop("py", lambda: httpclient.InferenceServerClient(server.url),
                                       lambda one: one.infer("py", [_python_input()]), timeout=60)
    assert calls >= 1
    client = httpclient.InferenceServerClient(server.url)
    try:
        for name in ("py_bls", "py_async", "py_threads"):
            for _ in range(20):
                np.testing.assert_array_equal(client.infer(name, [_python_input()]).as_numpy("OUTPUT0"), VALUES)
            assert LOOP_THREAD not in recorder.threads[name], f"{name} executed on the loop"
        versions = {name: server.server.models.get(name) for name in ("py", "py_bls", "py_async", "py_threads")}
        assert [v.context.compute_only for v in versions.values()] == [True, False, False, True]
    finally:
        client.close()
