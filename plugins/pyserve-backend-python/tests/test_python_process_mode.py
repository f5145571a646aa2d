"""``execution_mode: "process"``: one worker process per instance, tensors through shared memory."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from python_backend_helpers import MODELS
from python_backend_helpers import PROCESS_MODE as PROCESS
from tritonclient.utils import InferenceServerException

from pyserve.server.core import ServerThread

ADD_SUB_CONFIG = (MODELS / "add_sub" / "config.pbtxt").read_text()
ADD_SUB_SOURCE = (MODELS / "add_sub" / "1" / "model.py").read_text()

IO = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""

BUSY_CONFIG = IO + "instance_group [ { kind: KIND_CPU count: 2 } ]\n"

EXIT_SOURCE = """
import os
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.pid = os.getpid()
    def execute(self, requests):
        out = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if values[0] == 3:
                os._exit(3)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", values * 2)]))
        return out
"""

DECOUPLED_CONFIG = IO + "model_transaction_policy { decoupled: true }\n"

BYTES_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] }, { name: "LEN" data_type: TYPE_INT64 dims: [ -1 ] } ]
"""
BYTES_SOURCE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            upper = np.array([v.upper() for v in values], dtype=object)
            lengths = np.array([len(v) for v in values], dtype=np.int64)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", upper), pb_utils.Tensor("LEN", lengths)]))
        return out
"""

Serve = Callable[[dict[str, tuple[str | None, str]]], ServerThread]


def _segments() -> set[str]:
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith("pyserve_py_")}
    except OSError:
        return set()


def _add_sub(server: ServerThread, model: str, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    client = httpclient.InferenceServerClient(server.url)
    inputs = [httpclient.InferInput("INPUT0", list(a.shape), "FP32"), httpclient.InferInput("INPUT1", list(b.shape), "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer(model, inputs)
    return result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1")


def _infer(server: ServerThread, model: str, values: list[int]) -> np.ndarray:
    item = httpclient.InferInput("IN", [len(values)], "INT32")
    item.set_data_from_numpy(np.array(values, dtype=np.int32))
    return httpclient.InferenceServerClient(server.url).infer(model, [item]).as_numpy("OUT")


def _state(server: ServerThread, model: str) -> tuple[str, str]:
    index = httpx.post(f"http://{server.url}/v2/repository/index", json={}).json()
    entry = next(e for e in index if e["name"] == model)
    return entry["state"], entry.get("reason", "")


def test_add_sub_in_process_mode_matches_thread_mode_and_leaves_no_segments(serve: Serve) -> None:
    before = _segments()
    server = serve({
        "add_sub": (ADD_SUB_CONFIG, ADD_SUB_SOURCE),
        "add_sub_proc": (ADD_SUB_CONFIG + PROCESS, ADD_SUB_SOURCE),
        "bytes_proc": (BYTES_CONFIG + PROCESS, BYTES_SOURCE),
    })
    rng = np.random.default_rng(0)
    for _ in range(3):
        a = rng.random((1, 4), dtype=np.float32)
        b = rng.random((1, 4), dtype=np.float32)
        expected = _add_sub(server, "add_sub", a, b)
        got = _add_sub(server, "add_sub_proc", a, b)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])
    client = httpclient.InferenceServerClient(server.url)
    item = httpclient.InferInput("IN", [2], "BYTES")
    item.set_data_from_numpy(np.array([b"ab", b"xyz"], dtype=object))
    result = client.infer("bytes_proc", [item])
    assert list(result.as_numpy("OUT")) == [b"AB", b"XYZ"]
    assert list(result.as_numpy("LEN")) == [2, 3]
    server.stop()
    assert _segments() - before == set()


MEET_SOURCE = """
import json
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        self.meet = Path(parameters["meet_dir"]["string_value"])

    def execute(self, requests):
        # one file per process; then wait (60 s at most) until two processes are in execute at once
        (self.meet / str(os.getpid())).touch()
        waited = 0.0
        while len(list(self.meet.iterdir())) < 2:
            if waited > 60:
                raise pb_utils.TritonModelException("no other instance executed meanwhile")
            time.sleep(0.01)
            waited += 0.01
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([os.getpid()], dtype=np.int32))])
                for _ in requests]
