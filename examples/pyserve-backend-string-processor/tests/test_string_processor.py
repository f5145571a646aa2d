"""Unit tests of the string_processor example backend, through a real ``PluginHost``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pyserve_string_processor import KeywordClassifier, StringProcessorBackend, tokenize

from pyserve import (
    BackendContext,
    ErrorCode,
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelContext,
)
from pyserve.host.plugins import PluginHost
from pyserve.repository.model_config import (
    normalize,
    parameters,
    parse_config,
    validate,
)

TEXT_IO = """
input [ { name: "TEXT", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [
  { name: "LABEL", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "TOKEN_COUNT", data_type: TYPE_INT32, dims: [ 1 ] }
]
"""
CONFIG = 'backend: "string_processor"\nmax_batch_size: 8\n' + TEXT_IO


@pytest.fixture
def host() -> PluginHost:
    return PluginHost(extra_backends={"string_processor": StringProcessorBackend}, use_entry_points=False)


def make_model(tmp_path: Path, config_text: str) -> ModelContext:
    """A ModelContext for ``config_text`` (without ``name``), normalized and validated."""
    model_dir = tmp_path / "sentiment"
    (model_dir / "1").mkdir(parents=True)
    config = parse_config(config_text, model_dir / "config.pbtxt")
    normalize(config, model_dir)
    assert validate(config, model_dir) == []
    return ModelContext(
        name="sentiment",
        version=1,
        config=config,
        path=model_dir,
        backend=BackendContext("string_processor"),
        parameters=parameters(config),
    )


def param(key: str, value: str) -> str:
    return f'parameters [ {{ key: "{key}", value: {{ string_value: "{value}" }} }} ]\n'


def create(host: PluginHost, model: ModelContext) -> InstanceContext:
    model.state = host.backend("string_processor").hooks.model_create(model=model)
    return InstanceContext(name="sentiment_0_0", kind="CPU", device_id=0, index=0, model=model)


def texts(*values: bytes) -> np.ndarray:
    return np.array([[v] for v in values], dtype=object)


def request(text: np.ndarray, outputs: tuple[str, ...] = ("LABEL", "TOKEN_COUNT")) -> InferRequest:
    return InferRequest("sentiment", 1, {"TEXT": text}, outputs, batch_size=len(text))


def execute(
    host: PluginHost, instance: InstanceContext, requests: list[InferRequest]
) -> list[InferResponse | InferError]:
    responses = host.backend("string_processor").hooks.execute(instance=instance, requests=requests)
    assert len(responses) == len(requests)
    return list(responses)


def test_tokenize_lowercases_and_splits_on_non_alphanumerics() -> None:
    tokens = tokenize("Hello, WORLD!! it's 2024_06 — Grüße")
    assert tokens == ["hello", "world", "it", "s", "2024", "06", "grüße"]
    assert tokenize(" ,.;") == []


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("I love it, GREAT stuff", "positive"),
        ("awful. just awful, and bad", "negative"),
        ("good but bad", "neutral"),
        ("the sky is blue", "neutral"),
        ("", "neutral"),
    ],
)
def test_default_keywords(text: str, label: str) -> None:
    assert KeywordClassifier().classify(tokenize(text)) == label


def test_batched_request_gets_a_label_and_count_per_text(host: PluginHost, tmp_path: Path) -> None:
    instance = create(host, make_model(tmp_path, CONFIG))
    batch = texts(b"I love this, it is great", b"what an awful day", "caf\u00e9 ol\u00e9".encode())

    [response] = execute(host, instance, [request(batch)])

    assert isinstance(response, InferResponse)
    assert response.outputs["LABEL"].tolist() == [[b"positive"], [b"negative"], [b"neutral"]]
    counts = response.outputs["TOKEN_COUNT"]
    assert counts.dtype == np.int32 and counts.tolist() == [[6], [4], [2]]


def test_only_requested_outputs_are_produced(host: PluginHost, tmp_path: Path) -> None:
    instance = create(host, make_model(tmp_path, CONFIG))

    [response] = execute(host, instance, [request(texts(b"good"), ("TOKEN_COUNT",))])

    assert list(response.outputs) == ["TOKEN_COUNT"]


def test_keywords_come_from_model_parameters(host: PluginHost, tmp_path: Path) -> None:
    config = CONFIG + param("positive_words", "Sunny, warm") + param("negative_words", "rain")
    instance = create(host, make_model(tmp_path, config))

    [response] = execute(host, instance, [request(texts(b"a warm day", b"great rain", b"good"))])

    assert response.outputs["LABEL"].tolist() == [[b"positive"], [b"negative"], [b"neutral"]]


def test_invalid_utf8_fails_only_its_request(host: PluginHost, tmp_path: Path) -> None:
    instance = create(host, make_model(tmp_path, CONFIG))

    good, bad, also_good = execute(
        host,
        instance,
        [request(texts(b"great")), request(texts(b"fine", b"bad \xff\xfe")), request(texts(b"bad"))],
    )

    assert isinstance(bad, InferError)
    assert bad.code == ErrorCode.INVALID_ARG
    assert "element 1" in bad.message and "UTF-8" in bad.message
    assert good.outputs["LABEL"].tolist() == [[b"positive"]]
    assert also_good.outputs["LABEL"].tolist() == [[b"negative"]]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (CONFIG.replace("TEXT", "INPUT0"), "'TEXT'"),
        (CONFIG.replace('"LABEL"', '"CLASS"'), "LABEL"),
        (CONFIG.replace("TYPE_INT32", "TYPE_INT64"), "'TOKEN_COUNT' must have data_type TYPE_INT32"),
        (CONFIG.replace("TYPE_STRING, dims: [ 1 ] } ]", "TYPE_FP32, dims: [ 1 ] } ]"), "'TEXT'"),
        (CONFIG.replace("TYPE_INT32, dims: [ 1 ]", "TYPE_INT32, dims: [ 2 ]"), "'TOKEN_COUNT'"),
        (CONFIG + param("positive_words", " , "), "'positive_words'"),
        (CONFIG + param("negative_words", "good"), "share the word(s) ['good']"),
    ],
    ids=["input-name", "output-name", "output-type", "input-type", "output-dims", "empty-list", "overlap"],
)
def test_bad_config_fails_create(host: PluginHost, tmp_path: Path, config: str, message: str) -> None:
    model = make_model(tmp_path, config)

    with pytest.raises(ValueError) as caught:
        host.backend("string_processor").hooks.model_create(model=model)

    assert message in str(caught.value)
