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
``pyserve_backend_python.process``). A model with Triton's ``EXECUTION_ENV_PATH`` runs in its
own Python environment, in process mode (``pyserve_backend_python.environment``): its
``model.py`` is never imported by the server, and ``auto_complete_config`` runs in a worker too.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
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
from pyserve_backend_python import compute, context, environment, loader, metrics, requirements
from pyserve_backend_python.config import ModelConfig
from pyserve_backend_python.environment import ExecutionEnvironment
from pyserve_backend_python.environment_worker import auto_complete_in_environment
from pyserve_backend_python.loader import PythonModelError
from pyserve_backend_python.process import ProcessRunner, worker_spec
from pyserve_backend_python.runner import Runner, ThreadRunner

__all__ = [
    "EXECUTION_MODES",
    "PythonModelError",
    "ProcessRunner",
    "PythonModelState",
    "Runner",
    "ThreadRunner",
    "pyserve_backend_fork_safe",
    "pyserve_backend_initialize",
    "pyserve_execute",
    "pyserve_instance_create",
    "pyserve_instance_finalize",
    "pyserve_model_auto_complete",
    "pyserve_model_create",
    "pyserve_model_finalize",
    "pyserve_model_validate",
]

EXECUTION_MODES = ("thread", "process")
"""Supported values of the ``execution_mode`` model parameter."""

log = logging.getLogger("pyserve.python_backend")

_preloaded: weakref.WeakKeyDictionary[ModelContext, ModuleType] = weakref.WeakKeyDictionary()
_environments: weakref.WeakKeyDictionary[ModelContext, ExecutionEnvironment] = weakref.WeakKeyDictionary()


@dataclass
class PythonModelState:
    """``model.state`` of a Python model version.

    :ivar module: the imported model.py module (None for a model with its own environment,
        which only its workers import).
    :ivar execution_mode: the ``execution_mode`` parameter (``"thread"`` or ``"process"``).
    :ivar environment: the ``EXECUTION_ENV_PATH`` environment, or None.
    """

    module: ModuleType | None
    execution_mode: str
    environment: ExecutionEnvironment | None = None


def _environment(model: ModelContext) -> ExecutionEnvironment | None:
    """The model's own environment, or None: ``EXECUTION_ENV_PATH`` (unpacked once per model
    version), else the cached one of its requirements file (``requirements``).

    :raises PythonModelError: see ``environment.prepare`` and ``requirements.ensure``; both
        ``EXECUTION_ENV_PATH`` and the ``requirements`` parameter given.
    """
    prepared = _environments.get(model)
    if prepared is not None:
        return prepared
    value = environment.configured_path(model.parameters, Path(model.path))
    if value is None:
        wanted = requirements.find(model.name, model.parameters, Path(model.path), Path(model.version_path))
        if wanted is None:
            return None
        if model.parameters.get("execution_mode", "") == "thread":
            if (model.parameters.get(requirements.PARAMETER) or "").strip():
                raise PythonModelError(f"model '{model.name}': '{requirements.PARAMETER}' needs execution_mode "
                                       "'process' (a model in the server's own process uses the server's packages)")
            log.warning("model '%s': %s is not installed: execution_mode 'thread' runs the model with the "
                        "server's own packages", model.name, wanted)
            return None
        settings = requirements.Settings.from_config(model.backend.config)
        prepared = requirements.ensure(model.name, wanted, settings)
        _environments[model] = prepared
        return prepared
    if (model.parameters.get(requirements.PARAMETER) or "").strip():
        raise PythonModelError(f"model '{model.name}': give either {environment.PARAMETER} or "
                               f"'{requirements.PARAMETER}', not both")
    prepared = environment.prepare(model.name, value)
    _environments[model] = prepared
    weakref.finalize(model, prepared.close)  # also if the version fails before it is created
    return prepared


INVALID_NAME_CHARACTERS = ";|&$`<>()[]{}\\\"'*?~#!"
"""Characters Triton's Python backend refuses in a model's name (its stub's)."""


def _check_name(model: ModelContext) -> None:
    """Refuse a name Triton's Python backend refuses, so a repository that loads here loads
    there too. :raises PythonModelError: the name has such a character."""
    if any(character in INVALID_NAME_CHARACTERS for character in model.name):
        _preloaded.pop(model, None)
        raise PythonModelError(
            f"Invalid stub name: contains invalid characters: model name '{model.name}' may not contain "
            f"any of {INVALID_NAME_CHARACTERS}"
        )


def _load(model: ModelContext) -> ModuleType:
    module = _preloaded.pop(model, None)
    return module if module is not None else loader.load_module(model)


@hookimpl
def pyserve_backend_fork_safe(backend: BackendContext) -> bool:
    """True for thread-mode models: ``model.py`` is imported and ``initialize`` runs in the
    process; a model whose ``initialize`` starts threads is caught by the server's thread count
    and loaded after the fork. Process-mode models opt out (their workers are processes)."""
    return True


TRITON_STUB_SETTINGS = (
    "shm-default-byte-size", "shm-growth-byte-size", "shm-region-prefix-name", "shm_message_queue_size",
    "stub-timeout-seconds",
)
"""``--backend-config python,...`` keys of Triton's Python backend that size or time its stub
processes' shared memory, which models here do not use (they run in the server's process or
exchange tensors through segments of their own size)."""


