"""Triton's generate extension: ``/generate`` (one JSON object) and ``/generate_stream`` (SSE).

The request body is a JSON object: each top-level key naming a model input becomes that
input (a scalar → one element, a list → its elements, shaped as ``input_shape`` says), and so
does a key of the nested ``parameters`` object (as Triton reads ``{"text_input": ...,
"parameters": {"max_tokens": 5}}``); an input given twice is an error; the other keys, ``id``
among them, become request parameters. Each response is a JSON object with ``model_name``, ``model_version``,
``id`` (when given) and one key per output — a single element as a scalar, otherwise a flat
list. ``/generate_stream`` sends every response as a server-sent event ``data: <json>``;
errors after the first event arrive as ``data: {"error": ...}``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson

from pyserve.api.errors import InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.frontends.backlog import ResponseBacklog
from pyserve.frontends.http.codec import _json_to_array
from pyserve.repository.tensor_checks import (
    check_input,
    finish_inputs,
    invalid_parameter,
    parse_parameters,
)
from pyserve.runtime.versions import ModelVersion

SSE_TYPE = "text/event-stream; charset=utf-8"


class _Object(list[tuple[str, Any]]):
    """A JSON object as its (key, value) pairs in order, so that repeated keys are seen."""


def _load(body: bytes | bytearray) -> Any:
    try:
        return json.loads(body, object_pairs_hook=_Object) if body.strip() else _Object()
    except (ValueError, RecursionError) as exc:
        raise InferError.invalid(f"failed to parse the request JSON buffer: {exc}") from None


def decode_generate(body: bytes | bytearray, model: ModelVersion) -> InferRequest:
    """Map a generate body onto the model's inputs and parameters, in body order, as Triton 2.51
    does: a key naming an input becomes it (shaped by ``input_shape``), any other key a request
    parameter (a string, number or boolean), and the keys of a nested ``parameters`` object
    likewise, their errors prefixed with "Converting keyword: 'parameters': ".

    :raises InferError: not a JSON object, an input given twice, a value that does not fit its
        input, a parameter of another type, a missing input.
    """
    io = model.io
    assert io is not None
    payload = _load(body)
    if not isinstance(payload, _Object):
        raise InferError.invalid("the generate request body must be a JSON object")
    inputs: dict[str, np.ndarray] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    params: dict[str, Any] = {}
    request_id = ""
    for key, value in payload:
        if key == "parameters" and key not in io.inputs:
            if not isinstance(value, _Object):
                raise InferError.invalid("Expected JSON object for keyword: 'parameters'")
            for inner, item in value:
                try:
                    _take(model, inner, item, inputs, shapes, params)
                except InferError as exc:
                    raise InferError(f"Converting keyword: 'parameters': {exc.message}", exc.code) from None
            continue
        if key == "id" and key not in io.inputs:
            if not isinstance(value, str):
                raise InferError.invalid("request 'id' must be a string")
            request_id = value
        _take(model, key, value, inputs, shapes, params)
    # Triton 2.51's generate reads no scheduling controls from the body: 'sequence_id',
    # 'priority', 'timeout' and the like reach the model as its parameters (an LLM's 'timeout'),
    # checked side by side. Reserved 'triton_' keys are still refused.
    parse_parameters({key: value for key, value in params.items() if key not in _PLAIN_IN_GENERATE})
    batch = finish_inputs(model.name, io, inputs, shapes)
    return InferRequest(
        model.name,
        model.version,
        inputs,
        tuple(io.outputs),
        id=request_id,
        parameters={key: value for key, value in params.items() if key != "headers"},
        batch_size=batch,
    )


_PLAIN_IN_GENERATE = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout"})
"""Request parameters ``/infer`` reads as controls and ``/generate`` passes to the model."""


def _take(model: ModelVersion, key: str, value: Any, inputs: dict[str, np.ndarray],
          shapes: dict[str, tuple[int, ...]], params: dict[str, Any]) -> None:
    """One body key: an input of the model, else a request parameter (``id`` is both)."""
    io = model.io
    assert io is not None
    if key not in io.inputs:
        if isinstance(value, list) or value is None:  # an array, an object, null
            raise invalid_parameter(key, dict(value) if isinstance(value, _Object) else value)
        params[key] = value
        return
    if key in inputs:
        raise InferError.invalid(f"input '{key}' already exists in request")
    value = _plain_json(value)
    data = value if isinstance(value, list) else [value]
    shape = input_shape(model, key, len(data))
    spec, checked = check_input(model.name, io, key, io.inputs[key].datatype.name, shape)
    inputs[key] = _json_to_array(data, spec, checked, len(data), model.name)
    shapes[key] = checked


def _plain_json(value: Any) -> Any:
    """``value`` with every ``_Object`` turned back into a dict (the last of repeated keys)."""
    if isinstance(value, _Object):
        return {k: _plain_json(v) for k, v in value}
    if isinstance(value, list):
        return [_plain_json(v) for v in value]
    return value


def input_shape(model: ModelVersion, key: str, count: int) -> list[int]:
    """The shape of input ``key`` holding ``count`` elements, as Triton's generate endpoint
    derives it from the input's metadata shape (``-1`` first for a batching model): each fixed
    dimension takes its share of the elements, the innermost variable one what remains, any
    other variable one 1 (so a batching model's ``dims: [1]`` gets ``[1, 1]``).

    :raises InferError: the elements do not fill that shape.
    """
    io = model.io
    assert io is not None
    shape = ([-1] if io.batching else []) + list(io.inputs[key].dims)
    remaining = count
    for dim in reversed(shape):
        if dim != -1:
            if dim == 0 or remaining % dim:
                remaining = -1
                break
            remaining //= dim
    if remaining >= 0:
        for index in range(len(shape) - 1, -1, -1):
            if shape[index] == -1:
                shape[index], remaining = remaining, 1
    if remaining != 1:
        raise InferError.invalid(
            f"The schema can not convert input '{key}' to tensor with proper shape "
            f"({count} element(s) for dims {list(io.inputs[key].dims)}"
            f"{' after the batch dimension' if io.batching else ''})"
        )
    return shape


def encode_generate(response: InferResponse, request: InferRequest, model: ModelVersion) -> dict[str, Any]:
    """One generate response object."""
    out: dict[str, Any] = {}
    for name, array in response.outputs.items():
        flat = np.asarray(array).reshape(-1)
        values = [_plain(v) for v in flat]
        out[name] = values[0] if len(values) == 1 else values
    out["model_name"] = model.name
    out["model_version"] = str(model.version)
    if request.id:
        out["id"] = request.id
    if response.parameters:
        out["parameters"] = response.parameters
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InferError.invalid("an output holds bytes that are not valid UTF-8") from None
    if isinstance(value, np.generic):
        return value.item() if value.dtype.name != "bfloat16" else float(value)
    return value


class GenerateSender:
    """Collects one request's responses on the event loop (sent from any thread); a model that
    sends faster than the client reads waits in ``send`` (``pyserve.frontends.backlog``)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.backlog = ResponseBacklog(self.loop)

    @property
    def closed(self) -> bool:
        return self.backlog.closed

    def close(self) -> None:
        """The client went away: later responses are dropped, a waiting sender is released."""
        self.backlog.close()

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        if self.backlog.closed:  # the client went away: drop it (the loop may be gone too)
            return
        self.backlog.put((response, final))

    def is_cancelled(self) -> bool:
        return self.backlog.closed

    async def responses(self) -> AsyncIterator[InferResponse | InferError]:
        """Every response until the final flag (a bare final flag yields nothing)."""
        while True:
            response, final = await self.backlog.get()
            if response is not None:
                yield response
            if final:
                return

    async def items(self) -> AsyncIterator[tuple[InferResponse | InferError | None, bool]]:
        """Every ``(response, final)`` as sent, the final flag last (a bare one as ``(None, True)``)."""
        while True:
            response, final = await self.backlog.get()
            yield response, final
            if final:
                return


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
