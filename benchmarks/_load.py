"""Closed-loop HTTP/1.1 load generator for the benchmarks (run as its own process).

Each of ``--concurrency`` keep-alive connections sends one precomputed POST, waits for the
whole response, and sends the next one at once (no pipelining). Requests that complete
inside the measurement window — ``--warmup`` seconds after ``--start-at``, lasting
``--duration`` seconds — are counted and timed; the window is given in wall-clock time so
that several generator processes measure the same interval.

The generator is written against ``asyncio.Protocol`` (on uvloop when installed) and does
the least parsing it can: the status code, ``Content-Length`` and, when present, the integer
response parameter ``"batch_size"`` (which pyserve's identity backend reports). It prints
one JSON object on stdout::

    {"requests": n, "errors": e, "window_s": d, "latencies_ms": [...],
     "batch_reported": k, "batch_inverse_sum": s, "first_error": "...",
     "cpu_s": CPU seconds this process used inside the window}

``requests / batch_inverse_sum`` is the mean size of the executes the requests were part of,
averaged per execute (each execute of size b contributes b requests of weight 1/b).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import cast

_BATCH_KEY = b'"batch_size":'
_HEADER_END = b"\r\n\r\n"


@dataclass
class Window:
    """The measurement interval and what was measured in it (``perf_counter`` seconds)."""

    start: float
    end: float
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    batch_reported: int = 0
    batch_inverse_sum: float = 0.0
    cpu_at_start: float = 0.0
    cpu_at_end: float = 0.0

    def error(self, message: str) -> None:
        self.errors += 1
        if not self.first_error:
            self.first_error = message


class _Connection(asyncio.Protocol):
    """One keep-alive connection with one request in flight at a time."""

    def __init__(self, request: bytes, window: Window, done: asyncio.Future[None]) -> None:
        self._request = request
        self._window = window
        self._done = done
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._need = -1  # bytes of the whole response once its header is parsed
        self._body_start = 0
        self._status_ok = False
        self._sent_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done.done():
            self._done.set_result(None)

    def _send(self) -> None:
        assert self._transport is not None
        self._sent_at = time.perf_counter()
        self._transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while True:
            if self._need < 0 and not self._parse_header():
                return
            if len(buffer) < self._need:
                return
            self._complete(bytes(buffer[self._body_start : self._need]))
            del buffer[: self._need]
            self._need = -1
            if not buffer:
                return

    def _parse_header(self) -> bool:
        end = self._buffer.find(_HEADER_END)
        if end < 0:
            return False
        header = bytes(self._buffer[:end]).lower()
        self._status_ok = header[9:12] == b"200"
        at = header.find(b"content-length:")
        if at < 0:
            self._window.error("response without Content-Length")
            self._close()
            return False
        line_end = header.find(b"\r\n", at)
        length = int(header[at + 15 : line_end if line_end >= 0 else None])
        self._body_start = end + 4
        self._need = self._body_start + length
        return True

    def _complete(self, body: bytes) -> None:
        now = time.perf_counter()
        window = self._window
        if window.start <= now < window.end:
            if self._status_ok:
                window.latencies.append(now - self._sent_at)
                at = body.find(_BATCH_KEY)
                if at >= 0:
                    at += len(_BATCH_KEY)
                    stop = at
                    while body[stop : stop + 1].isdigit():
                        stop += 1
                    size = int(body[at:stop] or b"0")
                    if size > 0:
                        window.batch_reported += 1
                        window.batch_inverse_sum += 1.0 / size
            else:
                window.error(body[:200].decode("utf-8", "replace"))
        if now >= window.end:
            if not window.cpu_at_end:
                window.cpu_at_end = _cpu_seconds()
            self._close()
        else:
            self._send()

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()


async def _run(args: argparse.Namespace) -> Window:
    body = Path(args.body_file).read_bytes()
    request = (
        f"POST {args.path} HTTP/1.1\r\nHost: {args.host}:{args.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    loop = asyncio.get_running_loop()
    offset = time.perf_counter() - time.time()  # wall clock → perf_counter
    start = args.start_at + args.warmup + offset
    window = Window(start=start, end=start + args.duration)
    delay = args.start_at + offset - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    loop.call_later(window.start - time.perf_counter(), _note_cpu, window, "cpu_at_start")
    futures: list[asyncio.Future[None]] = []
    for _ in range(args.concurrency):
        done: asyncio.Future[None] = loop.create_future()
        await loop.create_connection(partial(_Connection, request, window, done), args.host, args.port)
        futures.append(done)
    try:
        await asyncio.wait_for(asyncio.gather(*futures), timeout=window.end - time.perf_counter() + 30.0)
    except asyncio.TimeoutError:
        window.error("timed out waiting for the last responses")
    return window


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _note_cpu(window: Window, attribute: str) -> None:
    setattr(window, attribute, _cpu_seconds())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", required=True, help="e.g. /v2/models/NAME/infer")
    parser.add_argument("--body-file", required=True, help="file holding the request body")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--start-at", type=float, default=0.0, help="wall-clock start (default: now)")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.start_at <= 0:
        args.start_at = time.time()
    try:
        import uvloop
    except ImportError:
        window = asyncio.run(_run(args))
    else:
        window = uvloop.run(_run(args))
    json.dump(
        {
            "requests": len(window.latencies),
            "errors": window.errors,
            "first_error": window.first_error,
            "window_s": args.duration,
            "latencies_ms": [round(x * 1000.0, 4) for x in window.latencies],
            "batch_reported": window.batch_reported,
            "batch_inverse_sum": window.batch_inverse_sum,
            "cpu_s": window.cpu_at_end - window.cpu_at_start,
        },
        sys.stdout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
