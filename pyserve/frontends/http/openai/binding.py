"""Which models the ``/v1`` routes serve, and how a prompt and its settings become their inputs.

A model is served when it has a text input and a text output (both ``TYPE_STRING``): by
Triton's LLM conventions an input named ``text_input`` or ``prompt`` and an output named
``text_output``, or the tensors named by config parameters ``pyserve_openai_text_input`` /
``pyserve_openai_text_output``. ``pyserve_openai: "false"`` hides a model that would fit;
any other required input the routes cannot fill also leaves it out.

A request's sampling settings reach the model, for each setting:

1. as the input of the same name when the model declares one (``max_tokens``, ``temperature``,
   ``top_p``, ``seed`` or ``random_seed``, ``stop`` or ``stop_words``, ``presence_penalty``,
   ``frequency_penalty``, ``top_k``), converted to its datatype;
2. else inside the JSON string input ``sampling_parameters``, when the model has one (the vLLM
   backend's convention);
3. else as a request parameter of the same name (``stop`` as a JSON list in a string).

A required sampling input the client left out gets OpenAI's default (``max_tokens`` 16,
``temperature`` and ``top_p`` 1, penalties 0, ``seed`` 0, no stop sequences). The BOOL inputs
``stream`` (whether the client streams), ``exclude_input_in_output`` (true: the server echoes the
prompt itself) and ``return_num_input_tokens`` / ``return_num_output_tokens`` (true) are set when
declared. The outputs ``num_input_tokens`` / ``num_output_tokens``, when the model gives them,
are its token counts (``num_output_tokens``: the tokens of that one response). Parameter
``pyserve_openai_context_length`` (tokens) makes the server refuse a prompt whose tokens plus
``max_tokens`` exceed it before the model sees it.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from pyserve.api.errors import InferError
from pyserve.api.inference import InferRequest, InferResponse, ParameterValue
from pyserve.frontends.http.openai.chat_template import ChatTemplate, TemplateError, load_chat_template
from pyserve.frontends.http.openai.errors import OpenAIError, invalid
from pyserve.frontends.http.openai.schema import Sampling
from pyserve.frontends.http.openai.tokens import TokenCounter, load_counter
from pyserve.repository.model_config import TensorSpec, parameters
from pyserve.repository.tensor_checks import check_input, finish_inputs
from pyserve.runtime.versions import ModelVersion

TEXT_INPUTS = ("text_input", "prompt")
TEXT_OUTPUTS = ("text_output",)
SAMPLING_INPUTS: dict[str, tuple[str, ...]] = {
    "max_tokens": ("max_tokens",),
    "temperature": ("temperature",),
    "top_p": ("top_p",),
    "seed": ("seed", "random_seed"),
    "stop": ("stop", "stop_words"),
    "presence_penalty": ("presence_penalty",),
    "frequency_penalty": ("frequency_penalty",),
    "top_k": ("top_k",),
}
"""OpenAI setting → the model input names that take it, in order of preference."""
DEFAULTS: dict[str, Any] = {
    "max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "seed": 0, "stop": [],
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "top_k": 0,
}
"""What a required sampling input gets when the client did not give the setting."""
SAMPLING_JSON_INPUT = "sampling_parameters"
CONTROL_INPUTS = ("stream", "exclude_input_in_output", "return_num_input_tokens", "return_num_output_tokens")
TOKEN_OUTPUTS = ("num_input_tokens", "num_output_tokens")


@dataclass(frozen=True)
class Shape:
    """How a model's config maps onto the routes (no files read: cheap to compute)."""

    text_input: str
    text_output: str
    sampling_inputs: dict[str, str]
    sampling_json: str | None
    controls: tuple[str, ...]
    token_outputs: tuple[str, ...]
    context_length: int | None


