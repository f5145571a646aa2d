"""The backend plugin contract, exercised end to end on real servers.

Every test starts a server on a loopback port and talks to it with ``tritonclient.http``:
function-style and class-style backends, the lifecycle order and threads, failures in each
hook, discovery through real entry points (lazily imported), missing backends, and server
plugins wrapping ``pyserve_execute``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import textwrap
import threading
import types
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pluggy
import pytest
import tritonclient.http as httpclient
from suite_support import write_model
from tritonclient.utils import InferenceServerException

import pyserve
from pyserve import (
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelContext,
)
from pyserve.host.plugins import PluginHost
from pyserve.server.core import ServerThread

Event = tuple[Any, ...]


@pytest.fixture
def pyserve_logs(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    """caplog for pyserve's loggers, even if ``pyserve.logs.configure`` stopped propagation."""
    monkeypatch.setattr(logging.getLogger("pyserve"), "propagate", True)
    return caplog


# ---------------------------------------------------------------------------
# Helpers


def model_config(backend: str, *, count: int = 1, params: dict[str, str] | None = None, extra: str = "") -> str:
    """A two-element FP32 model without batching, for the test backends below."""
    parameters = "".join(
        f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in (params or {}).items()
    )
    return textwrap.dedent(
        f"""
        backend: "{backend}"
        max_batch_size: 0
        input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
        output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
        instance_group [ {{ count: {count} kind: KIND_CPU }} ]
        """
    ) + parameters + extra


def infer(server: ServerThread, model: str, values: Sequence[float] = (1.0, 2.0)) -> np.ndarray:
    """One inference of ``model``; returns OUTPUT0 (raises InferenceServerException)."""
    client = httpclient.InferenceServerClient(server.url)
    try:
        tensor = httpclient.InferInput("INPUT0", [2], "FP32")
        tensor.set_data_from_numpy(np.asarray(values, dtype=np.float32))
        result = client.infer(model, [tensor])
        output = result.as_numpy("OUTPUT0")
        assert output is not None
        return output
    finally:
        client.close()


def index(server: ServerThread) -> dict[str, dict[str, str]]:
    """The repository index by model name (single-version models)."""
    client = httpclient.InferenceServerClient(server.url)
    try:
        return {entry["name"]: entry for entry in client.get_model_repository_index()}
    finally:
        client.close()


def ready(server: ServerThread, model: str, version: str = "") -> bool:
    client = httpclient.InferenceServerClient(server.url)
    try:
        return bool(client.is_model_ready(model, version))
    finally:
        client.close()


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Recorder(pyserve.Backend):
    """A class-style backend recording every call; model parameters make hooks fail.

    ``fail`` parameter values: ``model_create``, ``instance_create:<index>``, ``execute``,
    ``wrong_length``, ``per_request`` (negative first input → INVALID_ARG, zero → an
    exception instance).

    ``execute`` is overridden without ``@hookimpl``: the base class forwards to it.
    """

    def __init__(self, fail_initialize: bool = False) -> None:
        self.events: list[Event] = []
        self.fail_initialize = fail_initialize
        self._lock = threading.Lock()

    def record(self, *event: Any) -> None:
        with self._lock:
            self.events.append(event)

    def of(self, kind: str) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e[0] == kind]

    def initialize(self, backend: pyserve.BackendContext) -> None:
        self.record("backend_initialize", backend.name)
        if self.fail_initialize:
            raise RuntimeError("no licence for this backend")

    def finalize(self, backend: pyserve.BackendContext) -> None:
        self.record("backend_finalize", backend.name)

    def create_model(self, model: ModelContext) -> Any:
        self.record("model_create", model.name, model.version)
        if model.parameters.get("fail") == "model_create":
            raise ValueError("weights file is corrupt")
        return {"created": model.name}

    def finalize_model(self, model: ModelContext) -> None:
        self.record("model_finalize", model.name, model.version)

    def create_instance(self, instance: InstanceContext) -> Any:
        self.record("instance_create", instance.model.name, instance.model.version, instance.name)
        if instance.model.parameters.get("fail") == f"instance_create:{instance.index}":
            raise MemoryError("out of device memory")
        return instance.name

    def finalize_instance(self, instance: InstanceContext) -> None:
        self.record("instance_finalize", instance.model.name, instance.model.version, instance.name)

    def execute(
        self, instance: InstanceContext, requests: Sequence[InferRequest]
    ) -> Sequence[InferResponse | InferError | BaseException]:
        thread = threading.current_thread()
        self.record("execute", instance.model.name, instance.name, thread.name, _on_event_loop(), len(requests))
        assert instance.model.state == {"created": instance.model.name}
        assert instance.state == instance.name
        fail = instance.model.parameters.get("fail")
        if fail == "execute":
            raise RuntimeError("boom in execute")
        if fail == "wrong_length":
            return []
        results: list[InferResponse | InferError | BaseException] = []
        for request in requests:
            first = float(request.inputs["INPUT0"][0])
            if fail == "per_request" and first < 0:
                results.append(InferError.invalid(f"negative input {first} is not allowed"))
            elif fail == "per_request" and first == 0:
                results.append(ZeroDivisionError("zero is not allowed"))
            else:
                results.append(InferResponse({"OUTPUT0": request.inputs["INPUT0"] * 2}))
        return results


