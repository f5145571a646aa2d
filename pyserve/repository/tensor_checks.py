"""Request checks shared by the HTTP and gRPC codecs.

Everything here runs before any tensor memory is allocated: names, datatypes and shapes
are checked against the model config, and byte counts are checked against the element
count a shape implies, so a declared shape of 10^12 elements never turns into an
allocation. Every failure is an ``InferError`` with ``INVALID_ARG`` and a message that names
the input and the model.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from pyserve.api.errors import InferError
from pyserve.api.inference import SEQUENCE_END, SEQUENCE_START, ParameterValue
from pyserve.repository.model_config import ModelIO, TensorSpec

RESERVED_PARAMETERS = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers", "binary_data_output"}
)
"""Request parameters with a meaning to the server; never passed on as custom parameters."""

_LENGTH = struct.Struct("<I")


class Limits:
    """Process-wide request limits (``pyserve run --max-tensor-elements``)."""

    __slots__ = ("max_tensor_elements",)

    def __init__(self) -> None:
        self.max_tensor_elements = 0
        """The most elements one input tensor may declare; 0 = no limit."""


LIMITS = Limits()


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


def check_input(
    model_name: str, io: ModelIO, name: object, datatype: object, shape: object
) -> tuple[TensorSpec, tuple[int, ...]]:
    """Check one input's name, datatype and shape against the config.

    :returns: the input's spec and the shape as a tuple of ints.
    :raises InferError: unknown input, wrong datatype, bad or mismatched shape.
    """
    if not isinstance(name, str):
        raise InferError.invalid(f"input name must be a string for model '{model_name}'")
    spec = io.inputs.get(name)
    if spec is None:
        raise InferError.invalid(f"unexpected inference input '{name}' for model '{model_name}'")
    if datatype != spec.datatype.name:
        raise InferError.invalid(
            f"inference input '{name}' data-type is '{datatype}', but model '{model_name}' "
            f"expects '{spec.datatype.name}'"
        )
    if type(shape) is not list and type(shape) is not tuple:
        raise InferError.invalid(
            f"shape of input '{name}' for model '{model_name}' must be a list of non-negative integers"
        )
    for d in shape:  # a loop, not all(<genexpr>): this runs for every input of every request
        if type(d) is not int or d < 0:  # ``type`` also keeps out bool
            raise InferError.invalid(
                f"shape of input '{name}' for model '{model_name}' must be a list of non-negative integers"
            )
    dims = spec.dims
    if io.batching:
        expected = (-1, *dims)
        ok = len(shape) == len(expected) and _dims_match(shape[1:], dims)
        if ok and shape[0] > io.max_batch_size:
            raise InferError.invalid(
                f"inference request batch-size must be <= {io.max_batch_size} for '{model_name}' "
                f"(input '{name}' has batch size {shape[0]})"
            )
        if ok and shape[0] == 0:
            raise InferError.invalid(f"input '{name}' for model '{model_name}' has batch size 0")
    else:
        expected = dims
        ok = len(shape) == len(dims) and _dims_match(shape, dims)
    if not ok:
        raise InferError.invalid(
            f"unexpected shape for input '{name}' for model '{model_name}'. "
            f"Expected {_fmt(expected)}, got {_fmt(shape)}"
        )
    limit = LIMITS.max_tensor_elements
    if limit and element_count(shape) > limit:
        raise InferError.invalid(
            f"input '{name}' for model '{model_name}' has shape {_fmt(shape)} of {element_count(shape)} "
            f"elements, more than the server's limit of {limit} elements per tensor"
        )
    return spec, tuple(shape)


def _dims_match(shape: Sequence[int], dims: Sequence[int]) -> bool:
    for s, d in zip(shape, dims):
        if d != -1 and d != s:
            return False
    return True


def element_count(shape: Sequence[int]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def decode_bytes_elements(buffer: memoryview | bytes, count: int, name: str) -> np.ndarray:
    """Split a BYTES tensor's wire form (4-byte little-endian length + bytes, repeated).

    :raises InferError: when the buffer does not hold exactly ``count`` elements.
    """
    size = len(buffer)
    if count * 4 > size:
        raise InferError.invalid(
            f"input '{name}' declares {count} BYTES element(s) but carries only {size} byte(s) of data"
        )
    data = bytes(buffer) if isinstance(buffer, memoryview) else buffer
    out = np.empty(count, dtype=object)
    offset = 0
    unpack = _LENGTH.unpack_from
    for i in range(count):
        if offset + 4 > size:
            raise InferError.invalid(f"input '{name}': BYTES data ends inside element {i} of {count}")
        (length,) = unpack(data, offset)
        offset += 4
        end = offset + length
        if end > size:
            raise InferError.invalid(
                f"input '{name}': BYTES element {i} declares {length} byte(s) but the data ends first"
            )
        out[i] = data[offset:end]
        offset = end
    if offset != size:
        raise InferError.invalid(
            f"input '{name}': {size - offset} byte(s) of BYTES data left after the {count} element(s) "
            "its shape declares"
        )
    return out


def encode_bytes_elements(array: np.ndarray) -> bytes:
    """The wire form of a BYTES tensor (``str`` elements are UTF-8 encoded)."""
    pack = _LENGTH.pack
    parts: list[bytes] = []
    for item in array.reshape(-1):
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif not isinstance(item, (bytes, bytearray, memoryview)):
            item = str(item).encode("utf-8")
        parts.append(pack(len(item)))
        parts.append(bytes(item))
    return b"".join(parts)


def byte_size_mismatch(input_name: str, model_name: str, expected: int, got: int, detail: str) -> InferError:
    """Triton's INVALID_ARG for input bytes that do not match the input's shape and datatype:
    "input byte size mismatch for input 'X' for model 'm'. Expected 64, got 128", then
    ``detail`` in parentheses (where the bytes came from)."""
    return InferError.invalid(
        f"input byte size mismatch for input '{input_name}' for model '{model_name}'. "
        f"Expected {expected}, got {got} ({detail})"
    )


def missing_inputs(model_name: str, io: ModelIO, given: Iterable[str], missing: list[str]) -> InferError:
    """Triton's INVALID_ARG for a request without all required inputs, word for word (scripts
    match it): "expected 3 inputs but got 1 inputs for model 'm'. Got input(s) ['A'], but
    missing required input(s) ['B','C']. Please provide all required input(s)."; with optional
    inputs in the config, "expected number of inputs between 3 and 4 but got ...". The given
    names are sorted, the missing ones in config order."""
    names = sorted(given)
    required = sum(1 for s in io.inputs.values() if not s.optional)
    expected = (f"{required} inputs" if required == len(io.inputs)
                else f"number of inputs between {required} and {len(io.inputs)}")
    return InferError.invalid(
        f"expected {expected} but got {len(names)} inputs for model '{model_name}'. "
        f"Got input(s) {_name_list(names)}, but missing required input(s) {_name_list(missing)}. "
        "Please provide all required input(s)."
    )


def check_input_count(model_name: str, io: ModelIO, given: int, names: Callable[[], Iterable[object]]) -> None:
    """Triton's first check of a request's inputs, made before their datatypes and shapes: with
    fewer than the config's inputs (``given``), the required ones not among ``names()`` (called
    only then; names that are not str are ignored) make ``missing_inputs``' error.

    :raises InferError: a required input is missing.
    """
    if given >= len(io.inputs):  # every input given (too many or unknown ones are named later)
        return
    present = {n for n in names() if isinstance(n, str)}
    missing = [n for n, s in io.inputs.items() if n not in present and not s.optional]
    if missing:
        raise missing_inputs(model_name, io, present, missing)


def _name_list(names: Iterable[str]) -> str:
    return "[" + ",".join(f"'{name}'" for name in names) + "]"


def finish_inputs(
    model_name: str, io: ModelIO, inputs: dict[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]
) -> int:
    """Check the set of inputs as a whole; apply config reshapes.

    Every name in ``inputs`` must already have passed ``check_input`` (so is a config input).

    :returns: the request's batch size (1 for non-batching models).
    :raises InferError: a required input is missing, or batch sizes disagree.
    """
    if len(inputs) != len(io.inputs):  # every given input is known: only then can one be missing
        missing = [n for n, s in io.inputs.items() if n not in inputs and not s.optional]
        if missing:
            raise missing_inputs(model_name, io, inputs, missing)
    batch = 1
    if io.batching and shapes:
        batch = -1
        for shape in shapes.values():
            if batch < 0:
                batch = shape[0]
            elif shape[0] != batch:
                raise InferError.invalid(
                    f"inputs of model '{model_name}' have different batch sizes: "
                    + ", ".join(f"'{n}': {s[0]}" for n, s in shapes.items())
                )
    for name in io.reshaped_inputs:
        array = inputs.get(name)
        if array is not None:
            spec = io.inputs[name]
            assert spec.reshape is not None
            target = (batch, *spec.reshape) if io.batching else spec.reshape
            try:
                inputs[name] = array.reshape(target)
            except ValueError:
                raise InferError.invalid(
                    f"input '{name}' of shape {_fmt(array.shape)} cannot be reshaped to the config's "
                    f"reshape {_fmt(spec.reshape)} for model '{model_name}'"
                ) from None
    return batch


def check_outputs_requested(model_name: str, io: ModelIO, names: Sequence[object]) -> tuple[str, ...]:
    """Check requested output names; an empty list means every output, in config order.

    A name requested twice is answered once, as Triton does (its first place counts).
    """
    if not names:
        return tuple(io.outputs)
    seen: dict[str, None] = {}
    for name in names:
        if not isinstance(name, str) or name not in io.outputs:
            raise InferError.invalid(f"unexpected inference output '{name}' for model '{model_name}'")
        seen[name] = None
    return tuple(seen)


class RequestOptions:
    """The server-meaningful request parameters, split from the custom ones."""

    __slots__ = ("correlation_id", "custom", "flags", "priority", "timeout_us")

    def __init__(self) -> None:
        self.flags = 0
        self.correlation_id: int | str = 0
        self.priority = 0
        self.timeout_us = 0
        self.custom: dict[str, ParameterValue] = {}


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


def _reserved_message(key: str, allow: frozenset[str]) -> str:
    allowed = sorted(k for k in allow if k.startswith("triton_"))
    if not allowed:
        return (f"parameter keys starting with 'triton_' are reserved for Triton usage and should not be "
                f"specified (got '{key}')")  # Triton's words, which its scripts match
    return ("parameter keys starting with 'triton_' are reserved for Triton usage. Only the following keys "
            f"starting with 'triton_' are allowed: {', '.join(allowed)} (got '{key}')")  # Triton's gRPC text


def invalid_parameter(key: str, value: Any) -> InferError:
    """Triton's INVALID_ARG for a parameter value that is no string, number or boolean."""
    kind = "object" if isinstance(value, Mapping) else "array" if isinstance(value, list) else type(value).__name__
    return InferError.invalid(
        f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'. (got {kind})"
    )


