"""The hook specifications are the contract: each one documents when, where, and what."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pluggy
import pytest

import pyserve
from pyserve.host.plugins import LIFECYCLE_HOOKS
from pyserve_hookspecs import PROJECT_NAME, SPEC_MODULES, lifecycle

SPEC_ATTR = f"{PROJECT_NAME}_spec"
IMPL_ATTR = f"{PROJECT_NAME}_impl"


def _specs(modules: Any = SPEC_MODULES) -> Iterator[tuple[str, Callable[..., Any]]]:
    for module in modules:
        for name, func in inspect.getmembers(module, inspect.isfunction):
            if hasattr(func, SPEC_ATTR):
                yield name, func


ALL_SPECS = sorted(_specs(), key=lambda item: item[0])
LIFECYCLE_SPECS = sorted(name for name, _ in _specs((lifecycle,)))


def test_every_spec_module_declares_hooks() -> None:
    for module in SPEC_MODULES:
        assert list(_specs((module,))), f"{module.__name__} declares no hookspec"
    assert len(ALL_SPECS) >= 10


@pytest.mark.parametrize(("name", "spec"), ALL_SPECS, ids=[name for name, _ in ALL_SPECS])
def test_hookspec_docstring(name: str, spec: Callable[..., Any]) -> None:
    assert name.startswith("pyserve_")
    doc = inspect.getdoc(spec)
    assert doc, f"{name} has no docstring"
    assert "When:" in doc, f"{name}: the docstring does not say when the hook is called"
    assert "Thread:" in doc, f"{name}: the docstring does not say on which thread"
    for parameter in inspect.signature(spec).parameters:
        assert f":param {parameter}:" in doc, f"{name}: ':param {parameter}:' missing"
    assert ":returns:" in doc, f"{name}: ':returns:' missing"
    assert ":raises" in doc, f"{name}: ':raises' missing"


def test_lifecycle_hooks_match_the_server_list() -> None:
    assert sorted(LIFECYCLE_HOOKS) == LIFECYCLE_SPECS


@pytest.mark.parametrize("name", LIFECYCLE_SPECS)
def test_backend_base_class_implements_every_lifecycle_hook(name: str) -> None:
    method = getattr(pyserve.Backend, name, None)
    assert method is not None, f"pyserve.Backend lacks {name}"
    assert getattr(method, IMPL_ATTR, None) is not None, f"pyserve.Backend.{name} is not a hookimpl"
    spec = dict(ALL_SPECS)[name]
    spec_args = list(inspect.signature(spec).parameters)
    impl_args = list(inspect.signature(method).parameters)[1:]
    assert impl_args == spec_args


def test_backend_forwards_every_hook_to_a_plain_method() -> None:
    """A subclass overriding only plain methods gets every hook call (no re-decorating)."""
    calls: list[str] = []

    class Full(pyserve.Backend):
        def initialize(self, backend: Any) -> None:
            calls.append("initialize")

        def finalize(self, backend: Any) -> None:
            calls.append("finalize")

        def auto_complete_config(self, model: Any) -> bool:
            calls.append("auto_complete_config")
            return True

        def create_model(self, model: Any) -> str:
            calls.append("create_model")
            return "model-state"

        def finalize_model(self, model: Any) -> None:
            calls.append("finalize_model")

        def create_instance(self, instance: Any) -> str:
            calls.append("create_instance")
            return "instance-state"

        def finalize_instance(self, instance: Any) -> None:
            calls.append("finalize_instance")

        def execute(self, instance: Any, requests: Any) -> list[str]:
            calls.append("execute")
            return ["response"]

    pm = pluggy.PluginManager(PROJECT_NAME)
    for module in SPEC_MODULES:
        pm.add_hookspecs(module)
    pm.register(Full())
    pm.check_pending()
    hook = pm.hook
    assert hook.pyserve_backend_initialize(backend=None) == []
    assert hook.pyserve_model_auto_complete(model=None) is True
    assert hook.pyserve_model_create(model=None) == "model-state"
    assert hook.pyserve_instance_create(instance=None) == "instance-state"
    assert hook.pyserve_execute(instance=None, requests=[object()]) == ["response"]
    hook.pyserve_instance_finalize(instance=None)
    hook.pyserve_model_finalize(model=None)
    hook.pyserve_backend_finalize(backend=None)
    assert calls == [
        "initialize", "auto_complete_config", "create_model", "create_instance", "execute",
        "finalize_instance", "finalize_model", "finalize",
    ]


def test_backend_execute_is_required() -> None:
    with pytest.raises(NotImplementedError, match="does not implement execute"):
        pyserve.Backend().execute(None, [])  # type: ignore[arg-type]
