"""Native Triton backends (C test backends built by the tests) served end to end."""

from __future__ import annotations

import concurrent.futures
import json
import queue
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from pyserve_backend_native import metrics_text

from pyserve.testing import ServerFactory, write_model

IDENTITY = """
    name: "{name}"
    backend: "c_identity"
    max_batch_size: 8
    dynamic_batching {{ max_queue_delay_microseconds: 50000 }}
    input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] }},
            {{ name: "INPUT1", data_type: TYPE_STRING, dims: [ -1 ] }} ]
    output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] }},
             {{ name: "OUTPUT1", data_type: TYPE_STRING, dims: [ -1 ] }} ]
"""


def install_backend(directory: Path, library: Path, name: str | None = None) -> Path:
    """Copy a built library into ``directory`` (as ``name`` or its own file name)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / (name or library.name)
    shutil.copy(library, target)
    return target


def index(url: str) -> dict[str, dict[str, Any]]:
    with httpclient.InferenceServerClient(url) as client:
        return {entry["name"]: entry for entry in client.get_model_repository_index()}


def infer_identity(client: httpclient.InferenceServerClient, model: str, values: list[float]) -> Any:
    x = np.array([values], dtype=np.float32)
    s = np.array([[b"a" * (i + 1) for i in range(len(values))]], dtype=object)
    inputs = [httpclient.InferInput("INPUT0", list(x.shape), "FP32"), httpclient.InferInput("INPUT1", list(s.shape), "BYTES")]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(s)
    return client.infer(model, inputs)


# -- step 1: identity ----------------------------------------------------------------------
def test_identity_from_each_search_location(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory
) -> None:
    repo = tmp_path / "repo"
    backends = tmp_path / "backends"
    lib = backend_libraries["identity"]
    # <repo>/<model>/<version>/, <repo>/<model>/, <backend-directory>/<backend>/
    install_backend(write_model(repo, "in_version", IDENTITY.format(name="in_version")) / "1", lib)
    install_backend(write_model(repo, "in_model", IDENTITY.format(name="in_model")), lib)
    write_model(repo, "in_backend_dir", IDENTITY.format(name="in_backend_dir"))
    install_backend(backends / "c_identity", lib)
    server = pyserve_server_factory(repo, backend_directory=str(backends))
    with httpclient.InferenceServerClient(server.url) as client:
        for model in ("in_version", "in_model", "in_backend_dir"):
            assert client.is_model_ready(model)
            result = infer_identity(client, model, [1.0, 2.5, -3.0])
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[1.0, 2.5, -3.0]])
            assert result.as_numpy("OUTPUT1").tolist() == [[b"a", b"aa", b"aaa"]]
    loaded = {b.info.source: b for b in server.server.plugins.loaded_backends()}
    # three copies of the library → three backends; each initialized once
    assert sum(1 for k in loaded if k.startswith("native:")) == 3


def test_identity_over_grpc_and_dynamic_batching(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory
) -> None:
    repo = tmp_path / "repo"
    install_backend(write_model(repo, "ident", IDENTITY.format(name="ident")), backend_libraries["identity"])
    server = pyserve_server_factory(repo, frontend_processes=0)  # reads this process's backend counters
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        s = np.array([[b"x", b"", b"zz", b"\xff"]], dtype=object)
        inputs = [grpcclient.InferInput("INPUT0", [1, 4], "FP32"), grpcclient.InferInput("INPUT1", [1, 4], "BYTES")]
        inputs[0].set_data_from_numpy(x)
        inputs[1].set_data_from_numpy(s)
        result = client.infer("ident", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
        assert result.as_numpy("OUTPUT1").tolist() == s.tolist()
    with httpclient.InferenceServerClient(server.url, concurrency=8) as client:
        def one(i: int) -> Any:
            return infer_identity(client, "ident", [float(i)] * 3)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(16)))
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[float(i)] * 3])
    batched = [r.get_response()["parameters"]["batch_requests"] for r in results]
    assert max(batched) > 1, batched  # the dynamic batcher handed several requests to one execute
    stats = server.server.models.get("ident").context.state.statistics()
    assert stats["success_count"] == 17
    assert stats["execution_count"] < 17


def test_auto_complete_through_model_set_config(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory
) -> None:
    repo = tmp_path / "repo"
    model = write_model(repo, "completed", """
        backend: "c_identity"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    """)
    install_backend(model, backend_libraries["identity"])
    server = pyserve_server_factory(repo)
    with httpclient.InferenceServerClient(server.url) as client:
        config = client.get_model_config("completed")
        assert [o["name"] for o in config["output"]] == ["OUTPUT0"]
        x = np.array([1.0, 2.0], dtype=np.float32)
        inp = httpclient.InferInput("INPUT0", [2], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("completed", [inp]).as_numpy("OUTPUT0"), x)


# -- step 2: errors --------------------------------------------------------------------------
ERRORS = """
    backend: "c_errors"
    max_batch_size: 0
    input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ -1 ] } ]
