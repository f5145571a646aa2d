"""The backend author kit: ``pyserve new-backend``, ``pyserve.testing`` and ``backends --check``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from suite_support import write_model

from pyserve import (
    Backend,
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from pyserve.cli.main import main
from pyserve.cli.scaffold import ScaffoldError, create_backend_project, validate_name
from pyserve.host.check import check_installed, check_plugin
from pyserve.host.plugins import PluginHost
from pyserve.server.core import ServerThread
from pyserve.testing import BackendConformance, ServerFactory

SUBPROCESS_TIMEOUT = 180


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(extra)
    return env


def _run(args: Sequence[str], cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
    )


# -- pyserve new-backend ---------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["class", "hooks"])
def test_scaffolded_project_installs_and_passes_its_tests(tmp_path: Path, style: str) -> None:
    name = f"kit_{style}_{os.getpid()}"
    assert main(["new-backend", name, f"--{style}", "--directory", str(tmp_path)]) == 0
    project = tmp_path / f"pyserve-backend-{name.replace('_', '-')}"
    assert (project / "model_repository" / f"{name}_model" / "config.pbtxt").is_file()
    assert (project / "model_repository" / f"{name}_model" / "1").is_dir()
    pyproject = (project / "pyproject.toml").read_text()
    assert '[project.entry-points."pyserve.backends"]' in pyproject and '"pyserve-server>=' in pyproject
    source = (project / "src" / f"pyserve_backend_{name}" / "__init__.py").read_text()
    assert ("class ScaleBackend(Backend)" in source) == (style == "class")
    assert ("@hookimpl" in source) == (style == "hooks")
    install = _run(
        ["-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "-e", str(project)]
    )
    try:
        assert install.returncode == 0, install.stderr
        check = _run(["-m", "pyserve", "backends", "--check"])
        assert f"ok: backend '{name}'" in check.stdout, check.stdout + check.stderr
        tests = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project)
        assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
        assert " passed" in tests.stdout and "failed" not in tests.stdout
    finally:
        _run(["-m", "pip", "uninstall", "--quiet", "--yes", f"pyserve-backend-{name.replace('_', '-')}"])


@pytest.mark.parametrize("name", ["Scale", "2fast", "my-backend", "class", "x_", "a__b", "", "n" * 64, "é"])
def test_invalid_names_are_refused_with_exit_2(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ScaffoldError):
        validate_name(name)
    assert main(["new-backend", name, "--directory", str(tmp_path)]) == 2
    assert "invalid backend name" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_existing_directory_is_never_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    existing = tmp_path / "pyserve-backend-scale"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    assert main(["new-backend", "scale", "--directory", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]


def test_class_and_hooks_are_exclusive(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["new-backend", "scale", "--class", "--hooks", "--directory", str(tmp_path)])
    assert exit_info.value.code == 2


def test_generated_backends_follow_the_contract(tmp_path: Path) -> None:
    for style in ("class", "hooks"):
        project = create_backend_project(f"gen_{style}", tmp_path, style)  # type: ignore[arg-type]
        sys.path.insert(0, str(project.path / "src"))
        try:
            module = __import__(project.package)
            plugin = module.ScaleBackend() if style == "class" else module
            assert check_plugin(project.name, plugin) == []
        finally:
            sys.path.remove(str(project.path / "src"))
            sys.modules.pop(project.package, None)


# -- pyserve.testing fixtures ---------------------------------------------------------------------


class Doubler(Backend):
    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        return [InferResponse({"OUT": r.inputs["IN"] * 2}) for r in requests]


DOUBLER = """
    backend: "doubler"
    max_batch_size: 0
    input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
    output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""


@pytest.fixture
def pyserve_repository(tmp_path: Path) -> Path:
    write_model(tmp_path, "doubler", DOUBLER)
    return tmp_path


@pytest.fixture
def pyserve_backends() -> Mapping[str, object]:
    return {"doubler": Doubler}


def test_fixtures_serve_http_and_grpc(
    pyserve_server: ServerThread,
    pyserve_client: httpclient.InferenceServerClient,
    pyserve_grpc_client: grpcclient.InferenceServerClient,
) -> None:
    data = np.array([1, 2, 3], dtype=np.int32)
    http_in = httpclient.InferInput("IN", [3], "INT32")
    http_in.set_data_from_numpy(data)
    np.testing.assert_array_equal(pyserve_client.infer("doubler", [http_in]).as_numpy("OUT"), data * 2)
    grpc_in = grpcclient.InferInput("IN", [3], "INT32")
    grpc_in.set_data_from_numpy(data)
    np.testing.assert_array_equal(pyserve_grpc_client.infer("doubler", [grpc_in]).as_numpy("OUT"), data * 2)
    assert pyserve_server.url.startswith("127.0.0.1:") and pyserve_server.grpc_url.startswith("127.0.0.1:")


