"""The bundled model repository (what ``pyserve run`` serves by default) is valid and loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyserve import BackendContext, ModelContext
from pyserve.host.plugins import PluginHost
from pyserve.repository.model_config import (
    model_io,
    normalize,
    parameters,
    parse_config,
    validate,
)

REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
MODELS = sorted(p.name for p in REPOSITORY.iterdir() if (p / "config.pbtxt").is_file())


def load_config(name: str) -> object:
    model_dir = REPOSITORY / name
    path = model_dir / "config.pbtxt"
    config = parse_config(path.read_text(encoding="utf-8"), path)
    normalize(config, model_dir)
    return config


def test_repository_has_the_documented_models() -> None:
    assert MODELS == ["add_sub", "classifier", "identity_bytes", "identity_fp32", "sentiment", "simple", "square", "tiny_lm"]


@pytest.mark.parametrize("name", MODELS)
def test_config_parses_normalizes_and_validates(name: str) -> None:
    config = load_config(name)

    assert validate(config, REPOSITORY / name) == []
    assert (REPOSITORY / name / "1").is_dir()


def test_classifier_labels_are_read() -> None:
    io = model_io(load_config("classifier"), REPOSITORY / "classifier")

    assert len(io.outputs["OUTPUT0"].labels) == 5


@pytest.mark.parametrize("name", MODELS)
def test_model_is_accepted_by_its_backend(name: str) -> None:
    config = load_config(name)
    host = PluginHost()
    if not host.is_installed(config.backend):
        pytest.skip(f"backend '{config.backend}' is not installed in this environment")
    model = ModelContext(
        name=name,
        version=1,
        config=config,
        path=REPOSITORY / name,
        backend=BackendContext(config.backend),
        parameters=parameters(config),
    )

    host.backend(config.backend).hooks.model_create(model=model)
