"""One ``pyserve bench`` load generator process.

A worker runs one asyncio loop (uvloop when installed) and talks to the parent over a
``multiprocessing`` pipe. Commands (pickled tuples):

* ``("load", LoadSpec)`` — switch to a new load level and reset the counters;
* ``("snapshot",)`` — answer ``("window", {...})`` with what completed since the last
  snapshot or load change, then reset: ``count``, ``errors``, ``first_error``, ``delayed``,
  ``duration_s``, ``cpu_s`` (this process) and ``latencies`` (``array('d')`` bytes, seconds);
* ``("stop",)`` — close everything, answer ``("stopped",)`` and exit.

HTTP goes over raw keep-alive HTTP/1.1 connections (``asyncio.Protocol``) with pre-encoded
requests; only the status line and ``Content-Length`` of each response are parsed. Unary gRPC
goes over one HTTP/2 connection per worker with pyserve's lean client
(:mod:`pyserve.tools.bench.h2client`, pre-serialized ``ModelInferRequest`` bytes, replies counted not
parsed); ``--streaming`` uses ``grpc.aio``, one ``ModelStreamInfer`` stream per request slot.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import time
import traceback
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, cast

from pyserve.tools.bench.h2client import CallFailed, LeanChannel

_HEADER_END = b"\r\n\r\n"
_INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
_STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
_RETRY_S = 0.05


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker sends, and where."""

    protocol: str
    host: str
    port: int
    requests: list[bytes]
    streaming: bool = False
    max_connections: int = 256
    seed: int = 0


@dataclass(frozen=True)
class LoadSpec:
    """This worker's share of one load level.

    :ivar concurrency: closed loop: requests kept in flight (0 = none when ``rate`` is 0).
    :ivar rate: open loop: requests per second (0 = closed loop).
    :ivar distribution: ``constant`` or ``poisson`` gaps between sends (open loop).
    :ivar phase: constant distribution: first send after this fraction of a gap.
    """

    concurrency: int = 0
    rate: float = 0.0
    distribution: str = "constant"
    phase: float = 0.0


class Recorder:
    """Latencies and failures since the last snapshot."""

    def __init__(self) -> None:
        self.latencies = array("d")
        self.errors = 0
        self.first_error = ""
        self.delayed = 0
        self.since = time.perf_counter()
        self.cpu_since = time.process_time()

    def reset(self) -> None:
        """Forget everything measured so far."""
        self.__init__()  # type: ignore[misc]

    def fail(self, message: str) -> None:
        """Count one failed request."""
        self.errors += 1
        if not self.first_error:
            self.first_error = message

    def snapshot(self) -> dict[str, Any]:
        """What was measured since the last reset, then reset."""
        now = time.perf_counter()
        window = {
            "count": len(self.latencies),
            "errors": self.errors,
            "first_error": self.first_error,
            "delayed": self.delayed,
            "duration_s": now - self.since,
            "cpu_s": time.process_time() - self.cpu_since,
            "latencies": self.latencies.tobytes(),
        }
        self.reset()
        return window


class _Requests:
    """Cycles through the pre-encoded requests."""

    def __init__(self, requests: list[bytes]) -> None:
        self._requests = requests
        self._next = 0

    def next(self) -> bytes:
        request = self._requests[self._next]
        self._next = (self._next + 1) % len(self._requests)
        return request


class _Scheduler:
    """Open-loop send times: calls ``fire`` at a constant or Poisson rate until stopped."""

    def __init__(self, spec: LoadSpec, fire: Callable[[], None], seed: int) -> None:
        self.spec = spec
        self.fire = fire
        self.rng = random.Random(seed)
        self.task = asyncio.ensure_future(self._run())

    def _gap(self) -> float:
        if self.spec.distribution == "poisson":
            return self.rng.expovariate(self.spec.rate)
        return 1.0 / self.spec.rate

    async def _run(self) -> None:
        gap = 1.0 / self.spec.rate
        due = time.perf_counter() + (self.spec.phase * gap if self.spec.distribution == "constant" else self._gap())
        while True:
            now = time.perf_counter()
            while due <= now:
                self.fire()
                due += self._gap()
            await asyncio.sleep(due - now)

    def stop(self) -> None:
        self.task.cancel()


# -- HTTP ---------------------------------------------------------------------------------------------


