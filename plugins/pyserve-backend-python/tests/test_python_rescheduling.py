"""Request rescheduling (``set_release_flags(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)``) with
``sequence_batching { iterative_sequence: true }``: in-flight requests are executed together
iteration after iteration and finish at different iterations."""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from python_backend_helpers import PROCESS_MODE
from tritonclient.utils import InferenceServerException

from pyserve.server.core import ServerThread

Serve = Callable[[dict[str, tuple[str | None, str]]], ServerThread]

ITERATIVE = """
backend: "python"
max_batch_size: 8
input [ { name: "STEPS" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "SIZES" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "CORRID" data_type: TYPE_UINT64 dims: [ 1 ] } ]
sequence_batching {
  iterative_sequence: true
  oldest { max_candidate_sequences: 8 max_queue_delay_microseconds: 200000 preferred_batch_size: [ 5 ] }
}
"""

# Each execute appends the batch size it saw to the request's list; a request asking for N
# steps is rescheduled until its list holds N sizes, then answered with them.
GENERATE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.seen = {}
    def execute(self, requests):
        out = []
        for request in requests:
            steps = int(pb_utils.get_input_tensor_by_name(request, "STEPS").as_numpy()[0, 0])
            sizes = self.seen.setdefault(request.correlation_id(), [])
            sizes.append(len(requests))
            if len(sizes) < steps:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                out.append(None)
                continue
            del self.seen[request.correlation_id()]
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SIZES", np.array([sizes], dtype=np.int32)),
                pb_utils.Tensor("CORRID", np.array([[request.correlation_id()]], dtype=np.uint64))]))
        return out
"""

# Decoupled: one response per iteration (the step number), then the final flag.
STREAM = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.step = {}
    def execute(self, requests):
        for request in requests:
            steps = int(pb_utils.get_input_tensor_by_name(request, "STEPS").as_numpy()[0, 0])
            step = self.step.get(request.correlation_id(), 0)
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("SIZES", np.array([[step]], dtype=np.int32)),
                pb_utils.Tensor("CORRID", np.array([[request.correlation_id()]], dtype=np.uint64))]))
            if step + 1 < steps:
                self.step[request.correlation_id()] = step + 1
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            else:
                self.step.pop(request.correlation_id(), None)
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def _generate(server: ServerThread, model: str, steps: int) -> tuple[list[int], int]:
    item = httpclient.InferInput("STEPS", [1, 1], "INT32")
    item.set_data_from_numpy(np.array([[steps]], dtype=np.int32))
    result = httpclient.InferenceServerClient(server.url, network_timeout=60).infer(model, [item])
    return result.as_numpy("SIZES")[0].tolist(), int(result.as_numpy("CORRID")[0, 0])


def test_rescheduled_requests_run_together_and_finish_at_different_iterations(serve: Serve) -> None:
    server = serve({"generate": (ITERATIVE, GENERATE)})
    sizes, _ = _generate(server, "generate", 3)
    assert sizes == [1, 1, 1]  # alone: three iterations of one
    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(lambda steps: _generate(server, "generate", steps), [2, 3, 4, 5, 6]))
    for steps, (sizes, _) in zip([2, 3, 4, 5, 6], answers):
        assert len(sizes) == steps
    # all five were in flight together, and each iteration ran those not finished yet
    assert answers[-1][0] == [5, 5, 4, 3, 2, 1]
    assert answers[0][0] == [5, 5]
    corrids = [corrid for _, corrid in answers]
    assert len(set(corrids)) == 5 and all(c >= 1 << 63 for c in corrids)  # one sequence each, ids assigned


def test_decoupled_iterations_stream_one_response_each(serve: Serve) -> None:
    server = serve({"stream": (ITERATIVE + "model_transaction_policy { decoupled: true }\n", STREAM)})
    answers: queue.Queue[object] = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.server.grpc_port}")
    client.start_stream(callback=lambda result, error: answers.put(error or result))
    try:
        item = grpcclient.InferInput("STEPS", [1, 1], "INT32")
        item.set_data_from_numpy(np.array([[4]], dtype=np.int32))
        client.async_stream_infer("stream", [item], enable_empty_final_response=True)
        steps = []
        while True:
            answer = answers.get(timeout=30)
            assert not isinstance(answer, Exception), answer
            final = answer.get_response().parameters["triton_final_response"].bool_param  # type: ignore[union-attr]
            if answer.as_numpy("SIZES") is not None:  # type: ignore[union-attr]
                steps.append(int(answer.as_numpy("SIZES")[0, 0]))  # type: ignore[union-attr]
            if final:
                break
        assert steps == [0, 1, 2, 3]
    finally:
        client.stop_stream()
        client.close()


NOT_ITERATIVE = """
backend: "python"
max_batch_size: 8
input [ { name: "STEPS" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "SIZES" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "CORRID" data_type: TYPE_UINT64 dims: [ 1 ] } ]
"""


@pytest.mark.parametrize(("config", "message"), [
    (NOT_ITERATIVE, "rescheduling needs sequence_batching { iterative_sequence: true }"),
    (ITERATIVE + PROCESS_MODE, "not supported in execution_mode 'process'"),
], ids=["without-iterative-sequence", "process-mode"])
def test_rescheduling_where_it_cannot_work_is_a_clear_error(serve: Serve, config: str, message: str) -> None:
    server = serve({"generate": (config, GENERATE)})
    with pytest.raises(InferenceServerException, match="set_release_flags|RESCHEDULE|rescheduling") as failure:
        _generate(server, "generate", 2)
    assert message in str(failure.value)
    assert _generate(server, "generate", 1)[0]  # the model keeps serving (its own state aside)


ANSWERS_AND_RESCHEDULES = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("SIZES", request.inputs()[0].as_numpy())]))
        return out
"""


