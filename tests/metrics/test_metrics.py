"""The Prometheus endpoint (``--allow-metrics``, ``--metrics-port``): Triton's metric names,
types and labels, counters checked against the requests sent, failure reasons, the pending
gauge, the dynamic batcher's exec/inference counts, per-server registries, custom metrics."""

from __future__ import annotations

import json
import socket
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families
from suite_support import StartServer, wait_for, write_model

from pyserve import (
    Backend,
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelContext,
)
from pyserve.cli.main import build_parser
from pyserve.metrics import CustomMetrics, MetricsSettings
from pyserve.server.core import (
    Server,
    ServerOptions,
    ServerThread,
    StartupError,
)

IDENT = """
    backend: "gate"
    max_batch_size: 8
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
    output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


class GateBackend(Backend):
    """Echoes INPUT0; a negative first element fails the request; ``closed()`` holds executes."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.executing = threading.Event()
        self.batches: list[int] = []

    def create_model(self, model: ModelContext) -> Any:
        requests = model.metrics.counter("gate_requests", "Requests the gate backend saw", ["model"])
        return requests

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[Any]:
        self.executing.set()
        self.batches.append(len(requests))
        assert self.open.wait(30)
        instance.model.state.labels(model=instance.model.name).inc(len(requests))
        results: list[Any] = []
        for request in requests:
            data = request.inputs["INPUT0"]
            if data.reshape(-1)[0] < 0:
                results.append(RuntimeError("negative input"))
            else:
                results.append(InferResponse({"OUTPUT0": data}))
        return results


def _body(value: float = 1.0, batch: int = 1) -> bytes:
    data = [[value, value]] * batch
    return json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [batch, 2], "data": data}]}).encode()


def infer(server: ServerThread, model: str, value: float = 1.0, batch: int = 1) -> int:
    """POST /infer; the HTTP status."""
    request = urllib.request.Request(f"http://{server.url}/v2/models/{model}/infer", _body(value, batch))
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)


def scrape_text(server: ServerThread) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        return response.read().decode()


