"""Model warmup (``model_warmup`` in config.pbtxt): requests a version runs before it is READY.

Each ``ModelWarmup`` sample builds one request (inputs of zeros, random values, or the
contents of a file in ``<model>/warmup/``) and sends it ``count`` times (at least once)
through the version's own scheduler, so the backend's instances execute it exactly as they
would a client's request. Any error response fails the version with a message naming the
sample.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np

from pyserve.api import datatypes
from pyserve.api.datatypes import DataType
from pyserve.api.errors import InferError
from pyserve.api.inference import (
    SEQUENCE_END,
    SEQUENCE_START,
    InferRequest,
    InferResponse,
)
from pyserve.protocol import data_type_name
from pyserve.repository.model_config import ModelIO
from pyserve.repository.scan import WARMUP_DIRNAME, contained_path
from pyserve.repository.tensor_checks import check_input, finish_inputs

log = logging.getLogger("pyserve.runtime")

WARMUP_CORRELATION_ID = 1
"""The sequence id of warmup requests to sequence-batched models (one-request sequences)."""


class WarmupError(Exception):
    """A warmup sample could not be built or its request failed; the message says which."""


class _WaitingSender:
    """Collects a warmup request's final outcome for the loading thread."""

    __slots__ = ("_done", "error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: InferError | None = None

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        if isinstance(response, InferError) and self.error is None:
            self.error = response
        if final:
            self._done.set()

    def is_cancelled(self) -> bool:
        return False

    def wait(self, timeout: float | None) -> bool:
        return self._done.wait(timeout)


MAX_SAMPLE_INPUT_BYTES = 2 << 30
"""The most memory one warmup input may take (BYTES elements counted at 8 bytes each)."""


def run_warmup(version: Any, model_dir: Path, timeout: float | None = None) -> None:
    """Send every warmup sample of ``version``'s config through its scheduler and wait.

    :param version: a ``ModelVersion`` whose scheduler and instance workers are running.
    :param model_dir: the model directory (``warmup/`` data files are read from it).
    :param timeout: seconds to wait for each request; None waits as long as it takes.
    :raises WarmupError: a sample is invalid or its request failed or timed out.
    """
    config, io = version.config, version.io
    assert io is not None and version.scheduler is not None
    sequence = config.HasField("sequence_batching")
    for index, sample in enumerate(config.model_warmup):
        label = sample.name or f"#{index}"
        try:
            inputs, batch = build_inputs(version.name, io, sample, model_dir)
        except (InferError, OSError, ValueError) as exc:
            message = exc.message if isinstance(exc, InferError) else str(exc)
            raise WarmupError(f"model warmup sample '{label}' is invalid: {message}") from None
        for _ in range(max(int(sample.count), 1)):
            request = InferRequest(
                version.name,
                version.version,
                dict(inputs),
                tuple(io.outputs),
                id=f"warmup-{label}",
                flags=SEQUENCE_START | SEQUENCE_END if sequence else 0,
                correlation_id=WARMUP_CORRELATION_ID if sequence else 0,
                batch_size=batch,
            )
            sender = _WaitingSender()
            request.attach_sender(sender)
            try:
                version.scheduler.enqueue(request)
            except InferError as exc:
                raise WarmupError(f"model warmup sample '{label}' failed: {exc.message}") from None
            if not sender.wait(timeout):
                request.cancel()
                raise WarmupError(f"model warmup sample '{label}' did not finish within {timeout} s")
            if sender.error is not None:
                raise WarmupError(f"model warmup sample '{label}' failed: {sender.error.message}")
        log.info("model '%s' version %d: warmup sample '%s' done", version.name, version.version, label)


def build_inputs(model_name: str, io: ModelIO, sample: Any, model_dir: Path) -> tuple[dict[str, np.ndarray], int]:
    """The input arrays of one ``ModelWarmup`` sample, checked like a client's request.

    :returns: the inputs (config reshapes applied) and the batch size.
    :raises InferError: an input the model does not have, a wrong datatype or shape, or a
        missing required input.
    :raises ValueError: an input with no data setting, as Triton refuses it; a data file that
        is missing, too short or outside ``warmup/``.
    """
    batch = max(int(sample.batch_size), 1) if io.batching else 1
    inputs: dict[str, np.ndarray] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, spec in sample.inputs.items():
        if spec.WhichOneof("input_data_type") is None:  # Triton refuses it rather than sending zeros
            raise ValueError(f"warmup setting expects input '{name}' to have input_data_type set "
                             "(zero_data, random_data or input_data_file)")
        datatype = datatypes.from_config_name(data_type_name(spec.data_type))
        if datatype is None:
            raise ValueError(f"input '{name}': invalid data_type {data_type_name(spec.data_type)}")
        dims = [int(d) for d in spec.dims]
        if any(d < 0 for d in dims):
            raise ValueError(f"input '{name}': dims {dims} must be fixed (no -1) in a warmup sample")
        shape = [batch, *dims] if io.batching else dims
        _, checked = check_input(model_name, io, name, datatype.name, shape)
        size = math.prod(shape) * (datatype.itemsize if not datatype.is_bytes else 8)
        if size > MAX_SAMPLE_INPUT_BYTES:  # before allocating: zero_data needs no file to be huge
            raise ValueError(
                f"input '{name}': shape {shape} needs {size} bytes, more than the {MAX_SAMPLE_INPUT_BYTES} "
                "a warmup input may take"
            )
        inputs[name] = _data(spec, datatype, tuple(shape), model_dir)
        shapes[name] = checked
    batch = finish_inputs(model_name, io, inputs, shapes)
    return inputs, batch


def _data(spec: Any, datatype: DataType, shape: tuple[int, ...], model_dir: Path) -> np.ndarray:
    """One warmup input: zeros, random values or a data file's contents, read-only."""
    count = math.prod(shape)
    which = spec.WhichOneof("input_data_type")
    if which == "input_data_file":
        array = _from_file(model_dir, spec.input_data_file, datatype, count)
    elif which == "random_data" and not datatype.is_bytes:  # BYTES: Triton sends zeros
        array = _random(datatype, count)
    elif datatype.is_bytes:
        array = np.array([b""] * count, dtype=object)
    else:
        array = np.zeros(count, dtype=datatype.dtype)
    array = array.reshape(shape)
    array.setflags(write=False)
    return array


def _random(datatype: DataType, count: int) -> np.ndarray:
    rng = np.random.default_rng()
    if datatype.name == "BOOL":
        return rng.integers(0, 2, count).astype(np.bool_)
    if datatype.dtype.kind in "iu":
        return rng.integers(0, 100, count).astype(datatype.dtype)
    return rng.random(count).astype(datatype.dtype)


def _from_file(model_dir: Path, name: str, datatype: DataType, count: int) -> np.ndarray:
    """Read ``<model>/warmup/<name>``: raw little-endian elements, or for BYTES elements each
    preceded by its 4-byte little-endian length."""
    base = model_dir / WARMUP_DIRNAME
    path = contained_path(base, name)
    data = path.read_bytes()
    if not datatype.is_bytes:
        needed = count * datatype.itemsize
        if len(data) < needed:
            raise ValueError(
                f"warmup data file '{name}' holds {len(data)} bytes, but the input needs {needed}"
            )
        return np.frombuffer(data, dtype=datatype.dtype, count=count).copy()
    elements: list[bytes] = []
    offset = 0
    while len(elements) < count:
        if offset + 4 > len(data):
            raise ValueError(
                f"warmup data file '{name}' holds {len(elements)} length-prefixed element(s), but "
                f"the input needs {count}"
            )
        (length,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if offset + length > len(data):
            raise ValueError(f"warmup data file '{name}': element {len(elements)} is cut short")
        elements.append(data[offset:offset + length])
        offset += length
    return np.array(elements, dtype=object)


__all__ = ["WARMUP_CORRELATION_ID", "WarmupError", "build_inputs", "run_warmup"]
