"""The owner's hand-off folder: the Unix sockets its frontend processes connect to.

The owner makes it at start (``tempfile.mkdtemp``: mode 0700, this user only) and removes it
when it shuts down. An owner that dies (a crash, SIGKILL) cannot; its name carries the owner's
pid so that the keeper, which reaps that owner before it starts the next one, removes what the
dead one left (``remove_left_by``).

Standard library only: the small keeper imports it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "pyserve-handoff-"


def make() -> str:
    """A new hand-off folder of this process, in the temporary directory; its path."""
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def remove_left_by(pid: int) -> list[str]:
    """Remove the hand-off folders of the process ``pid``, which has exited (never call it for a
    live one: its frontends could not reconnect). Folders of other users are left alone.

    :returns: the paths removed.
    """
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}{pid}-*"):
        try:
            if not folder.is_dir() or folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(str(folder))
    return removed