class Scrape:
    """One parsed ``/metrics`` page."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(self, name: str, **labels: str) -> float:
        """The sample ``name`` (a family name, or a histogram's ``_bucket``/``_sum``/``_count``)."""
        for family in self.families.values():
            for sample in family.samples:
                if sample.name in (name, name + "_total") and sample.labels == labels:
                    return float(sample.value)
        raise KeyError(f"{name}{labels} not found")


def scrape(server: ServerThread) -> Scrape:
    return Scrape(scrape_text(server))


@pytest.fixture
def start_server(start_server: StartServer) -> StartServer:
    """The conftest fixture, with metrics on (``ServerOptions.allow_metrics`` defaults to off)."""

    def start(*repos: Path, **options: Any) -> ServerThread:
        options.setdefault("allow_metrics", True)
        return start_server(*repos, **options)

    return start


@pytest.fixture
def gate() -> GateBackend:
    return GateBackend()


@pytest.fixture
def gate_server(make_repo: Callable[..., Path], start_server: StartServer, gate: GateBackend) -> ServerThread:
    repo = make_repo({
        "ident": IDENT,
        "batched": IDENT + "dynamic_batching { max_queue_delay_microseconds: 100 }\n",
        "limited": IDENT + "dynamic_batching { default_queue_policy { max_queue_size: 1 } }\n",
    })
    return start_server(repo, backends={"gate": gate}, use_entry_points=False)


LABELS = {"model": "ident", "version": "1"}


def test_triton_names_types_and_labels(gate_server: ServerThread) -> None:
    assert infer(gate_server, "ident") == 200
    page = scrape(gate_server)
    expected = {
        "nv_inference_request_success": "counter",
        "nv_inference_request_failure": "counter",
        "nv_inference_count": "counter",
        "nv_inference_exec_count": "counter",
        "nv_inference_request_duration_us": "counter",
        "nv_inference_queue_duration_us": "counter",
        "nv_inference_compute_input_duration_us": "counter",
        "nv_inference_compute_infer_duration_us": "counter",
        "nv_inference_compute_output_duration_us": "counter",
        "nv_inference_pending_request_count": "gauge",
        "nv_cpu_utilization": "gauge",
        "nv_cpu_memory_total_bytes": "gauge",
        "nv_cpu_memory_used_bytes": "gauge",
    }
    for name, kind in expected.items():
        assert page.families[name].type == kind, name
    # Triton's text form: counter samples under the family name, no _total / _created
    assert 'nv_inference_request_success{model="ident",version="1"} 1\n' in page.text
    assert "_total{" not in page.text and "_total " not in page.text and "_created" not in page.text
    for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
        assert page.value("nv_inference_request_failure", **LABELS, reason=reason) == 0
    assert 'nv_inference_request_failure{model="ident",reason="BACKEND",version="1"} 0\n' in page.text  # Triton's order
    assert "nv_inference_first_response_histogram_ms" not in page.families  # off by default
    assert "nv_cache_num_hits_per_model" not in page.families  # no cache configured
    assert "nv_cache_num_lookups" not in page.families
    assert page.value("nv_cpu_memory_total_bytes") > page.value("nv_cpu_memory_used_bytes") > 0
    assert 0.0 <= page.value("nv_cpu_utilization") <= 1.0


def test_counters_follow_the_requests(gate_server: ServerThread) -> None:
    for _ in range(3):
        assert infer(gate_server, "ident") == 200
    assert infer(gate_server, "ident", batch=4) == 200
    assert infer(gate_server, "ident", value=-1.0) == 500  # execute result is an exception → BACKEND
    page = scrape(gate_server)
    assert page.value("nv_inference_request_success", **LABELS) == 4
    assert page.value("nv_inference_request_failure", **LABELS, reason="BACKEND") == 1
    assert page.value("nv_inference_request_failure", **LABELS, reason="OTHER") == 0
    assert page.value("nv_inference_exec_count", **LABELS) == 5
    assert page.value("nv_inference_count", **LABELS) == 3 + 4 + 1
    assert page.value("nv_inference_request_duration_us", **LABELS) > 0
    assert page.value("nv_inference_compute_infer_duration_us", **LABELS) >= 0
    assert page.value("nv_inference_pending_request_count", **LABELS) == 0
    # a model that saw no request is listed with zeros
    assert page.value("nv_inference_request_success", model="batched", version="1") == 0


def test_queue_full_counts_rejected(gate_server: ServerThread, gate: GateBackend) -> None:
    gate.open.clear()
    gate.executing.clear()
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(infer, gate_server, "limited")
        assert gate.executing.wait(10)
        queued = pool.submit(infer, gate_server, "limited")
        wait_for(lambda: scrape(gate_server).value(
            "nv_inference_pending_request_count", model="limited", version="1") == 1)
        assert infer(gate_server, "limited") == 503  # max_queue_size 1 reached
        gate.open.set()
        assert running.result() == 200 and queued.result() == 200
    page = scrape(gate_server)
    labels = {"model": "limited", "version": "1"}
    assert page.value("nv_inference_request_failure", **labels, reason="REJECTED") == 1
    assert page.value("nv_inference_request_success", **labels) == 2
    assert page.value("nv_inference_pending_request_count", **labels) == 0


def test_cancelled_request_counts_canceled(gate_server: ServerThread, gate: GateBackend) -> None:
    gate.open.clear()
    gate.executing.clear()
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(infer, gate_server, "batched")
        assert gate.executing.wait(10)
        body = _body()
        client = socket.create_connection(("127.0.0.1", gate_server.server.http_port))
        client.sendall(
            b"POST /v2/models/batched/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_for(lambda: scrape(gate_server).value(
            "nv_inference_pending_request_count", model="batched", version="1") == 1)
        client.close()  # the client goes away while its request is queued
        time.sleep(0.2)
        gate.open.set()
        assert running.result() == 200
    labels = {"model": "batched", "version": "1"}
    wait_for(lambda: scrape(gate_server).value("nv_inference_request_failure", **labels, reason="CANCELED") == 1)
    page = scrape(gate_server)
    assert page.value("nv_inference_request_success", **labels) == 1
    assert page.value("nv_inference_exec_count", **labels) == 1  # the cancelled one never executed
    assert page.value("nv_inference_pending_request_count", **labels) == 0


