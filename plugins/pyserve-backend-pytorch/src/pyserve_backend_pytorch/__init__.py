"""pyserve's ``pytorch`` backend: TorchScript models (platforms ``pytorch_libtorch``, ``libtorch``).

A module-style plugin: the entry point names this module and the hook functions below carry
``pyserve.hookimpl`` (the instance and execute hooks are ``pyserve.api.backend_support``'s). Importing this module does not import ``torch``; the framework is
imported when the first PyTorch model loads (``pyserve_backend_initialize``).

What callers may rely on:

* the model file is ``<version>/model.pt`` (TorchScript, ``torch.jit.load``) or
  ``<version>/<default_model_filename>``; a name ending in ``.pt2`` is loaded as a
  ``torch.export`` program, which parameter ``torch_compile`` can compile;
* every instance loads its own copy on its device: ``cuda:<gpu>`` for KIND_GPU instances,
  the CPU otherwise;
* Triton's naming conventions: config inputs named like forward's arguments are passed by
  keyword, inputs named ``<name>__<index>`` by position, and inputs following neither go in
  config order (Triton's strict config ordering); outputs named ``<name>__<index>``
  pick that element of forward's result, other outputs are taken in config order (or by key
  when forward returns a dict);
* forward runs under ``torch.inference_mode`` (parameter ``INFERENCE_MODE``), on tensors that
  share memory with the received arrays (DLPack, no copy for contiguous CPU arrays);
* a missing or corrupt file, names that match no forward argument, or outputs whose
  datatype or dims disagree with the config (checked by a probe run on zeros) make the model
  UNAVAILABLE with a message naming the tensor and both sides;
* a batch of requests runs as one forward over inputs gathered without copies;
* TYPE_STRING tensors are ``List[str]`` (UTF-8), one-dimensional counting the batch (Triton's
  rule), both ways;
* parameters ``INTRA_OP_THREAD_COUNT`` / ``INTER_OP_THREAD_COUNT`` size torch's thread pools
  for the whole process, the first model to set one winning (as in Triton).
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
from pyserve_backend_pytorch.runtime import (
    TorchInstance,
    TorchModel,
    apply_thread_counts,
    initialize_runtime,
    model_file,
)

__all__ = [
    "TorchInstance",
    "TorchModel",
    "pyserve_backend_fork_safe",
    "pyserve_backend_initialize",
    "pyserve_execute",
    "pyserve_instance_create",
    "pyserve_instance_finalize",
    "pyserve_model_create",
    "pyserve_model_validate",
]


@hookimpl
def pyserve_backend_fork_safe(backend: BackendContext) -> bool:
    """True: importing torch and loading a TorchScript module start no thread (torch's pools
    start at the first execute, in the process that runs it)."""
    return True


@hookimpl
def pyserve_backend_initialize(backend: BackendContext) -> None:
    """Import torch and record its version and CUDA device count in ``backend.state``; where
    the server sets ``backend.cpu_threads`` (its CPUs per process), torch's intra-op pool gets
    that many threads unless a model's ``INTRA_OP_THREAD_COUNT`` says otherwise.

    :raises ImportError: torch is not installed.
    """
    backend.state = initialize_runtime(backend.cpu_threads)


@hookimpl
def pyserve_model_validate(model: ModelContext) -> list[str]:
    """``pyserve validate``: the model file (``default_model_filename`` or model.pt) is missing (the framework is not imported)."""
    return missing_model_file(model_file, model)


@hookimpl
def pyserve_model_create(model: ModelContext) -> TorchModel:
    """Locate the model file and read the parameters; becomes ``model.state``. Applies the
    process-wide thread counts the first model to ask for them asks for.

    The model is compute-only (``ModelContext.compute_only``): a forward call waits for nothing else.

    :raises ValueError: missing model file, bad parameter value, unsupported datatype.
    """
    state = TorchModel.from_context(model)
    apply_thread_counts(state.name, state.intra_op_threads, state.inter_op_threads)
    model.compute_only = True
    return state
