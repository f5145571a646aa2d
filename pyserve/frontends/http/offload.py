"""Decoding large infer bodies on a worker thread, so the event loop goes on serving.

Turning tens of megabytes of JSON into tensors takes the better part of a second; on the event
loop that time would stall every other connection the loop serves. A body whose JSON part
(the whole body, or the ``Inference-Header-Content-Length`` bytes of it) is over
``OFFLOAD_JSON_BYTES``, or a compressed body over ``OFFLOAD_COMPRESSED_BYTES`` (it is inflated
while it is decoded), is therefore decoded on one of ``WORKERS`` decode threads; every other
body, the usual small request or one whose tensors travel as binary data, is decoded inline,
with no thread hop.

The loop runs while the worker runs Python code and between the C calls that decoding is made
of; a single call that keeps the interpreter lock (the JSON parser reading one document, numpy
building one array from a list) still holds the loop back until it returns, so binary tensor
data remains the way to send large tensors.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

OFFLOAD_JSON_BYTES = 1 << 20
"""JSON bytes above which a body is decoded on a decode thread."""
OFFLOAD_COMPRESSED_BYTES = 1 << 15
"""Compressed bytes above which a body is decoded on a decode thread (they inflate first)."""
WORKERS = 2
"""Decode threads per process: decoding holds the interpreter lock for most of its time, so
more threads would not decode faster, only hold more large bodies at once."""

_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def off_loop(body_length: int, headers: dict[bytes, bytes]) -> bool:
    """Whether a body of ``body_length`` bytes with ``headers`` (lower-case names) is decoded
    on a decode thread. A header the decoder will refuse keeps the body inline (it fails fast)."""
    if body_length <= OFFLOAD_COMPRESSED_BYTES:
        return False
    if headers.get(b"content-encoding"):
        return True
    raw = headers.get(b"inference-header-content-length")
    if raw is None:
        return body_length > OFFLOAD_JSON_BYTES
    try:
        json_length = int(raw)
    except ValueError:
        return False
    return json_length > OFFLOAD_JSON_BYTES


def _executor() -> ThreadPoolExecutor:
    """This process's decode threads (a forked child makes its own: threads do not survive a fork)."""
    global _pool
    pid = os.getpid()
    pool = _pool
    if pool is not None and pool[0] == pid:
        return pool[1]
    with _pool_lock:
        if _pool is None or _pool[0] != pid:
            _pool = (pid, ThreadPoolExecutor(WORKERS, thread_name_prefix="pyserve-decode"))
        return _pool[1]


def run(loop: asyncio.AbstractEventLoop, work: Callable[[], T]) -> asyncio.Future[T]:
    """Run ``work`` on a decode thread; the future (of ``loop``) resolves to its result or error."""
    return loop.run_in_executor(_executor(), work)
