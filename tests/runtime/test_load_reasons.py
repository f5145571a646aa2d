"""Why a model is unavailable, as a real ``pyserve run`` shows it: one line per model in the
startup table (the full text logged below it), and reasons without tracebacks, server paths or
the server's source locations for clients over HTTP and gRPC (index, metadata, infer). A missing
model file or a SyntaxError says what it is, not which load step ran into it."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from suite_support import RunningServer, write_model

from pyserve.runtime.load_reasons import describe, first_line, public

TENSORS = """
    input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
    output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""
EXPECTED = {
    "syntax": "failed to load 'model.py' of model 'syntax' version 1: SyntaxError: invalid syntax "
              "(at syntax/1/model.py:3)",
    "imports": "failed to load 'model.py' of model 'imports' version 1: ModuleNotFoundError: "
               "No module named 'no_such_module_for_pyserve' (at imports/1/model.py:2)",
    "missing": "Failed to preinitialize Python stub: Python model file not found in 'missing/1/model.py'",
    "noclass": "'model.py' of model 'noclass' defines no class 'TritonPythonModel'",
}


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Path]]:
    repo = tmp_path_factory.mktemp("reasons") / "repo"
    write_model(repo, "fine", 'backend: "identity"' + TENSORS.replace("IN", "INPUT0").replace("OUT", "OUTPUT0"))
    write_model(repo, "syntax", 'backend: "python"' + TENSORS, {"1/model.py": "import numpy\n\ndef broken(:\n"})
    write_model(repo, "imports", 'backend: "python"' + TENSORS,
                {"1/model.py": "import numpy\nimport no_such_module_for_pyserve\n"})
    write_model(repo, "missing", 'backend: "python"' + TENSORS)
    write_model(repo, "noclass", 'backend: "python"' + TENSORS, {"1/model.py": "x = 1\n"})
    server = RunningServer(["--model-repository", str(repo), "--exit-on-error", "false", "--grpc-port", "0"])
    try:
        server.wait_started(60)
        yield server, repo
    finally:
        server.close()


def _grpc_port(server: RunningServer) -> int:
    match = re.search(r"Started GRPCInferenceService at [\d.]+:(\d+)", server.stderr)
    assert match, server.stderr
    return int(match.group(1))


def _clean(reason: str, repo: Path) -> None:
    assert "Traceback" not in reason and "\n" not in reason, reason
    assert str(repo) not in reason and str(repo.resolve()) not in reason, reason
    assert not re.search(r"\(at [\w.]+\.py:\d+\)", reason), reason  # no server source location
    assert "site-packages" not in reason and "auto-complete of the config failed" not in reason, reason


