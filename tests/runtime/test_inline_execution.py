"""Config parameter ``pyserve_inline_execute``: a cheap model's execute runs on the event loop.

Checked with a real server and tritonclient: the execute runs on the server's loop thread (not
an instance thread) and answers HTTP, gRPC and concurrent clients; statistics count it; warm-up
runs; an exception becomes an error response; a blocking BLS call is refused with a message that
names the parameter; combinations that need queues or threads are refused at load. With
``dynamic_batching`` the batches form on the loop from what arrives together, a queue delay waits
on a timer while the server goes on answering, a full batch goes at once, and unloading executes
what is still queued.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from suite_support import pair_config, wait_for
from tritonclient.utils import InferenceServerException

from pyserve import InferRequest, InferResponse, InstanceContext
from pyserve.api.backend import Backend

INLINE = 'parameters { key: "pyserve_inline_execute" value { string_value: "true" } }'


def config(extra: str = INLINE) -> str:
    return pair_config("recorder", extra)


class Recorder(Backend):
    def __init__(self) -> None:
        self.threads: list[str] = []
        self.sizes: list[int] = []

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        self.threads.append(threading.current_thread().name)
        self.sizes.append(len(requests))
        out = []
        for request in requests:
            if request.parameters.get("fail"):
                raise RuntimeError("asked to fail")
            if request.parameters.get("bls"):
                call = InferRequest("plain", -1, {"IN": request.inputs["IN"]}, ("OUT",))
                answer = instance.model.server.infer(call)
                raise answer if not isinstance(answer, InferResponse) else RuntimeError("BLS was not refused")
            out.append(InferResponse({"OUT": request.inputs["IN"] * 2}))
        return out


def _input(values: np.ndarray, module: object = httpclient) -> object:
    tensor = module.InferInput("IN", list(values.shape), "FP32")  # type: ignore[attr-defined]
    tensor.set_data_from_numpy(values)
    return tensor


def test_inline_model_runs_on_the_event_loop(start_server, make_repo) -> None:  # type: ignore[no-untyped-def]
    backend = Recorder()
    server = start_server(make_repo({"inline": config(), "plain": config("")}), backends={"recorder": backend})
    values = np.array([[1, 2]], dtype=np.float32)
    with httpclient.InferenceServerClient(server.url) as client:
        assert np.array_equal(client.infer("inline", [_input(values)]).as_numpy("OUT"), values * 2)
        assert backend.threads[-1] == "pyserve-server"  # ServerThread's loop thread
        client.infer("plain", [_input(values)])
        assert backend.threads[-1].startswith("pyserve-instance-")
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        assert np.array_equal(grpc.infer("inline", [_input(values, grpcclient)]).as_numpy("OUT"), values * 2)
    finally:
        grpc.close()

    async def many() -> list[np.ndarray]:
        async with aioclient.InferenceServerClient(server.url) as aio:
            answers = await asyncio.gather(*(
                aio.infer("inline", [_input(np.full((1, 2), i, dtype=np.float32))]) for i in range(20)
            ))
        return [a.as_numpy("OUT") for a in answers]

    results = asyncio.run(many())
    assert [float(r[0, 0]) for r in results] == [2.0 * i for i in range(20)]
    with httpclient.InferenceServerClient(server.url) as client:
        stats = client.get_inference_statistics("inline")["model_stats"][0]
    assert stats["inference_count"] == 22 and stats["execution_count"] == 22


def test_errors_and_blocking_bls_are_answered(start_server, make_repo) -> None:  # type: ignore[no-untyped-def]
    server = start_server(make_repo({"inline": config(), "plain": config("")}), backends={"recorder": Recorder()})
    values = np.array([[1, 2]], dtype=np.float32)
    with httpclient.InferenceServerClient(server.url) as client:
        with pytest.raises(InferenceServerException, match="asked to fail"):
            client.infer("inline", [_input(values)], parameters={"fail": True})
        with pytest.raises(InferenceServerException, match="pyserve_inline_execute"):
            client.infer("inline", [_input(values)], parameters={"bls": True})
        assert np.array_equal(client.infer("inline", [_input(values)]).as_numpy("OUT"), values * 2)


def test_warmup_of_an_inline_model(start_server, make_repo) -> None:  # type: ignore[no-untyped-def]
    warmup = INLINE + """
    model_warmup [ { name: "w" batch_size: 1 inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } } ]
    """
    backend = Recorder()
    server = start_server(make_repo({"inline": config(warmup)}), backends={"recorder": backend})
    assert backend.threads, "warm-up did not execute"
    with httpclient.InferenceServerClient(server.url) as client:
        assert client.is_model_ready("inline")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (INLINE + " sequence_batching { }", "cannot be combined with the sequence batcher"),
        (INLINE + " model_transaction_policy { decoupled: true }", "cannot be used by a decoupled model"),
        ('parameters { key: "pyserve_inline_execute" value { string_value: "yes" } }', "must be \"true\", \"auto\" or \"false\""),
    ],
)
def test_refused_combinations(start_server, make_repo, extra: str, message: str) -> None:  # type: ignore[no-untyped-def]
    server = start_server(make_repo({"m": config(extra)}), backends={"recorder": Recorder()})
    with httpclient.InferenceServerClient(server.url) as client:
        index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["m"]["state"] == "UNAVAILABLE" and message in index["m"]["reason"]
    assert "pyserve_inline_execute" in index["m"]["reason"]


def _concurrent(url: str, model: str, count: int) -> tuple[list[np.ndarray], float]:
    """``count`` requests sent together (tritonclient aio); their outputs and the time taken."""

    async def run() -> list[np.ndarray]:
        async with aioclient.InferenceServerClient(url) as aio:
            answers = await asyncio.gather(*(
                aio.infer(model, [_input(np.full((1, 2), i, dtype=np.float32))]) for i in range(count)
            ))
        return [a.as_numpy("OUT") for a in answers]

    start = time.perf_counter()
    outputs = asyncio.run(run())
    return outputs, time.perf_counter() - start


class GatedRecorder(Recorder):
    """A ``Recorder`` whose first execute holds the event loop until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self.release = threading.Event()

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        if not self.started.is_set():
            self.started.set()
            self.release.wait(60)
        return super().execute(instance, requests)


