"""``pyserve new-backend``: write a ready-to-install backend plugin project.

``create_backend_project("scale", Path("."))`` writes ``./pyserve-backend-scale/``::

    pyproject.toml                      distribution pyserve-backend-scale, entry point
                                        pyserve.backends: scale = ...
    README.md
    src/pyserve_backend_scale/__init__.py   the backend (class or hook-function style)
    src/pyserve_backend_scale/py.typed
    model_repository/scale_model/config.pbtxt, 1/
    tests/test_scale.py                 pyserve.testing fixtures + BackendConformance

The generated backend is small but real: it multiplies its FP32 input by the model
parameter ``scale``, answers a whole dynamic batch with one numpy operation
(``gather_inputs`` / ``split_outputs``) and rejects a request holding NaN or infinity on its
own, without failing the rest of the batch. ``pip install -e pyserve-backend-scale`` then
``pytest pyserve-backend-scale`` passes as generated.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Style = Literal["class", "hooks"]
"""``"class"``: a ``pyserve.Backend`` subclass; ``"hooks"``: ``@pyserve.hookimpl`` functions."""

NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,62}")
"""Backend names: lowercase letters, digits and underscores, starting with a letter."""


class ScaffoldError(ValueError):
    """The project cannot be written (bad name, existing directory); the message says why."""


@dataclass(frozen=True)
class BackendProject:
    """Where a generated project is and what it is called.

    :ivar name: the backend name (entry-point name, ``backend:`` in config.pbtxt).
    :ivar distribution: the distribution name, ``pyserve-backend-<name with dashes>``.
    :ivar package: the import package, ``pyserve_backend_<name>``.
    :ivar model: the example model's name, ``<name>_model``.
    :ivar path: the project directory.
    :ivar style: the backend style written.
    """

    name: str
    distribution: str
    package: str
    model: str
    path: Path
    style: Style


def validate_name(name: str) -> str:
    """Return ``name`` if it can be a backend name.

    :raises ScaffoldError: not lowercase letters/digits/underscores starting with a letter,
        longer than 63 characters, a Python keyword, or ending with an underscore.
    """
    if not NAME_PATTERN.fullmatch(name):
        raise ScaffoldError(
            f"invalid backend name {name!r}: use lowercase letters, digits and underscores, "
            "starting with a letter (at most 63 characters), e.g. 'scale' or 'my_model'"
        )
    if keyword.iskeyword(name) or name.endswith("_") or "__" in name:
        raise ScaffoldError(f"invalid backend name {name!r}: not a keyword, no trailing or double underscore")
    return name


def project_for(name: str, directory: Path, style: Style = "class") -> BackendProject:
    """The project ``create_backend_project`` would write (nothing is written).

    :raises ScaffoldError: the name is invalid.
    """
    validate_name(name)
    distribution = "pyserve-backend-" + name.replace("_", "-")
    return BackendProject(
        name=name,
        distribution=distribution,
        package=f"pyserve_backend_{name}",
        model=f"{name}_model",
        path=directory / distribution,
        style=style,
    )


def create_backend_project(name: str, directory: Path, style: Style = "class") -> BackendProject:
    """Write the plugin project for backend ``name`` under ``directory``.

    :param name: the backend name (see ``validate_name``).
    :param directory: where the project directory is created (made if missing).
    :param style: ``"class"`` or ``"hooks"``.
    :returns: the written project.
    :raises ScaffoldError: invalid name or style, or the project directory already exists
        (nothing is overwritten).
    """
    if style not in ("class", "hooks"):
        raise ScaffoldError(f"unknown style {style!r}: 'class' or 'hooks'")
    project = project_for(name, directory, style)
    if project.path.exists():
        raise ScaffoldError(f"{project.path} already exists; choose another name or --directory")
    files = _files(project)
    for relative, text in files.items():
        path = project.path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (project.path / "model_repository" / project.model / "1").mkdir(parents=True, exist_ok=True)
    return project


# -- templates -------------------------------------------------------------------------------------


def _files(p: BackendProject) -> dict[str, str]:
    backend_source = _CLASS_BACKEND if p.style == "class" else _HOOKS_BACKEND
    entry_point = f"{p.package}:ScaleBackend" if p.style == "class" else p.package
    values = {
        "name": p.name,
        "distribution": p.distribution,
        "package": p.package,
        "model": p.model,
        "entry_point": entry_point,
        "style_words": "a `pyserve.Backend` subclass"
        if p.style == "class"
        else "`@pyserve.hookimpl` functions",
        "plugin_import": "ScaleBackend" if p.style == "class" else "",
    }
    return {
        "pyproject.toml": _PYPROJECT.format(**values),
        "README.md": _README.format(**values),
        f"src/{p.package}/__init__.py": backend_source.format(**values),
        f"src/{p.package}/py.typed": "",
        f"model_repository/{p.model}/config.pbtxt": _CONFIG.format(**values),
        f"model_repository/{p.model}/1/.gitkeep": "",
        f"tests/test_{p.name}.py": _TESTS.format(**values),
    }


_PYPROJECT = """\
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "{distribution}"
version = "0.1.0"
description = "pyserve backend '{name}': multiplies its input by the model parameter 'scale'."
readme = "README.md"
requires-python = ">=3.10"
dependencies = [
    "pyserve-server>=0.1,<0.2",
    "numpy>=1.26",
]