def test_factory_stops_every_server_at_teardown(
    pyserve_server_factory: ServerFactory, pyserve_repository: Path
) -> None:
    first = pyserve_server_factory(pyserve_repository, backends={"doubler": Doubler})
    second = pyserve_server_factory(pyserve_repository, backends={"doubler": Doubler}, exit_timeout_secs=5.0)
    assert first.url != second.url and first.grpc_url != second.grpc_url
    client = httpclient.InferenceServerClient(second.url)
    try:
        assert client.is_model_ready("doubler")
    finally:
        client.close()


def test_plugin_imports_nothing_heavy() -> None:
    heavy = ("tritonclient", "pyserve.server.core", "grpc", "uvicorn", "starlette", "pyserve.host.plugins")
    probe = _run(["-c", f"import sys, pyserve.testing; print([m for m in {heavy!r} if m in sys.modules])"])
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "[]"


# -- the conformance suite on a decoupled backend, and what it catches --------------------------------


class Counter(Backend):
    """Decoupled: for ``IN`` = [a, b, ...] sends one response per element, then the final flag;
    a negative element fails the request alone."""

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> None:
        for request in requests:
            threading.Thread(target=self._send, args=(request,), daemon=True).start()

    @staticmethod
    def _send(request: InferRequest) -> None:
        sender = request.response_sender()
        values = request.inputs["IN"].reshape(-1)
        if (values < 0).any():
            sender.send(InferError.invalid("negative counts are refused"), final=True)
            return
        for index, value in enumerate(values):
            sender.send(
                InferResponse(
                    {"OUT": np.array([value], dtype=np.int32), "IDX": np.array([index], dtype=np.int32)}
                )
            )
        sender.send(final=True)


class TestDecoupledConformance(BackendConformance):
    backend = "counter"
    plugin = Counter
    model = "counter"
    datatypes = ("INT32",)
    decoupled = True

    def conformance_repository(self, tmp_path: Path) -> Path:
        write_model(
            tmp_path,
            self.model,
            """
            backend: "counter"
            max_batch_size: 0
            model_transaction_policy { decoupled: true }
            input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
            output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
                     { name: "IDX" data_type: TYPE_INT32 dims: [ 1 ] } ]
        """,
        )
        return tmp_path

    def expected_responses(self, inputs: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        values = inputs["IN"].reshape(-1)
        return [
            {"OUT": np.array([v], dtype=np.int32), "IDX": np.array([i], dtype=np.int32)}
            for i, v in enumerate(values)
        ]

    def generate_inputs(
        self, metadata: Mapping[str, object], seed: int, batched: bool
    ) -> dict[str, np.ndarray]:
        return {"IN": np.random.default_rng(seed).integers(0, 1000, 4, dtype=np.int32)}

    def bad_inputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"IN": -np.abs(inputs["IN"]) - 1}


BROKEN_SUITE = '''
import threading
import numpy as np
from pyserve import Backend, gather_inputs, split_outputs
from pyserve.testing import BackendConformance


class Sloppy(Backend):
    """Adds 1 instead of the 2 the test expects, leaks a thread per instance, and fails the
    whole batch when one request is bad."""

    def create_instance(self, instance):
        stop = threading.Event()
        threading.Thread(target=stop.wait, name="sloppy-leak", daemon=True).start()
        return stop

    def execute(self, instance, requests):
        batch = gather_inputs(requests)["IN"]
        if (batch < 0).any():
            raise ValueError("negative input")
        return split_outputs(requests, {"OUT": batch + 1})


class TestSloppy(BackendConformance):
    backend = "sloppy"
    plugin = Sloppy
    model = "sloppy"
    datatypes = ("INT32", "FP32")
    shutdown_grace_s = 0.5

    def conformance_repository(self, tmp_path):
        (tmp_path / "sloppy" / "1").mkdir(parents=True)
        (tmp_path / "sloppy" / "config.pbtxt").write_text(
            'backend: "sloppy"\\nmax_batch_size: 16\\n'
            # a delay long enough that the bad request and the good ones sent with it share a
            # batch however busy the machine is (the sloppy backend fails the whole batch)
            'dynamic_batching { max_queue_delay_microseconds: 1000000 }\\n'
            'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 2 ] } ]\\n'
            'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 2 ] } ]\\n'
        )
        return tmp_path

    def generate_inputs(self, metadata, seed, batched):
        return {"IN": np.random.default_rng(seed).integers(0, 100, (1, 2), dtype=np.int32)}

    def expected_outputs(self, inputs):
        return {"OUT": inputs["IN"] + 2}

    def bad_inputs(self, inputs):
        return {"IN": -inputs["IN"] - 1}
'''