class _HttpConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection with at most one request in flight.

    Responses are framed by ``Content-Length`` or ``Transfer-Encoding: chunked``; of the
    headers only the status code and the framing are looked at.
    """

    def __init__(self, driver: HttpDriver) -> None:
        self.driver = driver
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.sent_at = 0.0
        self._buffer = bytearray()
        self._need = -1  # bytes of the whole response once known
        self._body_start = -1  # set once the header is parsed
        self._chunked = False
        self._scan = 0  # chunked: where the next chunk-size line starts
        self._status_ok = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.driver.lost(self, exc)

    def send(self, request: bytes) -> None:
        assert self.transport is not None
        self.busy = True
        self.sent_at = time.perf_counter()
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while True:
            if self._body_start < 0 and not self._parse_header():
                return
            if self._chunked and self._need < 0 and not self._scan_chunks():
                return
            if len(buffer) < self._need:
                return
            error = "" if self._status_ok else self._error_text()
            del buffer[: self._need]
            self._need = self._body_start = -1
            self.busy = False
            self.driver.done(self, time.perf_counter() - self.sent_at, error)
            if not buffer:
                return

    def _parse_header(self) -> bool:
        end = self._buffer.find(_HEADER_END)
        if end < 0:
            return False
        header = bytes(self._buffer[:end]).lower()
        self._status_ok = header[9:12] == b"200"
        self._body_start = end + 4
        at = header.find(b"\r\ncontent-length:")
        if at >= 0:
            line_end = header.find(b"\r\n", at + 2)
            self._chunked = False
            self._need = self._body_start + int(header[at + 17 : line_end if line_end >= 0 else None])
            return True
        if b"\r\ntransfer-encoding: chunked" in header or b"\r\ntransfer-encoding:chunked" in header:
            self._chunked = True
            self._scan = self._body_start
            self._need = -1
            return True
        self.driver.recorder.fail("a response with neither Content-Length nor chunked encoding")
        self.close()
        return False

    def _scan_chunks(self) -> bool:
        """Walk the chunks received so far; sets ``_need`` once the last one is in."""
        buffer = self._buffer
        pos = self._scan
        while True:
            line_end = buffer.find(b"\r\n", pos)
            if line_end < 0:
                return False
            size = int(bytes(buffer[pos:line_end]).split(b";", 1)[0], 16)
            if size == 0:  # the last chunk, then trailer lines up to an empty one
                pos = line_end + 2
                while True:
                    line_end = buffer.find(b"\r\n", pos)
                    if line_end < 0:  # ``_scan`` stays on the last chunk's size line
                        return False
                    if line_end == pos:
                        self._need = pos + 2
                        return True
                    pos = line_end + 2
            after = line_end + 2 + size + 2
            if after > len(buffer):
                self._scan = pos
                return False
            pos = self._scan = after

    def _error_text(self) -> str:
        """``HTTP/1.1 404 Not Found: {"error": ...}`` for a response that is not 200."""
        buffer = self._buffer
        status_line = bytes(buffer[: buffer.find(b"\r\n")]).decode("latin-1")
        raw = bytes(buffer[self._body_start : self._need])
        if self._chunked:
            parts, pos = [], 0
            while (line_end := raw.find(b"\r\n", pos)) >= 0:
                size = int(raw[pos:line_end].split(b";", 1)[0], 16)
                if size == 0:
                    break
                parts.append(raw[line_end + 2 : line_end + 2 + size])
                pos = line_end + 2 + size + 2
            raw = b"".join(parts)
        body = raw[:300].decode("utf-8", "replace")
        return f"{status_line}: {body}" if body else status_line

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class HttpDriver:
    """Keeps the HTTP connections busy according to the current :class:`LoadSpec`."""

    def __init__(self, config: WorkerConfig, recorder: Recorder) -> None:
        self.config = config
        self.recorder = recorder
        self.requests = _Requests(config.requests)
        self.loop = asyncio.get_running_loop()
        self.spec = LoadSpec()
        self.connections: set[_HttpConnection] = set()
        self.idle: collections.deque[_HttpConnection] = collections.deque()
        self.connecting = 0
        self.in_flight = 0
        self.backlog = 0
        self.scheduler: _Scheduler | None = None
        self.closing = False

    # load control
    def set_load(self, spec: LoadSpec) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
            self.scheduler = None
        self.spec = spec
        self.backlog = 0
        if spec.rate > 0:
            self.scheduler = _Scheduler(spec, self._fire, self.config.seed)
        else:
            self._fill()

    def _fill(self) -> None:
        """Closed loop: start requests on idle connections and open more up to the concurrency."""
        target = self.spec.concurrency
        while self.in_flight < target and self.idle:
            self._send(self.idle.popleft())
        missing = target - self.in_flight - self.connecting
        for _ in range(max(missing, 0)):
            self._open()

    def _fire(self) -> None:
        """Open loop: one scheduled send."""
        if self.idle:
            self._send(self.idle.popleft())
            return
        self.backlog += 1
        if len(self.connections) + self.connecting < self.config.max_connections:
            self._open()
        else:
            self.recorder.delayed += 1

    def _send(self, connection: _HttpConnection) -> None:
        self.in_flight += 1
        connection.send(self.requests.next())

    def _open(self) -> None:
        self.connecting += 1
        asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        try:
            _, protocol = await self.loop.create_connection(
                lambda: _HttpConnection(self), self.config.host, self.config.port
            )
        except OSError as exc:
            self.recorder.fail(f"cannot connect to {self.config.host}:{self.config.port}: {exc.strerror or exc}")
            await asyncio.sleep(_RETRY_S)
            self.connecting -= 1
            if not self.closing and self.spec.rate == 0:
                self._fill()
            return
        self.connecting -= 1
        connection = cast(_HttpConnection, protocol)
        if self.closing:
            connection.close()
            return
        self.connections.add(connection)
        self._next_for(connection)

    def _next_for(self, connection: _HttpConnection) -> None:
        """Give a free connection its next request, or park it."""
        if self.closing:
            return
        if self.spec.rate > 0:
            if self.backlog > 0:
                self.backlog -= 1
                self._send(connection)
                return
        elif self.in_flight < self.spec.concurrency:
            self._send(connection)
            return
        self.idle.append(connection)

    # connection callbacks
    def done(self, connection: _HttpConnection, latency: float, error: str) -> None:
        self.in_flight -= 1
        if error:
            self.recorder.fail(error)
        else:
            self.recorder.latencies.append(latency)
        self._next_for(connection)

    def lost(self, connection: _HttpConnection, exc: Exception | None) -> None:
        self.connections.discard(connection)
        try:
            self.idle.remove(connection)
        except ValueError:
            pass
        if connection.busy:
            connection.busy = False
            self.in_flight -= 1
            self.recorder.fail(f"the server closed the connection{f': {exc}' if exc else ''}")
        if not self.closing and self.spec.rate == 0:
            self.loop.call_later(_RETRY_S, self._fill)

    async def close(self) -> None:
        self.closing = True
        if self.scheduler is not None:
            self.scheduler.stop()
        for connection in list(self.connections):
            connection.close()
        await asyncio.sleep(0)


# -- gRPC ---------------------------------------------------------------------------------------------


class GrpcDriver:
    """Keeps gRPC requests in flight (unary ``ModelInfer`` or ``ModelStreamInfer`` streams)."""

    def __init__(self, config: WorkerConfig, recorder: Recorder) -> None:
        import grpc

        self.grpc = grpc
        self.config = config
        self.recorder = recorder
        self.requests = _Requests(config.requests)
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        # grpc.aio only for streaming calls: unary ones go through the lean client below
        self.channel = grpc.aio.insecure_channel(f"{config.host}:{config.port}", options=options) if config.streaming else None
        self.stream: Any = self.channel.stream_stream(_STREAM_METHOD) if self.channel is not None else None
        self.lean = LeanChannel(config.host, config.port)  # unary calls: far less CPU than grpc.aio
        self.spec = LoadSpec()
        self.generation = 0
        self.loops: set[int] = set()
        self.tasks: set[asyncio.Future[None]] = set()
        self.idle_streams: list[Any] = []
        self.in_flight = 0
        self.backlog = 0
        self.scheduler: _Scheduler | None = None
        self.closing = False
        if config.streaming:
            from pyserve import protocol as pb

            self.stream_response = pb.ModelStreamInferResponse

    def set_load(self, spec: LoadSpec) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
            self.scheduler = None
        self.spec = spec
        self.backlog = 0
        if spec.rate > 0:
            self.scheduler = _Scheduler(spec, self._fire, self.config.seed)
            return
        for index in range(spec.concurrency):
            if index not in self.loops:
                self.loops.add(index)
                self._spawn(self._closed_loop(index))

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _closed_loop(self, index: int) -> None:
        stream: Any = None
        try:
            while not self.closing and self.spec.rate == 0 and index < self.spec.concurrency:
                stream = await self._one(stream)
        finally:
            self.loops.discard(index)
            if stream is not None:
                self.idle_streams.append(stream)

    def _fire(self) -> None:
        if self.in_flight >= self.config.max_connections:
            self.backlog += 1
            self.recorder.delayed += 1
            return
        self._spawn(self._open_loop_request())

    async def _open_loop_request(self) -> None:
        stream = self.idle_streams.pop() if self.idle_streams else None
        while True:
            stream = await self._one(stream)
            if self.closing or self.backlog <= 0 or self.spec.rate == 0:
                break
            self.backlog -= 1
        if stream is not None:
            self.idle_streams.append(stream)

    async def _one(self, stream: Any) -> Any:
        """Send one request and wait for its (final) response; returns the stream to reuse."""
        body = self.requests.next()
        self.in_flight += 1
        try:
            if self.config.streaming:
                return await self._one_streamed(stream, body)
            started = time.perf_counter()
            try:
                await self.lean.unary(_INFER_METHOD, body)
            except CallFailed as exc:
                self.recorder.fail(f"{exc.code}: {exc.details}")
                if exc.code == "UNAVAILABLE":
                    await asyncio.sleep(_RETRY_S)
            else:
                self.recorder.latencies.append(time.perf_counter() - started)
            return None
        finally:
            self.in_flight -= 1

    async def _one_streamed(self, stream: Any, body: bytes) -> Any:
        grpc = self.grpc
        if stream is None:
            stream = self.stream()
        started = time.perf_counter()
        try:
            await stream.write(body)
            while True:
                message = await stream.read()
                if message is grpc.aio.EOF:
                    self.recorder.fail("the server ended the stream")
                    return None
                response = self.stream_response.FromString(message)
                if response.error_message:
                    self.recorder.fail(response.error_message)
                    stream.cancel()  # the request may or may not get a final response: start afresh
                    return None
                parameters = response.infer_response.parameters
                if "triton_final_response" in parameters and parameters["triton_final_response"].bool_param:
                    self.recorder.latencies.append(time.perf_counter() - started)
                    return stream
        except grpc.aio.AioRpcError as exc:
            self.recorder.fail(f"{exc.code().name}: {exc.details()}")
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                await asyncio.sleep(_RETRY_S)
            return None

    async def close(self) -> None:
        self.closing = True
        if self.scheduler is not None:
            self.scheduler.stop()
        for stream in self.idle_streams:
            stream.cancel()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=5)
        self.lean.close()
        if self.channel is not None:
            await self.channel.close(grace=None)


# -- process entry point ------------------------------------------------------------------------------


async def _serve(conn: Connection, config: WorkerConfig) -> None:
    loop = asyncio.get_running_loop()
    recorder = Recorder()
    driver: HttpDriver | GrpcDriver = (
        GrpcDriver(config, recorder) if config.protocol == "grpc" else HttpDriver(config, recorder)
    )
    commands: asyncio.Queue[Any] = asyncio.Queue()

    def readable() -> None:
        try:
            while conn.poll():
                commands.put_nowait(conn.recv())
        except (EOFError, OSError):
            commands.put_nowait(("stop",))
            loop.remove_reader(conn.fileno())

    def reply(message: tuple[Any, ...]) -> None:
        # The event loop may have made the pipe non-blocking (uvloop's readers do): a window of
        # latencies is larger than the pipe buffer, so write it blocking, while the parent reads.
        os.set_blocking(conn.fileno(), True)
        conn.send(message)

    loop.add_reader(conn.fileno(), readable)
    reply(("ready",))
    try:
        while True:
            command = await commands.get()
            if command[0] == "load":
                recorder.reset()
                driver.set_load(command[1])
            elif command[0] == "snapshot":
                reply(("window", recorder.snapshot()))
            elif command[0] == "stop":
                break
    finally:
        loop.remove_reader(conn.fileno())
        await driver.close()


def worker_main(conn: Connection, config: WorkerConfig) -> None:
    """The worker process: serve the parent's commands until ``stop``."""
    try:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
            asyncio.run(_serve(conn, config))
        else:
            uvloop.run(_serve(conn, config))
    except KeyboardInterrupt:
        pass
    except BaseException:  # report to the parent rather than dying silently
        try:
            os.set_blocking(conn.fileno(), True)
            conn.send(("failed", traceback.format_exc()))
        except OSError:
            pass
        return
    try:
        os.set_blocking(conn.fileno(), True)
        conn.send(("stopped",))
    except OSError:
        pass
