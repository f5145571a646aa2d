"""A native library placed where Triton looks wins over an installed Python backend of the same
name, and the startup table says which one serves each model."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from pyserve.testing import ServerFactory, write_model

IDENTITY = """
    name: "{name}"
    backend: "identity"
    max_batch_size: 0
    input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] }} ]
    output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] }} ]
"""


def _infer(client: httpclient.InferenceServerClient, model: str) -> httpclient.InferResult:
    inp = httpclient.InferInput("INPUT0", [3], "FP32")
    inp.set_data_from_numpy(np.array([1.0, 2.0, 3.0], dtype=np.float32))
    result = client.infer(model, [inp])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [1.0, 2.0, 3.0])
    return result


def _served_by_library(result: httpclient.InferResult) -> bool:
    # our C identity backend adds a "batch_requests" response parameter; the Python plugin does not
    return "batch_requests" in (result.get_response().get("parameters") or {})


def _table_rows(caplog: pytest.LogCaptureFixture) -> dict[str, list[str]]:
    tables = [r.getMessage() for r in caplog.records if r.name == "pyserve.server" and "| Model" in r.getMessage()]
    assert tables, "no startup table was logged"
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in tables[-1].splitlines() if line.startswith("|")]
    assert lines[0] == ["Model", "Version", "Status", "Backend"]
    return {cells[0]: cells for cells in lines[1:]}


def test_a_placed_library_wins_over_the_installed_plugin(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("pyserve_backend_identity")  # the installed Python plugin of the same name
    library = backend_libraries["identity"]
    repo = tmp_path / "repo"
    in_version = write_model(repo, "in_version", IDENTITY.format(name="in_version"))
    shutil.copy(library, in_version / "1" / "libtriton_identity.so")
    in_model = write_model(repo, "in_model", IDENTITY.format(name="in_model"))
    shutil.copy(library, in_model / "libtriton_identity.so")
    write_model(repo, "plugin", IDENTITY.format(name="plugin"))
    with caplog.at_level(logging.INFO, logger="pyserve.server"):
        server = pyserve_server_factory(repo)
    with httpclient.InferenceServerClient(server.url) as client:
        assert _served_by_library(_infer(client, "in_version"))
        assert _served_by_library(_infer(client, "in_model"))
        assert not _served_by_library(_infer(client, "plugin"))
    rows = _table_rows(caplog)
    for model, folder in (("in_version", in_version / "1"), ("in_model", in_model)):
        cell = rows[model][3]
        assert cell.startswith("identity (native:"), cell
        assert cell.endswith("libtriton_identity.so)") and str(folder.resolve()) in cell, cell
        assert rows[model][2] == "READY"
    assert re.fullmatch(r"identity \(plugin pyserve-backend-identity \S+\)", rows["plugin"][3]), rows["plugin"]


def test_backend_directory_library_wins_and_a_broken_one_is_not_skipped(
    tmp_path: Path, backend_libraries: dict[str, Path], pyserve_server_factory: ServerFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("pyserve_backend_identity")
    repo = tmp_path / "repo"
    write_model(repo, "from_dir", IDENTITY.format(name="from_dir"))
    backends = tmp_path / "backends"
    (backends / "identity").mkdir(parents=True)
    shutil.copy(backend_libraries["identity"], backends / "identity" / "libtriton_identity.so")
    # a library that cannot load (it imports a function the shim lacks) fails its model with the
    # library's path: the plugin does not silently take over, as Triton would not either
    broken = write_model(repo, "broken", IDENTITY.format(name="broken"))
    shutil.copy(backend_libraries["missing"], broken / "libtriton_identity.so")
    with caplog.at_level(logging.INFO, logger="pyserve.server"):
        server = pyserve_server_factory(repo, backend_directory=str(backends))
    with httpclient.InferenceServerClient(server.url) as client:
        assert _served_by_library(_infer(client, "from_dir"))
        assert not client.is_model_ready("broken")
        reason = {e["name"]: e for e in client.get_model_repository_index()}["broken"]["reason"]
    assert "broken/libtriton_identity.so" in reason and "TRITONSERVER_NoSuchFunction" in reason  # relative to the repository
    rows = _table_rows(caplog)
    assert str((backends / "identity" / "libtriton_identity.so").resolve()) in rows["from_dir"][3]
    assert rows["broken"][2].startswith("UNAVAILABLE")
