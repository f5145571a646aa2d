"""pyserve's ``repeat`` backend: one response per element of ``IN``, with optional delays.

A module-style plugin. ``pyserve_execute`` hands each request to a sender thread and returns
``None`` at once, so the instance is free for the next request while responses are still
being sent — which is what a decoupled model is for. As Triton's repeat backend, it also
serves a model that is not decoupled: a request of one element then gets its one response
(with more, the frontends fail it: "expected a single response, got N").
"""

from __future__ import annotations

import threading
import time
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
from pyserve.api.inference import BackendResponseSender

REQUIRED_INPUTS = ("IN",)
OUTPUTS = ("OUT", "IDX")


@hookimpl
def pyserve_model_create(model: ModelContext) -> None:
    """Check that the model declares the tensors this backend uses.

    :raises ValueError: ``IN`` / ``OUT`` / ``IDX`` missing.
    """
    inputs = {t.name for t in model.config.input}
    outputs = {t.name for t in model.config.output}
    missing = [n for n in REQUIRED_INPUTS if n not in inputs] + [n for n in OUTPUTS if n not in outputs]
    if missing:
        raise ValueError(f"the repeat backend needs the tensors {missing} in the model config")


@hookimpl
def pyserve_execute(instance: InstanceContext, requests: Sequence[InferRequest]) -> None:
    """Start sending each request's responses on its own thread; answer nothing here (the
    senders are taken here, so that the server knows the answers come later)."""
    for request in requests:
        threading.Thread(
            target=_repeat, args=(request, request.response_sender()), name=f"repeat-{instance.name}", daemon=True
        ).start()


def _repeat(request: InferRequest, sender: BackendResponseSender) -> None:
    values = np.asarray(request.inputs["IN"]).reshape(-1)
    delays = request.inputs.get("DELAY")
    delays = np.asarray(delays).reshape(-1) if delays is not None else np.zeros(0, dtype=np.uint32)
    if delays.size and delays.size != values.size:
        sender.send(InferError.invalid(
            f"DELAY has {delays.size} element(s) but IN has {values.size}; give one delay per element"
        ), final=True)
        return
    for index, value in enumerate(values):
        if delays.size:
            time.sleep(float(delays[index]) / 1000.0)
        if request.is_cancelled():
            break
        sender.send(InferResponse({
            "OUT": np.array([value], dtype=np.int32),
            "IDX": np.array([index], dtype=np.uint32),
        }))
    wait = request.inputs.get("WAIT")
    if wait is not None and np.asarray(wait).size:
        time.sleep(float(np.asarray(wait).reshape(-1)[0]) / 1000.0)
    sender.send(final=True)
