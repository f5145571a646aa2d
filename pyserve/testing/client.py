"""The ``tritonclient`` calls of the conformance checks: HTTP, concurrent gRPC and the gRPC stream."""

from __future__ import annotations

import queue
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


TIMEOUT_S = 30.0
"""How long a conformance check waits for one response."""


class _Model:
    """What a conformance check needs to know about the model under test."""

    def __init__(self, metadata: Mapping[str, Any], config: Mapping[str, Any]) -> None:
        self.metadata = metadata
        self.config = config
        self.max_batch_size = int(config.get("max_batch_size", 0))
        self.dynamic_batching = "dynamic_batching" in config
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        self.output_types = {t["name"]: t["datatype"] for t in metadata["outputs"]}
        self.output_ranks = {t["name"]: len(t["shape"]) for t in metadata["outputs"]}
        self.input_types = {t["name"]: t["datatype"] for t in metadata["inputs"]}

    @property
    def datatypes(self) -> set[str]:
        return set(self.input_types.values()) | set(self.output_types.values())


class _Reply:
    """One response of a request: outputs by name, or the error text."""

    def __init__(self, outputs: dict[str, np.ndarray] | None = None, error: str | None = None) -> None:
        self.outputs = outputs or {}
        self.error = error


def _check_datatype(array: np.ndarray, datatype: str, what: str) -> None:
    import numpy as np
    from tritonclient.utils import triton_to_np_dtype

    if datatype == "BYTES":
        assert array.dtype == object, f"{what}: BYTES came back as {array.dtype}"
    elif datatype != "BF16":  # tritonclient may read BF16 as float32
        want = np.dtype(triton_to_np_dtype(datatype))
        assert array.dtype == want, f"{what}: {datatype} came back as {array.dtype}"


def _client_inputs(module: Any, model: _Model, inputs: Mapping[str, np.ndarray]) -> list[Any]:
    tensors = []
    for name, array in inputs.items():
        datatype = model.input_types.get(name, "BYTES" if array.dtype == object else "")
        tensor = module.InferInput(name, list(array.shape), datatype)
        if module.__name__.endswith("http"):
            tensor.set_data_from_numpy(array, binary_data=True)
        else:
            tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _outputs(result: Any, model: _Model) -> dict[str, np.ndarray]:
    outputs = {}
    for name in model.output_types:
        array = result.as_numpy(name)
        if array is not None:
            outputs[name] = array
    return outputs


def _http_infer(
    url: str, model_name: str, model: _Model, inputs: Mapping[str, np.ndarray], request_id: str
) -> _Reply:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(url, network_timeout=TIMEOUT_S)
    try:
        outputs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in model.output_types]
        result = client.infer(
            model_name, _client_inputs(httpclient, model, inputs), outputs=outputs, request_id=request_id
        )
        return _Reply(_outputs(result, model))
    except InferenceServerException as exc:
        return _Reply(error=str(exc))
    finally:
        client.close()


def _grpc_infer_concurrent(
    url: str, model_name: str, model: _Model, requests: Sequence[Mapping[str, np.ndarray]], ids: Sequence[str]
) -> list[_Reply]:
    """Send every request at once (``async_infer``), wait for all; replies in request order."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue[tuple[int, Any, Any]] = queue.Queue()
    try:
        for index, (inputs, request_id) in enumerate(zip(requests, ids)):
            client.async_infer(
                model_name,
                _client_inputs(grpcclient, model, inputs),
                callback=lambda result, error, i=index: results.put((i, result, error)),
                request_id=request_id,
                client_timeout=TIMEOUT_S,
            )
        replies: dict[int, _Reply] = {}
        for _ in requests:
            index, result, error = results.get(timeout=TIMEOUT_S + 5)
            replies[index] = (
                _Reply(error=str(error)) if error is not None else _Reply(_outputs(result, model))
            )
        return [replies[i] for i in range(len(requests))]
    finally:
        client.close()


def _stream(
    url: str, model_name: str, model: _Model, requests: Sequence[Mapping[str, np.ndarray]], ids: Sequence[str]
) -> list[list[_Reply]]:
    """Send every request on one ``ModelStreamInfer`` stream; every request's replies, in order.

    :raises AssertionError: a request got no final flag in time, or a response after it.
    """
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    by_id: dict[str, list[_Reply]] = {i: [] for i in ids}
    finished: set[str] = set()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for inputs, request_id in zip(requests, ids):
            client.async_stream_infer(
                model_name,
                _client_inputs(grpcclient, model, inputs),
                request_id=request_id,
                enable_empty_final_response=True,
            )
        while len(finished) < len(ids):
            try:
                result, error = results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(
                    f"requests {sorted(set(ids) - finished)} got no final response in {TIMEOUT_S} s"
                ) from None
            if error is not None:
                # A stream error carries no request id (tritonclient drops it), so it can only
                # be attributed on a stream of one request; there it ends the request.
                assert len(ids) == 1, f"a request failed on a stream of {len(ids)} requests: {error}"
                by_id[ids[0]].append(_Reply(error=str(error)))
                finished.add(ids[0])
                continue
            response = result.get_response()
            request_id = response.id
            assert request_id in by_id, f"response for unknown request id {request_id!r}"
            assert request_id not in finished, f"request {request_id!r} got a response after its final one"
            if response.outputs:
                by_id[request_id].append(_Reply(_outputs(result, model)))
            if response.parameters["triton_final_response"].bool_param:
                finished.add(request_id)
        return [by_id[i] for i in ids]
    finally:
        client.stop_stream()
        client.close()
