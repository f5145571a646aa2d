"""``wrk`` against ``pyserve run --http-server pyserve|uvicorn``: req/s and server CPU per request.

The load: ``POST /v2/models/identity_fp32/infer`` with a 1×16 FP32 JSON body (the bundled
example repository), keep-alive, from a wrk Lua script; cells at 1 and 8 connections.
CPU per request is the server process's user + system CPU time over the measured window
divided by the requests wrk completed.

    .venv/bin/python benchmarks/http_server.py [--duration 5] [--rounds 2] [--servers pyserve,uvicorn]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from batching import free_port  # sibling benchmark module

REPO = Path(__file__).resolve().parent.parent / "examples" / "model_repository"
BODY = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
                               "data": [float(i) for i in range(16)]}]})
LUA = f"""wrk.method = "POST"
wrk.body = '{BODY}'
wrk.headers["Content-Type"] = "application/json"
"""




def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start(server: str, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pyserve", "run", "--model-repository", str(REPO), "--http-port", str(port),
           "--allow-grpc", "false", "--allow-metrics", "false", "--http-server", server, "--host", "127.0.0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as answer:
                if answer.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{server} did not become ready")


def _wrk(port: int, connections: int, duration: int, script: str) -> int:
    out = subprocess.run(
        ["wrk", f"-t{min(connections, 2)}", f"-c{connections}", f"-d{int(duration)}s", "-s", script,
         f"http://127.0.0.1:{port}/v2/models/identity_fp32/infer"],
        capture_output=True, text=True, check=True,
    ).stdout
    match = re.search(r"(\d+) requests in", out)
    if match is None or "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"wrk failed:\n{out}")
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--servers", default="pyserve,uvicorn")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as lua:
        lua.write(LUA)
    rows: list[tuple[str, int, float, float]] = []
    try:
        for _ in range(args.rounds):
            for server in args.servers.split(","):
                port = free_port()
                proc = _start(server, port)
                try:
                    _wrk(port, 8, 1, lua.name)  # warm-up
                    for connections in (1, 8):
                        cpu = _cpu_seconds(proc.pid)
                        start = time.monotonic()
                        requests = _wrk(port, connections, args.duration, lua.name)
                        elapsed = time.monotonic() - start
                        used = _cpu_seconds(proc.pid) - cpu
                        rows.append((server, connections, requests / elapsed, used / requests * 1e6))
                        print(f"{server} c={connections}: {requests / elapsed:,.0f} req/s, "
                              f"{used / requests * 1e6:.0f} µs CPU/req", file=sys.stderr)
                finally:
                    proc.send_signal(signal.SIGINT)
                    proc.wait(30)
    finally:
        os.unlink(lua.name)
    print("| server | connections | req/s | server CPU µs/req |\n|---|---:|---:|---:|")
    for server in args.servers.split(","):
        for connections in (1, 8):
            cells = [r for r in rows if r[0] == server and r[1] == connections]
            rate = sorted(c[2] for c in cells)[len(cells) // 2]
            cpu = sorted(c[3] for c in cells)[len(cells) // 2]
            print(f"| {server} | {connections} | {rate:,.0f} | {cpu:.0f} |")


if __name__ == "__main__":
    main()
