"""pyserve's ``identity`` backend: input *i* of the config comes back as output *i*.

A module-style plugin (the entry point names this module): the hook functions below carry
``pyserve.hookimpl``. Any datatype is served, BYTES and BF16 included, and the arrays are
returned as received, without a copy. See ``IdentityModel`` for the config rules and the
``execute_delay_ms`` / ``report_batch_size`` model parameters.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from pyserve import (
    BackendContext,
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelContext,
    hookimpl,
)
from pyserve_backend_identity.model import ExecuteSnapshot, ExecuteStats, IdentityModel

__all__ = [
    "ExecuteSnapshot", "ExecuteStats", "IdentityModel", "pyserve_backend_fork_safe", "pyserve_execute",
    "pyserve_model_create",
]


@hookimpl
def pyserve_backend_fork_safe(backend: BackendContext) -> bool:
    """True: a model is its parsed config (no threads, nothing tied to the process)."""
    return True


@hookimpl
def pyserve_model_create(model: ModelContext) -> IdentityModel:
    """Check the config and parameters; the returned ``IdentityModel`` becomes ``model.state``.

    :raises ValueError: the config or a parameter is unusable (see ``IdentityModel.from_config``).
    """
    return IdentityModel.from_config(model.config, model.parameters)


@hookimpl
def pyserve_execute(
    instance: InstanceContext, requests: Sequence[InferRequest]
) -> list[InferResponse | InferError]:
    """Echo each request's inputs; sleep ``execute_delay_ms`` once for the whole batch.

    :returns: one entry per request, in order: a response with the requested outputs (zeros
        for one whose optional input was left out, as Triton's identity backend answers), or an
        ``INVALID_ARG`` error for a request lacking another input that a requested output needs.
    """
    state: IdentityModel = instance.model.state
    if state.execute_delay_s:
        time.sleep(state.execute_delay_s)
    batch_size = sum(request.batch_size for request in requests)
    snapshot = state.stats.record(len(requests), batch_size)
    parameters = _batch_parameters(snapshot, batch_size) if state.report_batch_size else None
    return [_echo(state, request, parameters) for request in requests]


def _echo(
    state: IdentityModel, request: InferRequest, parameters: dict[str, int] | None
) -> InferResponse | InferError:
    outputs = {}
    for input_name, output_name in state.pairs:
        if output_name not in request.requested_outputs:
            continue
        array = request.inputs.get(input_name)
        if array is None:
            zero = state.absent.get(output_name)
            if zero is None:
                return InferError.invalid(
                    f"output '{output_name}' was requested but its input '{input_name}' was not given"
                )
            dtype, dims = zero  # an optional input left out: zeros, as Triton's identity backend
            shape = (request.batch_size, *dims) if state.batching else dims
            array = np.full(shape, b"", dtype=object) if dtype.kind == "O" else np.zeros(shape, dtype=dtype)
        outputs[output_name] = array
    return InferResponse(outputs, parameters)


def _batch_parameters(snapshot: ExecuteSnapshot, batch_size: int) -> dict[str, int]:
    return {
        "batch_size": batch_size,
        "execute_count": snapshot.executes,
        "request_count": snapshot.requests,
    }
