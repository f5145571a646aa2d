"""Backend lifecycle hooks, in the order the server calls them.

Concurrency and ordering (the same promises Triton makes to TRITONBACKEND backends):

* Backend hooks run once per backend, on a model-loading thread, never concurrently with
  each other. ``pyserve_backend_initialize`` runs the first time a model needs the backend
  (so a backend's heavy imports cost nothing to a server that does not use it).
* Model hooks for one model version never run concurrently with each other; hooks of
  different models may run concurrently on different loading threads.
* Instance hooks for one instance never run concurrently with each other. Each instance has
  its own execution thread: ``pyserve_execute`` for an instance is never called twice at
  once, but executes of different instances (of the same model too) do run in parallel.
* Finalizers run in exact reverse order of creation: instances, then the model, then (at
  server shutdown) the backend. A finalizer runs only if its matching create succeeded.

The objects passed in (``backend``, ``model``, ``instance``) are the server's contexts
(``pyserve.BackendContext``, ``pyserve.ModelContext``, ``pyserve.InstanceContext``). Each has
a ``state`` attribute that belongs to the backend; the value a create hook returns is stored
there for the matching finalizer and for ``pyserve_execute``.

Custom metrics: ``backend.metrics`` and ``model.metrics`` (the same server-wide object) create
Prometheus families that the server shows on its ``/metrics`` page next to Triton's own:
``counter(name, description, labels=())``, ``gauge(...)`` and ``histogram(..., buckets=None)``
return ``prometheus_client`` metrics (``.labels(...).inc()``, ``.set()``, ``.observe()``);
asking again for an existing name returns the same family. ``include(registry)`` shows
everything an existing ``prometheus_client.CollectorRegistry`` (or collector) holds. Counters
appear under exactly the given name, without a ``_total`` suffix, as Triton's custom metrics do.

Statistics: ``model.report_memory_usage([(type, device_id, byte_size), ...])`` (type ``"CPU"``,
``"CPU_PINNED"`` or ``"GPU"``) sets what the version holds, shown as ``memory_usage`` in
Triton's statistics (any hook, any thread; a later report replaces it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pyserve_hookspecs._markers import hookspec

if TYPE_CHECKING:  # the contract never imports the server at run time
    from pyserve.api import (
        BackendContext,
        InferError,
        InferRequest,
        InferResponse,
        InstanceContext,
        ModelContext,
    )


@hookspec
def pyserve_backend_initialize(backend: BackendContext) -> None:
    """Prepare the backend before its first model is created.

    When: once per server process, the first time a model that names this backend is loaded.
    Thread: a model-loading thread (not the event loop); blocking work is fine.

    :param backend: the backend's context: ``backend.name``, ``backend.config`` (the
        ``--backend-config <name>,<key>=<value>`` settings as ``dict[str, str]``) and
        ``backend.state``, which the backend may set freely.
    :returns: nothing.
    :raises Exception: the backend is marked failed; every model that needs it becomes
        UNAVAILABLE with the exception text as its reason, and the call is not retried.
    """


@hookspec(firstresult=True)
def pyserve_backend_fork_safe(backend: BackendContext) -> bool | None:
    """Whether this backend's models may be loaded in a process that forks afterwards.

    ``pyserve run`` with frontend processes loads the models it replicates once and then
    forks the frontend processes, so that all of them share one copy of the weights
    (copy-on-write). Only the models of backends that answer True are loaded that way; the
    others are loaded by each process after the fork, as without this hook.

    When: once per backend, before ``pyserve_backend_initialize``, and only in a server that
    forks; a backend that does not implement it is never asked to load before a fork.
    Thread: the server's main thread, while no other thread runs.

    :param backend: the backend's context (``name``, ``config``), not initialized yet.
    :returns: True when ``pyserve_backend_initialize``, ``pyserve_model_create`` and
        ``pyserve_instance_create`` start no threads or processes and make nothing that a
        forked child cannot use (network connections, GPU contexts, files opened for writing),
        and what they return stays valid in the child, which runs warm-up and every execute
        on threads of its own. A model may still opt out by setting ``model.fork_safe =
        False`` in ``pyserve_model_create``. False or None: load after the fork. The server
        also counts the process's threads around each such load and loads a model that
        started threads after the fork instead.
    :raises Exception: logged with the backend name; taken as False.
    """


@hookspec
def pyserve_backend_finalize(backend: BackendContext) -> None:
    """Release what ``pyserve_backend_initialize`` acquired.

    When: once, at server shutdown, after every model of the backend has been finalized;
    only for a backend whose initialize succeeded.
    Thread: the shutdown thread.

    :param backend: the same context object given to ``pyserve_backend_initialize``.
    :returns: nothing.
    :raises Exception: logged with the backend name; shutdown continues.
    """


@hookspec(firstresult=True)
def pyserve_model_auto_complete(model: ModelContext) -> bool | None:
    """Fill in what config.pbtxt leaves out, from the model's own files.

    When: before ``pyserve_model_create`` of each model version, unless the server runs with
    ``--disable-auto-complete-config`` / ``--strict-model-config``; also when a model has no
    config.pbtxt at all.
    Thread: a model-loading thread.

    The backend may add inputs and outputs, set ``max_batch_size`` and enable
    ``dynamic_batching`` on ``model.config`` (a ``ModelConfig`` protobuf message) in place;
    it must not change what the user did set. The server validates the completed config
    afterwards and reports problems against the model.

    :param model: the model's context (see ``pyserve_model_create``).
    :returns: ``True`` if the config was changed, otherwise ``None`` or ``False``.
    :raises Exception: the model version becomes UNAVAILABLE with the exception text, labelled
        as a failure of auto-complete unless the exception says what it is (a model file that
        is missing or broken: ``FileNotFoundError``, ``SyntaxError``, pyserve's
        ``ModelFileError``). Clients see the text without tracebacks or server paths.
    """


@hookspec
def pyserve_model_validate(model: ModelContext) -> list[str] | None:
    """Say what would keep a model version from loading, without loading it.

    When: only in ``pyserve validate``, once per version the model's version policy selects,
    after the model's config passed the server's own checks; never in a running server, and
    without ``pyserve_backend_initialize`` having run.
    Thread: the command's main thread; blocking work (reading files, asking a package index)
    is fine.

    The backend may look at the model's files and settings (e.g. that a weights file exists,
    that a requirements file resolves) but must not load the model nor change anything the
    server would later find (``model.server`` and ``model.state`` are None).

    :param model: the model's context (see ``pyserve_model_create``); ``model.backend.config``
        holds the ``--backend-config`` settings given to ``pyserve validate``.
    :returns: one line per problem (the command prefixes the model name and version), or
        None / an empty list when there is nothing to report.
    :raises Exception: reported as a problem of the model version, with the exception text.
    """


@hookspec(firstresult=True)
def pyserve_model_create(model: ModelContext) -> Any:
    """Load one version of a model (Triton's ``TRITONBACKEND_ModelInitialize``).

    When: for each version the model's ``version_policy`` selects, after the backend is
    initialized and the config is complete and valid.
    Thread: a model-loading thread; blocking work (reading weights) is fine.

    :param model: the model's context: ``name``, ``version``, ``config`` (the normalized
        ``ModelConfig`` message; treat it as read-only), ``path`` (model directory),
        ``version_path`` (the version directory), ``parameters`` (the config's
        ``parameters`` as ``dict[str, str]``), ``backend`` (the backend's context).
        The implementation may set ``model.compute_only = True`` when this model's execute
        only computes (it never sleeps, waits for I/O, a lock held elsewhere or another
        request, and never calls the server): the server may then run its short executes
        on the event loop while a single client sends requests one after another (config
        parameter ``pyserve_inline_execute``, ``"auto"``), which saves two thread wake-ups
        per request. It may set ``model.single_process_reason`` (a short text) when the
        model's executes need the process that holds every model (they call the server, or
        keep custom metrics): frontend processes then never answer it from a replica. Before a fork (``pyserve_backend_fork_safe``) ``model.fork_safe`` is
        True, and the implementation may set it to False for a model that cannot be
        inherited by a forked process (its instances are then not created before the fork).
    :returns: any object; it is stored as ``model.state``. ``None`` is fine.
    :raises Exception: the version becomes UNAVAILABLE with the exception text as its reason
        (labelled as a failure to create the model unless it says what it is, as for
        ``pyserve_model_auto_complete``); no instance is created and ``pyserve_model_finalize``
        is not called. Other models keep loading.
    """


@hookspec
def pyserve_model_finalize(model: ModelContext) -> None:
    """Release one model version (Triton's ``TRITONBACKEND_ModelFinalize``).

    When: when the version is unloaded or the server shuts down, after all its instances
    were finalized; only if ``pyserve_model_create`` succeeded.
    Thread: an unloading thread.

    :param model: the same context object given to ``pyserve_model_create``.
    :returns: nothing.
    :raises Exception: logged with the model name; unloading continues.
    """


@hookspec(firstresult=True)
def pyserve_instance_create(instance: InstanceContext) -> Any:
    """Create one model instance (Triton's ``TRITONBACKEND_ModelInstanceInitialize``).

    When: ``instance_group.count`` times per group after ``pyserve_model_create`` succeeded,
    one after another.
    Thread: a model-loading thread. The instance's own execution thread starts after this
    returns.

    :param instance: the instance's context: ``name`` (Triton's ``<group>_<n>``), ``kind``
        (``"CPU"``, ``"GPU"`` or ``"MODEL"``), ``device_id``, ``index``, ``model`` (the model's
        context) and ``state``.
    :returns: any object; it is stored as ``instance.state``.
    :raises Exception: the model version becomes UNAVAILABLE; the instances already created
        are finalized in reverse order, then the model.
    """


@hookspec
def pyserve_instance_finalize(instance: InstanceContext) -> None:
    """Release one model instance (Triton's ``TRITONBACKEND_ModelInstanceFinalize``).

    When: at unload or shutdown, after the instance's thread has finished its last execute
    (in-flight requests complete first); instances are finalized in reverse creation order.
    Thread: an unloading thread.

    :param instance: the same context object given to ``pyserve_instance_create``.
    :returns: nothing.
    :raises Exception: logged with the instance name; unloading continues.
    """


@hookspec(firstresult=True)
def pyserve_instance_ready(instance: InstanceContext) -> bool | None:
    """Whether one READY instance can serve now (Triton's ``TRITONBACKEND_ModelInstanceReady``).

    When: a client asks whether the model is ready (``/v2/models/<name>/ready``, gRPC
    ``ModelReady``) or, with strict readiness, whether the server is; once per instance of
    every READY version asked about. Never called for a version that is not READY.
    Thread: a readiness thread of the server, never the event loop nor the instance's
    execution thread, so it may run while the same instance executes. It may block; the
    server waits at most 5 s for it and then answers "not ready". While one check of an
    instance still runs, later questions wait for that check instead of starting another.

    :param instance: the instance's context (``instance.state`` as in ``pyserve_execute``).
    :returns: True (or None: no opinion, which is how backends without the hook behave) when
        the instance can serve, False when it cannot; the model is ready only when every one
        of its instances is.
    :raises Exception: the instance counts as not ready; the error is logged with its name.
    """


@hookspec(firstresult=True)
def pyserve_execute(
    instance: InstanceContext, requests: Sequence[InferRequest]
) -> Sequence[InferResponse | InferError | BaseException] | None:
    """Run the model on the requests the scheduler gathered for this instance.

    When: whenever the model's scheduler hands a batch to this instance. Without dynamic
    batching every call carries one request; with it, up to ``max_batch_size`` requests
    (counted along the batch dimension) that may be executed as one batch.
    Thread: the instance's own execution thread, never the event loop. Calls for one
    instance never overlap; calls for different instances do. A backend that wants the GIL
    released must do its heavy work in native code (numpy, a framework) as usual.

    Each request exposes ``inputs`` (``dict[str, numpy.ndarray]``, validated against the
    config, possibly read-only views of the received bytes: do not write into them),
    ``requested_outputs`` (names to produce), ``parameters``, ``id`` and the sequence fields.

    :param instance: the instance's context (``instance.state`` is what
        ``pyserve_instance_create`` returned; ``instance.model`` the model's context).
    :param requests: the gathered requests, in arrival order; never empty.
    :returns: one entry per request, in the same order: an ``InferResponse`` (outputs as
        arrays, optional response parameters), or an ``InferError`` / any exception
        instance for a request that failed alone, so that one bad request never fails the
        others. A list of the wrong length fails the whole batch with a clear error.
        Instead, a backend may return ``None`` and answer through each request's
        ``request.response_sender()``: ``send(response, final=False)`` any number of times,
        then ``send(final=True)`` (with or without a last response). The sender may be used
        from any thread, also after execute returned; that is how decoupled models
        (``model_transaction_policy { decoupled: true }``) stream 0..N responses per request.
        A non-decoupled model must have sent its one final response for every request by the
        time execute returns ``None``; a request left unanswered gets an error. With
        ``sequence_batching { iterative_sequence: true }`` a backend may instead call
        ``request.reschedule()`` and leave that request unanswered (``None`` in its place): it
        comes back in a later batch, until an execute answers it.
        The output arrays of a returned or sent response are the server's from then on: it
        encodes and sends them without a copy, possibly after execute returned, so a backend
        must not write into them again (one that reuses an output buffer hands over a copy).
    :raises Exception: every request of the batch gets an error response naming the model;
        the exception is logged once and the instance keeps serving.
    """
