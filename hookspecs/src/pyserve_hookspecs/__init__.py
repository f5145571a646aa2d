"""The pyserve plugin contract.

pyserve drives every backend through the hooks declared here. The hooks mirror the
TRITONBACKEND lifecycle of Triton Inference Server, in matched pairs::

    pyserve_backend_initialize        … pyserve_backend_finalize      (once per backend)
    pyserve_model_auto_complete                                      (per model, optional)
    pyserve_model_create              … pyserve_model_finalize        (per model version)
    pyserve_instance_create           … pyserve_instance_finalize     (per model instance)
    pyserve_execute                                                  (per gathered batch)
    pyserve_instance_ready                                           (per readiness question, optional)
    pyserve_model_validate                                           (pyserve validate only, optional)

Each backend is one pluggy plugin, found through the entry-point group
``pyserve.backends`` (entry-point name = backend name). The server calls a backend's hooks
through a caller scoped to that backend alone, so a model's hooks only ever reach the backend
that owns it. Server-wide plugins (entry-point group ``pyserve.plugins``) are left in every
scoped caller, which lets them wrap ``pyserve_execute`` for all models.

All hooks are called with keyword arguments; an implementation may accept any subset of
them (pluggy's opt-in arguments), so arguments can be added in later versions without
breaking existing backends.
"""

from __future__ import annotations

import pluggy

from pyserve_hookspecs import lifecycle, server
from pyserve_hookspecs._markers import hookspec

PROJECT_NAME = "pyserve"
"""The pluggy project name; markers from any other project are ignored by pyserve."""

BACKEND_ENTRY_POINT_GROUP = "pyserve.backends"
"""Entry-point group of backends; the entry-point name is the backend name used by configs."""

PLATFORM_ENTRY_POINT_GROUP = "pyserve.platforms"
"""Entry-point group mapping a config ``platform`` (entry-point name) to a backend name (value)."""

SERVER_PLUGIN_ENTRY_POINT_GROUP = "pyserve.plugins"
"""Entry-point group of server-wide plugins (observers and ``pyserve_execute`` wrappers)."""

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

SPEC_MODULES = (lifecycle, server)
"""Every module holding hook specifications, in the order they should be registered."""

__all__ = [
    "BACKEND_ENTRY_POINT_GROUP",
    "PLATFORM_ENTRY_POINT_GROUP",
    "PROJECT_NAME",
    "SERVER_PLUGIN_ENTRY_POINT_GROUP",
    "SPEC_MODULES",
    "hookimpl",
    "hookspec",
    "lifecycle",
    "server",
]
