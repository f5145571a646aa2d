"""Ending a forked child process (a frontend, the keeper's server) without the parent's exit code,
and the command line of a fresh Python process that runs as this one does."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn


def flush_output() -> None:
    """Flush this process's log handlers, stdout and stderr (before ``os._exit`` or ``exec``)."""
    with contextlib.suppress(Exception):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()


def exit_forked(code: int) -> NoReturn:
    """End a forked child with ``code``, its log and output flushed, without running anything
    the parent set up to run at exit (``atexit``, the parent's ``finally`` blocks)."""
    flush_output()
    os._exit(code)


def python_command(*args: str) -> list[str]:
    """``sys.executable`` with this interpreter's options (``-X``, ``-W``, ``-O``, ``-B``, ... as
    ``sys.flags``, ``sys.warnoptions`` and ``sys._xoptions`` hold them), then ``args``: a server,
    frontend or keeper started again runs under the options the user gave ``pyserve run``.
    """
    import subprocess  # only when a process is started: the small keeper stays small

    return [sys.executable, *subprocess._args_from_interpreter_flags(), *args]  # type: ignore[attr-defined]  # the standard library's own helper for this (multiprocessing uses it), not in its stubs
