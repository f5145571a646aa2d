"""Declaring a setting once: a dataclass field whose metadata holds its command-line flag(s).

A group of settings (``pyserve.server.options.http`` and its siblings) is a dataclass whose
fields are made with :func:`setting`; each names the flag(s) that set it, the help text, and how
the parsed value becomes the field's value. ``pyserve.cli.option_flags`` turns those
declarations into ``pyserve run``'s argparse flags and back into option values, and
``scripts/gen_flags_doc.py`` renders them; so adding a setting means writing one field.

Standard library only: building ``pyserve run --help`` imports these declarations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

METADATA_KEY = "pyserve.setting"
"""The key of a field's :class:`Setting` in ``dataclasses.Field.metadata``."""

GENERAL = ""
"""The ``--help`` group of flags listed under the parser's own heading."""
METRICS = "metrics"
GRPC = "gRPC"
OPERATIONS = "logging, tracing, cache and security"
TUNING = "advanced tuning"

HELP_GROUPS: tuple[tuple[str, str | None], ...] = (
    (METRICS, None),
    (GRPC, None),
    (OPERATIONS, None),
    (TUNING, "the defaults fit the machine (pyserve.handoff.layout): set these only to override them"),
)
"""The ``--help`` groups after the general one, in order: (title, description)."""


class _Same:
    """The type of :data:`SAME`."""

    def __repr__(self) -> str:
        return "SAME"


SAME: Any = _Same()
"""A flag's ``default`` when it is the default of the field it sets."""

REQUIRED: Any = object()
"""A :class:`Setting`'s ``default`` when its field has none."""


@dataclass(frozen=True)
class Flag:
    """One command-line flag: what argparse needs to parse it, and where ``--help`` lists it.

    ``names`` are the flag's spellings, Triton's first where it has one (the first long name
    gives the argparse destination unless ``dest`` is set). ``default`` is the value parsed
    when the flag is absent: :data:`SAME` means the field's default (``[]`` for a repeatable
    flag, ``False`` for a switch). ``headline`` puts the flag in the README's table of main flags.
    """

    names: tuple[str, ...]
    help: str | None = None
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: Sequence[str] | None = None
    action: str | None = None
    nargs: str | None = None
    const: Any = None
    dest: str | None = None
    group: str = GENERAL
    default: Any = SAME
    headline: bool = False

    @property
    def destination(self) -> str:
        """The attribute of the parsed namespace that holds this flag's value."""
        if self.dest:
            return self.dest
        long_names = [n for n in self.names if n.startswith("--")] or list(self.names)
        return long_names[0].lstrip("-").replace("-", "_")

    @property
    def repeatable(self) -> bool:
        return self.action == "append"


def flag(*names: str, **details: Any) -> Flag:
    """A :class:`Flag` spelled ``names`` (``details`` are its other attributes)."""
    return Flag(names=names, **details)


@dataclass(frozen=True)
class Setting:
    """How one option is set from the command line.

    A plain setting reads its ``flags`` (usually one) and passes their parsed values, in order,
    to ``convert`` (none: the one value as parsed). ``convert`` may raise ``ValueError`` with a
    message naming the flag. A nested setting (``nested``) is a whole options object (gRPC's)
    built by ``make`` from the values of its own settings, keyed by its field names.
    """

    flags: tuple[Flag, ...] = ()
    convert: Callable[..., Any] | None = None
    default: Any = REQUIRED
    default_factory: Callable[[], Any] | None = None
    nested: Mapping[str, Setting] | None = None
    make: Callable[[dict[str, Any]], Any] | None = None

    def flag_default(self, item: Flag) -> Any:
        """The value argparse gives ``item`` when it is absent from the command line."""
        if item.default is not SAME:
            return item.default
        if item.repeatable:
            return []
        if item.action == "store_true":
            return False
        if self.default_factory is not None:
            return self.default_factory()
        return None if self.default is REQUIRED else self.default

    def own_flags(self) -> Iterator[tuple[Flag, Setting]]:
        """This setting's flags, then those of its nested settings, each with its setting."""
        for item in self.flags:
            yield item, self
        for child in (self.nested or {}).values():
            yield from child.own_flags()

    def value(self, parsed: Any) -> Any:
        """The option's value from ``parsed`` (an ``argparse.Namespace``).

        :raises ValueError: a value the option cannot take (the message names the flag).
        """
        if self.nested is not None:
            assert self.make is not None
            return self.make({name: child.value(parsed) for name, child in self.nested.items()})
        raw = [getattr(parsed, item.destination) for item in self.flags]
        return self.convert(*raw) if self.convert is not None else raw[0]


def spec(*flags: Flag, default: Any = REQUIRED, default_factory: Callable[[], Any] | None = None,
         convert: Callable[..., Any] | None = None) -> Setting:
    """A :class:`Setting` outside a dataclass (for an options class declared elsewhere)."""
    if not flags:
        raise TypeError("a setting needs at least one flag")
    if len(flags) > 1 and convert is None:
        raise TypeError(f"a setting of several flags ({flags[0].names[0]}, ...) needs convert")
    return Setting(flags=flags, convert=convert, default=default, default_factory=default_factory)


def setting(*flags: Flag, default: Any = dataclasses.MISSING, default_factory: Callable[[], Any] | None = None,
            convert: Callable[..., Any] | None = None) -> Any:
    """A dataclass field set by ``flags`` (see :class:`Setting`); ``default`` and
    ``default_factory`` are the field's, as for ``dataclasses.field``."""
    declared = spec(*flags, default=REQUIRED if default is dataclasses.MISSING else default,
                    default_factory=default_factory, convert=convert)
    metadata = {METADATA_KEY: declared}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def nested(settings: Mapping[str, Setting], make: Callable[[dict[str, Any]], Any],
           default_factory: Callable[[], Any]) -> Any:
    """A dataclass field holding an options object declared elsewhere, whose fields are set by
    ``settings`` (keyed by field name) and which ``make`` builds from their values."""
    declared = Setting(nested=settings, make=make, default_factory=default_factory)
    return dataclasses.field(default_factory=default_factory, metadata={METADATA_KEY: declared})


def settings_of(options: type) -> Iterator[tuple[str, Setting]]:
    """(field name, setting) for each field of the dataclass ``options`` set from flags, in order."""
    for item in dataclasses.fields(options):
        declared = item.metadata.get(METADATA_KEY)
        if isinstance(declared, Setting):
            yield item.name, declared


def flags_of(groups: Sequence[type]) -> Iterator[tuple[Flag, Setting]]:
    """Every flag of the option classes ``groups``, in order, with the setting it belongs to."""
    for group in groups:
        for _, declared in settings_of(group):
            yield from declared.own_flags()


def values_from(options: type, parsed: Any) -> dict[str, Any]:
    """The keyword arguments of ``options`` (a dataclass) that its flags set, from ``parsed``.

    :raises ValueError: a value an option cannot take (the message names the flag).
    """
    return {name: declared.value(parsed) for name, declared in settings_of(options)}
