"""pyserve's ``python`` backend: Triton Python-backend ``model.py`` files, run unmodified.

A module-style plugin (the ``pyserve.backends`` entry point ``python`` names this module).
Per model version the backend imports ``<model>/<version>/model.py`` (or the config's
``default_model_filename``) as a fresh module; per instance it creates one
``TritonPythonModel`` object and calls ``initialize(args)`` with Triton's keys; each batch goes
to ``execute(requests)`` (plain or ``async def``) on the instance's thread; ``finalize()`` runs
at unload. Models use the ``triton_python_backend_utils`` module this distribution installs
(``import triton_python_backend_utils as pb_utils``).

BLS and metrics find the calling model through a context variable the backend sets around
every call into model code (see ``pyserve_backend_python.context``).

Model config parameter ``execution_mode``: ``"thread"`` (default; in-process) or ``"process"``
(one worker process per instance, tensors through shared memory; see
``pyserve_backend_python.process``).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from pyserve import (
    BackendContext,
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelContext,
    hookimpl,
)
from pyserve.protocol.config_json import model_config_to_dict

from pyserve_backend_python import context, loader, metrics
from pyserve_backend_python.config import ModelConfig
from pyserve_backend_python.loader import PythonModelError
from pyserve_backend_python.process import ProcessRunner
from pyserve_backend_python.runner import Runner, ThreadRunner

__all__ = [
    "EXECUTION_MODES",
    "PythonModelError",
    "ProcessRunner",
    "PythonModelState",
    "Runner",
    "ThreadRunner",
    "pyserve_backend_initialize",
    "pyserve_execute",
    "pyserve_instance_create",
    "pyserve_instance_finalize",
    "pyserve_model_auto_complete",
    "pyserve_model_create",
    "pyserve_model_finalize",
]

EXECUTION_MODES = ("thread", "process")
"""Supported values of the ``execution_mode`` model parameter."""

_preloaded: weakref.WeakKeyDictionary[ModelContext, ModuleType] = weakref.WeakKeyDictionary()


@dataclass
class PythonModelState:
    """``model.state`` of a Python model version.

    :ivar module: the imported model.py module.
    :ivar execution_mode: the ``execution_mode`` parameter (``"thread"`` or ``"process"``).
    """

    module: ModuleType
    execution_mode: str


def _load(model: ModelContext) -> ModuleType:
    module = _preloaded.pop(model, None)
    return module if module is not None else loader.load_module(model)


@hookimpl
def pyserve_backend_initialize(backend: BackendContext) -> None:
    """Show the Python models' custom metrics (``pb_utils.MetricFamily``, kept in
    ``metrics.REGISTRY``) on the server's ``/metrics`` page."""
    backend.metrics.include(metrics.REGISTRY)


@hookimpl
def pyserve_model_auto_complete(model: ModelContext) -> bool | None:
    """Call the model's static ``auto_complete_config(pb_utils.ModelConfig)`` when it has one
    and write the completed config back into ``model.config``.

    :raises PythonModelError: the model file fails to import or ``auto_complete_config`` fails.
    """
    module = loader.load_module(model)
    _preloaded[model] = module  # reused by pyserve_model_create
    weakref.finalize(model, loader.unload_module, module)  # if the version fails before create
    complete = getattr(getattr(module, loader.MODEL_CLASS), "auto_complete_config", None)
    if complete is None:
        return None
    before = model_config_to_dict(model.config)
    given = ModelConfig(copy.deepcopy(before))
    try:
        with context.calling(model):
            returned = complete(given)
        if not isinstance(returned, ModelConfig):
            raise TypeError(f"auto_complete_config must return the pb_utils.ModelConfig it was given, "
                            f"not {type(returned).__name__}")
        if returned.as_dict() == before:
            return False
        message = returned.to_message()
    except Exception as exc:
        raise PythonModelError(loader.format_failure(
            f"auto_complete_config of model '{model.name}' failed", exc
        )) from None
    model.config.CopyFrom(message)
    return True


@hookimpl
def pyserve_model_create(model: ModelContext) -> PythonModelState:
    """Import the model file (a fresh module per version) and check the execution mode.

    :raises PythonModelError: the file is missing, fails to import (traceback in the message)
        or has no ``TritonPythonModel``; or an unsupported ``execution_mode``.
    """
    mode = model.parameters.get("execution_mode", "") or "thread"
    if mode not in EXECUTION_MODES:
        _preloaded.pop(model, None)
        raise PythonModelError(
            f"model '{model.name}': execution_mode '{mode}' is not supported; use one of "
            f"{', '.join(EXECUTION_MODES)}"
        )
    context.remember(model)
    return PythonModelState(_load(model), mode)


@hookimpl
def pyserve_model_finalize(model: ModelContext) -> None:
    """Forget the model module and the metric families only this model version created."""
    state: PythonModelState = model.state
    metrics.release_model(model.name, model.version)
    loader.unload_module(state.module)


@hookimpl
def pyserve_instance_create(instance: InstanceContext) -> Runner:
    """Create the instance's ``TritonPythonModel`` and call ``initialize(args)``.

    :raises PythonModelError: the constructor or ``initialize`` raised (traceback in the message).
    """
    state: PythonModelState = instance.model.state
    runner: Runner
    if state.execution_mode == "process":
        runner = ProcessRunner(instance)
    else:
        runner = ThreadRunner(instance, state.module)
    runner.create()
    return runner


@hookimpl
def pyserve_instance_finalize(instance: InstanceContext) -> None:
    """Call the model's ``finalize()`` and stop the instance's event loop."""
    runner: Runner = instance.state
    runner.finalize()


@hookimpl
def pyserve_execute(
    instance: InstanceContext, requests: Sequence[InferRequest]
) -> list[InferResponse | InferError] | None:
    """Run ``TritonPythonModel.execute`` on the batch (see ``results`` for the rules)."""
    runner: Runner = instance.state
    return runner.execute(requests)


@hookimpl
def pyserve_instance_ready(instance: InstanceContext) -> bool:
    """The model's ``is_ready()`` (sync or ``async def``; True when it has none), as Triton's
    Python backend asks it; in process mode, False while the worker process is not running.

    :raises Exception: ``is_ready()`` raised or returned no bool (the model is not ready).
    """
    runner: Runner = instance.state
    return runner.ready()