def test_pending_gauge_and_dynamic_batching(gate_server: ServerThread, gate: GateBackend) -> None:
    gate.open.clear()
    gate.executing.clear()
    labels = {"model": "batched", "version": "1"}
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(infer, gate_server, "batched")
        assert gate.executing.wait(10)
        rest: list[Future[int]] = [pool.submit(infer, gate_server, "batched") for _ in range(5)]
        wait_for(lambda: scrape(gate_server).value("nv_inference_pending_request_count", **labels) == 5)
        gate.open.set()
        assert first.result() == 200 and all(f.result() == 200 for f in rest)
    page = scrape(gate_server)
    assert page.value("nv_inference_pending_request_count", **labels) == 0
    assert page.value("nv_inference_request_success", **labels) == 6
    assert page.value("nv_inference_count", **labels) == 6
    # the five queued requests went out as one batch: 2 executions for 6 inferences
    assert gate.batches[-1] == 5
    assert page.value("nv_inference_exec_count", **labels) == 2
    assert page.value("nv_inference_queue_duration_us", **labels) > 0


def test_custom_metrics_from_a_backend(gate_server: ServerThread) -> None:
    for _ in range(2):
        assert infer(gate_server, "ident") == 200
    page = scrape(gate_server)
    assert page.families["gate_requests"].type == "counter"
    assert page.value("gate_requests", model="ident") == 2
    assert 'gate_requests{model="ident"} 2\n' in page.text


def test_included_registry_appears(make_repo: Callable[..., Path], start_server: StartServer) -> None:
    external = CollectorRegistry()
    Counter("plugin_events", "Events of a plugin with its own registry", registry=external).inc(7)

    class Including(GateBackend):
        def initialize(self, backend: Any) -> None:
            backend.metrics.include(external)
            backend.metrics.include(external)  # twice: shown once

    server = start_server(make_repo({"ident": IDENT}), backends={"gate": Including()}, use_entry_points=False)
    page = scrape(server)
    assert page.value("plugin_events") == 7
    assert page.text.count("# TYPE plugin_events counter") == 1


def test_custom_metrics_api_rules() -> None:
    metrics = CustomMetrics()
    gauge = metrics.gauge("queue_depth", "d", ["pool"])
    assert metrics.gauge("queue_depth", "again", ["pool"]) is gauge
    with pytest.raises(ValueError, match="already exists"):
        metrics.counter("queue_depth", "d", ["pool"])
    with pytest.raises(ValueError, match="already exists"):
        metrics.gauge("queue_depth", "d", ["other"])
    with pytest.raises(ValueError, match="reserved"):
        metrics.counter("nv_inference_count", "mine")
    histogram = metrics.histogram("latency_ms", "d", buckets=[1, 10])
    histogram.observe(5)
    from pyserve.metrics import render

    text = render(metrics.registry).decode()
    assert 'latency_ms_bucket{le="10.0"} 1' in text and "latency_ms_count 1" in text


def test_two_servers_do_not_share_registries(
    make_repo: Callable[..., Path], start_server: StartServer, gate: GateBackend
) -> None:
    repo = make_repo({"ident": IDENT})
    one = start_server(repo, backends={"gate": gate}, use_entry_points=False)
    two = start_server(repo, backends={"gate": GateBackend()}, use_entry_points=False)
    assert one.server.metrics_port != two.server.metrics_port
    assert one.server.metrics.registry is not two.server.metrics.registry
    for _ in range(3):
        assert infer(one, "ident") == 200
    assert infer(two, "ident") == 200
    assert scrape(one).value("nv_inference_request_success", **LABELS) == 3
    assert scrape(two).value("nv_inference_request_success", **LABELS) == 1
    assert scrape(one).value("gate_requests", model="ident") == 3
    assert scrape(two).value("gate_requests", model="ident") == 1


def test_allow_metrics_false_opens_no_port(make_repo: Callable[..., Path], start_server: StartServer) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    server = start_server(make_repo({"ident": IDENT}), backends={"gate": GateBackend()}, use_entry_points=False,
                          allow_metrics=False, metrics_port=port)
    assert server.server.metrics_port is None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert infer(server, "ident") == 200  # statistics are still kept
    with urllib.request.urlopen(f"http://{server.url}/v2/models/ident/stats") as response:
        assert json.loads(response.read())["model_stats"][0]["inference_count"] == 1


