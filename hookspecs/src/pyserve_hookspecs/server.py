"""Hooks for server-wide plugins (entry-point group ``pyserve.plugins``).

Besides observing models, a server plugin may supply backends that are not Python entry
points (``pyserve_resolve_backend``), e.g. native Triton backend libraries.

A server plugin is registered in every model's scoped hook caller, so it can implement
``pyserve_execute`` as a pluggy wrapper (``@hookimpl(wrapper=True)``) to observe or time
every execute of every model, whatever backend owns it. It must not return a result of its
own from ``pyserve_execute`` (only wrappers are allowed there for server plugins).

With frontend processes (``pyserve run``'s default on more than one CPU) each process loads
the entry-point plugins, so a wrapper sees the executes of its own process: those of the
models the frontends replicate are spread over the processes. The model observers
(``pyserve_model_ready``, ``pyserve_model_unloaded``) are called in the owner only, once per
version, as in one process. A plugin object handed to an embedded server instead
(``PluginHost(server_plugins=...)``) exists in that process only; while one wraps
``pyserve_execute``, ``--replicate-models auto`` replicates no model, so it sees every execute.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pyserve_hookspecs._markers import hookspec

if TYPE_CHECKING:
    from pyserve.api import ModelContext


@hookspec
def pyserve_model_ready(model: ModelContext) -> None:
    """Observe a model version that just became READY.

    When: after all instances of the version were created, before it serves requests; once
    per version, in the owner process (not again for the frontend processes' replicas).
    Thread: the model-loading thread. Keep it short.

    :param model: the ready model's context.
    :returns: nothing.
    :raises Exception: logged with the plugin and model names; the model stays READY.
    """


@hookspec
def pyserve_model_unloaded(model: ModelContext) -> None:
    """Observe a model version that was finalized (unloaded or at shutdown).

    When: after ``pyserve_model_finalize`` of the version, in the owner process (not for the
    frontend processes' replicas).
    Thread: the unloading thread.

    :param model: the context of the version that was unloaded.
    :returns: nothing.
    :raises Exception: logged with the plugin and model names.
    """


@hookspec(firstresult=True)
def pyserve_resolve_backend(
    name: str,
    runtime: str,
    model_path: Path,
    version_paths: list[Path],
    backend_directory: str | None,
) -> tuple[str, object] | None:
    """Supply the backend of a model, before installed Python backends are considered.

    When: while a model with a ``backend`` loads, once per load. The first plugin returning a
    result wins (firstresult), and its backend serves the model even when a ``pyserve.backends``
    entry point of the same name is installed: a native library the user placed where Triton
    looks wins over a Python plugin, as in Triton. When every plugin returns ``None`` the
    installed Python backend serves the model (a config ``runtime`` naming a shared library,
    ``*.so``, then fails: only a plugin can supply it).
    Thread: a model-loading thread; may run concurrently for different models. Keep it cheap
    (it runs for every model with a backend): look for files, load nothing that is not found.

    :param name: the config's ``backend`` name.
    :param runtime: the config's ``runtime`` (``""`` when unset).
    :param model_path: the model directory.
    :param version_paths: the version directories being loaded, in load order.
    :param backend_directory: ``--backend-directory`` (Triton's default
        ``/opt/tritonserver/backends``), or None.
    :returns: ``None`` if this plugin does not serve the model; otherwise ``(key, plugin)``:
        ``key`` names the backend uniquely in this server (e.g. ``"native:<library path>"``:
        models resolving to the same key share one backend, initialized once; the startup
        table shows it as where the backend comes from) and ``plugin``
        implements the lifecycle hooks of ``pyserve_hookspecs.lifecycle``. When the key is
        already registered the server keeps the registered plugin and drops the new one, so
        creating it must have no side effects.
    :raises Exception: the model becomes UNAVAILABLE with the exception text as its reason (e.g.
        a library that exists but cannot be loaded, naming its path and what is missing).
    """
