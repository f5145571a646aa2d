"""Which model instances are executing right now, readable after the process died.

``pyserve run`` keeps the server process alive from a small parent (``pyserve.handoff.keeper``)
that restarts it when a model crashes it (a segfault in native code, ``os._exit`` in a
``model.py``, the kernel's OOM killer). To name the model that was executing, the server writes
into a page of memory it shares with that parent: each instance worker claims a slot holding
its name once, and sets the slot's busy byte around every execute (two stores per batch).

Frontend processes answer replicas of models too, and the owner restarts one that dies: each
frontend writes a board of its own that the owner reads (inherited when it was forked, or an
open file descriptor passed to it, ``fd``).

Process-wide, like ``pyserve.runtime.scheduling.busy_poll``: ``attach`` in the process that writes, ``detach`` in a
process forked from it that must not write. Workers claim their slot when their thread starts,
in the process that runs them. Thread-safe: ``claim`` takes a lock; ``enter``/``leave`` write
one byte of a slot only its worker uses.
"""

from __future__ import annotations

import mmap
import os
import threading

SLOT_BYTES = 128
SLOTS = 1023
SIZE = SLOT_BYTES * (SLOTS + 1)
"""The board's size: a header slot, then ``SLOTS`` slots of ``SLOT_BYTES``."""

_READY = 0  # header byte: the server said it serves (``serving``)

_view: memoryview | None = None
_next = 0
_lock = threading.Lock()
_fds: dict[int, int] = {}  # id(board) → its memfd


def create() -> mmap.mmap:
    """A new board, shared with the processes forked after this call and with any process
    given ``fd(board)`` (a memfd on Linux; anonymous shared memory elsewhere)."""
    if hasattr(os, "memfd_create"):
        descriptor = os.memfd_create("pyserve-execution-board")
        try:
            os.ftruncate(descriptor, SIZE)
            board = mmap.mmap(descriptor, SIZE)
        except OSError:
            os.close(descriptor)
            raise
        _fds[id(board)] = descriptor
        return board
    return mmap.mmap(-1, SIZE, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)


def fd(board: mmap.mmap) -> int | None:
    """The file descriptor another process can map ``board`` from (``open_fd``), or None."""
    return _fds.get(id(board))


def open_fd(descriptor: int) -> mmap.mmap:
    """The board behind a descriptor given by the process that made it (``fd``)."""
    return mmap.mmap(descriptor, SIZE)


def close(board: mmap.mmap) -> None:
    """Release a board this process made (``create``) and no longer reads."""
    descriptor = _fds.pop(id(board), None)
    if descriptor is not None:
        os.close(descriptor)
    board.close()


def attach(board: mmap.mmap) -> None:
    """Write into ``board`` from this process from now on (clears it first)."""
    global _view, _next
    board[:] = bytes(SIZE)
    with _lock:
        _view = memoryview(board)
        _next = 0


def detach() -> None:
    """Stop writing (a process forked from the server that is not the server itself)."""
    global _view
    _view = None


def claim(label: str) -> int:
    """A slot for one instance worker, labelled ``label`` (what the parent logs); -1 when no
    board is attached or every slot is taken."""
    global _next
    with _lock:
        view = _view
        if view is None or _next >= SLOTS:
            return -1
        _next += 1
        slot = _next
    data = label.encode("utf-8", errors="replace")[: SLOT_BYTES - 2]
    offset = slot * SLOT_BYTES
    view[offset + 1] = len(data)
    view[offset + 2: offset + 2 + len(data)] = data
    return slot


def enter(slot: int) -> None:
    """The worker of ``slot`` starts an execute (hot path: one store)."""
    view = _view
    if view is not None and slot > 0:
        view[slot * SLOT_BYTES] = 1


def leave(slot: int) -> None:
    """The worker of ``slot`` finished its execute."""
    view = _view
    if view is not None and slot > 0:
        view[slot * SLOT_BYTES] = 0


def serving() -> None:
    """The server started serving (a death after this is a crash to recover from)."""
    view = _view
    if view is not None:
        view[_READY] = 1


def read(board: mmap.mmap) -> tuple[bool, list[str]]:
    """What a board says: whether its server had started serving, and the labels of the slots
    busy now."""
    view = memoryview(board)
    busy = []
    for slot in range(1, SLOTS + 1):
        offset = slot * SLOT_BYTES
        length = view[offset + 1]
        if not length:
            break  # slots are claimed in order
        if view[offset]:
            busy.append(bytes(view[offset + 2: offset + 2 + length]).decode("utf-8", errors="replace"))
    ready = bool(view[_READY])
    view.release()
    return ready, busy