def function_backend(calls: list[str]) -> types.ModuleType:
    """A module-style backend built at run time (pluggy needs a real module or object)."""
    module = types.ModuleType("test_function_backend")

    @pyserve.hookimpl
    def pyserve_model_create(model: ModelContext) -> str:
        calls.append(f"create {model.name}")
        return "function-state"

    @pyserve.hookimpl
    def pyserve_execute(instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        calls.append(f"execute {instance.name}")
        assert instance.model.state == "function-state"
        return [InferResponse({"OUTPUT0": r.inputs["INPUT0"] + 1}) for r in requests]

    module.pyserve_model_create = pyserve_model_create  # type: ignore[attr-defined]
    module.pyserve_execute = pyserve_execute  # type: ignore[attr-defined]
    return module


# ---------------------------------------------------------------------------
# Function style, class style, and the pluggy subclassing pitfall


def test_function_and_class_style_backends_are_served(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> None:
    calls: list[str] = []
    recorder = Recorder()

    class Plus10(pyserve.Backend):
        """Registered as the class itself: the server instantiates it."""

        instances: list[Plus10] = []

        def __init__(self) -> None:
            Plus10.instances.append(self)

        def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
            return [InferResponse({"OUTPUT0": r.inputs["INPUT0"] + 10}) for r in requests]

    repo = make_repo({"fn": model_config("fn"), "cls": model_config("cls"), "plus": model_config("plus")})
    server = start_server(repo, backends={"fn": function_backend(calls), "cls": recorder, "plus": Plus10},
                          use_entry_points=False)

    np.testing.assert_array_equal(infer(server, "fn", (1, 2)), [2, 3])
    assert calls == ["create fn", "execute fn_0_0"]
    np.testing.assert_array_equal(infer(server, "cls", (1, 2)), [2, 4])
    assert len(recorder.of("execute")) == 1  # the undecorated override was called
    np.testing.assert_array_equal(infer(server, "plus", (1, 2)), [11, 12])
    assert len(Plus10.instances) == 1


def test_backend_class_that_is_not_a_backend_subclass_is_rejected(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> None:
    class NotABackend:
        pass

    repo = make_repo({"m": model_config("odd")})
    server = start_server(repo, backends={"odd": NotABackend}, use_entry_points=False)
    entry = index(server)["m"]
    assert entry["state"] == "UNAVAILABLE"
    assert "not a pyserve.Backend subclass" in entry["reason"]


# ---------------------------------------------------------------------------
# Lifecycle order and threads


def test_lifecycle_order_and_threads(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> None:
    recorder = Recorder()
    repo = make_repo({
        "a": model_config("rec", count=2, extra="version_policy { all { } }\n"),
        "b": model_config("rec", count=2),
    }, versions=(1, 2))
    server = start_server(repo, backends={"rec": recorder}, use_entry_points=False)

    for _ in range(4):
        infer(server, "a")
        infer(server, "b")
    assert ready(server, "a", "1") and ready(server, "a", "2") and ready(server, "b", "2")
    assert not ready(server, "b", "1")  # default policy: latest 1

    executes = recorder.of("execute")
    assert len(executes) == 8
    for _, model, instance, thread_name, on_loop, count in executes:
        assert instance in (f"{model}_0_0", f"{model}_0_1")
        assert instance in thread_name
        assert thread_name not in ("pyserve-server", "MainThread")
        assert not on_loop
        assert count == 1

    server.stop()
    events = recorder.events
    assert events[0] == ("backend_initialize", "rec")
    assert recorder.of("backend_initialize") == [("backend_initialize", "rec")]
    assert events[-1] == ("backend_finalize", "rec")
    assert recorder.of("backend_finalize") == [("backend_finalize", "rec")]
    assert sorted(recorder.of("model_create")) == [("model_create", "a", 1), ("model_create", "a", 2),
                                                   ("model_create", "b", 2)]

    for model, version in (("a", 1), ("a", 2), ("b", 2)):
        mine = [e[0:1] + e[3:] for e in events if e[1:3] == (model, version)]
        expected = [
            ("model_create",),
            ("instance_create", f"{model}_0_0"),
            ("instance_create", f"{model}_0_1"),
            ("instance_finalize", f"{model}_0_1"),
            ("instance_finalize", f"{model}_0_0"),
            ("model_finalize",),
        ]
        assert mine == expected, (model, version, events)
        # Instances of a version are created before it is finalized, and finalized in
        # reverse, after the version's last execute.
        finalize_at = events.index(("instance_finalize", model, version, f"{model}_0_1"))
        execute_at = max(i for i, e in enumerate(events) if e[0] == "execute" and e[1] == model)
        assert finalize_at > execute_at


# ---------------------------------------------------------------------------
# Failures in each hook


def test_backend_initialize_failure_only_hits_its_models(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> None:
    broken, good = Recorder(fail_initialize=True), Recorder()
    repo = make_repo({"x1": model_config("broken"), "x2": model_config("broken"), "ok": model_config("good")})
    server = start_server(repo, backends={"broken": broken, "good": good}, use_entry_points=False)

    entries = index(server)
    for name in ("x1", "x2"):
        assert entries[name]["state"] == "UNAVAILABLE"
        assert "no licence for this backend" in entries[name]["reason"]
        assert "broken" in entries[name]["reason"]
    assert entries["ok"]["state"] == "READY"
    infer(server, "ok")
    assert len(broken.of("backend_initialize")) == 1  # not retried for the second model
    server.stop()
    assert broken.of("backend_finalize") == []  # initialize failed: no finalize
    assert broken.of("model_create") == []
    assert good.of("backend_finalize") == [("backend_finalize", "good")]


def test_model_create_failure(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> None:
    recorder = Recorder()
    repo = make_repo({"bad": model_config("rec", params={"fail": "model_create"}), "ok": model_config("rec")})
    server = start_server(repo, backends={"rec": recorder}, use_entry_points=False)

    entries = index(server)
    assert entries["bad"]["state"] == "UNAVAILABLE"
    assert "weights file is corrupt" in entries["bad"]["reason"]
    assert entries["ok"]["state"] == "READY"
    with pytest.raises(InferenceServerException) as info:
        infer(server, "bad")
    assert "weights file is corrupt" in info.value.message()
    server.stop()
    bad = [e for e in recorder.events if len(e) > 1 and e[1] == "bad"]
    assert bad == [("model_create", "bad", 1)]  # no instance, no finalize


def test_instance_create_failure_finalizes_what_was_created(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> None:
    recorder = Recorder()
    repo = make_repo({"bad": model_config("rec", count=3, params={"fail": "instance_create:1"}),
                      "ok": model_config("rec")})
    server = start_server(repo, backends={"rec": recorder}, use_entry_points=False)

    entries = index(server)
    assert entries["bad"]["state"] == "UNAVAILABLE"
    assert "out of device memory" in entries["bad"]["reason"]
    bad = [e for e in recorder.events if len(e) > 1 and e[1] == "bad"]
    assert bad == [
        ("model_create", "bad", 1),
        ("instance_create", "bad", 1, "bad_0_0"),
        ("instance_create", "bad", 1, "bad_0_1"),
        ("instance_finalize", "bad", 1, "bad_0_0"),
        ("model_finalize", "bad", 1),
    ]
    infer(server, "ok")
    server.stop()
    assert [e for e in recorder.events if len(e) > 1 and e[1] == "bad"] == bad  # nothing more at shutdown


def test_execute_raising_fails_the_request_only(
    start_server: Callable[..., ServerThread], make_repo: Callable[..., Path], pyserve_logs: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    repo = make_repo({"bad": model_config("rec", params={"fail": "execute"}), "ok": model_config("rec")})
    server = start_server(repo, backends={"rec": recorder}, use_entry_points=False)

    with pyserve_logs.at_level(logging.ERROR, logger="pyserve"):
        with pytest.raises(InferenceServerException) as info:
            infer(server, "bad")
    assert info.value.status() == "500"
    assert "boom in execute" in info.value.message()
    assert "'bad'" in info.value.message()
    logged = [r for r in pyserve_logs.records if "boom in execute" in r.getMessage()]
    assert len(logged) == 1
    # The instance keeps serving: the next request reaches execute again.
    with pytest.raises(InferenceServerException):
        infer(server, "bad")
    assert len(recorder.of("execute")) == 2
    np.testing.assert_array_equal(infer(server, "ok", (1, 2)), [2, 4])


def test_execute_wrong_length(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> None:
    repo = make_repo({"short": model_config("rec", params={"fail": "wrong_length"})})
    server = start_server(repo, backends={"rec": Recorder()}, use_entry_points=False)
    with pytest.raises(InferenceServerException) as info:
        infer(server, "short")
    assert info.value.status() == "500"
    assert "returned 0 response(s) for 1 request(s)" in info.value.message()


def test_per_request_errors(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> None:
    repo = make_repo({"m": model_config("rec", count=2, params={"fail": "per_request"})})
    server = start_server(repo, backends={"rec": Recorder()}, use_entry_points=False)

    results: dict[float, Any] = {}

    def send(first: float) -> None:
        try:
            results[first] = infer(server, "m", (first, 1.0))
        except InferenceServerException as exc:
            results[first] = exc

    threads = [threading.Thread(target=send, args=(v,)) for v in (-1.0, 0.0, 3.0, -5.0, 4.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for good in (3.0, 4.0):
        np.testing.assert_array_equal(results[good], [good * 2, 2.0])
    for bad in (-1.0, -5.0):
        error = results[bad]
        assert isinstance(error, InferenceServerException)
        assert error.status() == "400"
        assert f"negative input {bad}" in error.message()
    zero = results[0.0]
    assert isinstance(zero, InferenceServerException)
    assert zero.status() == "500"
    assert "ZeroDivisionError: zero is not allowed" in zero.message()


# ---------------------------------------------------------------------------
# Discovery through real entry points, imported lazily

LAZY_MODULE = "lazy_backend_pkg"

LAZY_SOURCE = '''
"""A backend installed as a fake distribution by the tests."""
import pyserve

CREATED = []


@pyserve.hookimpl
def pyserve_model_create(model):
    CREATED.append(model.name)


@pyserve.hookimpl
def pyserve_execute(instance, requests):
    return [pyserve.InferResponse({"OUTPUT0": r.inputs["INPUT0"] * 3}) for r in requests]
'''


@pytest.fixture
def lazy_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fake installed distribution declaring backend ``lazyb`` and platform ``lazy_platform``."""
    site = tmp_path / "site"
    dist_info = site / "pyserve_backend_lazyb-1.2.3.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pyserve-backend-lazyb\nVersion: 1.2.3\n"
    )
    (dist_info / "entry_points.txt").write_text(
        f"[pyserve.backends]\nlazyb = {LAZY_MODULE}\n\n[pyserve.platforms]\nlazy_platform = lazyb\n"
    )
    (site / f"{LAZY_MODULE}.py").write_text(LAZY_SOURCE)
    sys.modules.pop(LAZY_MODULE, None)
    monkeypatch.syspath_prepend(str(site))
    try:
        yield site
    finally:
        sys.modules.pop(LAZY_MODULE, None)


def test_installed_lists_backend_without_importing(lazy_distribution: Path) -> None:
    infos = {info.name: info for info in PluginHost().installed()}
    info = infos["lazyb"]
    assert info.distribution == "pyserve-backend-lazyb"
    assert info.version == "1.2.3"
    assert info.platforms == ("lazy_platform",)
    assert info.source == LAZY_MODULE
    assert "identity" in infos
    assert LAZY_MODULE not in sys.modules


def test_entry_point_backend_is_imported_only_when_used(
    lazy_distribution: Path, start_server: Callable[..., ServerThread], tmp_path: Path
) -> None:
    unused = tmp_path / "unused"
    write_model(unused, "ident", model_config("identity"))
    server = start_server(unused)
    infer(server, "ident")
    assert LAZY_MODULE not in sys.modules
    server.stop()

    used = tmp_path / "used"
    write_model(used, "by_backend", model_config("lazyb"))
    write_model(used, "by_platform", model_config("lazyb").replace('backend: "lazyb"', 'platform: "lazy_platform"'))
    server = start_server(used)
    assert LAZY_MODULE in sys.modules
    np.testing.assert_array_equal(infer(server, "by_backend", (1, 2)), [3, 6])
    np.testing.assert_array_equal(infer(server, "by_platform", (1, 2)), [3, 6])
    assert sorted(sys.modules[LAZY_MODULE].CREATED) == ["by_backend", "by_platform"]


# ---------------------------------------------------------------------------
# A backend that is not installed


def test_missing_backend(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> None:
    repo = make_repo({"ghost": model_config("nosuch"), "ok": model_config("identity")})
    server = start_server(repo)
    entry = index(server)["ghost"]
    assert entry["state"] == "UNAVAILABLE"
    assert "'nosuch'" in entry["reason"]
    assert "pip install pyserve-backend-nosuch" in entry["reason"]
    np.testing.assert_array_equal(infer(server, "ok", (1, 2)), [1, 2])
    assert httpx.get(f"http://{server.url}/v2/health/ready").status_code == 400
    assert httpx.get(f"http://{server.url}/v2/health/live").status_code == 200


# ---------------------------------------------------------------------------
# Server plugins


class ExecuteCounter:
    """A server plugin wrapping every execute of every model."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.ready: list[tuple[str, int]] = []
        self.unloaded: list[tuple[str, int]] = []

    @pyserve.hookimpl(wrapper=True)
    def pyserve_execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> Any:
        self.counts[instance.model.name] += len(requests)
        result = yield
        assert len(result) == len(requests)
        return result

    @pyserve.hookimpl
    def pyserve_model_ready(self, model: ModelContext) -> None:
        self.ready.append((model.name, model.version))

    @pyserve.hookimpl
    def pyserve_model_unloaded(self, model: ModelContext) -> None:
        self.unloaded.append((model.name, model.version))


def test_server_plugin_wraps_execute_of_every_backend(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> None:
    alpha, beta = Recorder(), Recorder()
    counter = ExecuteCounter()
    repo = make_repo({"ma": model_config("alpha"), "mb": model_config("beta")})
    server = start_server(repo, backends={"alpha": alpha, "beta": beta}, server_plugins=(counter,),
                          use_entry_points=False)
    assert sorted(counter.ready) == [("ma", 1), ("mb", 1)]
    for _ in range(3):
        infer(server, "ma")
    infer(server, "mb")
    assert counter.counts == {"ma": 3, "mb": 1}
    assert {e[1] for e in alpha.of("execute")} == {"ma"} and len(alpha.of("execute")) == 3
    assert {e[1] for e in beta.of("execute")} == {"mb"} and len(beta.of("execute")) == 1
    assert {e[1] for e in alpha.of("model_create")} == {"ma"}
    assert {e[1] for e in beta.of("model_create")} == {"mb"}
    assert counter.unloaded == []
    server.stop()
    assert sorted(counter.unloaded) == [("ma", 1), ("mb", 1)]
    assert alpha.of("backend_finalize") == [("backend_finalize", "alpha")]
    assert beta.of("backend_finalize") == [("backend_finalize", "beta")]


def test_execute_skips_pluggy_dispatch_until_a_server_plugin_wraps_it(
    start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]
) -> None:
    """A backend's execute is called directly while it is the only implementation; a server
    plugin added while the model is serving takes part from the next request on."""
    alpha = Recorder()
    server = start_server(make_repo({"ma": model_config("alpha")}), backends={"alpha": alpha},
                          use_entry_points=False)
    host = server.server.plugins
    hooks = host.backend("alpha").hooks
    assert hooks.execute_direct is not None
    infer(server, "ma")
    counter = ExecuteCounter()
    host.add_server_plugin(counter)
    assert hooks.execute_direct is None
    assert infer(server, "ma", (3.0, 4.0)).tolist() == [6.0, 8.0]  # Recorder doubles
    assert counter.counts == {"ma": 1}
    assert len(alpha.of("execute")) == 2


def test_server_plugin_must_wrap_execute() -> None:
    class Greedy:
        @pyserve.hookimpl
        def pyserve_execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[Any]:
            return []

    with pytest.raises(pluggy.PluginValidationError, match="wrapper=True"):
        PluginHost(server_plugins=[Greedy()], use_entry_points=False)
    host = PluginHost(use_entry_points=False)
    with pytest.raises(pluggy.PluginValidationError, match="only wrap execute"):
        host.add_server_plugin(Greedy())
    assert host.server_plugins == []


def test_rejected_server_plugin_is_not_left_registered(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> None:
    class Typo:
        @pyserve.hookimpl
        def pyserve_modle_ready(self, model: ModelContext) -> None:
            pass

    host = PluginHost(extra_backends={"rec": Recorder()}, use_entry_points=False)
    for plugin in (Typo(), ExecuteCounter()):
        with pytest.raises(pluggy.PluginValidationError):
            host.add_server_plugin(plugin if isinstance(plugin, Typo) else _greedy(plugin))
    assert host.pm.get_plugins() == set()
    assert host.backend("rec").init_error is None  # later registrations are not poisoned


def _greedy(counter: ExecuteCounter) -> object:
    """A plugin that also returns a result from execute (not a wrapper)."""

    class Greedy:
        @pyserve.hookimpl
        def pyserve_model_ready(self, model: ModelContext) -> None:
            counter.ready.append((model.name, model.version))

        @pyserve.hookimpl
        def pyserve_execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[Any]:
            return []

    return Greedy()


def test_backend_breaking_the_contract(start_server: Callable[..., ServerThread], make_repo: Callable[..., Path]) -> None:
    class Misspelt:
        @pyserve.hookimpl
        def pyserve_exectue(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[Any]:
            return []

    shared = Recorder()
    repo = make_repo({"typo": model_config("typo"), "one": model_config("one"), "two": model_config("two"),
                      "ok": model_config("good")})
    server = start_server(repo, backends={"typo": Misspelt(), "one": shared, "two": shared, "good": Recorder()},
                          use_entry_points=False, model_load_thread_count=1)
    entries = index(server)
    assert entries["typo"]["state"] == "UNAVAILABLE"
    assert "does not follow the pyserve plugin contract" in entries["typo"]["reason"]
    assert "pyserve_exectue" in entries["typo"]["reason"]
    assert entries["one"]["state"] == "READY"
    assert entries["two"]["state"] == "UNAVAILABLE"
    assert "same plugin object as 'backend:one'" in entries["two"]["reason"]
    infer(server, "ok")


# --------------------------------------------------------------------------- instance readiness


class Gate(pyserve.Backend):
    """Doubles its input; ``instance_ready`` answers from ``open`` (per instance index)."""

    def __init__(self) -> None:
        self.open: dict[int, object] = {}
        self.asked: list[str] = []

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        return [InferResponse({"OUTPUT0": r.inputs["INPUT0"] * 2}) for r in requests]

    def instance_ready(self, instance: InstanceContext) -> bool | None:
        self.asked.append(threading.current_thread().name)
        answer = self.open.get(instance.index, True)
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[return-value]


def test_instance_ready_hook_answers_the_ready_endpoints(start_server: Callable[..., ServerThread],
                                                         make_repo: Callable[..., Path]) -> None:
    gate = Gate()
    server = start_server(make_repo({"gated": model_config("gate", count=2), "plain": model_config("rec")}),
                          backends={"gate": gate, "rec": Recorder()}, use_entry_points=False)
    client = httpclient.InferenceServerClient(server.url)
    assert ready(server, "gated") and client.is_server_ready()
    assert gate.asked and all(name.startswith("pyserve-ready") for name in gate.asked)  # never the loop
    for answer in (False, RuntimeError("no GPU"), "yes"):
        gate.open[1] = answer  # one instance of two says no (or fails, or answers no bool)
        assert not ready(server, "gated")
        assert not client.is_server_ready()
        assert ready(server, "plain")
    gate.open[1] = None  # no opinion counts as ready
    assert ready(server, "gated") and client.is_server_ready()
    assert infer(server, "gated").tolist() == [2.0, 4.0]


def test_backends_without_a_readiness_check_use_no_thread(start_server: Callable[..., ServerThread],
                                                          make_repo: Callable[..., Path]) -> None:
    server = start_server(make_repo({"plain": model_config("rec")}), backends={"rec": Recorder()},
                          use_entry_points=False)
    before = {t.ident for t in threading.enumerate()}
    for _ in range(3):
        assert ready(server, "plain")
    client = httpclient.InferenceServerClient(server.url)
    assert client.is_server_ready()
    assert not [t for t in threading.enumerate() if t.name.startswith("pyserve-ready") and t.ident not in before]
