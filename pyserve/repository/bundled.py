"""The bundled example repository: where it is, and which backends it needs.

A wheel of the ``pyserve-server`` distribution carries the repository as package data
(``pyserve/example_repository/``, put there by ``setup.py``); a checkout, or an editable install
of one, serves ``examples/model_repository/`` itself. The backends its models name are the
distributions of the ``examples`` extra (``pip install 'pyserve-server[examples]'``).
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "pyserve-server"
"""The core distribution: the server, the hookspecs contract and this repository."""

EXAMPLES_EXTRA = "examples"
"""The extra of :data:`DISTRIBUTION` naming the backends the bundled repository's models use."""

_PLACES = (
    Path(__file__).resolve().parents[1] / "example_repository",  # installed from a wheel
    Path(__file__).resolve().parents[2] / "examples" / "model_repository",  # a checkout
)

EXAMPLE_REPOSITORY = next((place for place in _PLACES if place.is_dir()), _PLACES[0])
"""The bundled example repository; it does not exist when neither place holds it."""

_EXTRA_REQUIREMENT = re.compile(
    rf"""^\s*([A-Za-z0-9][A-Za-z0-9._-]*)[^;]*;\s*extra\s*==\s*["']{EXAMPLES_EXTRA}["']\s*$"""
)


def missing_backends() -> list[str]:
    """The distributions of the ``examples`` extra that are not installed, in the extra's order.

    Empty when every one is installed, and when :data:`DISTRIBUTION` itself is not (the server run
    from a source folder on ``PYTHONPATH``): then nothing is known about what it needs.
    """
    try:
        requirements = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    missing = []
    for requirement in requirements:
        match = _EXTRA_REQUIREMENT.match(requirement)
        if match is None:
            continue
        try:
            metadata.distribution(match.group(1))
        except metadata.PackageNotFoundError:
            missing.append(match.group(1))
    return missing
