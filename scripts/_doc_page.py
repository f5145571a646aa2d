"""What the page generators in scripts/ share: write a generated page, or check it is current."""

from __future__ import annotations

import sys
from pathlib import Path


def write_or_check(page: str, output: Path, script: str, check: bool) -> int:
    """Write ``page`` to ``output``, or with ``check`` compare them without writing.

    :returns: the exit status: 1 when checking finds ``output`` stale or missing, else 0.
    """
    if check:
        current = output.read_text(encoding="utf-8") if output.is_file() else None
        if current != page:
            print(f"{output} is stale: run python scripts/{script}", file=sys.stderr)
            return 1
        print(f"{output} is up to date")
        return 0
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(page, encoding="utf-8")
    print(f"wrote {output}")
    return 0
