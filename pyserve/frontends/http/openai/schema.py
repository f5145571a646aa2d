"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``, checked.

Only the fields pyserve acts on are read; unknown fields are ignored (clients send ``user``,
``metadata``, ``store`` ...), but a known field of the wrong type or out of range, or a feature
that is not offered (``logprobs``, ``tools``, ``suffix`` ...), is refused with a 400 naming the
field, before anything is sent to a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from pyserve.frontends.http.openai.errors import OpenAIError, invalid

MAX_N = 128
"""The most choices one request may ask for (OpenAI's limit)."""
MAX_STOP = 16
"""The most stop sequences one request may give."""
MAX_PROMPTS = 64
"""The most prompts one ``/v1/completions`` request may batch (and ``n`` times the prompts is at
most ``MAX_N``: one request never starts more than that many model requests)."""
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

_UNSUPPORTED = ("logprobs", "top_logprobs", "logit_bias", "suffix", "tools", "tool_choice", "functions",
                "function_call", "audio", "prediction")
"""Fields whose feature pyserve does not offer: refused unless null (or false / empty)."""


@dataclass
class Sampling:
    """The sampling settings a request gave (``None``: not given, the model decides).

    :ivar extra: other sampling fields passed on as they are (``presence_penalty``,
        ``frequency_penalty``, ``top_k``).
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    extra: dict[str, float | int] = field(default_factory=dict)

    def given(self) -> dict[str, Any]:
        """Every setting the client gave, by OpenAI field name (``stop`` only when non-empty)."""
        values: dict[str, Any] = {}
        for name in ("max_tokens", "temperature", "top_p", "seed"):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        if self.stop:
            values["stop"] = list(self.stop)
        values.update(self.extra)
        return values


@dataclass
class GenerationRequest:
    """One checked completions or chat request.

    :ivar prompts: the prompts (completions: one or more; chat: empty until the chat template
        renders ``messages``).
    :ivar messages: the chat messages, each with ``role`` and ``content`` as a string.
    """

    model: str
    chat: bool
    prompts: list[str]
    messages: list[dict[str, str]]
    stream: bool
    include_usage: bool
    n: int
    echo: bool
    sampling: Sampling


def parse_body(body: bytes | bytearray) -> dict[str, Any]:
    """The JSON object of a request body.

    :raises OpenAIError: not JSON, or not an object.
    """
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise invalid("the request body must be a JSON object")
    return payload


def parse_completion(payload: dict[str, Any]) -> GenerationRequest:
    """A ``/v1/completions`` body.

    :raises OpenAIError: a missing or malformed field, or an unsupported feature.
    """
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise invalid(f"'prompt' may hold at most {MAX_PROMPTS} prompts", "prompt")
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(p) or isinstance(p, list) for p in prompt):
        raise invalid("prompts of token ids are not supported: send the prompt as text", "prompt")
    else:
        raise invalid("'prompt' must be a string or a non-empty list of strings", "prompt")
    best_of = payload.get("best_of")
    if best_of is not None and best_of != payload.get("n", 1):
        raise invalid("'best_of' is not supported", "best_of")
    request = _common(payload, chat=False)
    if len(prompts) * request.n > MAX_N:
        raise invalid(f"'n' times the number of prompts may be at most {MAX_N}", "n")
    request.prompts = prompts
    request.echo = _bool(payload, "echo", False)
    request.sampling.max_tokens = _max_tokens(payload, "max_tokens")
    return request


def parse_chat(payload: dict[str, Any]) -> GenerationRequest:
    """A ``/v1/chat/completions`` body (``max_completion_tokens`` wins over ``max_tokens``).

    :raises OpenAIError: a missing or malformed field, or an unsupported feature.
    """
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of messages", "messages")
    checked = [_message(m, i) for i, m in enumerate(messages)]
    response_format = payload.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") != "text":
            raise invalid("only 'response_format' {\"type\": \"text\"} is supported", "response_format")
    request = _common(payload, chat=True)
    request.messages = checked
    max_completion = _max_tokens(payload, "max_completion_tokens")
    request.sampling.max_tokens = max_completion if max_completion is not None else _max_tokens(payload, "max_tokens")
    return request


def _common(payload: dict[str, Any], chat: bool) -> GenerationRequest:
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' must be a non-empty string naming a model", "model")
    for name in _UNSUPPORTED:
        value = payload.get(name)
        if value is not None and value is not False and value != [] and value != {}:
            raise invalid(f"'{name}' is not supported by this server", name)
    stream = _bool(payload, "stream", False)
    include_usage = False
    options = payload.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(options, dict):
            raise invalid("'stream_options' must be an object", "stream_options")
        include_usage = _bool(options, "include_usage", False, "stream_options.include_usage")
    n = payload.get("n")
    if n is None:
        n = 1
    elif not _is_int(n) or not 1 <= n <= MAX_N:
        raise invalid(f"'n' must be an integer from 1 to {MAX_N}", "n")
    sampling = Sampling(
        temperature=_number(payload, "temperature", 0.0, 2.0),
        top_p=_number(payload, "top_p", 0.0, 1.0),
        seed=_seed(payload),
        stop=_stop(payload),
    )
    for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
        value = _number(payload, name, low, high)
        if value is not None:
            sampling.extra[name] = value
    top_k = payload.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or top_k < -1:
            raise invalid("'top_k' must be an integer of at least -1", "top_k")
        sampling.extra["top_k"] = top_k
    return GenerationRequest(model=model, chat=chat, prompts=[], messages=[], stream=stream,
                             include_usage=include_usage, n=n, echo=False, sampling=sampling)


def _message(message: Any, index: int) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(f"{where} must be an object with 'role' and 'content'", "messages")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise invalid(f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}", "messages")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    elif isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content: only text parts are supported", "messages")
            parts.append(part["text"])
        content = "".join(parts)
    elif not isinstance(content, str):
        raise invalid(f"{where}.content must be a string or a list of text parts", "messages")
    checked = {"role": role, "content": content}
    name = message.get("name")
    if isinstance(name, str):
        checked["name"] = name
    return checked


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bool(payload: dict[str, Any], name: str, default: bool, label: str | None = None) -> bool:
    value = payload.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{label or name}' must be a boolean", label or name)
    return value


def _number(payload: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = payload.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"'{name}' must be a number", name)
    if not low <= value <= high:
        raise invalid(f"'{name}' must be between {low:g} and {high:g}, got {value:g}", name)
    return float(value)


def _max_tokens(payload: dict[str, Any], name: str) -> int | None:
    value = payload.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise invalid(f"'{name}' must be an integer", name)
    if value < 1:
        raise invalid(f"'{name}' must be at least 1, got {value}", name)
    return int(value)


def _seed(payload: dict[str, Any]) -> int | None:
    value = payload.get("seed")
    if value is None:
        return None
    if not _is_int(value) or not -(2**63) <= value < 2**64:
        raise invalid("'seed' must be an integer that fits in 64 bits", "seed")
    return int(value)


def _stop(payload: dict[str, Any]) -> list[str]:
    value = payload.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP:
        raise invalid(f"'stop' may hold at most {MAX_STOP} sequences", "stop")
    if any(not s for s in stops):
        raise invalid("'stop' sequences must not be empty", "stop")
    return list(stops)


__all__ = ["GenerationRequest", "OpenAIError", "Sampling", "parse_body", "parse_chat", "parse_completion"]
