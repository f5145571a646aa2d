"""Unit tests of the ``triton_python_backend_utils`` API (no server)."""

from __future__ import annotations

import json
import logging

import ml_dtypes
import numpy as np
import pytest
import triton_python_backend_utils as pb_utils

from pyserve import (
    ErrorCode,
    InferError,
    InferRequest,
    InferResponse,
)


def test_constants_have_tritons_values() -> None:
    assert pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START == 1
    assert pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END == 2
    assert pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL == 1
    assert pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL == 1
    assert pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE == 2
    assert pb_utils.TRITONSERVER_MEMORY_CPU == 0 and pb_utils.TRITONSERVER_MEMORY_GPU == 2


def test_tensor_basics_and_no_copy() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = pb_utils.Tensor("X", array)
    assert tensor.name() == "X"
    assert tensor.as_numpy() is array
    assert tensor.shape() == [2, 3]
    assert tensor.triton_dtype() == 11
    assert tensor.is_cpu()
    strings = pb_utils.Tensor("S", np.array(["a", "bc"]))
    assert strings.as_numpy().dtype == np.object_ and strings.as_numpy().tolist() == [b"a", b"bc"]
    assert strings.triton_dtype() == 13
    bf16 = pb_utils.Tensor("B", np.ones(2, dtype=ml_dtypes.bfloat16))
    assert bf16.triton_dtype() == 14
    with pytest.raises(pb_utils.TritonModelException, match="unsupported numpy dtype"):
        pb_utils.Tensor("C", np.ones(2, dtype=np.complex64))


def test_dlpack_round_trips_with_numpy() -> None:
    array = np.arange(4, dtype=np.int64)
    tensor = pb_utils.Tensor("X", array)
    assert tensor.__dlpack_device__() == (1, 0)
    back = np.from_dlpack(tensor)
    back[0] = 42
    assert array[0] == 42  # shared memory
    from_capsule = pb_utils.Tensor.from_dlpack("Y", tensor.to_dlpack())
    from_object = pb_utils.Tensor.from_dlpack("Z", array)
    assert from_capsule.as_numpy().tolist() == [42, 1, 2, 3]
    assert np.shares_memory(from_object.as_numpy(), array)
    readonly = np.frombuffer(b"\x01\x00\x00\x00\x02\x00\x00\x00", dtype=np.int32)
    assert np.from_dlpack(pb_utils.Tensor("R", readonly)).tolist() == [1, 2]
    with pytest.raises(pb_utils.TritonModelException, match="BYTES"):
        pb_utils.Tensor("S", np.array([b"x"], dtype=np.object_)).to_dlpack()


def test_dlpack_with_torch() -> None:
    torch = pytest.importorskip("torch")
    source = torch.arange(5, dtype=torch.float32)
    tensor = pb_utils.Tensor.from_dlpack("T", source)
    assert tensor.as_numpy().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    back = torch.from_dlpack(tensor)
    back[0] = 7.0
    assert source[0].item() == 7.0
    bf16 = pb_utils.Tensor.from_dlpack("H", torch.ones(3, dtype=torch.bfloat16))
    assert bf16.triton_dtype() == 14
    assert torch.utils.dlpack.from_dlpack(pb_utils.Tensor("N", np.ones(2, np.int32)).to_dlpack()).tolist() == [1, 1]


def test_bf16_goes_through_dlpack_as_in_triton() -> None:
    """Triton's identity_bf16 QA model: ``as_numpy()`` refuses BF16, ``to_dlpack()`` hands it
    to torch and ``from_dlpack()`` takes torch's capsule back, all sharing one buffer."""
    torch = pytest.importorskip("torch")
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = pb_utils.Tensor("B", values.astype(ml_dtypes.bfloat16))
    with pytest.raises(pb_utils.TritonModelException, match="Tensor dtype is BF16 and cannot be converted to NumPy"):
        tensor.as_numpy()
    from_capsule = torch.utils.dlpack.from_dlpack(tensor.to_dlpack())
    assert from_capsule.dtype == torch.bfloat16 and from_capsule.float().numpy().tolist() == values.tolist()
    from_capsule[0, 0] = 9  # one buffer
    assert torch.from_dlpack(tensor)[0, 0].item() == 9
    back = pb_utils.Tensor.from_dlpack("O", torch.utils.dlpack.to_dlpack(from_capsule * 2))
    assert back.triton_dtype() == 14 and back.shape() == [2, 3]
    assert torch.from_dlpack(back).float().numpy().tolist() == [[18, 2, 4], [6, 8, 10]]
    again = pb_utils.Tensor.from_dlpack("A", tensor.to_dlpack())  # our own capsule
    assert torch.from_dlpack(again)[0, 0].item() == 9
    assert pb_utils.Tensor.from_dlpack("T", tensor).shape() == [2, 3]
    from pyserve_backend_python import dlpack_bf16

    del from_capsule, back, again
    tensor.to_dlpack()  # a capsule nobody consumes frees its tensor when dropped
    import gc

    gc.collect()
    assert not dlpack_bf16._exported