"""


def test_two_process_instances_execute_at_once_in_two_processes(serve: Serve, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two instances in process mode execute at the same time, each in its own worker process
    (outside the server's interpreter lock): each execute answers only once the other is under way."""
    meet = tmp_path / "meet"
    meet.mkdir()
    config = (BUSY_CONFIG + PROCESS
              + f'parameters {{ key: "meet_dir" value {{ string_value: "{meet}" }} }}\n')
    server = serve({"meet": (config, MEET_SOURCE)})
    with ThreadPoolExecutor(2) as pool:
        pids = sorted(int(out[0]) for out in pool.map(lambda i: _infer(server, "meet", [i]), range(2)))
    assert len(set(pids)) == 2 and os.getpid() not in pids, pids
    assert sorted(int(p.name) for p in meet.iterdir()) == pids


def test_worker_exit_fails_the_request_and_the_worker_restarts(serve: Serve) -> None:
    before = _segments()
    server = serve({"exits": (IO + PROCESS, EXIT_SOURCE)})
    assert list(_infer(server, "exits", [1, 2])) == [2, 4]
    big = list(range(1, 1_000_001))  # 4 MB: the input arena grows, the output segment is large
    np.testing.assert_array_equal(_infer(server, "exits", big), np.array(big, dtype=np.int32) * 2)
    with pytest.raises(InferenceServerException,
                       match=r"the worker process of model 'exits' instance '\S+' exited with code 3; restarting"):
        _infer(server, "exits", [3])
    assert list(_infer(server, "exits", [5])) == [10]
    assert _state(server, "exits")[0] == "READY"
    server.stop()
    assert _segments() - before == set()


def test_model_errors_reported_in_process_mode(serve: Serve) -> None:
    init_error = ("class TritonPythonModel:\n    def initialize(self, args):\n"
                  "        raise ValueError('no weights for ' + args['model_name'])\n")
    exec_error = ("import triton_python_backend_utils as pb_utils\n"
                  "class TritonPythonModel:\n    def execute(self, requests):\n"
                  "        raise pb_utils.TritonModelException('execute exploded')\n")
    server = serve({
        "init_err_proc": (IO + PROCESS, init_error),
        "exec_err_proc": (IO + PROCESS, exec_error),
    })
    state, reason = _state(server, "init_err_proc")
    assert state == "UNAVAILABLE"
    assert "initialize() failed" in reason and "ValueError: no weights for init_err_proc" in reason
    with pytest.raises(InferenceServerException, match="exec_err_proc.*execute exploded"):
        _infer(server, "exec_err_proc", [1])
    assert _state(server, "exec_err_proc")[0] == "READY"


DOUBLE_SOURCE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)])
                for r in requests]
"""

REPEAT_CONFIG = IO + "model_transaction_policy { decoupled: true }\n"
REPEAT_SOURCE = """
import threading
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            for i in range(3):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", values + i)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

BLS_SOURCE = """
import os
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.pid = os.getpid()

    async def execute(self, requests):
        out = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN")
            mode = int(values.as_numpy()[0])
            if mode == 0:  # blocking exec
                answer = pb_utils.InferenceRequest(model_name="double", inputs=[values], requested_output_names=["OUT"]).exec()
                result = pb_utils.get_output_tensor_by_name(answer, "OUT").as_numpy()
            elif mode == 1:  # awaitable exec
                answer = await pb_utils.InferenceRequest(model_name="double", inputs=[values], requested_output_names=["OUT"]).async_exec()
                result = pb_utils.get_output_tensor_by_name(answer, "OUT").as_numpy()
            elif mode == 2:  # decoupled BLS: every response of the called model
                parts = [pb_utils.get_output_tensor_by_name(r, "OUT").as_numpy()
                         for r in pb_utils.InferenceRequest(model_name="repeat", inputs=[values], requested_output_names=["OUT"]).exec(decoupled=True)
                         if r.output_tensors()]
                result = np.concatenate(parts)
            else:  # a call that fails comes back as an error response
                answer = pb_utils.InferenceRequest(model_name="missing", inputs=[values], requested_output_names=["OUT"]).exec()
                raise pb_utils.TritonModelException(answer.error().message())
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.append(result, self.pid).astype(np.int32))]))
        return out
"""