def test_metrics_port_in_use_fails_startup(make_repo: Callable[..., Path]) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        options = ServerOptions(
            model_repositories=[make_repo({})], host="127.0.0.1", http_port=0, grpc_port=0,
            metrics_port=taken.getsockname()[1], allow_metrics=True,
        )
        with pytest.raises(StartupError, match="Metrics service cannot listen"):
            ServerThread(Server(options)).start()
    finally:
        taken.close()


def test_other_paths_and_methods(gate_server: ServerThread) -> None:
    base = f"http://127.0.0.1:{gate_server.server.metrics_port}"
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(base + "/v2/health/live")
    missing.value.close()
    assert missing.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as wrong:
        urllib.request.urlopen(urllib.request.Request(base + "/metrics", b"", method="POST"))
    wrong.value.close()
    assert wrong.value.code == 405


def test_metrics_config_switches(make_repo: Callable[..., Path], start_server: StartServer) -> None:
    server = start_server(
        make_repo({"ident": IDENT}), backends={"gate": GateBackend()}, use_entry_points=False,
        metrics_config={"counter_latencies": "false", "histogram_latencies": "true"},
        allow_cpu_metrics=False,
    )
    for _ in range(2):
        assert infer(server, "ident") == 200
    page = scrape(server)
    assert "nv_inference_request_duration_us" not in page.families
    assert "nv_inference_compute_infer_duration_us" not in page.families
    assert "nv_cpu_utilization" not in page.families
    histogram = page.families["nv_inference_first_response_histogram_ms"]
    assert histogram.type == "histogram"
    assert page.value("nv_inference_first_response_histogram_ms_count", **LABELS) == 2
    assert page.value("nv_inference_first_response_histogram_ms_bucket", **LABELS, le="100") == 2
    assert 'le="100"' in page.text and 'le="5000"' in page.text  # Triton's bucket bounds
    with pytest.raises(ValueError, match="unknown --metrics-config key"):
        MetricsSettings.from_config({"bogus": "1"})


def test_summary_latencies(make_repo: Callable[..., Path], start_server: StartServer) -> None:
    """``summary_latencies=true``: Triton's five ``*_summary_us`` summaries with count, sum and
    the quantiles of ``summary_quantiles``; NaN quantiles while nothing was observed."""
    server = start_server(
        make_repo({"ident": IDENT}), backends={"gate": GateBackend()}, use_entry_points=False,
        metrics_config={"summary_latencies": "true", "summary_quantiles": "0.5:0.05,0.99:0.001"},
        allow_cpu_metrics=False,
    )
    names = [f"nv_inference_{f}_summary_us" for f in ("request", "queue", "compute_input", "compute_infer",
                                                       "compute_output")]
    page = scrape(server)
    for name in names:
        assert page.families[name].type == "summary"
        assert page.value(name + "_count", **LABELS) == 0
        assert f'{name}{{model="ident",version="1",quantile="0.5"}} NaN' in page.text
    for _ in range(3):
        assert infer(server, "ident") == 200
    assert infer(server, "ident", value=-1.0) == 500  # a failure is not summarised
    page = scrape(server)
    for name in names:
        assert page.value(name + "_count", **LABELS) == 3, name
        total = page.value(name + "_sum", **LABELS)
        median = page.value(name, **LABELS, quantile="0.5")
        top = page.value(name, **LABELS, quantile="0.99")
        assert 0 <= median <= top <= total, name
    assert page.value("nv_inference_request_summary_us_sum", **LABELS) > 0
    assert 'quantile="0.9"' not in page.text  # only the quantiles asked for
    assert "Summary of inference request duration in microseconds (includes cached requests)" in page.text
    with pytest.raises(ValueError, match="summary_quantiles"):
        MetricsSettings.from_config({"summary_quantiles": "1.5:0.1"})



