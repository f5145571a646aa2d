"""``--trace-config``: Triton's ``[<mode>,]<key>=<value>`` trace settings, parsed into a
``TraceConfig`` (the keys are listed in ``pyserve.tracing``'s docstring)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

TRACE_LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
TRACE_MODES = ("triton", "opentelemetry")
DEFAULT_OTLP_URL = "http://localhost:4318/v1/traces"


class TraceConfigError(ValueError):
    """A ``--trace-config`` value Triton would refuse."""


@dataclass
class TraceConfig:
    """Parsed ``--trace-config`` values."""

    mode: str = "triton"
    level: list[str] = field(default_factory=lambda: ["OFF"])
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0
    file: str = ""
    url: str = DEFAULT_OTLP_URL
    resource: dict[str, str] = field(default_factory=dict)
    bsp: dict[str, int] = field(default_factory=dict)


class _Parsing:
    """A ``TraceConfig`` being filled, and the levels given so far (``level`` is repeatable)."""

    def __init__(self) -> None:
        self.config = TraceConfig()
        self.levels: list[str] = []


def _mode(parsing: _Parsing, value: str) -> None:
    if value not in TRACE_MODES:
        raise TraceConfigError(f"unknown trace mode '{value}'")
    parsing.config.mode = value


def _level(parsing: _Parsing, value: str) -> None:
    level = value.upper()
    if level not in TRACE_LEVELS:
        raise TraceConfigError(f"unknown trace level '{value}' (expected OFF, TIMESTAMPS or TENSORS)")
    parsing.levels.append(level)


def _rate(parsing: _Parsing, value: str) -> None:
    parsing.config.rate = _positive(int(value), "rate")


def _count(parsing: _Parsing, value: str) -> None:
    parsing.config.count = int(value)
    if parsing.config.count < -1:
        raise TraceConfigError("trace count must be -1 (unlimited) or >= 0")


def _file(parsing: _Parsing, value: str) -> None:
    parsing.config.file = value


def _log_frequency(parsing: _Parsing, value: str) -> None:
    parsing.config.log_frequency = int(value)
    if parsing.config.log_frequency < 0:
        raise TraceConfigError("trace log-frequency must be >= 0")


def _url(parsing: _Parsing, value: str) -> None:
    parsing.config.url = value


def _resource(parsing: _Parsing, value: str) -> None:
    name, eq, attr = value.partition("=")
    if not eq or not name:
        raise TraceConfigError(f"opentelemetry resource must be <key>=<value>, got '{value}'")
    parsing.config.resource[name] = attr


def _bsp(key: str) -> Callable[[_Parsing, str], None]:
    def store(parsing: _Parsing, value: str) -> None:
        parsing.config.bsp[key] = _positive(int(value), key)

    return store


_Handler = Callable[[_Parsing, str], None]

_KEYS: dict[tuple[str, str], _Handler] = {
    ("", "mode"): _mode,
    ("", "level"): _level,
    ("", "rate"): _rate,
    ("", "count"): _count,
    ("", "file"): _file,
    ("triton", "file"): _file,
    ("", "log-frequency"): _log_frequency,
    ("triton", "log-frequency"): _log_frequency,
    ("opentelemetry", "url"): _url,
    ("opentelemetry", "resource"): _resource,
    **{("opentelemetry", key): _bsp(key)
       for key in ("bsp_max_queue_size", "bsp_schedule_delay", "bsp_max_export_batch_size")},
}
"""What each (mode section, key) sets; section "" is a global setting (or the triton mode's)."""


def _split(item: str) -> tuple[str, str, str]:
    """``(section, key, value)`` of one ``--trace-config`` item."""
    section, setting = "", item
    if "," in item.split("=", 1)[0]:
        section, _, setting = item.partition(",")
        if section not in TRACE_MODES:
            raise TraceConfigError(f"unknown trace mode '{section}' in '{item}' (expected triton or opentelemetry)")
    key, sep, value = setting.partition("=")
    if not sep:
        raise TraceConfigError(f"--trace-config '{item}' must be [<mode>,]<key>=<value>")
    return section, key, value


def parse_trace_config(items: Iterable[str]) -> TraceConfig:
    """``--trace-config`` values → ``TraceConfig``.

    :raises TraceConfigError: a malformed item, unknown mode or key, or a bad value.
    """
    parsing = _Parsing()
    for item in items:
        section, key, value = _split(item)
        handler = _KEYS.get((section, key))
        if handler is None:
            raise TraceConfigError(f"unknown --trace-config key '{key}'" + (f" for mode '{section}'" if section else ""))
        try:
            handler(parsing, value)
        except TraceConfigError:
            raise
        except ValueError:
            raise TraceConfigError(f"--trace-config '{item}': expected an integer value") from None
    if parsing.levels:
        parsing.config.level = normalize_levels(parsing.levels)
    return parsing.config


def _positive(value: int, label: str) -> int:
    if value < 1:
        raise TraceConfigError(f"trace {label} must be >= 1")
    return value


def normalize_levels(levels: Sequence[str]) -> list[str]:
    """The trace levels given, each once, ``OFF`` dropped unless it is the only one."""
    chosen = [lv for lv in dict.fromkeys(levels) if lv != "OFF"]
    return chosen or ["OFF"]