def test_type_helpers() -> None:
    assert pb_utils.triton_string_to_numpy("TYPE_FP32") is np.float32
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.TRITON_STRING_TO_NUMPY["TYPE_INT8"] is np.int8
    assert pb_utils.triton_to_numpy_type(8) is np.int32
    assert pb_utils.triton_to_numpy_type(13) is np.object_
    assert pb_utils.triton_to_numpy_type(99) is None
    assert pb_utils.numpy_to_triton_type(np.float16) == 10
    assert pb_utils.numpy_to_triton_type(np.object_) == 13
    assert pb_utils.numpy_to_triton_type(np.bytes_) == 13
    assert pb_utils.numpy_to_triton_type(np.complex64) is None


def test_byte_tensor_serialization() -> None:
    items = np.array([b"ab", "c\u00e9", b""], dtype=np.object_)
    raw = pb_utils.serialize_byte_tensor(items)
    assert type(raw) is bytes  # as Triton's pb_utils returns it
    assert raw == b"\x02\x00\x00\x00ab\x03\x00\x00\x00c\xc3\xa9\x00\x00\x00\x00"
    assert pb_utils.deserialize_bytes_tensor(raw).tolist() == [b"ab", "c\u00e9".encode(), b""]
    assert pb_utils.serialize_byte_tensor(np.array([], dtype=np.object_)) == ()  # Triton's empty result
    assert pb_utils.deserialize_bytes_tensor(pb_utils.serialize_byte_tensor(np.array([], dtype=np.object_))).size == 0
    ints = pb_utils.serialize_byte_tensor(np.array([[1, 22]], dtype=np.object_))
    assert ints == b"\x01\x00\x00\x001\x02\x00\x00\x0022"  # str(x), as Triton
    assert pb_utils.deserialize_bytes_tensor(pb_utils.serialize_byte_tensor(np.array([b"x", b"yz"], dtype="S2"))).tolist() == [b"x", b"yz"]
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.serialize_byte_tensor(np.array([1, 2]))


def test_triton_error_codes_map_to_pyserve() -> None:
    error = pb_utils.TritonError("nope", pb_utils.TritonError.NOT_FOUND)
    assert error.message() == "nope" and error.code() == 2
    assert error.to_infer_error().code is ErrorCode.NOT_FOUND
    assert pb_utils.TritonError("x").code() == pb_utils.TritonError.INTERNAL
    names = ["UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS", "CANCELLED"]
    assert [getattr(pb_utils.TritonError, n) for n in names] == [int(ErrorCode[n]) for n in names]


def test_inference_response() -> None:
    out = pb_utils.Tensor("OUT", np.ones(2, dtype=np.int32))
    response = pb_utils.InferenceResponse(output_tensors=[out], parameters={"a": 1, "b": "x"})
    assert not response.has_error() and response.error() is None
    assert json.loads(response.parameters()) == {"a": 1, "b": "x"}
    assert response.parameters() == '{"a":1,"b":"x"}'  # compact, as Triton's string is
    assert pb_utils.get_output_tensor_by_name(response, "OUT") is out
    assert pb_utils.get_output_tensor_by_name(response, "MISSING") is None
    failed = pb_utils.InferenceResponse(error=pb_utils.TritonError("bad"))
    assert failed.has_error() and failed.error().message() == "bad" and failed.output_tensors() == []
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.InferenceResponse(parameters={"a": [1]})
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.InferenceResponse(output_tensors=[np.ones(1)])


def _server_request(**kwargs: object) -> InferRequest:
    request = InferRequest("m", 1, {"IN": np.arange(3, dtype=np.int32)}, ("OUT",), id="r7",
                           parameters={"p": 1.5}, flags=1, correlation_id=42, timeout_us=100, **kwargs)  # type: ignore[arg-type]
    return request


class _Collect:
    def __init__(self) -> None:
        self.sent: list[tuple[object, bool]] = []

    def send(self, response: object, final: bool) -> None:
        self.sent.append((response, final))

    def is_cancelled(self) -> bool:
        return False