def describe(model: ModelVersion) -> Shape | str:
    """The model's ``Shape``, or the reason the ``/v1`` routes cannot serve it."""
    io = model.io
    if io is None or model.config is None:
        return "the model has no inputs and outputs loaded"
    params = parameters(model.config)
    if params.get("pyserve_openai", "").strip().lower() == "false":
        return "config parameter pyserve_openai is false"
    text_input = _pick(params.get("pyserve_openai_text_input"), TEXT_INPUTS, io.inputs)
    text_output = _pick(params.get("pyserve_openai_text_output"), TEXT_OUTPUTS, io.outputs)
    if text_input is None or not io.inputs[text_input].datatype.is_bytes:
        return "it has no TYPE_STRING input named text_input or prompt (or pyserve_openai_text_input)"
    if text_output is None or not io.outputs[text_output].datatype.is_bytes:
        return "it has no TYPE_STRING output named text_output (or pyserve_openai_text_output)"
    sampling: dict[str, str] = {}
    for setting, names in SAMPLING_INPUTS.items():
        for name in names:
            if name in io.inputs:
                sampling[setting] = name
                break
    json_input = SAMPLING_JSON_INPUT if SAMPLING_JSON_INPUT in io.inputs else None
    if json_input is not None and not io.inputs[json_input].datatype.is_bytes:
        return f"its input '{json_input}' is not TYPE_STRING"
    controls = tuple(n for n in CONTROL_INPUTS if n in io.inputs and io.inputs[n].datatype.name == "BOOL")
    known = {text_input, *sampling.values(), *controls, *([json_input] if json_input else [])}
    for name, spec in io.inputs.items():
        if name not in known and not spec.optional:
            return f"its required input '{name}' is not one the OpenAI routes can fill"
    context: int | None = None
    raw = params.get("pyserve_openai_context_length", "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            return f"config parameter pyserve_openai_context_length must be a positive integer, got '{raw}'"
        context = int(raw)
    tokens = tuple(n for n in TOKEN_OUTPUTS if n in io.outputs)
    return Shape(text_input, text_output, sampling, json_input, controls, tokens, context)


def _pick(named: str | None, conventions: tuple[str, ...], tensors: dict[str, TensorSpec]) -> str | None:
    if named:
        return named if named in tensors else None
    return next((n for n in conventions if n in tensors), None)


class Binding:
    """A served model's ``Shape`` plus its chat template and token counter.

    Immutable once made; shared by every request to that model version.
    """

    def __init__(self, shape: Shape, template: ChatTemplate, counter: TokenCounter) -> None:
        self.shape = shape
        self.template = template
        self.counter = counter

    def check_context(self, prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        """Refuse a prompt that leaves no room in the model's context (400 ``context_length_exceeded``)."""
        limit = self.shape.context_length
        if limit is None:
            return
        wanted = prompt_tokens + (max_tokens or 0)
        if prompt_tokens >= limit or wanted > limit:
            raise invalid(
                f"This model's maximum context length is {limit} tokens. However, you requested {wanted} tokens "
                f"({prompt_tokens} in the prompt, {max_tokens or 0} for the completion). Please reduce the length "
                "of the prompt or of max_tokens.", param, "context_length_exceeded",
            )

    def build_request(self, model: ModelVersion, prompt: str, sampling: Sampling, *, stream: bool,
                      choice: int, request_id: str) -> InferRequest:
        """The inference request for one choice of one prompt.

        :param choice: the choice's number: with ``n`` > 1 a given seed becomes ``seed + choice``,
            so the choices differ but stay reproducible.
        :raises OpenAIError: a setting that the model's input cannot take (400).
        """
        shape = self.shape
        io = model.io
        assert io is not None
        inputs: dict[str, np.ndarray] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        _put(model, shape.text_input, [prompt], inputs, shapes, "prompt")
        given = sampling.given()
        if choice and "seed" in given:
            given["seed"] = (given["seed"] + choice) % 2**64 if given["seed"] >= 0 else given["seed"] + choice
        params: dict[str, ParameterValue] = {}
        as_json: dict[str, Any] = {}
        for setting, value in given.items():
            name = shape.sampling_inputs.get(setting)
            if name is not None:
                _put(model, name, value, inputs, shapes, setting)
            elif shape.sampling_json is not None:
                as_json[setting] = value
            else:
                params[setting] = orjson.dumps(value).decode() if isinstance(value, list) else value
        for setting, name in shape.sampling_inputs.items():
            if name not in inputs and not io.inputs[name].optional:
                _put(model, name, DEFAULTS[setting], inputs, shapes, setting)
        if shape.sampling_json is not None and (as_json or not io.inputs[shape.sampling_json].optional):
            _put(model, shape.sampling_json, [orjson.dumps(as_json).decode()], inputs, shapes, "sampling_parameters")
        for name in shape.controls:
            _put(model, name, stream if name == "stream" else True, inputs, shapes, name)
        try:
            batch = finish_inputs(model.name, io, inputs, shapes)
        except InferError as exc:
            raise invalid(exc.message) from None
        return InferRequest(model.name, model.version, inputs, tuple(io.outputs), id=request_id,
                            parameters=params, batch_size=batch)

    def read(self, response: InferResponse) -> tuple[bytes, int | None, int | None]:
        """``(text bytes, input tokens, output tokens)`` of one response (None: not reported)."""
        outputs = response.outputs
        text = outputs.get(self.shape.text_output)
        data = b"".join(_as_bytes(v) for v in np.asarray(text).reshape(-1)) if text is not None else b""
        counts: list[int | None] = []
        for name in TOKEN_OUTPUTS:
            value = outputs.get(name) if name in self.shape.token_outputs else None
            flat = np.asarray(value).reshape(-1) if value is not None else None
            counts.append(int(flat[0]) if flat is not None and flat.size else None)
        return data, counts[0], counts[1]


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray, np.bytes_)):
        return bytes(value)
    return str(value).encode("utf-8", "surrogatepass")


