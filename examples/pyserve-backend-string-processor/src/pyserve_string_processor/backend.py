"""The pyserve side: config checks at load time, and tensors in and out at execute time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pyserve import (
    Backend,
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelContext,
)
from pyserve.protocol import data_type_name
from pyserve_string_processor.sentiment import KeywordClassifier, tokenize

TEXT = "TEXT"
"""Input: TYPE_STRING, UTF-8 text, one text per element."""
LABEL = "LABEL"
"""Output: TYPE_STRING, ``positive`` / ``negative`` / ``neutral``, same shape as ``TEXT``."""
TOKEN_COUNT = "TOKEN_COUNT"
"""Output: TYPE_INT32, the number of tokens of each text, same shape as ``TEXT``."""

_OUTPUT_TYPES = {LABEL: "TYPE_STRING", TOKEN_COUNT: "TYPE_INT32"}


class StringProcessorBackend(Backend):
    """Keyword-based sentiment labels for text, one label per element of ``TEXT``.

    The server creates one instance of this class (the entry point names the class) and
    calls ``create_model`` per model version and ``execute`` per gathered batch. The
    ``KeywordClassifier`` returned by ``create_model`` is the model's state; it is
    immutable, so any number of instances may execute at once.
    """

    def create_model(self, model: ModelContext) -> KeywordClassifier:
        """Check the config's tensors and read the keyword parameters.

        :raises ValueError: the config does not declare ``TEXT`` / ``LABEL`` /
            ``TOKEN_COUNT`` as expected, or a keyword parameter is invalid.
        """
        _check_config(model.config)
        return KeywordClassifier.from_parameters(model.parameters)

    def execute(
        self, instance: InstanceContext, requests: Sequence[InferRequest]
    ) -> list[InferResponse | InferError]:
        """Label every text of every request; a request with bad text fails alone."""
        classifier: KeywordClassifier = instance.model.state
        return [_process(classifier, request) for request in requests]


def _check_config(config: Any) -> None:
    inputs = {tensor.name: tensor for tensor in config.input}
    outputs = {tensor.name: tensor for tensor in config.output}
    if set(inputs) != {TEXT}:
        raise ValueError(
            f"the string_processor backend needs exactly one input, '{TEXT}' (got {sorted(inputs)})"
        )
    if set(outputs) != set(_OUTPUT_TYPES):
        raise ValueError(
            f"the string_processor backend needs the outputs {sorted(_OUTPUT_TYPES)} (got {sorted(outputs)})"
        )
    _check_tensor(inputs[TEXT], "input", "TYPE_STRING", list(inputs[TEXT].dims))
    for name, data_type in _OUTPUT_TYPES.items():
        _check_tensor(outputs[name], "output", data_type, list(inputs[TEXT].dims))


def _check_tensor(tensor: Any, kind: str, data_type: str, dims: list[int]) -> None:
    actual = data_type_name(tensor.data_type)
    if actual != data_type:
        raise ValueError(f"{kind} '{tensor.name}' must have data_type {data_type} (got {actual})")
    if list(tensor.dims) != dims:
        raise ValueError(
            f"{kind} '{tensor.name}' must have the dims of input '{TEXT}', {dims} (got {list(tensor.dims)})"
        )


def _process(classifier: KeywordClassifier, request: InferRequest) -> InferResponse | InferError:
    text = request.inputs[TEXT]
    try:
        tokens = [tokenize(_decode(element, position)) for position, element in enumerate(text.flat)]
    except InferError as error:
        return error
    outputs: dict[str, np.ndarray] = {}
    if LABEL in request.requested_outputs:
        labels = [classifier.classify(t).encode() for t in tokens]
        outputs[LABEL] = np.array(labels, dtype=object).reshape(text.shape)
    if TOKEN_COUNT in request.requested_outputs:
        outputs[TOKEN_COUNT] = np.array([len(t) for t in tokens], dtype=np.int32).reshape(text.shape)
    return InferResponse(outputs)


def _decode(element: bytes, position: int) -> str:
    try:
        return element.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InferError.invalid(
            f"input '{TEXT}' element {position} is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
