"""``pyserve run``'s flags, generated from the option declarations (``pyserve.server.options``).

:func:`add_option_flags` adds one argparse flag per declared :class:`Flag`, in the ``--help``
group it names; :func:`option_values` reads an options class's values back from the parsed
namespace. Neither knows any particular setting: a new field in an options group is a new flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from pyserve.server.options.declare import GENERAL, HELP_GROUPS, Flag, Setting, flags_of, values_from


def argparse_arguments(item: Flag, owner: Setting) -> dict[str, Any]:
    """The keyword arguments of ``add_argument`` for ``item``, a flag of ``owner``."""
    arguments: dict[str, Any] = {"default": owner.flag_default(item)}
    for name in ("help", "type", "metavar", "choices", "action", "nargs", "const", "dest"):
        value = getattr(item, name)
        if value is not None:
            arguments[name] = value
    return arguments


def add_option_flags(parser: argparse.ArgumentParser, groups: Sequence[type]) -> None:
    """Add the flags of the option classes ``groups`` to ``parser``, each in its ``--help`` group
    (the groups of ``HELP_GROUPS`` are created here, in that order, after the general one)."""
    sections: dict[str, Any] = {GENERAL: parser}
    for title, description in HELP_GROUPS:
        sections[title] = parser.add_argument_group(title, description)
    for item, owner in flags_of(groups):
        sections[item.group].add_argument(*item.names, **argparse_arguments(item, owner))


def option_values(options: type, args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``options`` that its flags set, from the parsed ``args``.

    :raises ValueError: a value an option cannot take (the message names the flag).
    """
    return values_from(options, args)
