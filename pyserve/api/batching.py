"""Helpers for backends: see a gathered batch as one tensor per input, split outputs back.

The dynamic batcher hands ``pyserve_execute`` a list of requests whose non-batch shapes
agree. ``gather_inputs`` joins them along the batch dimension — without a copy when there is
one request, or when the requests' arrays already lie back to back in one buffer — and
``split_outputs`` cuts the batched outputs back into one response per request as views.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from pyserve.api.errors import InferError
from pyserve.api.inference import InferRequest, InferResponse


def gather_inputs(requests: Sequence[InferRequest], names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """One array per input, the requests joined along axis 0, in request order.

    :param names: the inputs to gather (default: those of the first request).
    :raises InferError: an input is missing from some request, or shapes do not agree
        (ragged inputs must be handled by the backend itself).
    """
    if not requests:
        return {}
    wanted = list(names) if names is not None else list(requests[0].inputs)
    gathered: dict[str, np.ndarray] = {}
    for name in wanted:
        try:
            parts = [r.inputs[name] for r in requests]
        except KeyError:
            raise InferError.invalid(f"input '{name}' is missing from a request of the batch") from None
        gathered[name] = _join(parts, name)
    return gathered


def _join(parts: list[np.ndarray], name: str) -> np.ndarray:
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if any(p.shape[1:] != first.shape[1:] or p.dtype != first.dtype for p in parts):
        raise InferError.invalid(f"input '{name}' has different shapes across the batch; it cannot be joined")
    adjacent = _adjacent_view(parts)
    if adjacent is not None:
        return adjacent
    return np.concatenate(parts, axis=0)


def _adjacent_view(parts: list[np.ndarray]) -> np.ndarray | None:
    """A view over all parts when they are C-contiguous and back to back in one buffer."""
    if parts[0].dtype == np.dtype(object):
        return None
    base = parts[0].base
    if base is None:
        return None
    address = parts[0].__array_interface__["data"][0]
    for part in parts:
        if part.base is not base or not part.flags.c_contiguous or part.__array_interface__["data"][0] != address:
            return None
        address += part.nbytes
    rows = sum(p.shape[0] for p in parts)
    start = parts[0]
    shape = (rows, *start.shape[1:])
    view = np.lib.stride_tricks.as_strided(start, shape=shape, strides=(start.strides[0] if start.ndim else 0, *start.strides[1:]), writeable=False)
    return view


def split_outputs(
    requests: Sequence[InferRequest],
    outputs: Mapping[str, Any],
    parameters: Mapping[str, Any] | None = None,
) -> list[InferResponse]:
    """Cut batched outputs back into one ``InferResponse`` per request (views, no copies).

    :param outputs: output name → array whose axis 0 is the whole batch.
    :param parameters: response parameters given to every response.
    :raises InferError: an output's leading dimension is not the batch's total size.
    """
    sizes = [r.batch_size for r in requests]
    total = sum(sizes)
    arrays = {name: np.asarray(value) for name, value in outputs.items()}
    for name, array in arrays.items():
        if array.ndim == 0 or array.shape[0] != total:
            raise InferError(f"output '{name}' has leading dimension {array.shape[:1]} but the batch holds {total}")
    if len(sizes) == 1:  # one request: its outputs are the whole arrays
        return [InferResponse(arrays, parameters)]
    responses = []
    start = 0
    for size in sizes:
        end = start + size
        responses.append(InferResponse({n: a[start:end] for n, a in arrays.items()}, parameters))
        start = end
    return responses
