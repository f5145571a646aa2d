"""Inputs generated from model metadata, and the comparison of outputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


def generate_inputs(
    metadata: Mapping[str, Any],
    *,
    seed: int = 0,
    batch_size: int = 1,
    batched: bool = False,
    variable_dim: int = 3,
) -> dict[str, np.ndarray]:
    """Random inputs for every input of a model, from its KServe metadata (HTTP JSON form).

    The same arguments always give the same arrays. Integers span their whole range, floats
    are finite, BOOL is random, BYTES elements are 0–8 random bytes (NUL and 0xFF included),
    BF16 arrays use ``ml_dtypes.bfloat16``.

    :param metadata: ``client.get_model_metadata(model)`` of ``tritonclient.http``.
    :param seed: the random seed.
    :param batch_size: the leading dimension when ``batched``.
    :param batched: whether the model batches (``max_batch_size > 0``): the first dim of
        every input is then the batch dimension.
    :param variable_dim: the size used for every other ``-1`` dimension.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    inputs: dict[str, np.ndarray] = {}
    for tensor in metadata["inputs"]:
        dims = [int(d) for d in tensor["shape"]]
        if batched and dims:
            dims[0] = batch_size
        shape = tuple(variable_dim if d < 0 else d for d in dims)
        inputs[tensor["name"]] = _random_array(rng, tensor["datatype"], shape)
    return inputs


def _random_array(rng: Any, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    import numpy as np
    from tritonclient.utils import triton_to_np_dtype

    if datatype == "BYTES":
        flat = [
            bytes(rng.integers(0, 256, int(rng.integers(0, 9)), dtype=np.uint8))
            for _ in range(int(np.prod(shape)))
        ]
        values = np.empty(len(flat), dtype=object)
        values[:] = flat
        return values.reshape(shape)
    dtype = np.dtype(triton_to_np_dtype(datatype))
    if datatype == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 8).astype(np.float32).astype(dtype)


def _normalize(array: np.ndarray, datatype: str) -> np.ndarray:
    """Values comparable across clients (tritonclient may read BF16 back as float32)."""
    import numpy as np

    if datatype == "BF16":
        return np.asarray(array).astype(np.float32)
    return np.asarray(array)


def _assert_equal(actual: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray], what: str) -> None:
    import numpy as np

    assert set(actual) == set(expected), f"{what}: outputs {sorted(actual)} != expected {sorted(expected)}"
    for name, value in expected.items():
        got, want = np.asarray(actual[name]), np.asarray(value)
        if want.dtype == object or got.dtype == object:
            equal = got.shape == want.shape and list(got.reshape(-1)) == list(want.reshape(-1))
        else:
            equal = got.shape == want.shape and np.array_equal(
                got.astype(np.float64) if want.dtype.kind == "V" or got.dtype.kind == "V" else got,
                want.astype(np.float64) if want.dtype.kind == "V" or got.dtype.kind == "V" else want,
                equal_nan=got.dtype.kind == "f",
            )
        assert equal, f"{what}: output '{name}' differs:\n got {got!r}\nwant {want!r}"
