"""``pyserve bench`` against ``wrk`` on the same servers and the same request bytes.

Two targets, each started here on free loopback ports:

* ``canned``: a minimal uvloop HTTP/1.1 server answering every request with one fixed
  response (no inference) — it shows the load generators' own ceiling;
* ``pyserve``: ``pyserve run`` on the bundled example repository, model ``identity_fp32``.

The request is the KServe v2 infer request ``pyserve bench`` sends for ``identity_fp32`` with
``--shape INPUT0:16`` (binary tensor extension); ``wrk`` posts the same bytes through a Lua
script. Each cell: ``wrk -t T -c C -d D`` and ``pyserve bench --workers T --concurrency-range C
-p D*1000 -r 3`` (3 windows, all reported), in alternation. Prints a markdown table on stdout.

gRPC cells (unless ``--no-grpc``, and when ``h2load`` is installed): ``pyserve bench -i grpc``
against ``h2load`` posting the same ``ModelInferRequest`` to the same pyserve (wrk's column then
holds h2load's numbers; there is no canned gRPC target, since ``pyserve bench`` reads the model's
metadata and config over gRPC first).

Usage: ``.venv/bin/python benchmarks/bench_vs_wrk.py [--duration 3] [--concurrency 1,8,32]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batching import free_port  # sibling benchmark module

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

_CANNED_BODY = (
    b'{"model_name":"identity_fp32","model_version":"1","outputs":[{"name":"OUTPUT0","datatype":"FP32",'
    b'"shape":[1,16],"parameters":{"binary_data_size":64}}]}'
)


def serve_canned(port: int) -> None:
    """The ``canned`` target: parse just enough HTTP/1.1 to answer each request once.

    POST gets the fixed infer response; GET the identity_fp32 metadata and config (which
    ``pyserve bench`` reads first); anything else 404.
    """
    body = _CANNED_BODY + bytes(64)
    response = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
        b"inference-header-content-length: " + str(len(_CANNED_BODY)).encode() + b"\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )

    def reply(status: bytes, payload: bytes) -> bytes:
        return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
                + str(len(payload)).encode() + b"\r\n\r\n" + payload)

    tensor = b'[{"name":"%s","datatype":"FP32","shape":[-1,-1]}]'
    metadata = reply(b"200 OK", b'{"name":"identity_fp32","versions":["1"],"platform":"identity","inputs":'
                     + tensor % b"INPUT0" + b',"outputs":' + tensor % b"OUTPUT0" + b"}")
    config = reply(b"200 OK", b'{"name":"identity_fp32","max_batch_size":8}')
    not_found = reply(b"404 Not Found", b'{"error":"Not Found"}')

    def answer(header: bytes) -> bytes:
        if header.startswith(b"post "):
            return response
        path = header.split(b" ", 2)[1]
        if path == b"/v2/models/identity_fp32":
            return metadata
        return config if path == b"/v2/models/identity_fp32/config" else not_found

    class Canned(asyncio.Protocol):
        def __init__(self) -> None:
            self.buffer = bytearray()

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            buffer = self.buffer
            buffer += data
            while True:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                header = bytes(buffer[:end]).lower()
                at = header.find(b"\r\ncontent-length:")
                line_end = header.find(b"\r\n", at + 2)
                length = int(header[at + 17 : line_end if line_end > 0 else None]) if at >= 0 else 0
                if len(buffer) < end + 4 + length:
                    return
                del buffer[: end + 4 + length]
                self.transport.write(answer(header))  # type: ignore[attr-defined]

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Canned, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    import uvloop

    uvloop.run(main())




def wait_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout:.0f} s")


def request_bytes(host: str) -> bytes:
    """The raw request ``pyserve bench`` sends for identity_fp32 with INPUT0:16."""
    sys.path.insert(0, str(REPO_ROOT))
    from pyserve.tools.bench import inputs
    from pyserve.tools.bench.options import BenchOptions

    info = inputs.ModelInfo(
        "identity_fp32", "", [inputs.TensorSpec("INPUT0", "FP32", [-1, -1])],
        [inputs.TensorSpec("OUTPUT0", "FP32", [-1, -1])], max_batch_size=8,
    )
    options = BenchOptions(model="identity_fp32", shapes={"INPUT0": [16]})
    return inputs.http_request(info, inputs.build_samples(info, options)[0], host, binary=True)


def lua_script(request: bytes, directory: Path) -> Path:
    """A wrk script posting the same path, headers and body."""
    head, _, body = request.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    path = lines[0].split(" ")[1]
    body_file = directory / "body.bin"
    body_file.write_bytes(body)
    headers = [line.split(": ", 1) for line in lines[1:] if not line.lower().startswith(("host:", "content-length:"))]
    script = directory / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f'wrk.path = "{path}"\n'
        f'local f = io.open("{body_file}", "rb")\nwrk.body = f:read("*all")\nf:close()\n'
        + "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in headers)
    )
    return script


def run_wrk(port: int, threads: int, connections: int, duration: float, script: Path) -> dict[str, float]:
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration:g}s", "--latency", "-s", str(script),
         f"http://127.0.0.1:{port}"],
        capture_output=True, text=True, check=True,
    ).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]

    def ms(label: str) -> float:
        match = re.search(rf"\s{label}\s+([\d.]+)(us|ms|s)\b", out)
        if not match:
            return float("nan")
        value, unit = float(match.group(1)), match.group(2)
        return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value

    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": rate, "p50": ms("50%"), "p99": ms("99%"), "errors": float(errors.group(1)) if errors else 0.0}


def grpc_body(directory: Path) -> Path:
    """The length-prefixed ``ModelInferRequest`` h2load posts: what ``pyserve bench -i grpc``
    sends for ``identity_fp32 --shape INPUT0:16`` (one [1,16] FP32 tensor in raw_input_contents)."""
    import numpy as np

    from pyserve.protocol import ModelInferRequest

    request = ModelInferRequest(model_name="identity_fp32")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(np.random.default_rng(0).random(16, dtype=np.float32).tobytes())
    message = request.SerializeToString()
    body = directory / "request.grpc"
    body.write_bytes(b"\x00" + len(message).to_bytes(4, "big") + message)
    return body


def run_h2load(port: int, threads: int, connections: int, duration: float, body: Path) -> dict[str, float]:
    from serving import GRPC_PATH, parse_h2load  # sibling benchmark module

    log_file = body.with_suffix(".log")
    log_file.unlink(missing_ok=True)
    out = subprocess.run(
        ["h2load", f"-t{threads}", f"-c{connections}", "-m1", f"-D{max(1, round(duration))}", "-d", str(body),
         "--log-file", str(log_file), "-H", "content-type: application/grpc", "-H", "te: trailers",
         f"http://127.0.0.1:{port}{GRPC_PATH}"],
        capture_output=True, text=True, check=False,
    )
    parsed = parse_h2load(out.stdout + out.stderr, log_file)
    if parsed is None:
        raise RuntimeError(f"h2load failed: {(out.stdout + out.stderr)[-2000:]}")
    rps, p50, p99, errors = parsed
    return {"rps": rps, "p50": p50, "p99": p99, "errors": float(errors)}


def run_bench(port: int, workers: int, connections: int, duration: float, directory: Path,
              protocol: str = "http") -> dict[str, float]:
    result_file = directory / "bench.json"
    proc = subprocess.run(
        [PYTHON, "-m", "pyserve", "bench", "-m", "identity_fp32", "-u", f"127.0.0.1:{port}", "--shape", "INPUT0:16",
         "--concurrency-range", str(connections), "-p", str(int(duration * 1000)), "-r", "3",
         "--workers", str(workers), "-q", "--json", str(result_file), "-i", protocol],
        capture_output=True, text=True, cwd=REPO_ROOT,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"pyserve bench failed: {proc.stderr[-2000:]}")
    level = json.loads(result_file.read_text())["results"][0]
    return {"rps": level["throughput"], "p50": level["percentiles_us"]["p50"] / 1000,
            "p99": level["percentiles_us"]["p99"] / 1000, "errors": float(level["errors"]),
            "cpu": level["client_cpu"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per wrk run / per bench window")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--threads", default="1,2", help="wrk threads = bench workers")
    parser.add_argument("--no-grpc", dest="grpc", action="store_false",
                        help="skip the gRPC cells (pyserve bench -i grpc against h2load)")
    parser.add_argument("--serve-canned", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_canned:
        serve_canned(args.serve_canned)
        return 0
    if shutil.which("wrk") is None:
        print("wrk is not installed (apt-get install -y wrk)", file=sys.stderr)
        return 1
    canned_port, http_port, grpc_port = free_port(), free_port(), free_port()
    with_grpc = args.grpc and shutil.which("h2load") is not None
    servers = [
        subprocess.Popen([PYTHON, __file__, "--serve-canned", str(canned_port)]),
        subprocess.Popen([PYTHON, "-m", "pyserve", "run", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                          "--allow-metrics", "false", "--allow-grpc", str(with_grpc).lower()],
                         cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]
    rows: list[str] = []
    try:
        wait_port(canned_port)
        wait_port(http_port)
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            script = lua_script(request_bytes("127.0.0.1"), directory)
            cells = [(target, port, lambda p, t, c, d: run_wrk(p, t, c, d, script), "http")
                     for target, port in (("canned", canned_port), ("pyserve", http_port))]
            if with_grpc:  # gRPC: h2load in wrk's place, the same pyserve (no canned gRPC target)
                wait_port(grpc_port)
                body = grpc_body(directory)
                cells.append(("pyserve gRPC (h2load)", grpc_port, lambda p, t, c, d: run_h2load(p, t, c, d, body), "grpc"))
            for target, port, reference, protocol in cells:
                reference(port, 1, 8, 1.0)  # warm-up
                for threads in [int(t) for t in args.threads.split(",")]:
                    for connections in [int(c) for c in args.concurrency.split(",")]:
                        if connections < threads:
                            continue
                        peer = reference(port, threads, connections, args.duration * 3)
                        bench = run_bench(port, threads, connections, args.duration, directory, protocol)
                        rows.append(
                            f"| {target} | {threads} | {connections} | {peer['rps']:,.0f} | {bench['rps']:,.0f} | "
                            f"{bench['rps'] / peer['rps']:.2f} | {peer['p50']:.3f} / {bench['p50']:.3f} | "
                            f"{peer['p99']:.3f} / {bench['p99']:.3f} | {bench['cpu']:.2f} |"
                        )
                        print(rows[-1], file=sys.stderr, flush=True)
    finally:
        for server in servers:
            server.terminate()
            server.wait(10)
    print("| target | wrk threads = bench workers | connections | wrk req/s | bench req/s | bench / wrk "
          "| p50 ms wrk / bench | p99 ms wrk / bench | bench CPU (cores) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