"""


def _int_input(values: list[int]) -> httpclient.InferInput:
    inp = httpclient.InferInput("INPUT0", [len(values)], "INT32")
    inp.set_data_from_numpy(np.array(values, dtype=np.int32))
    return inp


def test_per_request_and_execute_errors(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory
) -> None:
    repo = tmp_path / "repo"
    install_backend(write_model(repo, "errs", ERRORS), backend_libraries["errors"])
    server = pyserve_server_factory(repo)
    with httpclient.InferenceServerClient(server.url) as client:
        np.testing.assert_array_equal(client.infer("errs", [_int_input([3, 4])]).as_numpy("OUTPUT0"), [6, 8])
        with pytest.raises(Exception, match="negative input -1 is not allowed") as bad:
            client.infer("errs", [_int_input([-1])])
        assert "400" in str(bad.value) or "Bad Request" in str(bad.value) or bad.value.status() in ("400", 400)
        with pytest.raises(Exception, match="the batch was rejected on purpose"):
            client.infer("errs", [_int_input([1])], request_id="fail-batch")
        with pytest.raises(Exception, match="released the request without sending a response"):
            client.infer("errs", [_int_input([0])])
        # the instance keeps serving
        np.testing.assert_array_equal(client.infer("errs", [_int_input([5])]).as_numpy("OUTPUT0"), [10])


def test_model_instance_ready_answers_the_ready_endpoints(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    repo = tmp_path / "repo"
    install_backend(write_model(repo, "errs", ERRORS), backend_libraries["errors"])
    # the library's flag is per process: the HTTP client's requests must all run in the owner
    server = pyserve_server_factory(repo, frontend_balance="connections")
    grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.server.grpc_port}")
    with httpclient.InferenceServerClient(server.url) as client:
        assert client.is_model_ready("errs") and client.is_server_ready()
        client.infer("errs", [_int_input([1])], request_id="not-ready")
        assert not client.is_model_ready("errs") and not client.is_server_ready()
        assert not grpc_client.is_model_ready("errs")
        assert "TRITONBACKEND_ModelInstanceReady failed: not ready on purpose" in caplog.text
        client.infer("errs", [_int_input([1])], request_id="ready")
        assert client.is_model_ready("errs") and grpc_client.is_server_ready()


def test_model_instance_ready_of_a_frontend_replica_counts(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory
) -> None:
    """A model's instances include its replicas' in frontend processes: when the replica's
    TRITONBACKEND_ModelInstanceReady fails, the model and the server are not ready, from
    either process, until it passes again."""
    repo = tmp_path / "repo"
    install_backend(write_model(repo, "errs", ERRORS), backend_libraries["errors"])
    server = pyserve_server_factory(repo, frontend_processes=1, replicate_models="auto")
    handoff, balancer = server.server._handoff, server.server.balancer
    assert handoff is not None and balancer is not None
    deadline = time.monotonic() + 60
    while not (balancer.peers and any(handoff.replicas.values())):
        assert time.monotonic() < deadline, "the frontend's replica did not become ready"
        time.sleep(0.05)
    owner = httpclient.InferenceServerClient(server.url)
    frontend = httpclient.InferenceServerClient(server.url)
    try:
        assert owner.is_model_ready("errs")  # the first connection: the owner's
        passed = balancer.passed
        assert frontend.is_model_ready("errs")  # opened while the owner holds one: the frontend's
        assert balancer.passed == passed + 1
        relayed = handoff.requests
        frontend.infer("errs", [_int_input([1])], request_id="not-ready")
        assert handoff.requests == relayed  # the replica executed it: the owner's instance is ready
        for client in (owner, frontend):
            assert not client.is_model_ready("errs") and not client.is_server_ready()
        assert owner.infer("errs", [_int_input([2])]).as_numpy("OUTPUT0").tolist() == [4]  # it still serves
        frontend.infer("errs", [_int_input([1])], request_id="ready")
        for client in (owner, frontend):
            assert client.is_model_ready("errs") and client.is_server_ready()
    finally:
        owner.close()
        frontend.close()


def test_model_initialize_failure_and_bad_libraries(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory
) -> None:
    repo = tmp_path / "repo"

    def config(backend: str) -> str:
        return ERRORS.replace('"c_errors"', f'"c_{backend}"')

    libs = {}
    for name in ("initfail", "missing", "newapi"):
        libs[name] = install_backend(write_model(repo, f"m_{name}", config(name)), backend_libraries[name])
    write_model(repo, "m_absent", config("absent"))
    write_model(repo, "m_runtime", config("errors") + '\nruntime: "libtriton_nothere.so"\n')
    install_backend(write_model(repo, "ok", ERRORS), backend_libraries["errors"])
    server = pyserve_server_factory(repo)
    entries = index(server.url)
    assert entries["ok"]["state"] == "READY"
    assert "refuses to load on purpose" in entries["m_initfail"]["reason"]
    assert "TRITONBACKEND_ModelInitialize" in entries["m_initfail"]["reason"]
    missing = entries["m_missing"]["reason"]  # the library's path relative to the repository
    assert str(libs["missing"].resolve().relative_to(repo.resolve())) in missing
    assert "TRITONSERVER_NoSuchFunction" in missing and str(repo) not in missing
    newapi = entries["m_newapi"]["reason"]
    assert str(libs["newapi"].resolve().relative_to(repo.resolve())) in newapi and "API version does not support" in newapi
    assert "backend 'c_absent' is not installed" in entries["m_absent"]["reason"]
    assert "libtriton_nothere.so" in entries["m_runtime"]["reason"] and "not found" in entries["m_runtime"]["reason"]


# -- step 3: decoupled ----------------------------------------------------------------------
DECOUPLED = """
    backend: "c_decoupled"
    max_batch_size: 0
    model_transaction_policy { decoupled: true }
    input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""