def test_summary_latencies_count_every_request_under_frontend_processes(tmp_path: Path,
                                                                        start_server: StartServer) -> None:
    """A replica's samples are not pulled into the owner's summaries, so with summaries on
    ``auto`` replicates nothing: the frontend's connections are answered by the owner, and the
    summaries count every request, as ``nv_inference_request_success`` does."""
    import tritonclient.http as httpclient
    from suite_support import ECHO_MODEL_PY, python_echo_config

    write_model(tmp_path / "repo", "pyecho", python_echo_config("pyecho"), {"1/model.py": ECHO_MODEL_PY})
    server = start_server(tmp_path / "repo", frontend_processes=1, replicate_models="auto",
                          frontend_balance="connections", metrics_config={"summary_latencies": "true"},
                          allow_cpu_metrics=False)
    balancer, handoff = server.server.balancer, server.server._handoff
    assert balancer is not None and handoff is not None
    wait_for(lambda: len(balancer.peers) == 1, what="the frontend is connected")
    passed = balancer.passed
    clients = [httpclient.InferenceServerClient(server.url) for _ in range(4)]
    values = np.arange(3, dtype=np.float32).reshape(1, 3)
    try:
        for _ in range(2):
            for client in clients:
                tensor = httpclient.InferInput("INPUT0", [1, 3], "FP32")
                tensor.set_data_from_numpy(values)
                client.infer("pyecho", [tensor])
    finally:
        for client in clients:
            client.close()
    assert balancer.passed > passed and not any(handoff.replicas.values())
    page = scrape(server)
    labels = {"model": "pyecho", "version": "1"}
    assert page.value("nv_inference_request_success", **labels) == 8
    assert page.value("nv_inference_request_summary_us_count", **labels) == 8


def decoupled_config(backend: str) -> str:
    """A decoupled model of ``backend``: FP32 ``INPUT0`` [2] → ``OUTPUT0``, no batching."""
    return f"""
        backend: "{backend}"
        max_batch_size: 0
        model_transaction_policy {{ decoupled: true }}
        input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
        output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
    """


def test_decoupled_first_response_histogram(make_repo: Callable[..., Path], start_server: StartServer) -> None:
    import tritonclient.grpc as grpcclient

    class Twice(Backend):
        def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> None:
            for request in requests:
                sender = request.response_sender()
                sender.send(InferResponse({"OUTPUT0": request.inputs["INPUT0"]}))
                time.sleep(0.05)
                sender.send(InferResponse({"OUTPUT0": request.inputs["INPUT0"]}), final=True)

    repo = make_repo({"stream": decoupled_config("twice")})
    server = start_server(repo, backends={"twice": Twice()}, use_entry_points=False,
                          metrics_config={"histogram_latencies": "true"})
    received: list[Any] = []
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:
        received.append(error or result)
        if len(received) == 2:
            done.set()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback)
    tensor = grpcclient.InferInput("INPUT0", [2], "FP32")
    tensor.set_data_from_numpy(np.ones(2, np.float32))
    client.async_stream_infer("stream", [tensor])
    assert done.wait(10)
    client.stop_stream()
    client.close()
    labels = {"model": "stream", "version": "1"}
    wait_for(lambda: scrape(server).value("nv_inference_request_success", **labels) == 1)
    page = scrape(server)
    assert page.value("nv_inference_first_response_histogram_ms_count", **labels) == 1
    first_ms = page.value("nv_inference_first_response_histogram_ms_sum", **labels)
    total_us = page.value("nv_inference_request_duration_us", **labels)
    assert first_ms * 1000 < total_us  # the first response came before the final one