def test_bls_and_async_execute_in_process_mode(serve: Serve) -> None:
    server = serve({
        "double": (IO, DOUBLE_SOURCE),
        "repeat": (REPEAT_CONFIG, REPEAT_SOURCE),
        "bls_proc": (IO + PROCESS, BLS_SOURCE),
    })
    assert _state(server, "bls_proc")[0] == "READY"
    blocking = _infer(server, "bls_proc", [0, 5])
    assert list(blocking[:2]) == [0, 10] and blocking[2] != os.getpid()  # ran in the worker process
    assert list(_infer(server, "bls_proc", [1, 7])[:2]) == [2, 14]
    assert list(_infer(server, "bls_proc", [2, 1])[:6]) == [2, 1, 3, 2, 4, 3]
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'missing' is not found"):
        _infer(server, "bls_proc", [3])


STREAM_SOURCE = """
import os
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            sender = request.get_response_sender()
            if values[0] == 9:  # the worker dies with the request open
                os._exit(9)
            def stream(values=values, sender=sender):  # after execute returned, from a thread
                if values[0] == 8:  # one response, then the worker dies with the request open
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([0, 0], dtype=np.int32))]))
                    time.sleep(0.3)  # execute() has returned and its reply went out
                    os._exit(8)
                for i in range(int(values[0])):
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i, os.getpid()], dtype=np.int32))]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            threading.Thread(target=stream).start()
        return None
"""


def _stream(server: ServerThread, model: str, value: int) -> list[object]:
    import tritonclient.grpc as grpcclient

    results: list[object] = []
    done = threading.Event()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        def callback(result: object, error: object) -> None:
            results.append(error or result)
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:  # type: ignore[union-attr]
                done.set()

        client.start_stream(callback=callback)
        item = grpcclient.InferInput("IN", [1], "INT32")
        item.set_data_from_numpy(np.array([value], dtype=np.int32))
        client.async_stream_infer(model, [item], enable_empty_final_response=True)
        assert done.wait(30), results
        client.stop_stream()
    finally:
        client.close()
    return results


def _text(result: object) -> str:
    message = getattr(result, "message", None)
    return message() if callable(message) else str(result)


def test_decoupled_model_streams_from_the_worker(serve: Serve) -> None:
    server = serve({"stream_proc": (DECOUPLED_CONFIG + PROCESS, STREAM_SOURCE)})
    assert _state(server, "stream_proc")[0] == "READY"
    results = _stream(server, "stream_proc", 4)
    outputs = [r.as_numpy("OUT") for r in results if r.as_numpy("OUT") is not None]  # type: ignore[union-attr]
    assert [int(o[0]) for o in outputs] == [0, 1, 2, 3]
    assert all(int(o[1]) != os.getpid() for o in outputs)  # sent by the worker process
    died = [_text(r) for r in _stream(server, "stream_proc", 9)]
    assert any("exited with code 9" in t for t in died), died
    late = [_text(r) for r in _stream(server, "stream_proc", 8)]  # died after execute returned
    assert any("exited before ending the request" in t for t in late), late
    assert [int(r.as_numpy("OUT")[0]) for r in _stream(server, "stream_proc", 2)  # type: ignore[union-attr]
            if r.as_numpy("OUT") is not None] == [0, 1]  # a new worker took over


METRICS_CONFIG = IO + "instance_group [ { kind: KIND_CPU count: 2 } ]\n" + PROCESS
METRICS_SOURCE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.family = pb_utils.MetricFamily("pyserve_proc_requests", "requests seen", pb_utils.MetricFamily.COUNTER)
        self.requests = self.family.Metric(labels={"model": args["model_name"]})
        self.sizes_family = pb_utils.MetricFamily("pyserve_proc_sizes", "input sizes", pb_utils.MetricFamily.HISTOGRAM)
        self.sizes = self.sizes_family.Metric(labels={}, buckets=[1.0, 4.0])

    def execute(self, requests):
        out = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            self.requests.increment(1)
            self.sizes.observe(len(values))
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", values)]))
        return out