def test_a_response_returned_for_a_rescheduled_request_is_an_error(serve: Serve) -> None:
    """As Triton's wrong_return_type QA model: the request fails with the stub's message (it
    used to be re-executed for ever)."""
    server = serve({"both": (ITERATIVE, ANSWERS_AND_RESCHEDULES)})
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        steps = httpclient.InferInput("STEPS", [1, 1], "INT32")
        steps.set_data_from_numpy(np.array([[3]], dtype=np.int32))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("both", [steps], sequence_id=5, sequence_start=True, sequence_end=True)
        assert "Expected a None object in the execute function return list for reschduled request" in str(caught.value)
        statistics = client.get_inference_statistics("both")["model_stats"][0]
        assert int(statistics["execution_count"]) == 1
    finally:
        client.close()


def test_statistics_of_rescheduled_requests_count_each_iteration_once(serve: Serve) -> None:
    """Every iteration of a rescheduled request is a new execute: the statistics count one
    execution per iteration, one inference per request, and no duration below zero (an
    earlier iteration's end once made a later one's compute input negative)."""
    server = serve({"generate": (ITERATIVE, GENERATE)})
    assert len(_generate(server, "generate", 3)[0]) == 3
    with ThreadPoolExecutor(3) as pool:
        assert [len(sizes) for sizes, _ in pool.map(lambda steps: _generate(server, "generate", steps), [2, 3, 4])] == [2, 3, 4]
    client = httpclient.InferenceServerClient(server.url, network_timeout=60)
    try:
        statistics = client.get_inference_statistics("generate")["model_stats"][0]
    finally:
        client.close()
    durations = statistics["inference_stats"]
    assert int(durations["success"]["count"]) == 4
    for name in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert int(durations[name]["ns"]) >= 0, (name, durations)
    for batch in statistics["batch_stats"]:
        for name in ("compute_input", "compute_infer", "compute_output"):
            assert int(batch[name]["ns"]) >= 0, (name, batch)
    assert int(statistics["inference_count"]) == sum(int(b["batch_size"]) * int(b["compute_infer"]["count"])
                                                     for b in statistics["batch_stats"])