def _read_response(sock: socket.socket) -> dict[str, object]:
    """One HTTP/1.1 response with a Content-Length body, as JSON."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return json.loads(body[:length])


def test_dynamic_batching_on_the_event_loop(start_server, make_repo) -> None:  # type: ignore[no-untyped-def]
    """Requests that are there together are batched on the loop: the first execute holds the
    loop while 23 more requests arrive on connections already open, so they are read in one
    turn once it returns (whatever the speed of the machine)."""
    backend = GatedRecorder()
    server = start_server(make_repo({"batched": config(INLINE + " dynamic_batching { }")}),
                          backends={"recorder": backend})
    host, port = server.url.rsplit(":", 1)

    def request(value: int, path: str = "/v2/models/batched/infer") -> bytes:
        body = json.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [value, value]}]})
        return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n{body}").encode()

    sockets = [socket.create_connection((host, int(port)), timeout=60) for _ in range(24)]
    try:
        for sock in sockets:  # every connection accepted and served once before the loop is held
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        for sock in sockets:
            data = b""
            while b"\r\n\r\n" not in data:
                data += sock.recv(65536)
        sockets[0].sendall(request(0))
        assert backend.started.wait(60), "the first execute did not start"
        for value, sock in enumerate(sockets[1:], start=1):
            sock.sendall(request(value))
        backend.release.set()
        outputs = [_read_response(sock)["outputs"] for sock in sockets]
    finally:
        backend.release.set()
        for sock in sockets:
            sock.close()
    assert [output[0]["data"][0] for output in outputs] == [2.0 * i for i in range(24)]  # type: ignore[index]
    assert set(backend.threads) == {"pyserve-server"}  # every batch ran on the loop thread
    assert sum(backend.sizes) == 24 and max(backend.sizes) > 1 and max(backend.sizes) <= 4
    with httpclient.InferenceServerClient(server.url) as client:
        stats = client.get_inference_statistics("batched")["model_stats"][0]
    assert stats["inference_count"] == 24 and stats["execution_count"] == len(backend.sizes)


def test_inline_queue_delay_waits_on_a_timer(start_server, make_repo) -> None:  # type: ignore[no-untyped-def]
    backend = Recorder()
    delayed = config(INLINE + " dynamic_batching { max_queue_delay_microseconds: 400000 }")
    # a delay far beyond the test's waits: a batch of "held" goes only when it is full
    held = config(INLINE + " dynamic_batching { max_queue_delay_microseconds: 600000000 }")
    server = start_server(make_repo({"delayed": delayed, "held": held}), backends={"recorder": backend})
    (_, waited) = _concurrent(server.url, "delayed", 1)
    assert backend.sizes == [1] and waited >= 0.4  # alone: sent when the delay's timer fired
    backend.sizes.clear()

    answers: list[np.ndarray] = []
    waiting = threading.Thread(target=lambda: answers.extend(_concurrent(server.url, "held", 2)[0]))
    waiting.start()
    dataplane = server.server.dataplane
    wait_for(lambda: dataplane.in_flight == 2, timeout=60, what="two requests waiting in the batcher")
    with httpclient.InferenceServerClient(server.url) as client:
        assert client.is_server_live()  # the loop answers while the batch waits for its delay
    assert not answers and backend.sizes == []
    outputs, _ = _concurrent(server.url, "held", 2)  # max_batch_size reached: sent at once
    waiting.join(60)
    assert backend.sizes == [4] and len(answers) == 2 and len(outputs) == 2


def test_unloading_executes_what_the_inline_batcher_holds(start_server, make_repo) -> None:  # type: ignore[no-untyped-def]
    backend = Recorder()
    held = config(INLINE + " dynamic_batching { max_queue_delay_microseconds: 20000000 }")
    server = start_server(make_repo({"held": held}), backends={"recorder": backend},
                          model_control_mode="explicit", load_models=["held"])
    answers: list[np.ndarray] = []
    waiting = threading.Thread(target=lambda: answers.extend(_concurrent(server.url, "held", 1)[0]))
    waiting.start()
    time.sleep(0.3)
    assert backend.sizes == []  # queued, waiting for its 20 s delay
    with httpclient.InferenceServerClient(server.url) as client:
        client.unload_model("held")
    waiting.join(60)
    assert backend.sizes == [1] and len(answers) == 1 and float(answers[0][0, 0]) == 0.0


def test_inline_batcher_keeps_the_queue_policy(start_server, make_repo) -> None:  # type: ignore[no-untyped-def]
    backend = Recorder()
    bounded = config(INLINE + """ dynamic_batching {
        max_queue_delay_microseconds: 500000
        default_queue_policy { max_queue_size: 1 }
    }""")
    server = start_server(make_repo({"bounded": bounded}), backends={"recorder": backend})
    answers: list[np.ndarray] = []
    waiting = threading.Thread(target=lambda: answers.extend(_concurrent(server.url, "bounded", 1)[0]))
    waiting.start()
    time.sleep(0.2)
    values = np.array([[1, 2]], dtype=np.float32)
    with httpclient.InferenceServerClient(server.url) as client:
        with pytest.raises(InferenceServerException, match="Exceeds maximum queue size"):
            client.infer("bounded", [_input(values)])
    waiting.join(60)
    assert len(answers) == 1 and backend.sizes == [1]
