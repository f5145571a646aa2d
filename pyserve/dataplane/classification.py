"""Triton's classification extension: replace an output by its top-k ``"value:index[:label]"``.

Shared by the HTTP and gRPC frontends. Values print as C's ``%f`` (six decimals) for
floating-point outputs and as integers for integer outputs, as Triton prints them.
"""

from __future__ import annotations

import numpy as np

from pyserve.api.errors import InferError


def classify(array: np.ndarray, k: int, labels: tuple[str, ...], batched: bool, name: str) -> np.ndarray:
    """Top-``k`` entries per batch row (or of the whole tensor) as a BYTES array.

    :returns: shape ``[batch, k']`` for batched outputs, ``[k']`` otherwise, where ``k'`` is
        ``min(k, class count)``.
    :raises InferError: the output is not numeric or ``k`` is not positive.
    """
    if k < 1:
        raise InferError.invalid(f"classification count for output '{name}' must be >= 1")
    if array.dtype.kind not in "biuf" and array.dtype.name != "bfloat16":
        raise InferError.invalid(f"classification is not supported for output '{name}' of this datatype")
    rows = array.reshape(array.shape[0], -1) if batched and array.ndim > 0 else array.reshape(1, -1)
    count = min(k, rows.shape[1])
    as_float = array.dtype.kind == "f" or array.dtype.name == "bfloat16"
    out = np.empty((rows.shape[0], count), dtype=object)
    for r, row in enumerate(rows):
        values = row.astype(np.float64) if array.dtype.name == "bfloat16" else row
        top = np.argsort(-values.astype(np.float64), kind="stable")[:count]
        for j, index in enumerate(top):
            value = values[index]
            text = f"{float(value):f}" if as_float else str(int(value))
            if index < len(labels) and labels[index]:  # an empty label line: none, as in Triton
                text = f"{text}:{index}:{labels[index]}"
            else:
                text = f"{text}:{index}"
            out[r, j] = text.encode("utf-8")
    return out if batched else out.reshape(count)
