"""Triton's generate extension: ``/generate`` (one JSON object) and ``/generate_stream`` (SSE).

The request body is a JSON object: each top-level key naming a model input becomes that
input (a scalar → one element, a list → a 1-D tensor, with a batch dimension of 1 for
batching models), and so does a key of the nested ``parameters`` object naming an input not
given at the top (as Triton reads ``{"text_input": ..., "parameters": {"max_tokens": 5}}``);
the other keys, ``id`` among them, become request parameters. Each response is a JSON object with ``model_name``, ``model_version``,
``id`` (when given) and one key per output — a single element as a scalar, otherwise a flat
list. ``/generate_stream`` sends every response as a server-sent event ``data: <json>``;
errors after the first event arrive as ``data: {"error": ...}``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson

from pyserve.backlog import ResponseBacklog
from pyserve.errors import InferError
from pyserve.http.codec import _json_to_array
from pyserve.inference import InferRequest, InferResponse
from pyserve.models import ModelVersion
from pyserve.validation import check_input, finish_inputs, parse_parameters

SSE_TYPE = "text/event-stream; charset=utf-8"


def decode_generate(body: bytes | bytearray, model: ModelVersion) -> InferRequest:
    """Map a generate body onto the model's inputs and parameters.

    :raises InferError: not a JSON object, a value that does not fit its input, a missing input.
    """
    io = model.io
    assert io is not None
    try:
        payload = orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise InferError.invalid(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(payload, dict):
        raise InferError.invalid("the generate request body must be a JSON object")
    request_id = payload.get("id", "")
    if not isinstance(request_id, str):
        raise InferError.invalid("request 'id' must be a string")
    params: dict[str, Any] = {}
    nested = payload.get("parameters", {})
    if not isinstance(nested, dict):
        raise InferError.invalid("'parameters' must be a JSON object")
    inputs: dict[str, np.ndarray] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    if request_id:
        params["id"] = request_id  # Triton passes the id on as a parameter too
    for key, value in payload.items():
        if key in ("id", "parameters"):
            continue
        if key in io.inputs:
            _add_input(model, key, value, inputs, shapes)
        else:
            params[key] = value
    for key, value in nested.items():  # as Triton: a nested parameter naming an input feeds it
        if key in io.inputs and key not in inputs:
            _add_input(model, key, value, inputs, shapes)
        else:
            params[key] = value
    options = parse_parameters(params)
    batch = finish_inputs(model.name, io, inputs, shapes)
    return InferRequest(
        model.name,
        model.version,
        inputs,
        tuple(io.outputs),
        id=request_id,
        parameters=options.custom,
        flags=options.flags,
        correlation_id=options.correlation_id,
        priority=options.priority,
        timeout_us=options.timeout_us,
        batch_size=batch,
    )


def _add_input(model: ModelVersion, key: str, value: Any, inputs: dict[str, np.ndarray],
               shapes: dict[str, tuple[int, ...]]) -> None:
    """A JSON value as input ``key``: a scalar → one element, a list → a 1-D tensor (batch 1
    in front for batching models)."""
    io = model.io
    assert io is not None
    data = value if isinstance(value, list) else [value]
    shape = [1, len(data)] if io.batching else [len(data)]
    spec, checked = check_input(model.name, io, key, io.inputs[key].datatype.name, shape)
    inputs[key] = _json_to_array(data, spec, checked, len(data), model.name)
    shapes[key] = checked


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
    sends faster than the client reads waits in ``send`` (``pyserve.backlog``)."""

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
