"""The garbage collector while ``pyserve run`` starts: paused, then frozen and resumed.

Starting the server imports some 700 modules and builds the models: tens of thousands of
objects that live as long as the process. Python's collector walks all of them again and
again meanwhile (about 50 ms per full collection here) and finds nearly nothing to free.
``pause`` stops it for the start; ``resume`` moves everything made so far into the permanent
generation (``gc.freeze``: later collections never walk it again, and forked processes do
not copy its pages by collecting) and starts it again.

``resume`` acts only in a process where ``pause`` stopped the collector (forked processes
inherit that), so an application that embeds the server keeps its own collector settings.
Both are called on the main thread.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Stop automatic collection until ``resume`` (no-op if it is off already)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Freeze what exists now and turn automatic collection back on, if ``pause`` stopped it."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
