"""pyserve's ``onnxruntime`` backend: ONNX models (platform ``onnxruntime_onnx``) on ONNX Runtime.

A module-style plugin: the entry point names this module and the hook functions below carry
``pyserve.hookimpl`` (the instance and execute hooks are ``pyserve.api.backend_support``'s). Importing this module does not import ``onnxruntime``; the framework is
imported when the first ONNX model loads (``pyserve_backend_initialize``).

What callers may rely on:

* the model file is ``<version>/model.onnx``, or ``<version>/<default_model_filename>``
  (a file, or a directory holding ``model.onnx``);
* one ``InferenceSession`` per instance; GPU instances use ``CUDAExecutionProvider`` on the
  instance's GPU when the installed onnxruntime has it, CPU otherwise (logged once per model);
* session settings come from the model ``parameters`` (``intra_op_thread_count``,
  ``inter_op_thread_count``, ``enable_mem_arena``, ``enable_mem_pattern``) and from
  ``optimization { graph { level } }`` (-1 basic, 1 extended, otherwise all optimizations);
* auto-complete fills inputs, outputs, ``max_batch_size`` (the backend config
  ``default-max-batch-size``) and enables ``dynamic_batching``, as Triton's backend does;
* a config that disagrees with the model (names, datatypes, dims) or an unreadable model file
  makes the model UNAVAILABLE with a message naming the tensor and both sides;
* a batch of requests runs as one ``session.run`` over inputs gathered without copies.
"""

from __future__ import annotations

from pyserve import (
    BackendContext,
    ModelContext,
    hookimpl,
)
from pyserve.api.backend_support import (
    missing_model_file,
    pyserve_execute,
    pyserve_instance_create,
    pyserve_instance_finalize,
)
from pyserve_backend_onnxruntime.runtime import (
    OnnxInstance,
    OnnxModel,
    auto_complete,
    initialize_runtime,
    model_file,
)

__all__ = [
    "OnnxInstance",
    "OnnxModel",
    "pyserve_backend_fork_safe",
    "pyserve_backend_initialize",
    "pyserve_execute",
    "pyserve_instance_create",
    "pyserve_instance_finalize",
    "pyserve_model_auto_complete",
    "pyserve_model_create",
    "pyserve_model_validate",
]


@hookimpl
def pyserve_backend_fork_safe(backend: BackendContext) -> bool:
    """True: importing onnxruntime and creating a CPU session with one intra-op thread starts
    no thread pool, and such a session runs in a forked process. Models whose sessions would
    use a pool opt out in ``pyserve_model_create``."""
    return True


@hookimpl
def pyserve_backend_initialize(backend: BackendContext) -> None:
    """Import onnxruntime and record its version and execution providers in ``backend.state``.

    :raises ImportError: onnxruntime is not installed (every ONNX model becomes UNAVAILABLE
        with an install hint).
    """
    backend.state = initialize_runtime()


@hookimpl
def pyserve_model_auto_complete(model: ModelContext) -> bool:
    """Fill in inputs, outputs, ``max_batch_size`` and dynamic batching from the ONNX file.

    :returns: True when the config was changed.
    :raises ValueError: the model file is missing or is not a loadable ONNX model.
    """
    return auto_complete(model)


@hookimpl
def pyserve_model_validate(model: ModelContext) -> list[str]:
    """``pyserve validate``: the ONNX file (``default_model_filename`` or model.onnx) is missing (the framework is not imported)."""
    return missing_model_file(model_file, model)


@hookimpl
def pyserve_model_create(model: ModelContext) -> OnnxModel:
    """Locate the model file and read the session settings; becomes ``model.state``. The model
    is compute-only (``ModelContext.compute_only``): a session run waits for nothing else.
    Without ``intra_op_thread_count``, sessions use ``backend.cpu_threads`` intra-op threads
    (the server's CPUs per process) where the server sets it, else onnxruntime's default.

    :raises ValueError: missing model file, a bad parameter value, or an unsupported datatype.
    """
    state = OnnxModel.from_context(model)
    model.compute_only = True
    model.fork_safe = model.fork_safe and state.pool_free()
    return state
