"""A lean blocking gRPC client for ``ModelInfer``: one HTTP/2 connection, one call at a time.

Used by ``frameworks.py`` to measure what the *server* adds to a request: tritonclient (and
the grpc C core under it) spends several hundred microseconds per call on its own side, which
would otherwise be counted as server overhead. This client still does a real gRPC call (HTTP/2
frames, HPACK headers, length-prefixed protobuf, ``grpc-status`` checked) but nothing more:
it serializes a ``ModelInferRequest`` per call and parses the ``ModelInferResponse`` into numpy.

``poll=True`` keeps the client from sleeping while it waits for the answer: the socket is
non-blocking and the client retries ``recv`` until bytes arrive. On this virtual machine a
thread blocked in ``recv`` costs tens of microseconds to wake (the idle vCPU halts and is
resumed by the hypervisor); that wake-up is the client's, not the server's, so the polling
client is the closer measure of what the server adds. It keeps one core busy while it waits.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import hpack
import numpy as np

from pyserve import protocol as pb
from pyserve.frontends.grpc import http2 as h2

PATH = "/inference.GRPCInferenceService/ModelInfer"


class LeanGrpcClient:
    """``infer(x) -> output array`` over one connection (not thread-safe: one per thread)."""

    def __init__(self, address: str, model: str, input_name: str, output_name: str, poll: bool = False) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.model, self.input_name, self.output_name = model, input_name, output_name
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.buffer = b""
        self.frames: list[tuple[int, int, int, bytes]] = []
        self.stream_id = 1
        self._block: bytes | None = None  # the request headers once they encode to table references
        self._decoded: dict[bytes, dict[str, str]] = {}
        self.sock.sendall(h2.PREFACE + h2.settings({h2.INITIAL_WINDOW_SIZE: 1 << 30}) + h2.window_update(0, 1 << 30))
        self.poll = poll
        if poll:
            self.sock.setblocking(False)

    def close(self) -> None:
        self.sock.close()

    def infer(self, x: np.ndarray) -> np.ndarray:
        request = pb.ModelInferRequest(model_name=self.model)
        request.inputs.add(name=self.input_name, datatype="FP32", shape=list(x.shape))
        request.outputs.add(name=self.output_name)
        request.raw_input_contents.append(np.ascontiguousarray(x, dtype=np.float32).tobytes())
        message = request.SerializeToString()
        stream_id, self.stream_id = self.stream_id, self.stream_id + 2
        block = self._block
        if block is None:  # the first call adds the headers to the table; later ones only refer to it
            block = self.encoder.encode([
                (":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "pyserve"),
                ("content-type", "application/grpc"), ("te", "trailers"),
            ])
            if stream_id > 1:
                self._block = block
        self._send(
            h2.frame(h2.HEADERS, h2.END_HEADERS, stream_id, block)
            + h2.frame(h2.DATA, h2.END_STREAM, stream_id, b"\x00" + len(message).to_bytes(4, "big") + message)
        )
        body = b""
        while True:
            kind, flags, sid, payload = self._frame()
            if kind == h2.DATA and sid == stream_id:
                body += payload
            elif kind == h2.HEADERS:
                headers = self._decoded.get(payload)
                if headers is None:
                    headers = dict(self.decoder.decode(payload))
                    if not self.decoder.header_table.dynamic_entries:  # literals only: same bytes, same headers
                        self._decoded[payload] = headers
                if sid == stream_id and flags & h2.END_STREAM:
                    if headers.get("grpc-status") != "0":
                        raise RuntimeError(f"gRPC status {headers.get('grpc-status')}: {headers.get('grpc-message')}")
                    break
            elif kind == h2.SETTINGS and not flags & h2.ACK:
                self._send(h2.frame(h2.SETTINGS, h2.ACK, 0))
            elif kind == h2.PING and not flags & h2.ACK:
                self._send(h2.frame(h2.PING, h2.ACK, 0, payload))
            elif kind in (h2.GOAWAY, h2.RST_STREAM):
                raise RuntimeError(f"the server ended the call (frame type {kind})")
        response = pb.ModelInferResponse.FromString(body[5:])
        shape = list(response.outputs[0].shape)
        return np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(shape)

    def _send(self, data: bytes) -> None:
        if not self.poll:
            self.sock.sendall(data)
            return
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view):]
            except BlockingIOError:
                continue

    def _recv(self) -> bytes:
        if not self.poll:
            return self.sock.recv(1 << 16)
        while True:
            try:
                return self.sock.recv(1 << 16)
            except BlockingIOError:
                continue

    def _frame(self) -> tuple[int, int, int, bytes]:
        while not self.frames:
            chunk = self._recv()
            if not chunk:
                raise ConnectionError("the server closed the connection")
            frames, self.buffer = h2.split_frames(self.buffer + chunk)
            self.frames.extend(frames)
        return self.frames.pop(0)


def median_us(call: Callable[[np.ndarray], Any], x: np.ndarray, requests: int) -> float:
    """The median of ``requests`` timed calls of ``call(x)``, in µs, after a warm-up of a tenth
    as many (at least 20)."""
    for _ in range(max(requests // 10, 20)):
        call(x)
    samples = []
    for _ in range(requests):
        start = time.perf_counter_ns()
        call(x)
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000.0


def main(argv: list[str] | None = None) -> None:
    """Time ``--requests`` calls in this fresh process and print ``{"median_us": …}`` as JSON.

    ``frameworks.py`` measures this way so that the client's process holds nothing else: no
    framework runtime or grpc C core of its own whose threads could take the CPU the client
    needs while it waits."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0] if main.__doc__ else None)
    parser.add_argument("--address", required=True, help="HOST:PORT of the gRPC server")
    parser.add_argument("--model", required=True)
    parser.add_argument("--input", required=True, help="input tensor name")
    parser.add_argument("--output", required=True, help="output tensor name")
    parser.add_argument("--shape", default="1,4", help="FP32 input shape (1,4)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--poll", action="store_true", help="spin on the socket instead of sleeping in recv")
    args = parser.parse_args(argv)
    shape = tuple(int(d) for d in args.shape.split(","))
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    client = LeanGrpcClient(args.address, args.model, args.input, args.output, poll=args.poll)
    try:
        print(json.dumps({"median_us": median_us(client.infer, x, args.requests)}))
    finally:
        client.close()


if __name__ == "__main__":
    main()