def parse_parameters(params: Mapping[str, Any], *, allow: frozenset[str] = frozenset()) -> RequestOptions:
    """Interpret request-level parameters as Triton does.

    :param allow: extra reserved keys the caller handles itself (e.g. ``binary_data_output``).
    :raises InferError: a reserved key with the wrong type, an unknown ``triton_`` key, or a
        value that is not a string, number or boolean.
    """
    options = RequestOptions()
    if not params:  # most requests carry none
        return options
    for key, value in params.items():
        if key == "sequence_id":
            if isinstance(value, str) or _is_uint(value):
                options.correlation_id = value
            else:
                raise InferError.invalid("parameter 'sequence_id' must be an unsigned integer or a string")
        elif key in ("sequence_start", "sequence_end"):
            if not isinstance(value, bool):
                raise InferError.invalid(f"parameter '{key}' must be a boolean")
            if value:
                options.flags |= SEQUENCE_START if key == "sequence_start" else SEQUENCE_END
        elif key in ("priority", "timeout"):
            if not _is_uint(value):
                raise InferError.invalid(f"parameter '{key}' must be a non-negative integer")
            if key == "priority":
                options.priority = value
            else:
                options.timeout_us = value
        elif key in allow or key == "headers":
            continue
        elif key.startswith("triton_"):
            raise InferError.invalid(_reserved_message(key, allow))
        elif isinstance(value, (bool, int, float, str)):
            options.custom[key] = value
        else:
            raise invalid_parameter(key, value)
    return options  # sequence flags without an id: refused by a sequence batcher only, as in Triton