[project.optional-dependencies]
test = ["pytest>=8", "tritonclient[http,grpc]>=2.51"]

# The entry-point name is the backend name a config.pbtxt uses: backend: "{name}".
[project.entry-points."pyserve.backends"]
{name} = "{entry_point}"

[tool.setuptools.packages.find]
where = ["src"]

[tool.setuptools.package-data]
{package} = ["py.typed"]

[tool.pytest.ini_options]
testpaths = ["tests"]
filterwarnings = [
    "error",
    "ignore::DeprecationWarning:tritonclient.*",
    "ignore::DeprecationWarning:geventhttpclient.*",
]
"""

_README = """\
# {distribution}

A pyserve backend named `{name}`, written as {style_words}. It multiplies
the FP32 input `INPUT0` by the model parameter `scale` (default 1) and returns it as `OUTPUT0`.
A dynamic batch is computed with one numpy operation; a request holding NaN or infinity fails
alone with `INVALID_ARG`.

```sh
pip install -e .                                  # registers the entry point pyserve.backends: {name}
pyserve backends --check                          # the backend imports and follows the contract
pyserve run --model-repository model_repository   # serves {model} on :8000 (HTTP) and :8001 (gRPC)
pytest                                            # pyserve.testing's conformance suite + unit tests
```

A model uses it with `backend: "{name}"` in its `config.pbtxt`; see
`model_repository/{model}/config.pbtxt`.
"""

_CONFIG = """\
# Multiplies INPUT0 by the parameter "scale"; requests are batched together (up to 8 rows).
name: "{model}"
backend: "{name}"
max_batch_size: 8
input [
  {{
    name: "INPUT0"
    data_type: TYPE_FP32
    dims: [ -1 ]
  }}
]
output [
  {{
    name: "OUTPUT0"
    data_type: TYPE_FP32
    dims: [ -1 ]
  }}
]
parameters [
  {{
    key: "scale"
    value: {{ string_value: "2" }}
  }}
]
dynamic_batching {{
  max_queue_delay_microseconds: 2000
}}
instance_group [
  {{
    count: 1
    kind: KIND_CPU
  }}
]
"""

_SHARED_HELPERS = '''

def _check(request: InferRequest) -> InferError | None:
    """The error for a request this model refuses, or None."""
    if not np.isfinite(request.inputs["INPUT0"]).all():
        return InferError.invalid("INPUT0 must not contain NaN or infinity")
    return None


def _scale_all(requests: Sequence[InferRequest], scale: float) -> list[InferResponse | InferError]:
    """One answer per request, in order; the good requests are computed as one batch."""
    errors = [_check(request) for request in requests]
    good = [request for request, error in zip(requests, errors) if error is None]
    responses: Iterator[InferResponse] = iter(())
    if good:
        batch = gather_inputs(good, ["INPUT0"])["INPUT0"]  # one array, the requests along axis 0
        responses = iter(split_outputs(good, {{"OUTPUT0": batch * np.float32(scale)}}))
    return [next(responses) if error is None else error for error in errors]


def _scale_parameter(model: ModelContext) -> float:
    raw = model.parameters.get("scale", "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not np.isfinite(scale):
        raise ValueError(f"model parameter 'scale' must be a finite number (got {{raw!r}})")
    return scale
'''

_CLASS_BACKEND = (
    '''\
"""Backend ``{name}``: ``OUTPUT0 = INPUT0 * scale`` (a ``pyserve.Backend`` subclass).

The entry point ``pyserve.backends: {name} = "{entry_point}"`` names the class; the server
instantiates it once with no arguments. The model parameter ``scale`` (a number, default 1)
is read when the model is loaded; a bad value makes the model UNAVAILABLE with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from pyserve import (
    Backend,
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelContext,
    gather_inputs,
    split_outputs,
)

