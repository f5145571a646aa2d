"""pyserve's ``square`` backend: input N → N responses of N, then the final flag alone.

A decoupled, module-style plugin; responses are sent from a thread per request so the
instance is free again as soon as ``pyserve_execute`` returns.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from pyserve import (
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelContext,
    hookimpl,
)


@hookimpl
def pyserve_model_create(model: ModelContext) -> None:
    """Check that the model is decoupled with INT32 ``IN`` and ``OUT``.

    :raises ValueError: not decoupled, or the tensors are missing.
    """
    if not model.config.model_transaction_policy.decoupled:
        raise ValueError("the square backend needs model_transaction_policy { decoupled: true }")
    if "IN" not in {t.name for t in model.config.input} or "OUT" not in {t.name for t in model.config.output}:
        raise ValueError("the square backend needs input 'IN' and output 'OUT' in the model config")


@hookimpl
def pyserve_execute(instance: InstanceContext, requests: Sequence[InferRequest]) -> None:
    """Start sending each request's responses on its own thread; answer nothing here."""
    for request in requests:
        threading.Thread(target=_square, args=(request,), name=f"square-{instance.name}", daemon=True).start()


def _square(request: InferRequest) -> None:
    sender = request.response_sender()
    values = np.asarray(request.inputs["IN"]).reshape(-1)
    if values.size != 1 or values[0] < 0:
        sender.send(InferError.invalid("IN must hold exactly one non-negative integer"), final=True)
        return
    count = int(values[0])
    for _ in range(count):
        if request.is_cancelled():
            break
        sender.send(InferResponse({"OUT": np.array([count], dtype=np.int32)}))
    sender.send(final=True)
