"""pyserve's ``tensorflow`` backend: SavedModels and frozen GraphDefs on TensorFlow 2.

A module-style plugin: the entry point names this module and the hook functions below carry
``pyserve.hookimpl`` (the instance and execute hooks are ``pyserve.api.backend_support``'s). Importing this module does not import ``tensorflow``; the framework is
imported when the first TensorFlow model loads (``pyserve_backend_initialize``), which also
turns on GPU memory growth so that TensorFlow does not reserve whole GPUs.

What callers may rely on:

* platform ``tensorflow_savedmodel``: ``<version>/model.savedmodel/`` (or
  ``default_model_filename``), served through its ``serving_default`` signature or the one
  named by model parameter ``TF_SIGNATURE_DEF`` (Triton's) or ``signature_name``, from the
  meta graph tagged ``TF_GRAPH_TAG`` (default ``serve``); config names are the signature's input and
  output keys, and auto-complete fills inputs, outputs, ``max_batch_size`` and dynamic
  batching from the signature;
* platform ``tensorflow_graphdef``: ``<version>/model.graphdef`` (a frozen ``GraphDef``), with
  inputs and outputs declared in config.pbtxt by graph tensor name (``x`` means ``x:0``);
* ``TF_NUM_INTRA_THREADS`` / ``TF_NUM_INTER_THREADS`` size TensorFlow's process-wide pools (the
  first model wins); ``--backend-config tensorflow,allow-soft-placement`` is applied;
* one loaded copy per instance, placed on ``/GPU:<id>`` for KIND_GPU instances, ``/CPU:0``
  otherwise; host arrays enter TensorFlow through DLPack where numpy can export them;
* a missing or corrupt model, a missing signature, or a config that disagrees with the model
  (names, datatypes, dims) makes the model UNAVAILABLE with a message naming the tensor and
  both sides;
* a batch of requests runs as one call over inputs gathered without copies.
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
from pyserve_backend_tensorflow.runtime import (
    TensorFlowInstance,
    TensorFlowModel,
    auto_complete,
    initialize_runtime,
    model_path,
)

__all__ = [
    "TensorFlowInstance",
    "TensorFlowModel",
    "pyserve_backend_initialize",
    "pyserve_execute",
    "pyserve_instance_create",
    "pyserve_instance_finalize",
    "pyserve_model_auto_complete",
    "pyserve_model_create",
    "pyserve_model_validate",
]


@hookimpl
def pyserve_backend_initialize(backend: BackendContext) -> None:
    """Import TensorFlow, enable GPU memory growth, record the version in ``backend.state``.

    :raises ImportError: TensorFlow is not installed.
    """
    backend.state = initialize_runtime(backend.config)


@hookimpl
def pyserve_model_auto_complete(model: ModelContext) -> bool:
    """Fill in inputs, outputs, ``max_batch_size`` and dynamic batching from the SavedModel signature.

    :returns: True when the config was changed.
    :raises ValueError: unloadable SavedModel, missing signature, GraphDef without declared I/O.
    """
    return auto_complete(model)


@hookimpl
def pyserve_model_validate(model: ModelContext) -> list[str]:
    """``pyserve validate``: the SavedModel directory (with saved_model.pb) or GraphDef file is missing (the framework is not imported)."""
    return missing_model_file(model_path, model)


@hookimpl
def pyserve_model_create(model: ModelContext) -> TensorFlowModel:
    """Locate the model and read the config; becomes ``model.state``. The model is compute-only
    (``ModelContext.compute_only``): a signature call waits for nothing else.

    :raises ValueError: the SavedModel directory or GraphDef file is missing.
    """
    state = TensorFlowModel.from_context(model)
    model.compute_only = True
    return state