@pytest.mark.parametrize("empty_final", [False, True])
def test_summaries_count_a_stream_request_that_ends_with_a_final_flag_alone(
    make_repo: Callable[..., Path], start_server: StartServer, empty_final: bool
) -> None:
    """A decoupled model that sends its responses, then the final flag with no response (the
    usual way), over a gRPC stream: the request summary counts the request, as Triton's does,
    whether or not the client asked for the empty final response."""
    import tritonclient.grpc as grpcclient

    class ThenFinal(Backend):
        def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> None:
            for request in requests:
                sender = request.response_sender()
                sender.send(InferResponse({"OUTPUT0": request.inputs["INPUT0"]}))
                sender.send(None, final=True)

    repo = make_repo({"stream": decoupled_config("then_final")})
    server = start_server(repo, backends={"then_final": ThenFinal()}, use_entry_points=False,
                          metrics_config={"summary_latencies": "true"}, allow_cpu_metrics=False)
    received: list[Any] = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(lambda result, error: received.append(error or result))
    tensor = grpcclient.InferInput("INPUT0", [2], "FP32")
    tensor.set_data_from_numpy(np.ones(2, np.float32))
    for _ in range(2):
        client.async_stream_infer("stream", [tensor], enable_empty_final_response=empty_final)
    labels = {"model": "stream", "version": "1"}
    wait_for(lambda: scrape(server).value("nv_inference_request_success", **labels) == 2)
    wait_for(lambda: scrape(server).value("nv_inference_request_summary_us_count", **labels) == 2,
             what="the request summary counted both requests")
    client.stop_stream()
    client.close()
    assert len(received) == (4 if empty_final else 2) and not any(isinstance(r, Exception) for r in received)
    assert scrape(server).value("nv_inference_request_summary_us_sum", **labels) > 0


def test_response_cache_metrics(make_repo: Callable[..., Path], start_server: StartServer) -> None:
    repo = make_repo({"cached": IDENT + "response_cache { enable: true }\n"})
    server = start_server(repo, backends={"gate": GateBackend()}, use_entry_points=False,
                          cache_config=("local", {"size": "1048576"}))
    for _ in range(3):
        assert infer(server, "cached") == 200
    labels = {"model": "cached", "version": "1"}
    page = scrape(server)
    assert page.value("nv_cache_num_hits_per_model", **labels) == 2
    assert page.value("nv_cache_num_misses_per_model", **labels) == 1
    assert page.value("nv_inference_request_success", **labels) == 3  # includes cache hits
    assert page.value("nv_inference_count", **labels) == 1  # excludes them
    assert page.value("nv_inference_exec_count", **labels) == 1
    # the server-wide gauges, as Triton 2.51 shows them (checked side by side)
    assert {name: page.value(name) for name in ("nv_cache_num_lookups", "nv_cache_num_hits", "nv_cache_num_misses",
                                                "nv_cache_num_entries", "nv_cache_num_evictions")} == {
        "nv_cache_num_lookups": 3, "nv_cache_num_hits": 2, "nv_cache_num_misses": 1,
        "nv_cache_num_entries": 1, "nv_cache_num_evictions": 0}
    assert 0 < page.value("nv_cache_util") < 1
    assert page.value("nv_cache_lookup_duration") >= 0 and page.value("nv_cache_insertion_duration") >= 0
    with urllib.request.urlopen(f"http://{server.url}/v2/models/cached/stats") as response:
        stats = json.loads(response.read())["model_stats"][0]["inference_stats"]
    assert stats["cache_hit"]["count"] == 2 and stats["cache_miss"]["count"] == 1
    assert stats["success"]["count"] == 3 and stats["queue"]["count"] == 3
    assert stats["compute_infer"]["count"] == 1


def test_python_backend_metric_families_appear(make_repo: Callable[..., Path], start_server: StartServer) -> None:
    pytest.importorskip("pyserve_backend_python")
    repo = make_repo({})
    write_model(repo, "pymetrics", """
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
    """, files={"1/model.py": textwrap.dedent("""
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def initialize(self, args):
                self.family = pb_utils.MetricFamily(
                    "pyserve_test_py_requests", "Requests seen by model.py", pb_utils.MetricFamily.COUNTER)
                self.requests = self.family.Metric(labels={"model": "pymetrics"})

            def execute(self, requests):
                responses = []
                for request in requests:
                    self.requests.increment(1)
                    data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
                    responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data)]))
                return responses
    """)})
    server = start_server(repo)
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2], "data": [1, 2]}]}).encode()
    for _ in range(2):
        urllib.request.urlopen(urllib.request.Request(f"http://{server.url}/v2/models/pymetrics/infer", body)).read()
    page = scrape(server)
    assert page.value("pyserve_test_py_requests", model="pymetrics") == 2
    assert 'pyserve_test_py_requests{model="pymetrics"} 2\n' in page.text


