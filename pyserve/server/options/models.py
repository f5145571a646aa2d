"""The model settings: the repositories, how models are loaded and controlled, the backends."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pyserve.server.options import values
from pyserve.server.options.declare import flag, setting


def _auto_complete(strict: bool, disabled: bool) -> bool:
    """Backends complete model configs unless ``--strict-model-config`` or
    ``--disable-auto-complete-config`` says otherwise."""
    return not (strict or disabled)


@dataclass(kw_only=True)
class ModelOptions:
    """Which models are served and how they are loaded (``--model-*``, ``--backend-*``)."""

    model_repositories: list[Path] = setting(
        flag("--model-repository", "--model-store", action="append", metavar="PATH", headline=True,
             help="a model repository (repeatable); default: the bundled example repository"),
        convert=values.paths,
    )
    model_control_mode: str = setting(
        flag("--model-control-mode", choices=["none", "poll", "explicit"], headline=True,
             help="none: load all, no changes; poll: load all, reload on repository changes; "
                  "explicit: load --load-model names, then only through the load/unload API"),
        default="none",
    )
    load_models: list[str] = setting(
        flag("--load-model", action="append", metavar="NAME", headline=True,
             help="a model to load at startup in explicit mode (repeatable; '*' alone = all)"),
        default_factory=list,
    )
    repository_poll_secs: float = setting(
        flag("--repository-poll-secs", type=values.poll_secs, metavar="SECS",
             help="seconds between repository scans in poll mode (default 15)"),
        default=15.0,
    )
    model_config_name: str = setting(  # read configs/<name>.pbtxt where a model has one
        flag("--model-config-name", type=values.config_name, metavar="NAME",
             help="read a model's configs/NAME.pbtxt instead of its config.pbtxt where it has one"),
        default="",
    )
    backend_directory: str = setting(
        flag("--backend-directory", metavar="PATH",
             help="where native backends live: <dir>/<backend>/libtriton_<backend>.so "
                  "(default /opt/tritonserver/backends)"),
        default="/opt/tritonserver/backends",
    )
    backend_config: Mapping[str, Mapping[str, str]] = setting(
        flag("--backend-config", action="append", type=values.backend_setting, metavar="BACKEND,KEY=VALUE",
             help="a setting passed to a backend (repeatable)"),
        default_factory=dict, convert=values.backend_config,
    )
    auto_complete: bool = setting(
        flag("--strict-model-config", type=values.boolean, nargs="?", const=True, default=False, metavar="BOOL",
             help="require config.pbtxt and turn off auto-complete (deprecated in Triton)"),
        flag("--disable-auto-complete-config", action="store_true", help="backends do not complete model configs"),
        default=True, convert=_auto_complete,
    )
    model_load_thread_count: int = setting(flag("--model-load-thread-count", type=int, metavar="N"), default=4)
    model_load_retry_count: int = setting(  # further attempts after a failed load
        flag("--model-load-retry-count", type=int, metavar="N",
             help="try a model version that fails to load N more times (default 0)"),
        default=0,
    )
    # --rate-limit: "off" or "execution_count" (instances wait for their instance group's
    # rate_limiter resources; pyserve.runtime.scheduling.rate_limiter)
    rate_limit: str = setting(
        flag("--rate-limit", choices=["off", "execution_count"],
             help="execution_count: instances execute only while the resources of their "
                  "instance_group rate_limiter are free (default off, as Triton)"),
        default="off",
    )
    rate_limit_resources: list[str] = setting(
        flag("--rate-limit-resource", action="append", metavar="NAME:COUNT[:DEVICE]",
             help="units of a rate-limiter resource, on one device or (without DEVICE) on every device "
                  "(repeatable; default: the most any instance asks for)"),
        default_factory=list,
    )


__all__ = ["ModelOptions"]