"""


def test_custom_metrics_of_workers_reach_the_server(serve: Serve) -> None:
    from pyserve_backend_python.metrics import REGISTRY

    server = serve({"metrics_proc": (METRICS_CONFIG, METRICS_SOURCE)})
    with ThreadPoolExecutor(4) as pool:  # both instances (workers) take requests
        list(pool.map(lambda n: _infer(server, "metrics_proc", list(range(n % 6 + 1))), range(24)))
    assert REGISTRY.get_sample_value("pyserve_proc_requests", {"model": "metrics_proc"}) == 24
    assert REGISTRY.get_sample_value("pyserve_proc_sizes_count", {}) == 24
    assert REGISTRY.get_sample_value("pyserve_proc_sizes_bucket", {"le": "1"}) == 4  # sizes 1 of 1..6
    server.stop()
    assert REGISTRY.get_sample_value("pyserve_proc_requests", {"model": "metrics_proc"}) is None  # unloaded


DROPPING_SOURCE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.family = pb_utils.MetricFamily("pyserve_proc_dropped", "dropped later", pb_utils.MetricFamily.COUNTER)
        self.seen = self.family.Metric()

    def execute(self, requests):
        for request in requests:
            if pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0] < 0:
                self.family = None  # its last MetricFamily object: the family is deleted
            else:
                self.seen.increment(1)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", r.inputs()[0].as_numpy())]) for r in requests]
"""


def test_a_family_a_worker_deletes_leaves_the_servers_page(serve: Serve) -> None:
    from pyserve_backend_python.metrics import REGISTRY

    server = serve({"dropping": (IO + PROCESS, DROPPING_SOURCE)})
    for _ in range(2):
        _infer(server, "dropping", [1])
    assert REGISTRY.get_sample_value("pyserve_proc_dropped", {}) == 2
    _infer(server, "dropping", [-1])
    assert REGISTRY.get_sample_value("pyserve_proc_dropped", {}) is None


CANCEL_SOURCE = """
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            def stream(request=request, sender=sender):
                sent = 0
                while sent < 200 and not request.is_cancelled():
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([sent], dtype=np.int32))]))
                    sent += 1
                    time.sleep(0.02)
                with open(__import__("json").loads(request.parameters())["path"], "w") as f:
                    f.write(f"{sent} {request.is_cancelled()} {sender.is_cancelled()}")
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            threading.Thread(target=stream).start()
        return None
"""


def test_a_cancelled_stream_is_seen_by_the_worker(serve: Serve, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import tritonclient.grpc as grpcclient

    server = serve({"cancel_proc": (DECOUPLED_CONFIG + PROCESS, CANCEL_SOURCE)})
    record = tmp_path / "sent.txt"
    received: list[object] = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: received.append(error or result))
        item = grpcclient.InferInput("IN", [1], "INT32")
        item.set_data_from_numpy(np.array([1], dtype=np.int32))
        client.async_stream_infer("cancel_proc", [item], parameters={"path": str(record)})
        deadline = time.monotonic() + 60
        while len(received) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        client.stop_stream(cancel_requests=True)  # the client goes away mid-stream
    finally:
        client.close()
    deadline = time.monotonic() + 60
    while not record.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    sent, request_cancelled, sender_cancelled = record.read_text().split()
    assert int(sent) < 100, sent  # stopped long before its 200 responses (4 s)
    assert request_cancelled == "True" and sender_cancelled == "True"


BIG_BLS_SOURCE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN")
            big = pb_utils.Tensor("IN", np.arange(2_000_000, dtype=np.int32) + int(values.as_numpy()[0]))
            answer = pb_utils.InferenceRequest(model_name="double", inputs=[big], requested_output_names=["OUT"]).exec()
            result = pb_utils.get_output_tensor_by_name(answer, "OUT").as_numpy()
            assert result.flags.writeable and result.shape == (2_000_000,)
            checks = np.array([result[0], result[-1], int(np.array_equal(result, big.as_numpy() * 2))], dtype=np.int32)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", checks)]))
        return out
"""


def test_bls_tensors_cross_processes_in_shared_memory_and_leave_no_segments(serve: Serve) -> None:
    before = _segments()
    server = serve({"double": (IO, DOUBLE_SOURCE), "big_bls": (IO + PROCESS, BIG_BLS_SOURCE)})
    for start in (0, 5):  # 8 MB each way per call
        assert list(_infer(server, "big_bls", [start])) == [2 * start, 2 * (1_999_999 + start), 1]
    left = _segments() - before
    assert not {s for s in left if "_oi" in s or "_or" in s}  # BLS segments: unlinked once mapped