def test_gpu_metrics_with_nvml(make_repo: Callable[..., Path], start_server: StartServer) -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception:
        pytest.skip("NVML is not available")
    if count == 0:
        pytest.skip("no GPU")
    server = start_server(make_repo({}))
    page = scrape(server)
    for name in ("nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes"):
        family = page.families[name]
        assert family.type == "gauge"
        assert len(family.samples) == count
        assert all(sample.labels["gpu_uuid"] for sample in family.samples)
    total = page.families["nv_gpu_memory_total_bytes"].samples[0].value
    assert total > 0
    assert all(0.0 <= s.value <= 1.0 for s in page.families["nv_gpu_utilization"].samples)


def test_cli_metrics_flags() -> None:
    args = build_parser().parse_args([
        "run", "--metrics-port", "9102", "--allow-metrics", "false", "--metrics-interval-ms", "500",
        "--metrics-address", "127.0.0.1", "--metrics-config", "histogram_latencies=true",
        "--metrics-config", "counter_latencies=false", "--allow-gpu-metrics", "false",
    ])
    assert args.metrics_port == 9102 and args.allow_metrics is False
    assert args.metrics_interval_ms == 500 and args.metrics_address == "127.0.0.1"
    assert dict(args.metrics_config) == {"histogram_latencies": "true", "counter_latencies": "false"}
    assert args.allow_gpu_metrics is False and args.allow_cpu_metrics is True


def test_gpu_gauges_from_nvml_readings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NVML code path with a stand-in ``pynvml`` (the real one needs a GPU)."""
    import sys
    import types

    from pyserve.metrics import SystemMonitor, render

    class NotSupported(Exception):
        pass

    def unsupported(handle: Any) -> Any:
        raise NotSupported()

    fake = types.ModuleType("pynvml")
    calls: list[str] = []
    fake.nvmlInit = lambda: calls.append("init")  # type: ignore[attr-defined]
    fake.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    fake.nvmlDeviceGetCount = lambda: 2  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    fake.nvmlDeviceGetUUID = lambda h: f"GPU-{h}".encode()  # type: ignore[attr-defined]
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=40 + h)  # type: ignore[attr-defined]
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=1000, used=250)  # type: ignore[attr-defined]
    fake.nvmlDeviceGetPowerUsage = lambda h: 75_500  # type: ignore[attr-defined]  # mW
    fake.nvmlDeviceGetPowerManagementLimit = unsupported  # type: ignore[attr-defined]
    energy = iter([1_000, 2_000, 6_000, 9_000])  # mJ: start readings, then one sample per GPU
    fake.nvmlDeviceGetTotalEnergyConsumption = lambda h: next(energy)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)

    monitor = SystemMonitor(cpu=False, gpu=True)
    assert monitor.has_gpu
    monitor.sample()
    registry = CollectorRegistry()
    registry.register(monitor)  # type: ignore[arg-type]
    page = Scrape(render(registry).decode())
    assert page.value("nv_gpu_utilization", gpu_uuid="GPU-0") == 0.40
    assert page.value("nv_gpu_utilization", gpu_uuid="GPU-1") == 0.41
    assert page.value("nv_gpu_memory_total_bytes", gpu_uuid="GPU-1") == 1000
    assert page.value("nv_gpu_memory_used_bytes", gpu_uuid="GPU-0") == 250
    assert page.value("nv_gpu_power_usage", gpu_uuid="GPU-0") == 75.5
    assert "nv_gpu_power_limit" not in page.families  # NVML does not support it here
    assert page.value("nv_energy_consumption", gpu_uuid="GPU-0") == 5.0  # joules since start
    assert "nv_cpu_utilization" not in page.families
    monitor.close()
    assert calls == ["init", "shutdown"]


def test_model_load_duration_gauge(gate_server: ServerThread) -> None:
    """``nv_model_load_duration_secs`` (Triton, from 24.10): a gauge per loaded version, seconds."""
    page = scrape(gate_server)
    family = page.families["nv_model_load_duration_secs"]
    assert family.type == "gauge" and family.documentation == "Model load time in seconds"
    assert {tuple(sorted(s.labels.items())) for s in family.samples} == {
        (("model", name), ("version", "1")) for name in ("ident", "batched", "limited")
    }
    assert all(0 < s.value < 600 for s in family.samples)


FIRST_BUCKETS = """
    model_metrics { metric_control [ {
      metric_identifier { family: "nv_inference_first_response_histogram_ms" }
      histogram_options { buckets: [ 0.5, 20, 3000 ] }
    } ] }