def test_served_request_wrapper_and_response_sender() -> None:
    from pyserve_backend_python.request import InferenceRequest

    server_request = _server_request()
    sink = _Collect()
    server_request.attach_sender(sink)
    request = InferenceRequest._from_server(server_request, False)
    assert [t.name() for t in request.inputs()] == ["IN"]
    assert request.inputs()[0].as_numpy() is server_request.inputs["IN"]
    assert request.requested_output_names() == {"OUT"}
    assert request.request_id() == "r7" and request.correlation_id() == 42
    assert request.flags() == pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
    assert request.timeout() == 100 and request.parameters() == '{"p":1.5}'  # compact, as Triton's
    assert not request.is_cancelled()
    sender = request.get_response_sender()
    assert request.get_response_sender() is sender
    with pytest.raises(pb_utils.TritonModelException, match="Inference Response object must be provided"):
        sender.send()
    with pytest.raises(pb_utils.TritonModelException, match="Unsupported flag provided"):
        sender.send(flags=3)
    # a non-decoupled model: the final flag alone needs a response before it (Triton >= 2.47)
    with pytest.raises(pb_utils.TritonModelException, match="cannot send complete final before sending a response"):
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    response = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones(1, np.int32))])
    sender.send(response)
    with pytest.raises(pb_utils.TritonModelException) as second:
        sender.send(response)
    assert str(second.value) == "Unable to send response. Non-decoupled model cannot send more than one response."
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert [final for _, final in sink.sent] == [False, True]
    assert isinstance(sink.sent[0][0], InferResponse) and sink.sent[1][0] is None
    with pytest.raises(pb_utils.TritonModelException) as closed:
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert str(closed.value) == "Unable to send response. Response sender has been closed."
    server_request.cancel()
    assert request.is_cancelled() and sender.is_cancelled()
    with pytest.raises(pb_utils.TritonModelException, match="needs sequence_batching { iterative_sequence: true }"):
        request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
    with pytest.raises(pb_utils.TritonModelException, match="unknown release flags 4"):
        request.set_release_flags(4)


def test_bls_request_construction() -> None:
    tensor = pb_utils.Tensor("IN", np.ones(2, np.float32))
    request = pb_utils.InferenceRequest(model_name="other", inputs=[tensor], requested_output_names=["OUT"],
                                        request_id="x", correlation_id="seq", parameters='{"k": "v"}',
                                        preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0),
                                        trace=pb_utils.InferenceTrace())
    assert pb_utils.get_input_tensor_by_name(request, "IN") is tensor
    assert request.correlation_id() == "seq" and json.loads(request.parameters()) == {"k": "v"}
    assert request.trace().get_context() is None
    with pytest.raises(pb_utils.TritonModelException, match="response sender"):
        request.get_response_sender()
    with pytest.raises(pb_utils.TritonModelException, match="no running pyserve server"):
        _exec_without_server(request)


def _exec_without_server(request: pb_utils.InferenceRequest) -> None:
    import pyserve_backend_python.context as context

    saved = context._last_server
    context._last_server = None
    try:
        request.exec()
    finally:
        context._last_server = saved


CONFIG = {
    "name": "m", "max_batch_size": 8,
    "input": [{"name": "A", "data_type": "TYPE_INVALID", "dims": [], "optional": False}],
    "output": [],
}


def test_model_config_setters() -> None:
    config = pb_utils.ModelConfig(json.dumps(CONFIG))
    config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [4]})  # fills what the config left out
    config.add_input({"name": "B", "data_type": "TYPE_INT32", "dims": [-1], "optional": True})
    config.add_output({"name": "C", "data_type": "TYPE_FP32", "dims": [4]})
    config.set_max_batch_size(16)
    config.set_dynamic_batching()
    config.set_model_transaction_policy({"decoupled": True})
    data = config.as_dict()
    assert data["input"][0]["data_type"] == "TYPE_FP32" and data["input"][0]["dims"] == [4]
    assert data["input"][1]["optional"] is True
    assert data["max_batch_size"] == 16 and data["dynamic_batching"] == {}
    assert pb_utils.using_decoupled_model_transaction_policy(data)
    assert pb_utils.get_output_config_by_name(data, "C")["dims"] == [4]
    assert pb_utils.get_input_config_by_name(data, "nope") is None
    message = config.to_message()
    assert message.max_batch_size == 16 and message.model_transaction_policy.decoupled


