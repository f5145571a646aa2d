"""Value parsers for command-line flags, shared by ``pyserve`` and ``pyserve bench``.

Standard library only, so that ``--help`` stays fast.
"""

from __future__ import annotations

import argparse


def boolean(value: str) -> bool:
    """Triton's boolean flag values: true/false, 1/0, yes/no, on/off."""
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{value}'")
