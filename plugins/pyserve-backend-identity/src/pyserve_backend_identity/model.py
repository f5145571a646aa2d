"""The identity model's state: the input → output pairing, its settings and its counters."""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pyserve.api import datatypes
from pyserve.protocol import data_type_name

EXECUTE_DELAY_PARAMETER = "execute_delay_ms"
"""Model parameter: milliseconds to sleep once per execute call (default 0)."""

REPORT_BATCH_SIZE_PARAMETER = "report_batch_size"
"""Model parameter: ``"true"`` adds batch statistics to every response (default ``"false"``)."""


@dataclass(frozen=True)
class ExecuteSnapshot:
    """The counters of one model at one moment.

    :ivar executes: execute calls so far.
    :ivar requests: requests seen so far.
    :ivar batch_sizes: total batch size of an execute → number of executes of that size.
    """

    executes: int
    requests: int
    batch_sizes: dict[int, int]


class ExecuteStats:
    """Per-model counters, safe to update from several instances' threads at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executes = 0
        self._requests = 0
        self._batch_sizes: Counter[int] = Counter()

    def record(self, requests: int, batch_size: int) -> ExecuteSnapshot:
        """Count one execute of ``requests`` requests totalling ``batch_size``.

        :returns: the counters including this execute.
        """
        with self._lock:
            self._executes += 1
            self._requests += requests
            self._batch_sizes[batch_size] += 1
            return self._snapshot()

    def snapshot(self) -> ExecuteSnapshot:
        """A consistent copy of the counters."""
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> ExecuteSnapshot:
        return ExecuteSnapshot(self._executes, self._requests, dict(self._batch_sizes))


@dataclass(frozen=True)
class IdentityModel:
    """What ``pyserve_model_create`` stores as ``model.state`` for an identity model.

    :ivar pairs: ``(input name, output name)`` for each output, in config order.
    :ivar execute_delay_s: seconds to sleep once per execute call.
    :ivar report_batch_size: whether responses carry the batch statistics.
    :ivar stats: the model's execute counters (shared by all its instances).
    :ivar absent: output name → (numpy dtype, shape without the batch dimension) of the zero
        tensor answered, as Triton's identity backend does, when the output is requested but
        its input is optional and not given (the input's dims with -1 as 1).
    :ivar batching: whether the model batches (the zero tensor then gets the batch dimension).
    """

    pairs: tuple[tuple[str, str], ...]
    execute_delay_s: float = 0.0
    report_batch_size: bool = False
    stats: ExecuteStats = field(default_factory=ExecuteStats, compare=False)
    absent: Mapping[str, tuple[Any, tuple[int, ...]]] = field(default_factory=dict, compare=False)
    batching: bool = False

    @classmethod
    def from_config(cls, config: Any, parameters: Mapping[str, str]) -> IdentityModel:
        """Check a normalized ``ModelConfig`` and the model parameters.

        :raises ValueError: the config cannot be served as an identity model, or a parameter
            has a bad value; the message names the tensors or the parameter.
        """
        return cls(
            pairs=_pairs(config),
            execute_delay_s=_execute_delay_ms(parameters) / 1000.0,
            report_batch_size=_report_batch_size(parameters),
            absent=_absent(config),
            batching=config.max_batch_size > 0,
        )


def _pairs(config: Any) -> tuple[tuple[str, str], ...]:
    if not config.input:
        raise ValueError("the identity backend needs at least one input")
    if len(config.output) > len(config.input):
        raise ValueError(
            f"the identity backend needs no more outputs than inputs "
            f"({len(config.output)} outputs, {len(config.input)} inputs)"
        )
    for source, target in zip(config.input, config.output):
        _check_pair(source, target)
    return tuple((source.name, target.name) for source, target in zip(config.input, config.output))


def _absent(config: Any) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """The zero tensors of the outputs whose input is optional (see ``IdentityModel.absent``)."""
    zeros = {}
    for source, target in zip(config.input, config.output):
        if source.optional:
            dtype = datatypes.from_config_name(data_type_name(source.data_type))
            if dtype is not None:
                zeros[target.name] = (dtype.dtype, tuple(1 if d == -1 else int(d) for d in _backend_shape(source)))
    return zeros


def _check_pair(source: Any, target: Any) -> None:
    names = f"input '{source.name}' and output '{target.name}'"
    if source.data_type != target.data_type:
        raise ValueError(
            f"{names} must have the same data_type "
            f"({data_type_name(source.data_type)} vs {data_type_name(target.data_type)})"
        )
    source_shape, target_shape = _backend_shape(source), _backend_shape(target)
    if not _shapes_compatible(source_shape, target_shape):
        raise ValueError(f"{names} must have compatible dims ({source_shape} vs {target_shape})")


def _backend_shape(tensor: Any) -> list[int]:
    """The shape the backend sees: ``reshape`` when the config has one, else ``dims``."""
    dims = tensor.reshape.shape if tensor.HasField("reshape") else tensor.dims
    return [int(d) for d in dims]


def _shapes_compatible(left: list[int], right: list[int]) -> bool:
    return len(left) == len(right) and all(a == b or -1 in (a, b) for a, b in zip(left, right))


def _execute_delay_ms(parameters: Mapping[str, str]) -> float:
    raw = parameters.get(EXECUTE_DELAY_PARAMETER, "0")
    try:
        delay = float(raw)
    except ValueError:
        delay = math.nan
    if not (math.isfinite(delay) and delay >= 0):
        raise ValueError(f"model parameter '{EXECUTE_DELAY_PARAMETER}' must be a number >= 0 (got {raw!r})")
    return delay


def _report_batch_size(parameters: Mapping[str, str]) -> bool:
    raw = parameters.get(REPORT_BATCH_SIZE_PARAMETER, "false")
    value = raw.strip().lower()
    if value not in ("true", "false"):
        raise ValueError(
            f"model parameter '{REPORT_BATCH_SIZE_PARAMETER}' must be 'true' or 'false' (got {raw!r})"
        )
    return value == "true"
