"""``pyserve bench --endpoint-type completions|chat``: a language model's speed on the OpenAI routes.

Each concurrency level (``--concurrency-range``) sends ``--request-count`` streamed requests
(``stream: true`` with ``stream_options.include_usage``), keeping that many in flight, each on a
keep-alive HTTP/1.1 connection of its own, and times every Server-Sent Event as it is read:

* time to first token (TTFT): from sending the request to the first event carrying text;
* inter-token latency (ITL): per request, the time from its first to its last text divided by
  its output tokens minus one (genai-perf's definition);
* request latency: from sending to ``data: [DONE]``;
* output tokens: the ``usage`` of the last event (the text events counted where there is none);
* throughput: requests and output tokens per second over the level's wall time.

Asyncio on one thread, standard library plus ``httptools`` (a pyserve dependency): no client
package needed. A failed request (a status other than 200, or an error event) ends the run
with its message.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httptools
import numpy as np

from pyserve.tools.bench.options import BenchError

DEFAULT_PROMPT = "Tell me how the server measures the time to the first token"
REQUEST_TIMEOUT_S = 120.0


@dataclass
class LlmOptions:
    """One ``pyserve bench --endpoint-type`` run."""

    model: str
    host: str
    port: int
    endpoint_type: str = "chat"
    concurrency: list[int] = field(default_factory=lambda: [1])
    request_count: int = 32
    prompt: str = DEFAULT_PROMPT
    max_tokens: int = 64
    json: Path | None = None
    quiet: bool = False


@dataclass
class Timing:
    """One request: seconds from sending it (``first_token`` None: the answer held no text), and
    its output tokens."""

    first_token: float | None
    last_token: float
    done: float
    tokens: int

    @property
    def inter_token(self) -> float | None:
        if self.first_token is None or self.tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)


@dataclass
class LevelReport:
    """What one concurrency level measured (times in milliseconds)."""

    concurrency: int
    requests: int
    seconds: float
    requests_per_s: float
    output_tokens_per_s: float
    output_tokens_avg: float
    empty_answers: int
    """Answers without text (the model ended at once): no time to first token."""
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    latency_ms: dict[str, float]


class _Answer:
    """httptools callbacks: the status, then body bytes with their arrival times."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.chunks: list[bytes] = []
        self.complete = False

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


class _Client:
    """One keep-alive connection sending streamed completions."""

    def __init__(self, options: LlmOptions) -> None:
        self.options = options
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        body: dict[str, Any] = {"model": options.model, "max_tokens": options.max_tokens, "stream": True,
                                "stream_options": {"include_usage": True}}
        if options.endpoint_type == "chat":
            body["messages"] = [{"role": "user", "content": options.prompt}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = options.prompt
            path = "/v1/completions"
        data = json.dumps(body).encode()
        self.request = (f"POST {path} HTTP/1.1\r\nhost: {options.host}:{options.port}\r\n"
                        f"content-type: application/json\r\naccept: text/event-stream\r\n"
                        f"content-length: {len(data)}\r\n\r\n").encode() + data

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    async def one(self) -> Timing:
        """Send one request and time its events.

        :raises BenchError: the server answered an error, or went away.
        """
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.options.host, self.options.port)
        assert self.reader is not None
        start = time.perf_counter()
        self.writer.write(self.request)
        answer = _Answer()
        events = _Events(self.options.endpoint_type == "chat")
        while not answer.complete:
            data = await asyncio.wait_for(self.reader.read(1 << 16), REQUEST_TIMEOUT_S)
            if not data:
                raise BenchError("the server closed the connection before the answer ended")
            answer.parser.feed_data(data)
            now = time.perf_counter() - start
            for chunk in answer.chunks:
                events.feed(chunk, now)
            answer.chunks.clear()
        if answer.status != 200:
            raise BenchError(f"HTTP {answer.status}: {events.text()[:300]}")
        if not answer.parser.should_keep_alive():
            await self.close()
        return events.timing(time.perf_counter() - start)