def test_model_config_refuses_contradictions() -> None:
    config = pb_utils.ModelConfig(json.loads(json.dumps(CONFIG)))
    with pytest.raises(ValueError, match="max_batch_size 8"):
        config.set_max_batch_size(4)
    config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [4]})
    with pytest.raises(ValueError, match="data_type"):
        config.add_input({"name": "A", "data_type": "TYPE_INT8", "dims": [4]})
    with pytest.raises(ValueError, match="missing property 'dims'"):
        config.add_output({"name": "X", "data_type": "TYPE_FP32"})
    with pytest.raises(ValueError, match="not supported"):
        config.set_model_transaction_policy({"other": 1})
    config.set_model_transaction_policy({"decoupled": False})
    with pytest.raises(ValueError, match="decoupled"):
        config.set_model_transaction_policy({"decoupled": True})
    sequence = pb_utils.ModelConfig({"name": "s", "sequence_batching": {}})
    with pytest.raises(ValueError, match="sequence_batching"):
        sequence.set_dynamic_batching()


def test_metrics_kinds_and_registry() -> None:
    counter = pb_utils.MetricFamily("pyserve_unit_counter", "a counter", pb_utils.MetricFamily.COUNTER)
    metric = counter.Metric(labels={"k": "v"})
    metric.increment(2)
    metric.increment(0.5)
    assert metric.value() == 2.5
    assert counter.Metric(labels={"k": "v"}).value() == 2.5  # same labels, same metric
    assert pb_utils.REGISTRY.get_sample_value("pyserve_unit_counter", {"k": "v"}) == 2.5
    with pytest.raises(pb_utils.TritonModelException, match="negative"):
        metric.increment(-1)
    with pytest.raises(pb_utils.TritonModelException, match="set"):
        metric.set(1)
    gauge_family = pb_utils.MetricFamily("pyserve_unit_gauge", "a gauge", pb_utils.MetricFamily.GAUGE)
    gauge = gauge_family.Metric()
    gauge.set(5)
    gauge.increment(-2)
    assert gauge.value() == 3
    histogram_family = pb_utils.MetricFamily("pyserve_unit_hist", "a histogram", pb_utils.MetricFamily.HISTOGRAM)
    with pytest.raises(pb_utils.TritonModelException, match="buckets"):
        histogram_family.Metric()
    histogram = histogram_family.Metric(labels={"k": "v"}, buckets=[1, 2.5, 10])
    for value in (0.5, 5, 50):
        histogram.observe(value)
    with pytest.raises(pb_utils.TritonModelException, match="value"):
        histogram.value()
    sample = pb_utils.REGISTRY.get_sample_value
    assert sample("pyserve_unit_hist_bucket", {"k": "v", "le": "1"}) == 1  # Triton's words: not "1.0"
    assert sample("pyserve_unit_hist_bucket", {"k": "v", "le": "2.5"}) == 1
    assert sample("pyserve_unit_hist_bucket", {"k": "v", "le": "10"}) == 2
    assert sample("pyserve_unit_hist_bucket", {"k": "v", "le": "+Inf"}) == 3
    assert sample("pyserve_unit_hist_sum", {"k": "v"}) == 55.5
    with pytest.raises(pb_utils.TritonModelException, match="already exists"):
        pb_utils.MetricFamily("pyserve_unit_counter", "again", pb_utils.MetricFamily.GAUGE)
    with pytest.raises(pb_utils.TritonModelException, match="invalid metric family name"):
        pb_utils.MetricFamily("bad name", "", pb_utils.MetricFamily.GAUGE)


def test_a_metric_family_lives_as_long_as_an_object_for_it() -> None:
    """As Triton's custom_metrics QA model checks: once the last ``MetricFamily`` object of a
    family is deleted, the family leaves the page and its metrics refuse every operation;
    a second object for the same family keeps it alive."""
    message = "Invalid metric operation as the corresponding 'MetricFamily' has been deleted."
    for kind in (pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE):
        family = pb_utils.MetricFamily("pyserve_unit_lifetime", "lifetime", kind)
        metric = family.Metric(labels={"k": "v"})
        metric.increment(3)
        assert pb_utils.REGISTRY.get_sample_value("pyserve_unit_lifetime", {"k": "v"}) == 3
        del family
        assert pb_utils.REGISTRY.get_sample_value("pyserve_unit_lifetime", {"k": "v"}) is None
        calls: list[tuple[str, tuple[int, ...]]] = [("increment", (1,)), ("value", ())]
        if kind == pb_utils.MetricFamily.GAUGE:
            calls.append(("set", (1,)))
        for operation, arguments in calls:
            with pytest.raises(pb_utils.TritonModelException) as caught:
                getattr(metric, operation)(*arguments)
            assert message in str(caught.value)
    first = pb_utils.MetricFamily("pyserve_unit_shared", "shared", pb_utils.MetricFamily.COUNTER)
    second = pb_utils.MetricFamily("pyserve_unit_shared", "shared", pb_utils.MetricFamily.COUNTER)
    metric = second.Metric()
    del first
    metric.increment(2)  # the second object keeps the family
    assert metric.value() == 2
    del second
    with pytest.raises(pb_utils.TritonModelException, match="has been deleted"):
        metric.value()
    again = pb_utils.MetricFamily("pyserve_unit_shared", "shared", pb_utils.MetricFamily.COUNTER)
    assert again.Metric().value() == 0  # a new family starts from zero