"""


def test_model_metrics_sets_first_response_buckets(make_repo: Callable[..., Path], start_server: StartServer) -> None:
    server = start_server(
        make_repo({"ident": IDENT + FIRST_BUCKETS, "batched": IDENT}), backends={"gate": GateBackend()},
        use_entry_points=False, metrics_config={"histogram_latencies": "true"},
    )
    assert infer(server, "ident") == 200 and infer(server, "batched") == 200
    page = scrape(server)
    buckets = [s.labels["le"] for s in page.families["nv_inference_first_response_histogram_ms"].samples
               if s.name.endswith("_bucket") and s.labels["model"] == "ident"]
    assert buckets == ["0.5", "20", "3000", "+Inf"]
    assert page.value("nv_inference_first_response_histogram_ms_bucket", **LABELS, le="+Inf") == 1
    other = {"model": "batched", "version": "1"}  # the server's default buckets elsewhere
    assert page.value("nv_inference_first_response_histogram_ms_bucket", **other, le="5000") == 1


@pytest.mark.parametrize("control, message", [
    ('metric_identifier { family: "nv_inference_first_response_histogram_ms" } '
     "histogram_options { buckets: [ 10, 5 ] }", "must be finite and strictly increasing"),
    ('metric_identifier { family: "nv_inference_count" } histogram_options { buckets: [ 1 ] }',
     "metric family 'nv_inference_count' has no histogram to configure"),
])
def test_model_metrics_errors_name_the_field(
    make_repo: Callable[..., Path], start_server: StartServer, control: str, message: str
) -> None:
    server = start_server(make_repo({"ident": IDENT + f"model_metrics {{ metric_control [ {{ {control} }} ] }}\n"}),
                          backends={"gate": GateBackend()}, use_entry_points=False, exit_on_error=False)
    with urllib.request.urlopen(f"http://{server.url}/v2/repository/index", data=b"{}", timeout=10) as response:
        (entry,) = json.loads(response.read())
    assert entry["state"] == "UNAVAILABLE"
    assert "model_metrics.metric_control[0]" in entry["reason"] and message in entry["reason"]


class _FailingMonitor:
    """CPU/GPU readings that fail, except the third: the refresh loop's view of a bad NVML."""

    def __init__(self) -> None:
        self.calls = 0

    def sample(self) -> None:
        self.calls += 1
        if self.calls != 3:
            raise OSError("no reading")

    def collect(self) -> list[Any]:
        return []


def test_the_gauge_refresh_logs_each_run_of_failures_once_and_ends_with_the_executor(
        caplog: pytest.LogCaptureFixture) -> None:
    """A reading that keeps failing logs its traceback once per run of failures, not at every
    interval; once the loop's executor is shut down (the server is stopping) the refresh ends
    by itself instead of logging "cannot schedule new futures" at every interval."""
    import asyncio
    import logging

    from pyserve.metrics.prometheus import ServerMetrics
    from pyserve.server.metrics_port import MetricsService

    monitor = _FailingMonitor()
    service = MetricsService(ServerMetrics({}), monitor)  # type: ignore[arg-type]

    async def refresh() -> None:
        task = asyncio.create_task(service._sample_every(0.001))
        while monitor.calls < 6:
            await asyncio.sleep(0.005)
        await asyncio.get_running_loop().shutdown_default_executor()
        await asyncio.wait_for(task, 60)  # returns: no cancel needed

    with caplog.at_level(logging.ERROR, "pyserve.metrics"):
        asyncio.run(refresh())
    failures = [r for r in caplog.records if r.name == "pyserve.metrics"]
    assert [r.getMessage() for r in failures] == ["reading CPU/GPU metrics failed"] * 2  # calls 1-2, then 4-
    assert all(r.exc_info is not None and "no reading" in str(r.exc_info[1]) for r in failures)