def _put(model: ModelVersion, name: str, value: Any, inputs: dict[str, np.ndarray],
         shapes: dict[str, tuple[int, ...]], setting: str) -> None:
    """``value`` as input ``name`` in the shape and datatype the config declares.

    :raises OpenAIError: the value does not fit the input (400, naming the setting).
    """
    io = model.io
    assert io is not None
    spec = io.inputs[name]
    values = value if isinstance(value, list) else [value]
    array = _convert(spec, values, setting)
    shape = _fit(spec.dims, len(values), name, setting)
    full = [1, *shape] if io.batching else shape
    try:
        _, checked = check_input(model.name, io, name, spec.datatype.name, full)
    except InferError as exc:
        raise invalid(exc.message, setting) from None
    inputs[name] = array.reshape(checked)
    shapes[name] = checked


def _convert(spec: TensorSpec, values: list[Any], setting: str) -> np.ndarray:
    datatype = spec.datatype
    if datatype.is_bytes:
        items = [v.encode("utf-8", "surrogatepass") if isinstance(v, str) else orjson.dumps(v) for v in values]
        array = np.empty(len(items), dtype=object)
        array[:] = items
        return array
    kind = datatype.dtype.kind
    bad = OpenAIError(400, f"'{setting}' cannot be given to model input '{spec.name}' of type {datatype.name}",
                      param=setting)
    if kind == "b":
        if not all(isinstance(v, bool) for v in values):
            raise bad
        return np.array(values, dtype=np.bool_)
    if any(isinstance(v, (str, list, dict)) for v in values):
        raise bad
    if kind in "iu":
        if not all(isinstance(v, int) for v in values):
            raise bad
        info = np.iinfo(datatype.dtype)
        if kind == "u" and setting == "seed":  # a negative seed wraps, as C's unsigned conversion does
            values = [v % (int(info.max) + 1) for v in values]
        if any(not info.min <= v <= info.max for v in values):
            raise OpenAIError(400, f"'{setting}' is out of the range of model input '{spec.name}' ({datatype.name})",
                              param=setting)
    return np.array(values, dtype=datatype.dtype)


def _fit(dims: tuple[int, ...], count: int, name: str, setting: str) -> list[int]:
    """A shape matching ``dims`` that holds ``count`` elements (a ``-1`` dim takes the rest)."""
    shape = [1 if d == -1 else d for d in dims]
    fixed = int(np.prod([d for d in dims if d != -1])) if dims else 1
    variable = [i for i, d in enumerate(dims) if d == -1]
    if variable and fixed and count % fixed == 0:
        shape[variable[0]] = count // fixed
    if int(np.prod(shape)) != count:
        raise invalid(f"model input '{name}' of shape {list(dims)} cannot hold {count} value(s) of '{setting}'",
                      setting)
    return shape


class Bindings:
    """The bindings of the served models, made on first use (files read off the event loop).

    Event loop only. A reloaded version is a new ``ModelVersion``, so it gets a new binding.
    """

    def __init__(self) -> None:
        self._made: weakref.WeakKeyDictionary[ModelVersion, Binding] = weakref.WeakKeyDictionary()

    async def get(self, model: ModelVersion) -> Binding:
        """The binding of ``model``.

        :raises OpenAIError: the model cannot be served on ``/v1`` (400 naming the reason), or
            its chat template does not compile (500).
        """
        binding = self._made.get(model)
        if binding is not None:
            return binding
        shape = describe(model)
        if isinstance(shape, str):
            raise invalid(f"model '{model.name}' cannot be used with the OpenAI API: {shape}", "model",
                          "model_not_supported")
        context = model.context
        directories = [context.version_path, context.path] if context is not None else []
        try:
            template, counter = await asyncio.to_thread(_load_files, directories)
        except TemplateError as exc:
            raise OpenAIError(500, f"model '{model.name}': {exc}") from None
        binding = self._made.setdefault(model, Binding(shape, template, counter))
        return binding


def _load_files(directories: list[Any]) -> tuple[ChatTemplate, TokenCounter]:
    return load_chat_template(directories), load_counter(directories)
