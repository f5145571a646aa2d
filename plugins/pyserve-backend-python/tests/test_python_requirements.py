"""A model's ``requirements.txt``: installed once into a cached virtual environment, reused.

No network: the package the models need is a wheel this module writes (a zip with a module
and its metadata), and pip is pointed at its folder alone (``PIP_CONFIG_FILE`` = /dev/null,
``PIP_NO_INDEX``, ``PIP_FIND_LINKS``). The server's own environment does not have that
package, so a model that imports it can only be served from its own environment.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from pyserve_backend_python import requirements
from python_backend_helpers import start, write_python_model

from pyserve.server.core import ServerThread

pytestmark = pytest.mark.timeout(300)

PACKAGE = "pyserve_req_probe"
DISTRIBUTION = "pyserve-req-probe"

CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "WHERE" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

MODEL_PY = f"""
import sys

import numpy as np
import triton_python_backend_utils as pb_utils
import {PACKAGE}  # only in the model's own environment


class TritonPythonModel:
    def execute(self, requests):
        where = f"{{{PACKAGE}.VALUE}}|{{sys.prefix}}"
        out = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", values * 2),
                pb_utils.Tensor("WHERE", np.array([where.encode()], dtype=np.object_)),
            ]))
        return out
"""

PLAIN_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", values * 2),
                pb_utils.Tensor("WHERE", np.array([b"server"], dtype=np.object_)),
            ]))
        return out
"""