__all__ = ["ScaleBackend"]


class ScaleBackend(Backend):
    """Multiplies ``INPUT0`` by the model's ``scale``; batches with the dynamic batcher."""

    def create_model(self, model: ModelContext) -> float:
        """Read the ``scale`` parameter; the returned value becomes ``model.state``.

        :raises ValueError: ``scale`` is not a finite number.
        """
        return _scale_parameter(model)

    def execute(
        self, instance: InstanceContext, requests: Sequence[InferRequest]
    ) -> list[InferResponse | InferError]:
        """One response per request, in order; a request with NaN/inf gets an error alone."""
        return _scale_all(requests, instance.model.state)
'''
    + _SHARED_HELPERS
)

_HOOKS_BACKEND = (
    '''\
"""Backend ``{name}``: ``OUTPUT0 = INPUT0 * scale`` (``@pyserve.hookimpl`` functions).

The entry point ``pyserve.backends: {name} = "{entry_point}"`` names this module; pyserve
registers it as a pluggy plugin. The model parameter ``scale`` (a number, default 1) is read
when the model is loaded; a bad value makes the model UNAVAILABLE with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from pyserve import (
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelContext,
    gather_inputs,
    hookimpl,
    split_outputs,
)

__all__ = ["pyserve_execute", "pyserve_model_create"]


@hookimpl
def pyserve_model_create(model: ModelContext) -> float:
    """Read the ``scale`` parameter; the returned value becomes ``model.state``.

    :raises ValueError: ``scale`` is not a finite number.
    """
    return _scale_parameter(model)


@hookimpl
def pyserve_execute(
    instance: InstanceContext, requests: Sequence[InferRequest]
) -> list[InferResponse | InferError]:
    """One response per request, in order; a request with NaN/inf gets an error alone."""
    return _scale_all(requests, instance.model.state)
'''
    + _SHARED_HELPERS
)

_TESTS = '''\
"""Tests of backend ``{name}`` against real servers (fixtures from ``pyserve.testing``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from pyserve.testing import BackendConformance, ServerFactory
from tritonclient.utils import InferenceServerException

REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
MODEL = "{model}"
SCALE = 2.0  # the "scale" parameter of model_repository/{model}/config.pbtxt


class TestConformance(BackendConformance):
    """pyserve's conformance suite: datatypes, batching, error isolation, shutdown, reload."""

    backend = "{name}"  # found through the installed entry point (pip install -e .)
    repository = REPOSITORY
    model = MODEL
    datatypes = ("FP32",)
    decoupled = False

    def expected_outputs(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        return {{"OUTPUT0": inputs["INPUT0"] * np.float32(SCALE)}}

    def bad_inputs(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        bad = inputs["INPUT0"].copy()
        bad[..., 0] = np.nan  # the backend itself rejects this request
        return {{"INPUT0": bad}}


@pytest.fixture
def pyserve_repository() -> Path:
    """The repository the pyserve_server / pyserve_client fixtures serve."""
    return REPOSITORY


def infer(client: httpclient.InferenceServerClient, values: list[list[float]]) -> np.ndarray:
    data = np.array(values, dtype=np.float32)
    tensor = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return client.infer(MODEL, [tensor]).as_numpy("OUTPUT0")


def test_scales_the_input(pyserve_client: httpclient.InferenceServerClient) -> None:
    np.testing.assert_array_equal(infer(pyserve_client, [[1.0, -2.5, 0.0]]), [[2.0, -5.0, 0.0]])


def test_nan_is_refused_with_invalid_arg(pyserve_client: httpclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="NaN") as failure:
        infer(pyserve_client, [[float("nan")]])
    assert failure.value.status() == "400"


def test_bad_scale_makes_the_model_unavailable(pyserve_server_factory: ServerFactory, tmp_path: Path) -> None:
    model_dir = tmp_path / MODEL
    (model_dir / "1").mkdir(parents=True)
    config = (REPOSITORY / MODEL / "config.pbtxt").read_text()
    (model_dir / "config.pbtxt").write_text(config.replace('string_value: "2"', 'string_value: "lots"'))
    server = pyserve_server_factory(tmp_path)
    client = httpclient.InferenceServerClient(server.url)
    try:
        assert not client.is_model_ready(MODEL)
        [entry] = client.get_model_repository_index()
        assert "scale" in entry["reason"]
    finally:
        client.close()
'''