def test_clients_see_each_reason_without_traceback_or_server_paths(broken: tuple[RunningServer, Path]) -> None:
    server, repo = broken
    url = f"http://127.0.0.1:{server.port}"
    index = {e["name"]: e for e in httpx.post(f"{url}/v2/repository/index", json={}).json()}
    assert index["fine"]["state"] == "READY"
    for name, reason in EXPECTED.items():
        assert index[name]["state"] == "UNAVAILABLE" and index[name]["reason"] == reason, index[name]
        _clean(index[name]["reason"], repo)
        metadata = httpx.get(f"{url}/v2/models/{name}")
        assert metadata.status_code == 404 and reason in metadata.json()["error"], metadata.text
        infer = httpx.post(f"{url}/v2/models/{name}/infer",
                           json={"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1], "data": [1]}]})
        assert infer.status_code in (400, 404) and reason in infer.json()["error"], infer.text
        _clean(infer.json()["error"], repo)
    with grpcclient.InferenceServerClient(f"127.0.0.1:{_grpc_port(server)}") as client:
        grpc_index = {m.name: m for m in client.get_model_repository_index().models}
        tensor = grpcclient.InferInput("IN", [1], "FP32")
        tensor.set_data_from_numpy(np.ones(1, dtype=np.float32))
        for name, reason in EXPECTED.items():
            assert grpc_index[name].reason == reason
            with pytest.raises(Exception, match=re.escape(reason)) as metadata_error:
                client.get_model_metadata(name)
            _clean(str(metadata_error.value), repo)
            with pytest.raises(Exception, match=re.escape(reason)) as infer_error:
                client.infer(name, [tensor])
            _clean(str(infer_error.value), repo)


def test_the_startup_table_has_one_line_per_model_and_the_full_text_below(broken: tuple[RunningServer, Path]) -> None:
    server, repo = broken
    log = server.stderr
    table = re.search(r"\n(\+-+\+-+\+-+\+-+\+\n\| Model .*?\n\+-+.*?)\n(?=[IWE]\d{4})", log, re.S)
    assert table, log
    lines = table.group(1).splitlines()
    assert all(line.startswith(("|", "+")) for line in lines), lines
    assert len({len(line) for line in lines}) == 1 and len(lines[0]) < 200, lines
    cells = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    rows = {name: line for name, line in cells.items() if name != "Model"}
    assert sorted(rows) == ["fine", "imports", "missing", "noclass", "syntax"]
    assert "| READY " in rows["fine"]
    assert f"UNAVAILABLE: {EXPECTED['missing'][:77]}... " in rows["missing"]  # cut too
    assert f"UNAVAILABLE: {EXPECTED['syntax'][:77]}... " in rows["syntax"]  # cut
    after = log[table.end():]  # the reasons the table cut, in full, with their tracebacks
    assert "model 'syntax' version 1: failed to load 'model.py' of model 'syntax' version 1:" in after
    assert "Traceback (most recent call last)" in after and "SyntaxError: invalid syntax" in after
    assert f'File "{repo / "syntax" / "1" / "model.py"}", line 3' in after
    assert f"UNAVAILABLE: {EXPECTED['noclass']} " in rows["noclass"]  # short enough to show whole
    assert "model 'missing' version 1: Failed to preinitialize Python stub: Python model file not found in" in after
    assert "model 'noclass' version 1:" not in after  # shown whole: not repeated


# -- the pieces ------------------------------------------------------------------------------------


def test_public_reduces_a_traceback_and_paths(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    text = (f"failed to load 'model.py' of model 'm' version 1:\nTraceback (most recent call last):\n"
            f'  File "/usr/lib/python3/site-packages/x/loader.py", line 9, in load\n    run()\n'
            f'  File "{repo}/m/1/model.py", line 4, in <module>\n    import helper\n'
            f'  File "{repo}/m/1/helper.py", line 2, in <module>\n    raise ValueError("bad")\n'
            f"ValueError: bad weights in {repo}/m/1/weights.bin, not in {sys.prefix}/lib/file.txt nor /data/w.bin")
    reduced = public(text, [repo])
    assert reduced == ("failed to load 'model.py' of model 'm' version 1: ValueError: bad weights in "
                       "m/1/weights.bin, not in file.txt nor /data/w.bin (at m/1/helper.py:2)")
    assert public(reduced, [repo]) == reduced  # idempotent
    chained = ("Traceback (most recent call last):\n  File \"/srv/a.py\", line 1, in f\nKeyError: 'x'\n\n"
               "During handling of the above exception, another exception occurred:\n\n"
               "Traceback (most recent call last):\n  File \"/srv/b.py\", line 2, in g\nRuntimeError: boom")
    assert public(chained, [repo]) == "RuntimeError: boom"
    assert public("see http://host/v2/models/x for more", [repo]) == "see http://host/v2/models/x for more"


def test_describe_labels_only_what_does_not_say_what_it_is() -> None:
    def raised(exc: Exception) -> Exception:
        try:
            raise exc
        except Exception as caught:
            return caught

    text, detail = describe("auto-complete of the config failed", raised(FileNotFoundError("model file 'x' not found")))
    assert text == "model file 'x' not found" and "(raised at " in detail and __file__ in detail
    error = SyntaxError("invalid syntax", ("/r/m/1/model.py", 3, 1, "def f(:\n"))
    assert describe("stage", error)[0] == "/r/m/1/model.py:3: SyntaxError: invalid syntax"
    assert describe("stage", raised(KeyError("k")))[0] == "stage: KeyError: 'k'"
    assert first_line("short") == "short"
    assert first_line("one\ntwo") == "one..."
    assert first_line("x" * 90, width=80) == "x" * 77 + "..."