def test_conformance_suite_catches_a_sloppy_backend(tmp_path: Path) -> None:
    (tmp_path / "test_sloppy.py").write_text(textwrap.dedent(BROKEN_SUITE))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    run = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"], cwd=tmp_path)
    failed = {
        line.split("::", 2)[-1].split(" ", 1)[0]
        for line in run.stdout.splitlines()
        if line.startswith("FAILED")
    }
    assert failed == {
        "test_model_is_ready_and_declared",  # FP32 declared by the class but not by the model
        "test_round_trip[INT32-http]",
        "test_round_trip[INT32-grpc]",
        "test_round_trip[FP32-http]",
        "test_round_trip[FP32-grpc]",
        "test_batched_equals_unbatched",
        "test_error_isolation",
        "test_clean_shutdown",
        "test_reload",
    }, run.stdout[-6000:]
    assert "sloppy-leak" in run.stdout
    assert "failed next to a bad one" in run.stdout


# -- pyserve backends --check ------------------------------------------------------------------------


FAKE_PLUGINS = {
    "fake_typos": """
        from pyserve import hookimpl

        @hookimpl
        def pyserve_exectue(instance, requests):
            return []

        @hookimpl
        def pyserve_model_create(model, weights_path):
            return None

        def pyserve_instance_create(instance):
            return None

        @hookimpl
        def pyserve_model_ready(model):
            pass
    """,
    "fake_lazy": """
        from pyserve import Backend

        class Lazy(Backend):
            def create_model(self, model):
                return None
    """,
    "fake_broken": """
        raise RuntimeError("cannot find libfake.so")
    """,
    "fake_good": """
        from pyserve import hookimpl

        @hookimpl
        def pyserve_execute(requests):
            return [None for _ in requests]
    """,
}

FAKE_ENTRY_POINTS = {
    "fake_typos": "fake_typos",
    "fake_lazy": "fake_lazy:Lazy",
    "fake_broken": "fake_broken",
    "fake_good": "fake_good",
}


@pytest.fixture
def fake_site(tmp_path: Path) -> Path:
    """A directory with one fake distribution per fake plugin (dist-info + module)."""
    for module, source in FAKE_PLUGINS.items():
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        dist = "pyserve-backend-" + module.replace("_", "-")
        info = tmp_path / f"{dist.replace('-', '_')}-0.0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
        (info / "entry_points.txt").write_text(
            f"[pyserve.backends]\n{module} = {FAKE_ENTRY_POINTS[module]}\n"
        )
    return tmp_path


def test_backends_check_reports_each_problem_by_distribution_and_hook(fake_site: Path) -> None:
    pythonpath = os.pathsep.join([str(fake_site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    run = _run(["-m", "pyserve", "backends", "--check"], PYTHONPATH=pythonpath)
    assert run.returncode == 1, run.stdout + run.stderr
    errors = run.stderr
    typos = "pyserve-backend-fake-typos: backend 'fake_typos'"
    assert f"{typos}: pyserve_exectue: unknown hook" in errors and "did you mean 'pyserve_execute'" in errors
    assert f"{typos}: pyserve_model_create: wrong signature: argument(s) 'weights_path'" in errors
    assert f"{typos}: pyserve_instance_create: not marked with @pyserve.hookimpl" in errors
    assert f"{typos}: pyserve_model_ready: a server-plugin hook" in errors
    assert f"{typos}: pyserve_execute: required hook missing" in errors
    assert (
        "pyserve-backend-fake-lazy: backend 'fake_lazy': pyserve_execute: Lazy does not override execute()"
        in errors
    )
    assert (
        "pyserve-backend-fake-broken: backend 'fake_broken': " in errors
        and "cannot find libfake.so" in errors
    )
    assert "ok: backend 'fake_good' (pyserve-backend-fake-good 0.0.1)" in run.stdout
    assert "fake_good" not in errors
    assert "problem(s) in " in errors  # other installed backends may add their own


def test_check_passes_the_first_party_backends() -> None:
    import pyserve_backend_identity

    host = PluginHost(extra_backends={"identity": pyserve_backend_identity}, use_entry_points=False)
    infos, problems = check_installed(host)
    assert [i.name for i in infos] == ["identity"]
    assert problems == []


def test_check_reports_a_signature_pluggy_would_refuse() -> None:
    class Odd(Backend):
        def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> None:
            return None

        def pyserve_model_finalize(self, model: object, when: str) -> None:  # shadows the marked hook
            pass

    problems = check_plugin("odd", Odd())
    assert [(p.hook, p.message.split(",")[0]) for p in problems] == [
        ("pyserve_model_finalize", "not marked with @pyserve.hookimpl")
    ]


@pytest.fixture(autouse=True, scope="module")
def _no_leftover_threads() -> Iterator[None]:
    """The module's servers (fixtures, suites) leave no thread behind."""
    before = set(threading.enumerate())
    yield
    leftover = [
        t.name
        for t in threading.enumerate()
        if t not in before and t.is_alive() and t.name.startswith("pyserve")
    ]
    assert leftover == []