class _Events:
    """Server-Sent Events of one answer, split and timed as their bytes arrive."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.buffer = b""
        self.raw: list[bytes] = []
        self.first = self.last = 0.0
        self.pieces = 0
        self.usage_tokens: int | None = None

    def feed(self, data: bytes, now: float) -> None:
        self.raw.append(data)
        self.buffer += data
        while b"\n\n" in self.buffer:
            event, _, self.buffer = self.buffer.partition(b"\n\n")
            if event.startswith(b"data: ") and event != b"data: [DONE]":
                self._event(json.loads(event[len(b"data: "):]), now)

    def _event(self, payload: dict[str, Any], now: float) -> None:
        if "error" in payload:
            raise BenchError(f"error event: {payload['error']}")
        if payload.get("usage"):
            self.usage_tokens = int(payload["usage"]["completion_tokens"])
        for choice in payload.get("choices", ()):
            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if text:
                self.pieces += 1
                self.first = self.first or now
                self.last = now

    def text(self) -> str:
        return b"".join(self.raw).decode("utf-8", "replace")

    def timing(self, done: float) -> Timing:
        tokens = self.usage_tokens if self.usage_tokens is not None else self.pieces
        return Timing(self.first if self.pieces else None, self.last, done, tokens)


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"avg": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    array = np.asarray(values) * 1000.0
    return {"avg": float(array.mean()), **{f"p{p}": float(np.percentile(array, p)) for p in (50, 90, 99)}}


async def measure(options: LlmOptions, concurrency: int) -> LevelReport:
    """Send ``request_count`` requests, ``concurrency`` at a time; the level's report."""
    clients = [_Client(options) for _ in range(concurrency)]
    remaining = options.request_count
    timings: list[Timing] = []

    async def lane(client: _Client) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            timings.append(await client.one())

    start = time.perf_counter()
    try:
        await asyncio.gather(*(lane(c) for c in clients))
    finally:
        for client in clients:
            await client.close()
    seconds = time.perf_counter() - start
    tokens = sum(t.tokens for t in timings)
    return LevelReport(
        concurrency=concurrency, requests=len(timings), seconds=seconds, requests_per_s=len(timings) / seconds,
        output_tokens_per_s=tokens / seconds, output_tokens_avg=tokens / len(timings),
        empty_answers=sum(1 for t in timings if t.first_token is None),
        ttft_ms=_stats([t.first_token for t in timings if t.first_token is not None]),
        itl_ms=_stats([t.inter_token for t in timings if t.inter_token is not None]),
        latency_ms=_stats([t.done for t in timings]),
    )


def table(reports: list[LevelReport]) -> str:
    """The summary table, one row per level."""
    head = ("Concurrency", "Req/s", "Out tok/s", "Tok/req", "TTFT avg ms", "TTFT p99 ms", "ITL avg ms",
            "ITL p99 ms", "Latency avg ms", "Latency p99 ms")
    rows = [head] + [(
        str(r.concurrency), f"{r.requests_per_s:.1f}", f"{r.output_tokens_per_s:.1f}", f"{r.output_tokens_avg:.1f}",
        f"{r.ttft_ms['avg']:.2f}", f"{r.ttft_ms['p99']:.2f}", f"{r.itl_ms['avg']:.3f}", f"{r.itl_ms['p99']:.3f}",
        f"{r.latency_ms['avg']:.2f}", f"{r.latency_ms['p99']:.2f}",
    ) for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def run(options: LlmOptions, out: Any = None) -> int:
    """Measure every level, print the table (and write ``--json``); the exit status.

    :raises BenchError: a request failed, or the server cannot be reached.
    """
    out = out if out is not None else sys.stdout
    reports = []
    for level in options.concurrency:
        if not options.quiet:
            print(f"pyserve bench: {options.endpoint_type} on '{options.model}', concurrency {level}, "
                  f"{options.request_count} requests", file=sys.stderr)
        try:
            reports.append(asyncio.run(measure(options, level)))
        except OSError as exc:
            raise BenchError(f"cannot reach {options.host}:{options.port}: {exc}") from None
    print(table(reports), file=out)
    empty = sum(r.empty_answers for r in reports)
    if empty:
        print(f"note: {empty} answer(s) held no text (left out of the time to first token)", file=out)
    if options.json is not None:
        document = {"model": options.model, "endpoint_type": options.endpoint_type, "prompt": options.prompt,
                    "max_tokens": options.max_tokens, "levels": [asdict(r) for r in reports]}
        options.json.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return 0