def test_decoupled_responses_from_a_backend_thread(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory
) -> None:
    repo = tmp_path / "repo"
    install_backend(write_model(repo, "dec", DECOUPLED), backend_libraries["decoupled"])
    server = pyserve_server_factory(repo)
    received: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: received.put((result, error)))
        for n in (3, 0, 2):
            inp = grpcclient.InferInput("INPUT0", [1], "INT32")
            inp.set_data_from_numpy(np.array([n], dtype=np.int32))
            client.async_stream_infer("dec", [inp], request_id=f"r{n}", enable_empty_final_response=True)
        finals = 0
        values: dict[str, list[int]] = {"r3": [], "r0": [], "r2": []}
        while finals < 3:
            result, error = received.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                finals += 1
                continue
            values[response.id].append(int(result.as_numpy("OUT")[0]))
        client.stop_stream()
    assert values == {"r3": [0, 1, 2], "r0": [], "r2": [0, 1]}


# -- step 4: sequence batcher -------------------------------------------------------------
STATEFUL = """
    backend: "c_stateful"
    max_batch_size: 2
    sequence_batching {
      max_sequence_idle_microseconds: 5000000
      control_input [
        { name: "START", control [ { kind: CONTROL_SEQUENCE_START, int32_false_true: [ 0, 1 ] } ] },
        { name: "CORRID", control [ { kind: CONTROL_SEQUENCE_CORRID, data_type: TYPE_UINT64 } ] }
      ]
    }
    input [ { name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "OUTPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""


ITERATIVE = """
    backend: "c_iterative"
    max_batch_size: 4
    sequence_batching {
      iterative_sequence: true
      oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 0 }
    }
    input [ { name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "OUTPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""


def test_request_release_reschedule_runs_iterative_sequences(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    repo = tmp_path / "repo"
    install_backend(write_model(repo, "iter", ITERATIVE), backend_libraries["iterative"])
    install_backend(write_model(repo, "plain", ITERATIVE.replace("iterative_sequence: true", "")),
                    backend_libraries["iterative"])
    server = pyserve_server_factory(repo)

    def ask(model: str, steps: int, seq: int = 0) -> int:
        with httpclient.InferenceServerClient(server.url) as client:
            inp = httpclient.InferInput("INPUT", [1, 1], "INT32")
            inp.set_data_from_numpy(np.array([[steps]], dtype=np.int32))
            return int(client.infer(model, [inp], sequence_id=seq, sequence_start=seq != 0).as_numpy("OUTPUT")[0][0])

    assert ask("iter", 4) == 4  # executed four times, answered on the fourth
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert list(pool.map(lambda n: ask("iter", n), [2, 5, 3])) == [2, 5, 3]
    # without iterative_sequence, a rescheduled release is an error for that request alone
    with pytest.raises(Exception, match="released the request without sending a response"):
        ask("plain", 2, seq=9)
    assert "rescheduling needs sequence_batching { iterative_sequence: true }" in caplog.text
    assert ask("plain", 1, seq=10) == 1


def test_stateful_sequences(tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory) -> None:
    repo = tmp_path / "repo"
    install_backend(write_model(repo, "acc", STATEFUL), backend_libraries["stateful"])
    server = pyserve_server_factory(repo)

    def step(client: httpclient.InferenceServerClient, seq: int, value: int, start: bool, end: bool) -> int:
        inp = httpclient.InferInput("INPUT", [1, 1], "INT32")
        inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
        result = client.infer("acc", [inp], sequence_id=seq, sequence_start=start, sequence_end=end)
        return int(result.as_numpy("OUTPUT")[0][0])

    with httpclient.InferenceServerClient(server.url) as client:
        assert step(client, 11, 1, True, False) == 1
        assert step(client, 22, 100, True, False) == 100
        assert step(client, 11, 2, False, False) == 3
        assert step(client, 22, 5, False, True) == 105
        assert step(client, 11, 3, False, True) == 6
        assert step(client, 11, 7, True, True) == 7  # a new sequence starts from zero


# -- step 5: BLS ------------------------------------------------------------------------------
BLS = """
    backend: "c_bls"
    max_batch_size: 0
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""


def test_bls_through_server_infer_async(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory
) -> None:
    repo = tmp_path / "repo"
    install_backend(write_model(repo, "caller", BLS), backend_libraries["bls"])
    ident = """
        backend: "c_identity"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    """
    install_backend(write_model(repo, "ident", ident), backend_libraries["identity"])
    server = pyserve_server_factory(repo)
    with httpclient.InferenceServerClient(server.url) as client:
        for values in ([1.0, 2.0, 3.5], [-1.0]):
            inp = httpclient.InferInput("INPUT0", [len(values)], "FP32")
            inp.set_data_from_numpy(np.array(values, dtype=np.float32))
            result = client.infer("caller", [inp])
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.array(values, dtype=np.float32) * 2)
    text = metrics_text()
    assert 'bls_calls_total{model="caller"} 2' in text


def test_backend_config_reaches_the_backend(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    repo = tmp_path / "repo"
    install_backend(write_model(repo, "ident", IDENTITY.format(name="ident")), backend_libraries["identity"])
    with caplog.at_level("INFO", logger="pyserve.native"):
        pyserve_server_factory(repo, backend_config={"c_identity": {"answer": "42"}}, backend_directory="/nonexistent")
    lines = [r.getMessage() for r in caplog.records if "identity backend 'c_identity' config" in r.getMessage()]
    assert lines, [r.getMessage() for r in caplog.records]
    config = json.loads(lines[0].split(" config ", 1)[1])
    assert config["cmdline"]["answer"] == "42"
    assert config["cmdline"]["backend-directory"] == "/nonexistent"
    assert config["cmdline"]["default-max-batch-size"] == "4"


# -- metrics and statistics on the server's own pages -----------------------------------------
def _scrape(server: Any) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10) as response:
        return response.read().decode()


def test_custom_metrics_on_the_metrics_page(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    repo = tmp_path / "repo"
    install_backend(write_model(repo, "caller", BLS), backend_libraries["bls"])
    ident = """
        backend: "c_identity"
        max_batch_size: 0
        input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
        output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    """
    install_backend(write_model(repo, "ident", ident), backend_libraries["identity"])
    server = pyserve_server_factory(repo, allow_metrics=True, metrics_port=0)
    with httpclient.InferenceServerClient(server.url) as client:
        for values in ([1.0, 2.0], [3.0], [4.0]):
            inp = httpclient.InferInput("INPUT0", [len(values)], "FP32")
            inp.set_data_from_numpy(np.array(values, dtype=np.float32))
            client.infer("caller", [inp])
    page = _scrape(server)
    assert "# TYPE bls_calls_total counter" in page
    assert 'bls_calls_total{model="caller"} 3' in page
    families = {f.name: f for f in text_string_to_metric_families(page)}
    assert "nv_inference_count" in families  # next to the server's own families
    assert page.count("# TYPE bls_calls_total") == 1  # two native backends, one collector


def test_backend_reported_statistics_split_the_execute(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory
) -> None:
    repo = tmp_path / "repo"
    install_backend(write_model(repo, "ident", IDENTITY.format(name="ident")), backend_libraries["identity"])
    server = pyserve_server_factory(repo, frontend_processes=0)  # reads this process's backend counters
    with httpclient.InferenceServerClient(server.url, concurrency=4) as client:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: infer_identity(client, "ident", [float(i)]), range(8)))
    with httpclient.InferenceServerClient(server.url) as client:
        stats = client.get_inference_statistics("ident")["model_stats"][0]
    reported = server.server.models.get("ident").context.state.statistics()
    inference = stats["inference_stats"]
    assert inference["success"]["count"] == 8 == reported["success_count"]
    # compute infer is the part of each request's execute inside what identity reported as
    # its compute (identity reports compute_end after it sent the response, so it is at most that)
    assert inference["compute_infer"]["count"] == 8
    assert 0 < inference["compute_infer"]["ns"] <= reported["compute_infer_ns"]
    # the rest of the measured execute is compute input (before the backend's compute began:
    # building the requests) and output; compute input also holds the HTTP decode time
    assert inference["compute_input"]["count"] == inference["compute_output"]["count"] == 8
    assert inference["compute_input"]["ns"] > 0
    assert sum(b["compute_infer"]["count"] for b in stats["batch_stats"]) == stats["execution_count"]
    for batch in stats["batch_stats"]:
        assert batch["compute_input"]["ns"] > 0
        assert batch["compute_infer"]["ns"] > 0


def test_libraries_that_call_the_server_stay_with_the_owner(backend_libraries: dict[str, Path]) -> None:
    """What a library imports says whether its models may be replicated in frontend processes
    (``ModelContext.single_process_reason``): BLS ties a model to the process holding every model."""
    from pyserve_backend_native.loader import load_library

    assert "TRITONSERVER_ServerInferAsync" in load_library(backend_libraries["bls"]).single_process_reason()
    assert load_library(backend_libraries["identity"]).single_process_reason() == ""
