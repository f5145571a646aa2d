"""Triton's JSON form of a ``ModelConfig`` (as served by ``GET /v2/models/{model}/config``).

The JSON is protobuf's JSON mapping with Triton's settings: original snake_case field
names, enums by name, every field without presence printed even when it holds its
default, unset sub-messages omitted, and 64-bit integers printed as JSON numbers
rather than the strings protobuf's mapping prescribes (map keys stay strings). Keys
follow field declaration order, as in Triton's output.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from pyserve.protocol import ModelConfig

_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def model_config_to_dict(msg: Message) -> dict[str, Any]:
    """Return Triton's JSON object for a ``ModelConfig`` (ours or Triton's class)."""
    data = json_format.MessageToDict(
        msg,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    return _normalize(data, msg.DESCRIPTOR)


def model_config_from_dict(data: dict[str, Any]) -> Message:
    """Parse Triton's JSON object (64-bit integers as numbers or strings) into a ``ModelConfig``.

    :raises ValueError: if ``data`` is not a valid ``ModelConfig`` JSON object.
    """
    if not isinstance(data, dict):
        raise ValueError(f"model config must be a JSON object, got {type(data).__name__}")
    try:
        return json_format.ParseDict(data, ModelConfig(), ignore_unknown_fields=False)
    except json_format.ParseError as exc:
        raise ValueError(f"invalid model config: {exc}") from exc


def model_config_from_json(text: str | bytes) -> Message:
    """Parse Triton's JSON text into a ``ModelConfig``.

    :raises ValueError: if ``text`` is not JSON or not a valid ``ModelConfig``.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        # Triton's parser (protobuf's C++ JSON reader) also takes object keys without quotes
        # (``{direct: {...}}``), which its own QA load requests send
        quoted = _quote_bare_keys(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)
        try:
            data = json.loads(quoted)
        except json.JSONDecodeError:
            raise ValueError(f"model config is not valid JSON: {exc}") from exc
    return model_config_from_dict(data)


def _quote_bare_keys(text: str) -> str:
    """``text`` with every unquoted object key (an identifier followed by ``:`` outside a
    string) put in double quotes; the rest is left as it is."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if char == '"':  # a string, escapes included: copied as it is
            end = i + 1
            while end < n and text[end] != '"':
                end += 2 if text[end] == "\\" else 1
            out.append(text[i:end + 1])
            i = end + 1
        elif char.isalpha() or char == "_":
            end = i
            while end < n and (text[end].isalnum() or text[end] == "_"):
                end += 1
            after = end
            while after < n and text[after].isspace():
                after += 1
            word = text[i:end]
            out.append(f'"{word}"' if after < n and text[after] == ":" else word)
            i = end
        else:
            out.append(char)
            i += 1
    return "".join(out)


def _normalize(data: dict[str, Any], descriptor: Descriptor) -> dict[str, Any]:
    """Return ``data`` (JSON of a ``descriptor`` message) with 64-bit integers as numbers.

    Keys are put in declaration order, as Triton prints them. ``ModelConfig`` uses no
    well-known types, so every message value is a JSON object.
    """
    out: dict[str, Any] = {}
    for field in descriptor.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            value_field = entry.fields_by_name["value"]
            out[field.name] = {key: _convert(item, value_field) for key, item in value.items()}
        elif field.is_repeated:
            out[field.name] = [_convert(item, field) for item in value]
        else:
            out[field.name] = _convert(value, field)
    return out


def _convert(value: Any, field: FieldDescriptor) -> Any:
    """Convert one JSON value of a singular field (or of one element of a repeated one)."""
    if field.type in _INT64_TYPES:
        return int(value)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return _normalize(value, field.message_type)
    return value