def test_logger_writes_to_python_logging(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="pyserve.python_model"):
        pb_utils.Logger.log_info("info message")
        pb_utils.Logger.log_warn("warn message")
        pb_utils.Logger.log_error("error message")
        pb_utils.Logger.log_verbose("verbose message")
        pb_utils.Logger.log("explicit", pb_utils.Logger.LogLevel.ERROR)
        pb_utils.Logger.log_info('two\nlines with "quotes" and é')
    got = [(r.levelno, r.getMessage(), r.filename) for r in caplog.records]
    assert got == [  # quoted and escaped, as Triton writes a model's messages
        (logging.INFO, '"info message"', "test_pb_utils.py"),
        (logging.WARNING, '"warn message"', "test_pb_utils.py"),
        (logging.ERROR, '"error message"', "test_pb_utils.py"),
        (logging.DEBUG, '"verbose message"', "test_pb_utils.py"),
        (logging.ERROR, '"explicit"', "test_pb_utils.py"),
        (logging.INFO, '"two\\nlines with \\"quotes\\" and é"', "test_pb_utils.py"),
    ]


def test_infer_error_from_bls_becomes_a_triton_error() -> None:
    response = pb_utils.InferenceResponse.from_server(InferError("gone", ErrorCode.UNAVAILABLE))
    assert response.has_error() and response.error().code() == pb_utils.TritonError.UNAVAILABLE


def test_a_released_request_is_ended_off_the_thread_that_freed_its_sender() -> None:
    """The collector may free a released request's sender on a thread that holds the lock the
    ending takes (here the model's statistics lock, as ``request_done`` holds it): the ending
    must not run there, or that thread waits for itself for ever."""
    import threading
    import time

    from pyserve_backend_python.request import InferenceRequest
    from pyserve_backend_python.results import watch_unanswered

    from pyserve.metrics.stats import ModelStats

    server_request = _server_request()
    server_request.stats = ModelStats()
    sink = _Collect()
    server_request.attach_sender(sink)
    wrapped = [InferenceRequest._from_server(server_request, False)]
    watch_unanswered("m", server_request, wrapped[0])
    freed = threading.Event()

    def free_under_the_lock() -> None:
        with server_request.stats.lock:
            wrapped.clear()  # the last reference to the request wrapper and its sender
            freed.set()

    freeing = threading.Thread(target=free_under_the_lock, daemon=True)
    freeing.start()
    freeing.join(60)
    assert freed.is_set() and not freeing.is_alive(), "the ending ran under the lock and deadlocked"
    deadline = time.monotonic() + 60
    while not sink.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    [(error, final)] = sink.sent
    assert final and isinstance(error, InferError) and error.code is ErrorCode.INTERNAL
    assert "released it without sending a response" in error.message
    assert server_request.stats.fail_count == 1


@pytest.mark.parametrize(("parameters", "message"), [
    ([], "to be a dict, got <class 'list'>"),
    ({1: "one"}, "Expect parameters keys to have type str, found type <class 'int'>"),
    ({"f": 0.5}, "Expect parameters values to have type bool/int/str, found type <class 'float'>"),
    ({"n": None}, "Expect parameters values to have type bool/int/str, found type <class 'NoneType'>"),
    ({"l": [1]}, "Expect parameters values to have type bool/int/str, found type <class 'list'>"),
])
def test_response_and_request_parameters_are_checked_as_triton_checks_them(parameters: object, message: str) -> None:
    """As Triton's stub (its response_parameters QA model): str keys, bool/int/str values only."""
    with pytest.raises(pb_utils.TritonModelException) as caught:
        pb_utils.InferenceResponse(output_tensors=[], parameters=parameters)
    assert message in str(caught.value)
    with pytest.raises(pb_utils.TritonModelException) as caught:
        pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[], parameters=parameters)
    assert message in str(caught.value)


def test_parameters_of_the_accepted_types_are_kept() -> None:
    response = pb_utils.InferenceResponse(output_tensors=[], parameters={"b": True, "i": 2, "s": "x"})
    assert json.loads(response.parameters()) == {"b": True, "i": 2, "s": "x"}