@hookimpl
def pyserve_backend_initialize(backend: BackendContext) -> None:
    """Show the Python models' custom metrics (``pb_utils.MetricFamily``, kept in
    ``metrics.REGISTRY``) on the server's ``/metrics`` page; say once which of Triton's stub
    settings given with ``--backend-config`` have no effect here."""
    backend.metrics.include(metrics.REGISTRY)
    ignored = [key for key in TRITON_STUB_SETTINGS if key in backend.config]
    if ignored:
        log.info("python backend: --backend-config %s: no effect in pyserve (models use no stub "
                 "shared-memory pool)", ", ".join(f"python,{key}={backend.config[key]}" for key in ignored))


@hookimpl
def pyserve_model_auto_complete(model: ModelContext) -> bool | None:
    """Call the model's static ``auto_complete_config(pb_utils.ModelConfig)`` when it has one
    and write the completed config back into ``model.config``.

    :raises PythonModelError: the model file fails to import or ``auto_complete_config`` fails.
    """
    _check_name(model)
    own = _environment(model)
    if own is not None:
        return _auto_complete_in(own, model)
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


def _auto_complete_in(own: ExecutionEnvironment, model: ModelContext) -> bool:
    before = model_config_to_dict(model.config)
    after = auto_complete_in_environment(own, worker_spec(model), copy.deepcopy(before))
    if after is None or after == before:
        return False
    try:
        message = ModelConfig(after).to_message()
    except Exception as exc:
        raise PythonModelError(loader.format_failure(
            f"auto_complete_config of model '{model.name}' failed", exc)) from None
    model.config.CopyFrom(message)
    return True


@hookimpl
def pyserve_model_validate(model: ModelContext) -> list[str]:
    """``pyserve validate``: a model file that is missing or does not compile (a
    ``SyntaxError``, reported with its file and line; the file is compiled, not run), an
    ``EXECUTION_ENV_PATH`` that does not exist, a ``requirements`` parameter naming no file,
    or a requirements set that does not resolve (a dry run of the installer against the
    configured index: no environment is made; a set whose environment is already cached passes
    without asking the index). A model with an ``EXECUTION_ENV_PATH`` is not compiled: its
    environment's Python may be another version than the server's."""
    try:
        value = environment.configured_path(model.parameters, Path(model.path))
        problems = loader.check_source(model, compile_it=value is None)
        if value is not None:
            if not Path(value).exists():
                problems.append(f"{environment.PARAMETER} '{value}' does not exist")
            return problems
        if problems:
            return problems
        wanted = requirements.find(model.name, model.parameters, Path(model.path), Path(model.version_path))
        if wanted is None or (model.parameters.get("execution_mode", "") == "thread"
                              and not (model.parameters.get(requirements.PARAMETER) or "").strip()):
            return []
        return requirements.check(model.name, wanted, requirements.Settings.from_config(model.backend.config))
    except PythonModelError as exc:
        return [str(exc)]


@hookimpl
def pyserve_model_create(model: ModelContext) -> PythonModelState:
    """Import the model file (a fresh module per version) and check the execution mode; for a
    model with ``EXECUTION_ENV_PATH`` or a requirements file, prepare its environment instead
    (its workers import it).
    A thread-mode model that only computes is declared so (``pyserve_backend_python.compute``),
    so that its short executes may run on the server's event loop while one client sends.

    :raises PythonModelError: the file is missing, fails to import (traceback in the message)
        or has no ``TritonPythonModel``; an unsupported ``execution_mode``; an unusable
        environment, or one asked for with ``execution_mode: "thread"``; a model name with
        a character Triton's Python backend refuses.
    """
    _check_name(model)
    mode = model.parameters.get("execution_mode", "")
    if (mode or "thread") not in EXECUTION_MODES:
        _preloaded.pop(model, None)
        raise PythonModelError(
            f"model '{model.name}': execution_mode '{mode}' is not supported; use one of "
            f"{', '.join(EXECUTION_MODES)}"
        )
    own = _environment(model)
    if own is not None:
        if mode == "thread":
            raise PythonModelError(
                f"model '{model.name}': {own.source} needs execution_mode 'process' (a model "
                "in the server's own process runs in the server's Python environment)"
            )
        if not mode:
            log.info("model '%s': %s given, so it runs in execution_mode 'process' with %s",
                     model.name, own.source, own.python)
        context.remember(model)
        model.fork_safe = False
        model.single_process_reason = ("it runs in its own Python environment (EXECUTION_ENV_PATH or its "
                                       "requirements), in worker processes")
        return PythonModelState(None, "process", own)
    context.remember(model)
    state = PythonModelState(_load(model), mode or "thread")
    model.compute_only = compute.only_computes(model, state.module, state.execution_mode)
    model.fork_safe = model.fork_safe and state.execution_mode == "thread"
    model.single_process_reason = compute.single_process_reason(model)
    return state


@hookimpl
def pyserve_model_finalize(model: ModelContext) -> None:
    """Forget the model module and the metric families only this model version created."""
    state: PythonModelState = model.state
    metrics.release_model(model.name, model.version)
    if state.module is not None:
        loader.unload_module(state.module)
    if state.environment is not None:
        _environments.pop(model, None)
        state.environment.close()


@hookimpl
def pyserve_instance_create(instance: InstanceContext) -> Runner:
    """Create the instance's ``TritonPythonModel`` and call ``initialize(args)``.

    :raises PythonModelError: the constructor or ``initialize`` raised (traceback in the message).
    """
    state: PythonModelState = instance.model.state
    runner: Runner
    if state.execution_mode == "process":
        runner = ProcessRunner(instance, state.environment)
    else:
        assert state.module is not None
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
