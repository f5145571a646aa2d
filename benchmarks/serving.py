"""Serving benchmark: pyserve against real Triton (Python backend) and bare Python echo servers.

Every server gets the same Triton-style repository: one model ``identity`` (``backend:
"python"``, ``max_batch_size: 8``, FP32 ``INPUT0``/``OUTPUT0`` with ``dims: [-1]``, one CPU
instance, no dynamic batcher) whose ``model.py`` echoes ``INPUT0`` as ``OUTPUT0``. Servers:

* ``pyserve``: ``pyserve run`` (the ``python`` backend plugin runs ``model.py`` in-process);
* ``triton``: Triton 2.51 from the ``nvidia-pytriton`` wheel, same ``model.py`` in its Python
  backend stub (see ``_triton.py``; ``--with-triton`` installs it on demand);
* ``starlette``: a bare Starlette/uvicorn echo of the KServe v2 infer route (HTTP ceiling);
* ``grpc-aio``: a bare ``grpc.aio`` echo of ``ModelInfer`` (gRPC ceiling);
* ``pyserve-single``: ``pyserve run --frontend-processes 0`` (one process), on the cells with one
  connection, where the default layout must not be slower (``--no-single`` skips it);
* ``pyserve-before`` (with ``--before CHECKOUT``): the plain ``pyserve run`` of another checkout
  (a worktree of the previous main: ``git worktree add --detach ../before <commit>``), on every
  cell: an A/B of a change, "default / before" per cell (and ``pyserve-before-batched``, its
  plain command on the batched repository, beside ``pyserve-batched``);
* ``pyserve-batched`` and ``triton-batched``: the same ``model.py`` with ``dynamic_batching { }``
  (``max_batch_size: 32``), on the cells with more than one connection: the issue's "Triton with
  its dynamic batcher" column and the 32-connection target against it (``--no-batched`` skips them).

Load: ``wrk`` (HTTP/1.1 keep-alive, one thread, the body posted by a Lua script) and
``h2load`` (gRPC unary over h2c: the length-prefixed ``ModelInferRequest`` posted to
``/inference.GRPCInferenceService/ModelInfer``, one stream per connection, latencies from its
``--log-file``). Cells are interleaved: each round measures every cell on every server, the
server order rotating per round; tables show medians over the rounds. Each server answers one
request of each kind correctly before it is measured (gRPC through a real gRPC client, since
h2load only sees HTTP status 200).

Also: the time from process start until a repository of 20 such Python models is READY
(``/v2/health/ready`` and every ``/v2/models/mNN/ready`` answer 200), and the idle memory of
each server process tree (RSS summed, and PSS, which counts shared pages once).

Prints markdown tables and the target verdicts on stdout and always exits 0.
Run: ``.venv/bin/python benchmarks/serving.py [--duration 3] [--rounds 3]`` (see README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _triton  # noqa: E402  sibling helper module
from batching import _fmt, _log_tail, _percentile, _tree_cpu_seconds, free_port, run_report, stop_process  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = "identity"
SMALL = 16
BIG = 4 * 1024 * 1024  # FP32 elements: 16 MiB
GRPC_PATH = "/inference.GRPCInferenceService/ModelInfer"

MODEL_PY = '''"""Identity: echoes INPUT0 as OUTPUT0 (Triton Python backend model)."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]
            )
            for r in requests
        ]
