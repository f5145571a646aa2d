"""Parsers of ``pyserve run``'s flag values (argparse ``type=``) and the conversions of parsed
values into option values (a setting's ``convert``).

A parser raises ``argparse.ArgumentTypeError`` (argparse then names the flag); a conversion
raises ``ValueError`` with a message naming the flag. Light imports only: ``--help`` builds the
parser, so the heavier conversions import what they need when called.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pyserve.handoff.layout import AUTO
from pyserve.repository.scan import check_config_name
from pyserve.runtime.scheduling.busy_poll import MAX_WINDOW_US
from pyserve.server.argtypes import boolean

__all__ = [
    "AUTO", "at_least_zero", "auto_bool", "auto_count", "backend_config", "backend_setting", "boolean",
    "busy_poll_us", "config_name", "exit_timeout", "metrics_setting", "non_negative_float",
    "non_negative_int", "paths", "poll_secs", "port",
]


def port(value: str) -> int:
    number = int(value)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port must be between 0 and 65535, got {number}")
    return number


def non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return number


def non_negative_float(value: str) -> float:
    number = float(value)
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return number


def poll_secs(value: str) -> float:
    secs = float(value)
    if not secs > 0:
        raise argparse.ArgumentTypeError(f"--repository-poll-secs must be greater than 0, got {value}")
    return secs


def http_max_input_size(value: str) -> int:
    size = int(value)
    if size <= 0:  # Triton's words, which its scripts look for in the log
        raise argparse.ArgumentTypeError("Error: --http-max-input-size must be greater than 0.")
    return size


def config_name(value: str) -> str:
    try:
        return check_config_name(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def auto_count(value: str) -> str | int:
    if value == AUTO:
        return AUTO
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a whole number, got '{value}'") from None


def auto_bool(value: str) -> str | bool:
    return AUTO if value == AUTO else boolean(value)


def busy_poll_us(value: str) -> str | int:
    if value == AUTO:
        return AUTO
    try:
        microseconds = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--busy-poll-us must be a whole number of microseconds, got '{value}'") from None
    if not 0 <= microseconds <= MAX_WINDOW_US:
        raise argparse.ArgumentTypeError(f"--busy-poll-us must be between 0 and {MAX_WINDOW_US}, got {value}")
    return microseconds


def backend_setting(item: str) -> tuple[str, str, str]:
    """One ``--backend-config`` value, Triton's ``<backend>,<key>=<value>`` or global ``<key>=<value>``.

    :returns: ``(backend, key, value)``; ``backend`` is ``""`` for a global setting.
    """
    backend, setting = "", item
    if "," in item.split("=", 1)[0]:
        backend, _, setting = item.partition(",")
        if not backend.strip():
            raise argparse.ArgumentTypeError(f"'{item}' names no backend before ','")
    key, sep, value = setting.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"'{item}' must be <backend>,<key>=<value> or <key>=<value>")
    return backend.strip(), key.strip(), value


def metrics_setting(item: str) -> tuple[str, str]:
    """One ``--metrics-config`` value, ``<key>=<value>``."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"'{item}' must be <key>=<value>")
    return key.strip(), value.strip()


def backend_config(items: Sequence[tuple[str, str, str]]) -> dict[str, dict[str, str]]:
    """The parsed ``--backend-config`` values, as settings per backend (``""`` = every backend)."""
    settings: dict[str, dict[str, str]] = {}
    for backend, key, value in items:
        settings.setdefault(backend, {})[key] = value
    return settings


def paths(values: Sequence[str]) -> list[Path]:
    return [Path(p) for p in values]


def at_least_zero(flag: str) -> Callable[[int], int]:
    """A conversion refusing a negative number: ``<flag> must be >= 0``."""

    def checked(value: int) -> int:
        if value < 0:
            raise ValueError(f"{flag} must be >= 0")
        return value

    return checked


def exit_timeout(value: float) -> float:
    if not 0 <= value < 1e9:  # also refuses nan and inf
        raise ValueError(f"--exit-timeout-secs must be a number of seconds >= 0, not {value}")
    return value


def trace_config(items: Sequence[str]) -> Any:
    from pyserve.tracing import parse_trace_config

    return parse_trace_config(items)


def cache_config(items: Sequence[tuple[str, str, str]]) -> Any:
    from pyserve.dataplane.cache import parse_cache_config

    return parse_cache_config(list(items))


def http_restrictions(items: Sequence[str]) -> Any:
    from pyserve.frontends.restricted import parse_restrictions

    return parse_restrictions(items)


def grpc_restrictions(items: Sequence[str]) -> Any:
    from pyserve.frontends.restricted import parse_restrictions

    return parse_restrictions(items, grpc=True)
