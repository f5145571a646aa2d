"""Hooks for server-wide plugins (entry-point group ``pyserve.plugins``).

A server plugin is registered in every model's scoped hook caller, so it can implement
``pyserve_execute`` as a pluggy wrapper (``@hookimpl(wrapper=True)``) to observe or time
every execute of every model, whatever backend owns it. It must not return a result of its
own from ``pyserve_execute`` (only wrappers are allowed there for server plugins).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyserve_hookspecs._markers import hookspec

if TYPE_CHECKING:
    from pyserve import ModelContext


@hookspec
def pyserve_model_ready(model: ModelContext) -> None:
    """Observe a model version that just became READY.

    When: after all instances of the version were created, before it serves requests.
    Thread: the model-loading thread. Keep it short.

    :param model: the ready model's context.
    :returns: nothing.
    :raises Exception: logged with the plugin and model names; the model stays READY.
    """


@hookspec
def pyserve_model_unloaded(model: ModelContext) -> None:
    """Observe a model version that was finalized (unloaded or at shutdown).

    When: after ``pyserve_model_finalize`` of the version.
    Thread: the unloading thread.

    :param model: the context of the version that was unloaded.
    :returns: nothing.
    :raises Exception: logged with the plugin and model names.
    """