'''


def config_pbtxt(name: str, batching: bool = False) -> str:
    """The model's config; ``batching`` adds Triton's dynamic batcher with its defaults (the
    repository of the ``-batched`` servers)."""
    return "\n".join([
        f'name: "{name}"',
        'backend: "python"',
        f"max_batch_size: {BATCHED_MAX_BATCH_SIZE if batching else 8}",
        'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]',
        'output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]',
        "instance_group [ { count: 1, kind: KIND_CPU } ]",
        # e.g. parameters { key: "pyserve_inline_execute" value { string_value: "true" } }
        # (the same config for every server: Triton ignores parameters it does not know)
        os.environ.get("PYSERVE_BENCH_CONFIG_EXTRA", ""),
        "dynamic_batching { }" if batching else "",
    ]) + "\n"


def write_repository(root: Path, names: Iterable[str], batching: bool = False) -> Path:
    for name in names:
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config_pbtxt(name, batching))
        (root / name / "1" / "model.py").write_text(MODEL_PY)
    return root


# --------------------------------------------------------------------------- cells and request bytes


@dataclass(frozen=True)
class CellSpec:
    key: str
    label: str
    protocol: str  # "http" | "grpc"
    encoding: str  # "json" | "binary" (HTTP only)
    elements: int
    concurrency: int

    @property
    def big(self) -> bool:
        return self.elements >= BIG


def cell(protocol: str, encoding: str, elements: int, concurrency: int) -> CellSpec:
    size = "16 MB" if elements >= BIG else f"1x{elements}"
    kind = "gRPC" if protocol == "grpc" else f"HTTP {encoding}"
    key = f"{protocol}-{encoding}-{'16mb' if elements >= BIG else elements}-c{concurrency}"
    return CellSpec(key, f"{kind} {size} c={concurrency}", protocol, encoding, elements, concurrency)


SERVING_CELLS = [
    cell("http", "json", SMALL, 1),
    cell("http", "json", SMALL, 8),
    cell("http", "json", SMALL, 32),
    cell("http", "binary", SMALL, 1),
    cell("http", "binary", SMALL, 8),
    cell("http", "binary", SMALL, 32),
    cell("grpc", "grpc", SMALL, 1),
    cell("grpc", "grpc", SMALL, 8),
    cell("grpc", "grpc", SMALL, 32),
    cell("http", "binary", BIG, 1),
    cell("grpc", "grpc", BIG, 1),
]

BATCHED_CELLS = frozenset(c.key for c in SERVING_CELLS if not c.big and c.concurrency > 1)
"""The cells the ``-batched`` servers (``dynamic_batching``) are measured on: batching only
changes anything when requests overlap."""
SINGLE_CELLS = frozenset(c.key for c in SERVING_CELLS if not c.big and c.concurrency == 1)
"""The cells ``pyserve-single`` (``--frontend-processes 0``: one process) is measured on: the
default layout must lose nothing to it at one connection."""
BATCHED_MAX_BATCH_SIZE = 32


def tensor_bytes(elements: int) -> bytes:
    import numpy as np

    return np.arange(elements, dtype=np.float32).tobytes()


def http_json_body(elements: int) -> bytes:
    data = [float(i) for i in range(elements)]
    body = {"inputs": [{"name": "INPUT0", "shape": [1, elements], "datatype": "FP32", "data": data}]}
    return json.dumps(body, separators=(",", ":")).encode()


def http_binary_body(elements: int) -> tuple[bytes, int]:
    header = json.dumps({
        "inputs": [{"name": "INPUT0", "shape": [1, elements], "datatype": "FP32",
                    "parameters": {"binary_data_size": elements * 4}}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
    }, separators=(",", ":")).encode()
    return header + tensor_bytes(elements), len(header)


def grpc_message(elements: int) -> bytes:
    from pyserve.protocol import ModelInferRequest

    request = ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, elements])
    request.raw_input_contents.append(tensor_bytes(elements))
    return request.SerializeToString()


@dataclass
class RequestFiles:
    """Body file (and wrk Lua script for HTTP) of one cell kind."""

    body: Path
    script: Path | None
    headers: dict[str, str]
    message: bytes  # gRPC: the serialized ModelInferRequest (no prefix); HTTP: the body


_LUA = """local f = assert(io.open("{body}", "rb"))
wrk.body = f:read("*a")
f:close()
wrk.method = "POST"
{headers}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("WRKJSON {{\\"requests\\":%d,\\"duration_us\\":%d,\\"p50_us\\":%d,\\"p99_us\\":%d,"
    .. "\\"status\\":%d,\\"connect\\":%d,\\"read\\":%d,\\"write\\":%d,\\"timeout\\":%d}}\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.status, e.connect, e.read, e.write, e.timeout))
end
"""


def prepare_requests(spec: CellSpec, work: Path, cache: dict[tuple[str, str, int], RequestFiles]) -> RequestFiles:
    key = (spec.protocol, spec.encoding, spec.elements)
    if key in cache:
        return cache[key]
    stem = work / f"request-{spec.protocol}-{spec.encoding}-{spec.elements}"
    if spec.protocol == "grpc":
        message = grpc_message(spec.elements)
        body = stem.with_suffix(".grpc")
        body.write_bytes(b"\x00" + len(message).to_bytes(4, "big") + message)
        files = RequestFiles(body, None, {"content-type": "application/grpc", "te": "trailers"}, message)
    else:
        if spec.encoding == "json":
            payload, headers = http_json_body(spec.elements), {"Content-Type": "application/json"}
        else:
            payload, header_length = http_binary_body(spec.elements)
            headers = {"Content-Type": "application/octet-stream",
                       "Inference-Header-Content-Length": str(header_length)}
        body = stem.with_suffix(".body")
        body.write_bytes(payload)
        script = stem.with_suffix(".lua")
        lines = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items())
        script.write_text(_LUA.format(body=body, headers=lines))
        files = RequestFiles(body, script, headers, payload)
    cache[key] = files
    return files


# --------------------------------------------------------------------------- servers


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    http_port: int | None
    grpc_port: int | None
    log: Path
    started_s: float = 0.0  # seconds from spawn to ready
    memory: dict[str, float] = field(default_factory=dict)
    starter: Callable[[], Server] | None = None  # how to start it again
    restarts: int = 0
    cells: frozenset[str] | None = None  # the cell keys it is measured on (None: all it can serve)

    def revive(self) -> str:
        """Restart a server that exited during the run; returns a note saying what happened."""
        note = (f"{self.name} exited with {self.process.returncode} during the run "
                f"(log tail: {' | '.join(_log_tail(self.log, 4).splitlines())[-400:]})")
        if self.starter is None or self.restarts >= 2:
            return note + "; not restarted"
        fresh = self.starter()
        self.process, self.http_port, self.grpc_port, self.log = fresh.process, fresh.http_port, fresh.grpc_port, fresh.log
        self.restarts += 1
        return note + "; restarted"

    def supports(self, spec: CellSpec) -> bool:
        if self.cells is not None and spec.key not in self.cells:
            return False
        return (self.http_port if spec.protocol == "http" else self.grpc_port) is not None

    def stop(self) -> None:
        stop_process(self.process)

    def cpu_seconds(self) -> float | None:
        return _tree_cpu_seconds(self.process.pid)


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (OSError, ValueError):
        return 0


def _grpc_ready(port: int) -> bool:
    import grpc

    from pyserve.protocol import ServerReadyRequest, ServerReadyResponse

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ServerReady",
                                   request_serializer=ServerReadyRequest.SerializeToString,
                                   response_deserializer=ServerReadyResponse.FromString)
        try:
            return bool(call(ServerReadyRequest(), timeout=1.0).ready)
        except grpc.RpcError:
            return False


def spawn(name: str, command: list[str], http_port: int | None, grpc_port: int | None, log: Path,
          env: dict[str, str] | None, timeout: float, models: Iterable[str] = (), cwd: Path | None = None) -> Server:
    """Start ``command`` and wait until it is ready (all ``models`` too); records the time it took.

    :raises RuntimeError: it exited or was not ready in time; the message has the log's tail.
    """
    models = list(models)
    start = time.perf_counter()
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    server = Server(name, process, http_port, grpc_port, log)
    deadline = start + timeout
    while time.perf_counter() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{_log_tail(log)}")
        if http_port is not None:
            base = f"http://127.0.0.1:{http_port}"
            ready = _get(f"{base}/v2/health/ready") == 200 and all(
                _get(f"{base}/v2/models/{m}/ready") == 200 for m in models)
        else:
            assert grpc_port is not None
            ready = _grpc_ready(grpc_port)
        if ready:
            server.started_s = time.perf_counter() - start
            return server
        time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"{name} was not ready after {timeout:.0f} s:\n{_log_tail(log)}")


def _unique(work: Path, stem: str) -> str:
    tag, n = "", 0
    while (work / f"{stem}{tag}.log").exists():
        n += 1
        tag = f"-{n}"
    return tag


def start_pyserve(repository: Path, work: Path, timeout: float, models: Iterable[str] = (),
                  tag: str = "", name: str = "pyserve", extra_args: bool = True,
                  flags: Iterable[str] = (), checkout: Path | None = None) -> Server:
    """``pyserve run`` on ``repository`` (the README's command), with ``flags``, and with
    ``PYSERVE_BENCH_PYSERVE_ARGS`` unless ``extra_args`` is false (the plain command).

    :param checkout: run the pyserve of another checkout (its core, contract and plugins put
        first on ``PYTHONPATH``, started outside this one) instead of the installed one.
    """
    tag = tag + _unique(work, f"{name}{tag}")
    http, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "pyserve", "run", "--model-repository", str(repository),
               "--http-port", str(http), "--grpc-port", str(grpc_port), "--metrics-port", str(free_port())]
    command += list(flags)
    if extra_args:
        command += os.environ.get("PYSERVE_BENCH_PYSERVE_ARGS", "").split()  # e.g. --frontend-processes 0
    env = None
    if checkout is not None:
        checkout = checkout.resolve()  # the server starts in ``work``: a relative path would miss it
        if not (checkout / "pyserve" / "__init__.py").is_file():
            raise RuntimeError(f"--before {checkout}: not a pyserve checkout (no pyserve/__init__.py)")
        paths = [checkout, checkout / "hookspecs" / "src", *sorted(checkout.glob("plugins/*/src")),
                 *sorted(checkout.glob("examples/*/src"))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in paths)}
    return spawn(name, command, http, grpc_port, work / f"{name}{tag}.log", env, timeout, models,
                 cwd=work if checkout is not None else None)


def start_triton(install: _triton.TritonInstall, repository: Path, work: Path, timeout: float,
                 models: Iterable[str] = (), tag: str = "", name: str = "triton") -> Server:
    tag = tag + _unique(work, f"{name}{tag}")
    backends = work / "triton-backends"
    if not backends.exists():
        install.prepare_backends(backends)
    http, grpc_port = free_port(), free_port()
    command = [str(install.binary), "--model-repository", str(repository.resolve()),
               "--backend-directory", str(backends), "--http-port", str(http), "--grpc-port", str(grpc_port),
               "--metrics-port", str(free_port())] + os.environ.get("PYSERVE_BENCH_TRITON_ARGS", "").split()
    return spawn(name, command, http, grpc_port, work / f"{name}{tag}.log", install.environment(),
                 timeout, models)


def start_echo(kind: str, work: Path, timeout: float) -> Server:
    port = free_port()
    command = [sys.executable, str(HERE / "_echo.py"), kind, str(port)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    name = "starlette" if kind == "http" else "grpc-aio"
    return spawn(name, command, port if kind == "http" else None, port if kind == "grpc" else None,
                 work / f"echo-{kind}.log", env, timeout)


def _tree_pids(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with suppress(OSError, ValueError, IndexError):
                stat = Path(entry.path, "stat").read_text()
                parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    pids, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        pids.append(pid)
        frontier += [child for child, parent in parents.items() if parent == pid]
    return pids


def tree_memory(root: int) -> dict[str, float]:
    """RSS summed over the process tree, PSS summed (shared pages counted once), in MiB."""
    rss = pss = 0
    pids = _tree_pids(root)
    for pid in pids:
        with suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
    return {"rss": rss / 1024, "pss": pss / 1024, "processes": float(len(pids))}


# --------------------------------------------------------------------------- checks and load


def check(server: Server, spec: CellSpec, files: RequestFiles) -> str:
    """Send one request of the cell's kind; '' when the answer echoes the input, else why not."""
    try:
        if spec.protocol == "grpc":
            import grpc

            from pyserve.protocol import ModelInferResponse

            limit = 64 * 1024 * 1024
            with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=[
                    ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]) as ch:
                call = ch.unary_unary(GRPC_PATH, request_serializer=None,
                                      response_deserializer=ModelInferResponse.FromString)
                response = call(files.message, timeout=30)
            got = b"".join(response.raw_output_contents)
            return "" if len(got) == spec.elements * 4 else f"gRPC answer has {len(got)} output bytes"
        request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v2/models/{MODEL}/infer",
                                         data=files.message, headers=files.headers, method="POST")
        with urllib.request.urlopen(request, timeout=30) as reply:
            body = reply.read()
        if spec.encoding == "json":
            output = json.loads(body)["outputs"][0]
            return "" if len(output["data"]) == spec.elements else "JSON answer has the wrong size"
        header_length = int(reply.headers.get("Inference-Header-Content-Length", "0"))
        raw = len(body) - header_length
        return "" if raw == spec.elements * 4 else f"binary answer has {raw} tensor bytes"
    except Exception as error:  # noqa: BLE001  reported, not raised
        return f"{type(error).__name__}: {str(error)[:200]}"


@dataclass
class Measurement:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    server_cpu: float | None
    load_cpu: float
    note: str = ""


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _load_command(server: Server, spec: CellSpec, files: RequestFiles, duration: float,
                  log_file: Path, threads: int = 1) -> list[str]:
    threads = max(1, min(threads, spec.concurrency))
    if spec.protocol == "http":
        assert files.script is not None
        return ["wrk", f"-t{threads}", f"-c{spec.concurrency}", f"-d{max(1, round(duration))}s", "--timeout", "30s",
                "-s", str(files.script), f"http://127.0.0.1:{server.http_port}/v2/models/{MODEL}/infer"]
    command = ["h2load", f"-t{threads}", f"-c{spec.concurrency}", "-m1", f"-D{max(1, round(duration))}",
               "-d", str(files.body), "--log-file", str(log_file)]
    for name, value in files.headers.items():
        command += ["-H", f"{name}: {value}"]
    return command + [f"http://127.0.0.1:{server.grpc_port}{GRPC_PATH}"]


def measure(server: Server, spec: CellSpec, files: RequestFiles, duration: float, work: Path,
            load_prefix: tuple[str, ...] = (), threads: int = 1) -> Measurement:
    """One load run of ``spec`` against ``server``: ``load_prefix`` goes before the load
    generator's command (e.g. ``("taskset", "-c", "0")`` to pin it), ``threads`` is its thread
    count (at most one per connection)."""
    log_file = work / "h2load.log"
    with suppress(FileNotFoundError):
        log_file.unlink()
    command = [*load_prefix, *_load_command(server, spec, files, duration, log_file, threads)]
    cpu_before, load_before, start = server.cpu_seconds(), _children_cpu(), time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    cpu_after, load_after = server.cpu_seconds(), _children_cpu()
    server_cpu = None if cpu_before is None or cpu_after is None else (cpu_after - cpu_before) / wall
    load_cpu = (load_after - load_before) / wall
    output = result.stdout + result.stderr
    if spec.protocol == "http":
        match = re.search(r"WRKJSON (\{.*\})", output)
        if not match:
            return Measurement(0, float("nan"), float("nan"), 1, server_cpu, load_cpu, output[-300:])
        data = json.loads(match.group(1))
        errors = sum(data[k] for k in ("status", "connect", "read", "write", "timeout"))
        ok = data["requests"] - data["status"]
        return Measurement(ok / (data["duration_us"] / 1e6), data["p50_us"] / 1000, data["p99_us"] / 1000,
                           errors, server_cpu, load_cpu)
    parsed = parse_h2load(output, log_file)
    if parsed is None:
        return Measurement(0, float("nan"), float("nan"), 1, server_cpu, load_cpu, output[-300:])
    rps, p50, p99, errors = parsed
    return Measurement(rps, p50, p99, errors, server_cpu, load_cpu)


def parse_h2load(output: str, log_file: Path) -> tuple[float, float, float, int] | None:
    """(req/s, p50 ms, p99 ms, errors) of an ``h2load ... --log-file LOG`` run, or None if its
    summary is missing. Latencies come from the per-request log (status 200 only)."""
    requests = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                         r"(\d+) errored, (\d+) timeout", output)
    finished = re.search(r"finished in ([\d.]+)(m?s)", output)
    if not requests or not finished:
        return None
    seconds = float(finished.group(1)) / (1000.0 if finished.group(2) == "ms" else 1.0)
    succeeded = int(requests.group(4))
    errors = int(requests.group(5)) + int(requests.group(6)) + int(requests.group(7))
    latencies: list[float] = []
    with suppress(OSError):
        for line in log_file.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 3 and parts[1] == "200":
                latencies.append(int(parts[2]) / 1000.0)
    latencies.sort()
    return (succeeded / seconds if seconds > 0 else 0.0, _percentile(latencies, 0.5),
            _percentile(latencies, 0.99), errors)


# --------------------------------------------------------------------------- running


@dataclass
class Results:
    cells: dict[tuple[str, str], list[Measurement]] = field(default_factory=dict)
    bad: dict[tuple[str, str], str] = field(default_factory=dict)  # failed checks
    startup: dict[str, list[float]] = field(default_factory=dict)
    startup_one: dict[str, list[float]] = field(default_factory=dict)  # one model, every start
    memory: dict[str, dict[str, float]] = field(default_factory=dict)  # idle, after start
    memory_after: dict[str, dict[str, float]] = field(default_factory=dict)  # idle, after the load
    startup_memory: dict[str, dict[str, float]] = field(default_factory=dict)  # 20 models
    notes: list[str] = field(default_factory=list)
    startup_models: int = 20

    def median(self, server: str, key: str, attribute: str) -> float | None:
        values = [getattr(m, attribute) for m in self.cells.get((server, key), [])
                  if getattr(m, attribute) is not None and getattr(m, attribute) == getattr(m, attribute)]
        return statistics.median(values) if values else None


PLAIN = "pyserve-plain"
"""The memory rows' name for ``pyserve run`` without ``PYSERVE_BENCH_PYSERVE_ARGS``."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _starters(args: argparse.Namespace, work: Path, with_echo: bool,
              install: _triton.TritonInstall | None) -> list[tuple[str, Callable[[], Server]]]:
    """The servers this run measures, by name, each with the call that starts it."""
    repository = write_repository(work / "repo", [MODEL])
    starters: list[tuple[str, Callable[[], Server]]] = [
        ("pyserve", lambda: start_pyserve(repository, work, args.start_timeout, [MODEL]))]
    if getattr(args, "before", None) is not None:  # the plain command of another checkout (A/B)
        starters.append(("pyserve-before", lambda: start_pyserve(
            repository, work, args.start_timeout, [MODEL], name="pyserve-before", extra_args=False,
            checkout=args.before)))
    if getattr(args, "single", False):  # one process: what the default must not lose to at one connection
        starters.append(("pyserve-single", lambda: start_pyserve(
            repository, work, args.start_timeout, [MODEL], name="pyserve-single", extra_args=False,
            flags=["--frontend-processes", "0"])))
    if install is not None:
        starters.append(("triton", lambda: start_triton(install, repository, work, args.start_timeout, [MODEL])))
    if getattr(args, "batched", False):  # the same model.py with the dynamic batcher, on both servers
        batched = write_repository(work / "repo-batched", [MODEL], batching=True)
        starters.append(("pyserve-batched", lambda: start_pyserve(
            batched, work, args.start_timeout, [MODEL], name="pyserve-batched")))
        if getattr(args, "before", None) is not None:
            starters.append(("pyserve-before-batched", lambda: start_pyserve(
                batched, work, args.start_timeout, [MODEL], name="pyserve-before-batched", extra_args=False,
                checkout=args.before)))
        if install is not None:
            starters.append(("triton-batched", lambda: start_triton(
                install, batched, work, args.start_timeout, [MODEL], name="triton-batched")))
    if with_echo:
        starters += [("starlette", lambda: start_echo("http", work, args.start_timeout)),
                     ("grpc-aio", lambda: start_echo("grpc", work, args.start_timeout))]
    return starters


def start_servers(args: argparse.Namespace, work: Path, results: Results, with_echo: bool,
                  install: _triton.TritonInstall | None) -> list[Server]:
    servers: list[Server] = []
    for name, starter in _starters(args, work, with_echo, install):
        try:
            server = starter()
            server.starter = starter
        except (RuntimeError, OSError) as error:
            note = f"{name} could not be started: {error}"
            if name == "triton":
                note = f"Triton skipped: it could not be started: {error}"
            results.notes.append(note)
            _log(note)
            continue
        if name.endswith("-batched"):
            server.cells = BATCHED_CELLS
        if name == "pyserve-single":
            server.cells = SINGLE_CELLS
        time.sleep(1.0)
        results.memory[name] = tree_memory(server.process.pid)
        results.memory[name]["started"] = server.started_s  # seconds until READY, one model
        results.startup_one.setdefault(name, []).append(server.started_s)
        _log(f"{name}: ready in {server.started_s:.2f} s, idle RSS {results.memory[name]['rss']:.0f} MiB")
        servers.append(server)
    if os.environ.get("PYSERVE_BENCH_PYSERVE_ARGS", "").strip():
        # flags such as --frontend-processes trade memory for speed: the plain server's idle
        # memory is measured too (it serves no cells)
        try:
            plain = start_pyserve(work / "repo", work, args.start_timeout, [MODEL], name=PLAIN, extra_args=False)
        except (RuntimeError, OSError) as error:
            results.notes.append(f"{PLAIN} could not be started: {error}")
        else:
            try:
                time.sleep(1.0)
                results.memory[PLAIN] = tree_memory(plain.process.pid)
            finally:
                plain.stop()
    return servers


def run_cells(servers: list[Server], cells: list[CellSpec], args: argparse.Namespace, work: Path,
              results: Results) -> None:
    cache: dict[tuple[str, str, int], RequestFiles] = {}
    usable: dict[str, list[Server]] = {}
    for spec in cells:
        files = prepare_requests(spec, work, cache)
        usable[spec.key] = []
        for server in servers:
            if not server.supports(spec):
                continue
            why = check(server, spec, files)
            if why:
                results.bad[(server.name, spec.key)] = why
                _log(f"{server.name} {spec.label}: check failed: {why}")
            else:
                usable[spec.key].append(server)
                results.cells[(server.name, spec.key)] = []
    if args.warmup > 0:  # one short load per server and protocol, so JIT-less caches and pools settle
        for server in servers:
            for spec in cells:
                if server in usable[spec.key] and not spec.big and spec.concurrency == 8:
                    measure(server, spec, cache[(spec.protocol, spec.encoding, spec.elements)], args.warmup, work)
    for round_number in range(args.rounds):
        for spec in cells:
            order = usable[spec.key]
            order = order[round_number % len(order):] + order[: round_number % len(order)] if order else []
            for server in order:
                if server.process.poll() is not None:
                    try:
                        note = server.revive()
                    except (RuntimeError, OSError) as error:
                        note = f"{server.name} exited during the run and could not be restarted: {error}"
                    results.notes.append(note)
                    _log(note)
                    if server.process.poll() is not None:
                        continue
                files = cache[(spec.protocol, spec.encoding, spec.elements)]
                m = measure(server, spec, files, args.duration, work)
                results.cells[(server.name, spec.key)].append(m)
                cpu = "—" if m.server_cpu is None else f"{m.server_cpu:.2f}"
                _log(f"round {round_number + 1}: {server.name:9} {spec.label:24} {m.rps:9,.0f} req/s  "
                     f"p50 {m.p50_ms:7.3f}  p99 {m.p99_ms:7.3f} ms  cpu {cpu}  load {m.load_cpu:.2f}  "
                     f"errors {m.errors} {m.note}")


def measure_startup(args: argparse.Namespace, work: Path, install: _triton.TritonInstall | None,
                    results: Results) -> None:
    names = [f"m{i:02d}" for i in range(args.startup_models)]
    repository = write_repository(work / "repo-startup", names)
    one = write_repository(work / "repo-startup-one", [MODEL])
    kinds = ["pyserve"] + (["triton"] if install is not None else [])

    def start(name: str, repo: Path, models: list[str], tag: str) -> Server | None:
        try:
            if name == "pyserve":
                return start_pyserve(repo, work, args.start_timeout, models, tag=tag)
            assert install is not None
            return start_triton(install, repo, work, args.start_timeout, models, tag=tag)
        except (RuntimeError, OSError) as error:
            results.notes.append(f"{name} startup with {len(models)} model(s) failed: {str(error)[:300]}")
            return None

    for round_number in range(args.startup_rounds):
        for name in kinds:  # one model: more starts for the median than the serving servers' one
            server = start(name, one, [MODEL], "-startup-one")
            if server is None:
                continue
            try:
                results.startup_one.setdefault(name, []).append(server.started_s)
                _log(f"startup round {round_number + 1}: {name} 1 model READY in {server.started_s:.2f} s")
            finally:
                server.stop()
        for name in kinds:
            server = start(name, repository, names, "-startup")
            if server is None:
                continue
            try:
                results.startup.setdefault(name, []).append(server.started_s)
                if round_number == 0:
                    time.sleep(1.0)
                    results.startup_memory[name] = tree_memory(server.process.pid)
                _log(f"startup round {round_number + 1}: {name} {len(names)} models READY in {server.started_s:.2f} s")
            finally:
                server.stop()


# --------------------------------------------------------------------------- report


def cell_table(results: Results, cells: list[CellSpec], server_names: list[str]) -> list[str]:
    lines = ["| cell | server | req/s | MB/s | p50 ms | p99 ms | vs Triton req/s | server CPU (cores) "
             "| load-gen CPU (cores) | errors |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for spec in cells:
        for name in server_names:
            triton = results.median("triton-batched" if name.endswith("-batched") else "triton", spec.key, "rps")
            if (name, spec.key) in results.bad:
                lines.append(f"| {spec.label} | {name} | check failed: {results.bad[(name, spec.key)][:80]} "
                             "| | | | | | | |")
                continue
            if (name, spec.key) not in results.cells:
                continue
            rps = results.median(name, spec.key, "rps")
            mbps = rps * spec.elements * 4 / 1e6 if rps is not None and spec.big else None
            ratio = rps / triton if rps is not None and triton else None
            errors = sum(m.errors for m in results.cells[(name, spec.key)])
            lines.append(
                f"| {spec.label} | {name} | {_fmt(rps, ',.0f')} | {_fmt(mbps, ',.0f')} "
                f"| {_fmt(results.median(name, spec.key, 'p50_ms'), '.3f')} "
                f"| {_fmt(results.median(name, spec.key, 'p99_ms'), '.3f')} | {_fmt(ratio, '.2f')} "
                f"| {_fmt(results.median(name, spec.key, 'server_cpu'), '.2f')} "
                f"| {_fmt(results.median(name, spec.key, 'load_cpu'), '.2f')} | {errors} |")
    return lines


@dataclass
class Target:
    label: str
    value: float | None  # pyserve / Triton
    bound: float
    higher_is_better: bool
    rounds: tuple[float, float] | None = None  # the lowest and highest ratio of one round's pair

    def line(self) -> str:
        sign = ">=" if self.higher_is_better else "<="
        if self.value is None:
            return f"| {self.label} | — | {sign} {self.bound:g}x | not measured |"
        met = self.value >= self.bound if self.higher_is_better else self.value <= self.bound
        spread = f" (rounds {self.rounds[0]:.2f}–{self.rounds[1]:.2f})" if self.rounds is not None else ""
        return (f"| {self.label} | {self.value:.2f}x{spread} | {sign} {self.bound:g}x "
                f"| {'met' if met else '**MISSED**'} |")


def ratio(results: Results, key: str, attribute: str, top_server: str = "pyserve",
          bottom_server: str = "triton") -> float | None:
    top, bottom = results.median(top_server, key, attribute), results.median(bottom_server, key, attribute)
    return top / bottom if top is not None and bottom else None


def round_range(results: Results, key: str, attribute: str, top_server: str = "pyserve",
                bottom_server: str = "triton") -> tuple[float, float] | None:
    """The lowest and highest ratio of the two servers' measurements in the same round (the
    rounds interleave the servers, so each pair shared the machine's state), or None with
    fewer than two pairs or a server missing a round."""
    top, bottom = results.cells.get((top_server, key), []), results.cells.get((bottom_server, key), [])
    if len(top) != len(bottom) or len(top) < 2:
        return None
    pairs = [getattr(a, attribute) / getattr(b, attribute) for a, b in zip(top, bottom)
             if getattr(a, attribute) is not None and getattr(b, attribute)]
    return (min(pairs), max(pairs)) if len(pairs) == len(top) else None


def paired(label: str, results: Results, key: str, attribute: str, bound: float, higher_is_better: bool,
           top_server: str = "pyserve", bottom_server: str = "triton") -> Target:
    """A target of the ratio of medians, with the range of the per-round ratios beside it."""
    return Target(label, ratio(results, key, attribute, top_server, bottom_server), bound, higher_is_better,
                  round_range(results, key, attribute, top_server, bottom_server))


def serving_targets(results: Results) -> list[Target]:
    """Issue 28's targets for the default command (``pyserve``) against Triton in the same run."""
    def key(protocol: str, encoding: str, elements: int, concurrency: int) -> str:
        return cell(protocol, encoding, elements, concurrency).key

    def startup_ratio(startup: dict[str, list[float]] = results.startup) -> float | None:
        a, b = startup.get("pyserve"), startup.get("triton")
        return statistics.median(a) / statistics.median(b) if a and b else None

    def memory_ratio(kind: str, memory: dict[str, dict[str, float]] = results.memory,
                     server: str = "pyserve") -> float | None:
        a, b = memory.get(server), memory.get("triton")
        return a[kind] / b[kind] if a and b and b[kind] else None

    kinds = (("HTTP JSON", "http", "json"), ("HTTP binary", "http", "binary"), ("gRPC", "grpc", "grpc"))
    targets = []
    for label, protocol, encoding in kinds:
        for concurrency, bound in ((1, 1.2), (8, 1.5), (32, 1.5)):
            plural = "s" if concurrency > 1 else ""
            targets.append(paired(f"{label} req/s, {concurrency} connection{plural}", results,
                                  key(protocol, encoding, SMALL, concurrency), "rps", bound, True))
    for label, protocol, encoding in kinds:
        targets.append(paired(f"{label} req/s at 1 connection, default / pyserve-single (one process)", results,
                              key(protocol, encoding, SMALL, 1), "rps", 1.0, True, "pyserve", "pyserve-single"))
    if any(server == "pyserve-before" for server, _ in results.cells):  # --before: every cell, an A/B
        for item in SERVING_CELLS:
            targets.append(paired(f"{item.key}, default / pyserve-before (the checkout given by --before)",
                                  results, item.key, "rps", 0.9, True, "pyserve", "pyserve-before"))
    if any(server == "pyserve-before-batched" for server, _ in results.cells):
        for item in (c for c in SERVING_CELLS if c.key in BATCHED_CELLS):
            targets.append(paired(f"{item.key}, with the dynamic batcher, default / pyserve-before", results,
                                  item.key, "rps", 0.9, True, "pyserve-batched", "pyserve-before-batched"))
    for label, protocol, encoding in kinds:
        for concurrency in (1, 8, 32):
            plural = "s" if concurrency > 1 else ""
            targets.append(Target(f"p99 latency, {label} {concurrency} connection{plural}",
                                  ratio(results, key(protocol, encoding, SMALL, concurrency), "p99_ms"), 1.0, False))
    return targets + [
        Target("HTTP JSON req/s, 32 connections, both with the dynamic batcher (pyserve-batched / triton-batched)",
               ratio(results, key("http", "json", SMALL, 32), "rps", "pyserve-batched", "triton-batched"), 1.0, True),
        Target("16 MB echo bytes/s, HTTP binary", ratio(results, key("http", "binary", BIG, 1), "rps"), 1.0, True),
        Target("16 MB echo bytes/s, gRPC", ratio(results, key("grpc", "grpc", BIG, 1), "rps"), 1.0, True),
        Target("startup of 1 Python model until READY (median of every start)", startup_ratio(results.startup_one),
               0.5, False),
        Target(f"startup of {results.startup_models} Python models until READY", startup_ratio(), 0.5, False),
        Target("idle RSS, 1 model (process tree, summed)", memory_ratio("rss"), 0.5, False),
        Target("idle PSS, 1 model (process tree, shared pages once)", memory_ratio("pss"), 0.5, False),
        Target(f"idle RSS, {results.startup_models} Python models (process tree, summed)",
               memory_ratio("rss", results.startup_memory), 1.0, False),
    ]


def target_table(targets: list[Target]) -> list[str]:
    return ["| target (pyserve / Triton, same run) | ratio | target | verdict |", "|---|---:|---:|---|"] + [
        t.line() for t in targets]


def memory_table(results: Results, server_names: list[str], startup_models: int) -> list[str]:
    lines = [f"| server | startup, {startup_models} models → READY (s, median) | idle RSS MiB (1 model) "
             f"| idle PSS MiB | processes | RSS MiB after the load | RSS / PSS MiB with {startup_models} models "
             f"| processes with {startup_models} models |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in server_names:
        memory, after, big = results.memory.get(name), results.memory_after.get(name), results.startup_memory.get(name)
        startup = results.startup.get(name)
        lines.append(
            f"| {name} | {_fmt(statistics.median(startup) if startup else None, '.2f')}"
            f"{' (' + ' / '.join(f'{s:.2f}' for s in startup) + ')' if startup else ''} "
            f"| {_fmt(memory and memory['rss'], '.0f')} | {_fmt(memory and memory['pss'], '.0f')} "
            f"| {_fmt(memory and memory['processes'], '.0f')} | {_fmt(after and after['rss'], '.0f')} "
            f"| {_fmt(big and big['rss'], '.0f')} / {_fmt(big and big['pss'], '.0f')} "
            f"| {_fmt(big and big['processes'], '.0f')} |")
    return lines


def header(args: argparse.Namespace, what: str) -> str:
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{what}; {args.rounds} round(s) x {args.duration:g} s per cell, interleaved, medians; "
            f"{os.cpu_count()} CPUs; load average at the end {load}.")


# --------------------------------------------------------------------------- main


def common_arguments(parser: argparse.ArgumentParser, rounds: int) -> None:
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per cell (3; wrk/h2load whole seconds)")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds; medians shown ({rounds})")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of load per server before round 1 (1)")
    parser.add_argument("--with-triton", action="store_true",
                        help="install nvidia-pytriton into --triton-venv if no Triton is found")
    parser.add_argument("--no-triton", action="store_true", help="skip Triton")
    parser.add_argument("--triton-venv", type=Path, default=_triton.default_venv(),
                        help="venv holding nvidia-pytriton (default: %(default)s)")
    parser.add_argument("--start-timeout", type=float, default=180.0, help="seconds to wait for a server (180)")


def tools_missing(cells: list[CellSpec]) -> list[CellSpec]:
    missing = [spec for spec in cells if shutil.which("wrk" if spec.protocol == "http" else "h2load") is None]
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser, rounds=3)  # odd: a median of two rounds is their mean
    parser.add_argument("--startup-models", type=int, default=20, help="models in the startup repository (20)")
    parser.add_argument("--startup-rounds", type=int, default=2, help="startups per server (2)")
    parser.add_argument("--skip-startup", action="store_true", help="skip the startup measurement")
    parser.add_argument("--before", type=Path, default=None, metavar="CHECKOUT",
                        help="also measure the plain pyserve run of another checkout (e.g. a worktree of the "
                             "previous main) on every cell, as pyserve-before (and pyserve-before-batched)")
    parser.add_argument("--no-single", dest="single", action="store_false",
                        help="skip pyserve-single (pyserve run --frontend-processes 0, on the 1-connection cells)")
    parser.add_argument("--no-batched", dest="batched", action="store_false",
                        help="skip pyserve-batched and triton-batched (the same model with dynamic_batching, "
                             "measured on the cells with more than one connection)")
    parser.add_argument("--connections", default=None, metavar="LIST",
                        help="measure only the cells with these connection counts, e.g. 1 or 8,32 (all)")
    parser.add_argument("--protocols", default=None, metavar="LIST",
                        help="measure only the cells of these protocols: http, grpc or http,grpc (all)")
    args = parser.parse_args(argv)
    results = Results(startup_models=args.startup_models)
    cells = list(SERVING_CELLS)
    if args.connections:
        wanted = {int(n) for n in args.connections.split(",")}
        cells = [c for c in cells if c.concurrency in wanted]
    if args.protocols:
        protocols = set(args.protocols.split(","))
        unknown = protocols - {"http", "grpc"}
        if unknown:
            parser.error(f"--protocols: unknown protocol(s) {', '.join(sorted(unknown))} (http, grpc)")
        cells = [c for c in cells if c.protocol in protocols]
    missing = tools_missing(cells)
    if missing:
        results.notes.append("skipped (wrk or h2load not installed; apt-get install wrk nghttp2-client): "
                             + ", ".join(s.label for s in missing))
        cells = [c for c in cells if c not in missing]
    with tempfile.TemporaryDirectory(prefix="pyserve-serving-") as temp:
        work = Path(temp)
        install, why = _triton.install_for(args, work)
        if why:
            results.notes.append(why)
            _log(why)
        servers = start_servers(args, work, results, with_echo=True, install=install)
        try:
            run_cells(servers, cells, args, work, results)
            for server in servers:
                results.memory_after[server.name] = tree_memory(server.process.pid)
        finally:
            for server in servers:
                server.stop()
        if not args.skip_startup:
            if install is not None and not any(s.name == "triton" for s in servers):
                install = None
            measure_startup(args, work, install, results)
    names = [s.name for s in servers] or ["pyserve"]
    lines = [header(args, "Identity model.py (1x16 FP32 echo unless 16 MB), wrk -t1 (HTTP/1.1), h2load -t1 -m1 "
                          "(gRPC unary)"), ""]
    lines += cell_table(results, cells, names) + [""]
    memory_rows = [n for n in names if n in ("pyserve", "triton")] + ([PLAIN] if PLAIN in results.memory else [])
    lines += memory_table(results, memory_rows, args.startup_models) + [""]
    lines += target_table(serving_targets(results))
    lines += [""] + [f"- {note}" for note in results.notes]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    run_report(main)
