"""Ending a forked child process (a frontend, the keeper's server) without the parent's exit code."""

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
