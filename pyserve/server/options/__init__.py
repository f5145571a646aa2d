"""Every setting of ``pyserve run``, declared once, in groups.

Each group is a dataclass whose fields carry their flags (``declare.setting``): ``models``,
``http``, ``grpc``, ``metrics``, ``lifecycle``, ``operations`` (tracing, cache, limits) and
``scale`` (the process layout); ``LogOptions`` (``--log-*``) configures logging and is not part
of the server's options. ``ServerOptions`` is all the server groups in one object with flat
fields (``options.http_port``), built by keyword. ``RUN_GROUPS`` is the order in which
``pyserve run``'s flags are generated (``pyserve.cli.option_flags``).

Importing this package stays light (no grpc, no web framework): ``pyserve --help`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyserve.server.options.declare import HELP_GROUPS, Flag, Setting, flags_of, values_from
from pyserve.server.options.grpc import GRPC_SETTINGS, GrpcServiceOptions
from pyserve.server.options.http import HttpOptions
from pyserve.server.options.lifecycle import LifecycleOptions
from pyserve.server.options.logging_options import LogOptions
from pyserve.server.options.metrics import MetricsOptions
from pyserve.server.options.models import ModelOptions
from pyserve.server.options.operations import OperationsOptions
from pyserve.server.options.scale import ScaleOptions


@dataclass(kw_only=True)
class ServerOptions(  # bases in reverse: a dataclass lists the fields of its last base first
    OperationsOptions, LifecycleOptions, MetricsOptions, GrpcServiceOptions, HttpOptions, ScaleOptions, ModelOptions,
):
    """Everything a server can be set to (``pyserve run``'s flags, less ``--log-*``); field names
    follow Triton's flags. Only ``model_repositories`` is required; the other defaults are an
    embedded server's (this process alone, no metrics port)."""


RUN_GROUPS: tuple[type, ...] = (
    ModelOptions, ScaleOptions, HttpOptions, GrpcServiceOptions, MetricsOptions, LifecycleOptions, LogOptions,
    OperationsOptions,
)
"""The option groups whose flags ``pyserve run`` takes, in ``--help`` order."""

__all__ = [
    "GRPC_SETTINGS", "HELP_GROUPS", "RUN_GROUPS", "Flag", "GrpcServiceOptions", "HttpOptions", "LifecycleOptions",
    "LogOptions", "MetricsOptions", "ModelOptions", "OperationsOptions", "ScaleOptions", "ServerOptions", "Setting",
    "flags_of", "values_from",
]