def write_wheel(folder: Path, distribution: str, version: str, files: dict[str, str]) -> Path:
    """A pure-Python wheel of ``files`` (path in the wheel → text), as pip installs it."""
    name = distribution.replace("-", "_")
    info = f"{name}-{version}.dist-info"
    contents = dict(files)
    contents[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n"
    contents[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: pyserve-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, text in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    contents[f"{info}/RECORD"] = "\n".join(record) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in contents.items():
            archive.writestr(path, text)
    return wheel


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wheelhouse")
    write_wheel(folder, DISTRIBUTION, "1.0", {f"{PACKAGE}/__init__.py": 'VALUE = "from-the-wheel"\n'})
    return folder


@pytest.fixture
def offline_pip(wheelhouse: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pip (and uv) see only the wheelhouse: no configured index, no network."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheelhouse))
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("UV_NO_INDEX", "1")
    monkeypatch.setenv("UV_FIND_LINKS", str(wheelhouse))
    monkeypatch.setenv("UV_NO_CONFIG", "1")
    return wheelhouse


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    """What the python backend logs while the test runs."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("pyserve.python_backend")
    handler = Collect(logging.INFO)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def _settings(cache: Path, installer: str = "pip") -> dict[str, dict[str, str]]:
    return {"python": {requirements.CACHE_DIR_KEY: str(cache), requirements.INSTALLER_KEY: installer}}


@contextmanager
def _serving(repo: Path, cache: Path, installer: str = "pip") -> Iterator[ServerThread]:
    server = start(repo, backend_config=_settings(cache, installer))
    try:
        yield server
    finally:
        server.stop()


def _ask(server: ServerThread, model: str) -> tuple[list[int], str, str]:
    with httpclient.InferenceServerClient(server.url) as client:
        data = httpclient.InferInput("IN", [3], "INT32")
        data.set_data_from_numpy(np.array([1, 2, 3], dtype=np.int32))
        result = client.infer(model, [data])
    value, _, prefix = result.as_numpy("WHERE")[0].decode().partition("|")
    return result.as_numpy("OUT").tolist(), value, prefix


def _index(server: ServerThread) -> dict[str, dict[str, str]]:
    with httpclient.InferenceServerClient(server.url) as client:
        return {entry["name"]: entry for entry in client.get_model_repository_index()}


def _published(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.is_symlink())


def _requirements_model(repo: Path, name: str, text: str, in_model_dir: bool = False) -> Path:
    folder = write_python_model(repo, name, CONFIG, MODEL_PY)
    (folder / ("requirements.txt" if in_model_dir else "1/requirements.txt")).write_text(text)
    return folder


@pytest.mark.parametrize("installer", ["pip", "uv"])
def test_a_model_with_requirements_is_served_from_its_environment_which_a_second_start_reuses(
    tmp_path: Path, offline_pip: Path, log_lines: list[str], installer: str,
) -> None:
    if installer == "uv" and requirements.find_uv() is None:
        pytest.skip("uv is not installed")
    assert importlib.util.find_spec(PACKAGE) is None  # the server cannot import it itself
    repo, cache = tmp_path / "repo", tmp_path / "cache"
    _requirements_model(repo, "probe", f"{DISTRIBUTION}==1.0\n")
    _requirements_model(repo, "probe_twin", f"# the same set\n{DISTRIBUTION}==1.0\n", in_model_dir=True)
    _requirements_model(repo, "probe_same", f"{DISTRIBUTION}==1.0\n")  # byte for byte: shares the environment
    write_python_model(repo, "plain", CONFIG, PLAIN_PY)
    with _serving(repo, cache, installer) as server:
        out, value, prefix = _ask(server, "probe")
        assert out == [2, 4, 6] and value == "from-the-wheel"
        _, twin_value, twin_prefix = _ask(server, "probe_twin")
        _, _, same_prefix = _ask(server, "probe_same")
        assert twin_value == "from-the-wheel"
        assert same_prefix == prefix and twin_prefix != prefix  # one environment per distinct set
        assert _ask(server, "plain")[1] == "server"  # a model without requirements: in-process
    created = [line for line in log_lines if "creating a Python environment" in line]
    assert len(created) == 2, created  # two distinct sets, each built once
    assert any(f"{installer}: " in line for line in log_lines)  # the installer's progress is logged
    links = _published(cache)
    assert len(links) == 2 and Path(prefix) in {link.resolve() for link in links}
    markers = {link.name: (link.resolve() / requirements.MARKER) for link in links}
    before = {name: (m.read_bytes(), m.stat().st_mtime_ns, m.stat().st_ino) for name, m in markers.items()}
    builds = sorted((cache / "builds").iterdir())
    assert json.loads(next(iter(markers.values())).read_text())["installer"] == installer

    log_lines.clear()
    with _serving(repo, cache, installer) as server:  # a second start: nothing is built again
        assert _ask(server, "probe")[1:] == ("from-the-wheel", prefix)
        assert _ask(server, "probe_twin")[2] == twin_prefix
    assert not [line for line in log_lines if "creating a Python environment" in line]
    reused = [line for line in log_lines if "reusing the Python environment" in line]
    assert len(reused) == 3, reused
    after = {name: (m.read_bytes(), m.stat().st_mtime_ns, m.stat().st_ino) for name, m in markers.items()}
    assert after == before and sorted((cache / "builds").iterdir()) == builds


def test_an_install_that_fails_leaves_that_model_unavailable_with_pips_message(
    tmp_path: Path, offline_pip: Path,
) -> None:
    repo, cache = tmp_path / "repo", tmp_path / "cache"
    _requirements_model(repo, "unresolvable", "pyserve-req-missing==9.9\n")
    _requirements_model(repo, "garbled", "this is not a requirement !!\n")
    write_python_model(repo, "plain", CONFIG, PLAIN_PY)
    with _serving(repo, cache) as server:
        index = _index(server)
        assert index["unresolvable"]["state"] == "UNAVAILABLE"
        reason = index["unresolvable"]["reason"]
        assert "installing the requirements" in reason and "pip exited with code" in reason
        assert "No matching distribution found for pyserve-req-missing" in reason  # pip's own words
        assert index["garbled"]["state"] == "UNAVAILABLE" and "ERROR:" in index["garbled"]["reason"]
        assert index["plain"]["state"] == "READY" and _ask(server, "plain")[0] == [2, 4, 6]
    assert not _published(cache)  # nothing half-built is published
    assert not list((cache / "builds").iterdir())  # and nothing is left behind


def test_the_requirements_parameter_names_the_file(tmp_path: Path, offline_pip: Path) -> None:
    repo, cache = tmp_path / "repo", tmp_path / "cache"
    named = write_python_model(repo, "named", CONFIG + 'parameters { key: "requirements" value { string_value: '
                               '"$$TRITON_MODEL_DIRECTORY/deps/needs.txt" } }\n', MODEL_PY)
    (named / "deps").mkdir()
    (named / "deps" / "needs.txt").write_text(f"{DISTRIBUTION}\n")
    write_python_model(repo, "missing", CONFIG + 'parameters { key: "requirements" value { string_value: '
                       '"nowhere.txt" } }\n', MODEL_PY)
    write_python_model(repo, "both", CONFIG + 'parameters { key: "requirements" value { string_value: "r.txt" } }\n'
                       'parameters { key: "EXECUTION_ENV_PATH" value { string_value: "/nonexistent" } }\n', MODEL_PY)
    thread_mode = _requirements_model(repo, "thread_mode", f"{DISTRIBUTION}\n")
    (thread_mode / "config.pbtxt").write_text(
        CONFIG + 'parameters { key: "execution_mode" value { string_value: "thread" } }\n')
    with _serving(repo, cache) as server:
        assert _ask(server, "named")[1] == "from-the-wheel"
        index = _index(server)
        assert index["missing"]["state"] == "UNAVAILABLE"
        assert "parameter 'requirements' names" in index["missing"]["reason"]
        assert "nowhere.txt', which is not a file" in index["missing"]["reason"]
        assert "not both" in index["both"]["reason"]
        # thread mode runs with the server's packages: the file is not installed, the import fails
        assert index["thread_mode"]["state"] == "UNAVAILABLE" and PACKAGE in index["thread_mode"]["reason"]


def test_concurrent_builders_build_once_and_a_dead_build_is_replaced(tmp_path: Path, offline_pip: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    wanted = folder / "requirements.txt"
    wanted.write_text(f"{DISTRIBUTION}==1.0\n")
    cache = tmp_path / "cache"
    key = requirements.environment_key(wanted)
    (cache / "builds" / f"{key}-dead").mkdir(parents=True)  # a builder that died half-way
    (cache / "builds" / f"{key}-dead" / "bin").mkdir()
    os.symlink(os.path.join("builds", f"{key}-dead"), cache / key)
    script = textwrap.dedent(f"""
        import logging, sys
        from pathlib import Path
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        from pyserve_backend_python import requirements as r
        env = r.ensure("m", Path({str(wanted)!r}), r.Settings(Path({str(cache)!r}), "pip"))
        print("ROOT", env.root)
    """)
    lock = os.open(cache / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)  # both builders start while the lock is held: they must wait
    try:
        builders = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True) for _ in range(2)]
        deadline_lines: list[str] = []
        for builder in builders:  # each says it waits before the lock is released
            assert builder.stdout is not None
            line = builder.stdout.readline()
            deadline_lines.append(line)
            assert "waiting for another process" in line, line
    finally:
        os.close(lock)
    outputs = [builder.communicate(timeout=240)[0] for builder in builders]
    assert [builder.returncode for builder in builders] == [0, 0], outputs
    roots = {line.split(" ", 1)[1] for output in outputs for line in output.splitlines() if line.startswith("ROOT ")}
    assert len(roots) == 1  # the same environment for both
    assert sum("creating a Python environment" in output for output in outputs) == 1
    assert sum("reusing the Python environment" in output for output in outputs) == 1
    assert [p.name for p in (cache / "builds").iterdir()] == [Path(roots.pop()).name]  # the dead build is gone
    assert requirements.cached(requirements.Settings(cache), key) is not None


def _validate(repo: Path, cache: Path, installer: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pyserve", "validate", str(repo), "--backend-config",
         f"python,{requirements.CACHE_DIR_KEY}={cache}", "--backend-config",
         f"python,{requirements.INSTALLER_KEY}={installer}"],
        capture_output=True, text=True, timeout=240, check=False,
    )


@pytest.mark.parametrize("installer", ["pip", "uv"])
def test_validate_reports_requirements_that_do_not_resolve_without_building_anything(
    tmp_path: Path, offline_pip: Path, installer: str,
) -> None:
    if installer == "uv" and requirements.find_uv() is None:
        pytest.skip("uv is not installed")
    repo, cache = tmp_path / "repo", tmp_path / "cache"
    _requirements_model(repo, "resolvable", f"{DISTRIBUTION}==1.0\n")
    _requirements_model(repo, "unresolvable", f"{DISTRIBUTION}==2.0\n")
    done = _validate(repo, cache, installer)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("unresolvable: version 1: requirements '")
    assert f"cannot be resolved ({installer})" in lines[0]
    said = {"pip": f"No matching distribution found for {DISTRIBUTION}==2.0",  # each installer's own words
            "uv": f"there is no version of {DISTRIBUTION}==2.0"}[installer]
    assert said in lines[0]
    assert not cache.exists() or not _published(cache)  # a dry run: no environment was made
    (repo / "unresolvable" / "1" / "requirements.txt").write_text(f"{DISTRIBUTION}>=1\n")
    done = _validate(repo, cache, installer)
    assert done.returncode == 0 and "OK: no problems found" in done.stdout, done.stdout + done.stderr


def test_settings_are_checked() -> None:
    with pytest.raises(requirements.PythonModelError, match="requirements-installer 'conda' is not one of"):
        requirements.Settings.from_config({requirements.INSTALLER_KEY: "conda"})
    with pytest.raises(requirements.PythonModelError, match="must be a positive number"):
        requirements.Settings.from_config({requirements.TIMEOUT_KEY: "soon"})
    settings = requirements.Settings.from_config({})
    assert settings.cache_dir.parts[-2:] == ("pyserve", "python-envs") and settings.installer == "auto"


def test_the_cache_key_follows_the_text_and_its_includes(tmp_path: Path) -> None:
    base = tmp_path / "base.txt"
    base.write_text("numpy\n")
    first = tmp_path / "a" / "requirements.txt"
    first.parent.mkdir()
    first.write_text("-r ../base.txt\nhttpx\n")
    second = tmp_path / "b" / "requirements.txt"
    second.parent.mkdir()
    second.write_text("-r ../base.txt\nhttpx\n")
    key = requirements.environment_key(first)
    assert key == requirements.environment_key(second)  # the same text: the same environment
    base.write_text("numpy<3\n")  # an included file changed: another set
    assert requirements.environment_key(first) != key
    changed = requirements.environment_key(first)
    second.write_text("-r ../base.txt\nhttpx\n# a comment\n")  # any change of the text counts
    assert requirements.environment_key(second) not in (key, changed)
    local = tmp_path / "c" / "requirements.txt"
    local.parent.mkdir()
    local.write_text("./wheels/pkg.whl\n")
    other = tmp_path / "d" / "requirements.txt"
    other.parent.mkdir()
    other.write_text("./wheels/pkg.whl\n")  # a local path: relative to another folder, another set
    assert requirements.environment_key(local) != requirements.environment_key(other)
